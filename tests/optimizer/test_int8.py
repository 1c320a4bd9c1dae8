"""The opt-in "int8" feature: int8 linears (weights per channel, activations per row).

Also the checks both opt-in linear modes share (int8 and fast_gemm): dtype fallback, compile tracing.

What is asserted: the op's backends compute the documented formula (``int_mm`` bit for bit, ``fbgemm``
within its activation grid); the feature is off by default, runs on every plain CPU fp32 linear of a
Transformers or fairseq ``generate`` call and leaves the modules as they were; it stays close to
upstream's scores (quantization error, relative to the step's logits); with fast_gemm also on, int8
serves; other dtypes fall back with a reason; a compiled forward traces upstream's op.
Weight updates of every kind are in tests/optimizer/test_weight_updates.py.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fastgen
from fastgen.ops import cpu_kernels, int8_linear
from fastgen.optimizer import linear_modes, registry
from tests import harness
from tests.conftest import HAS_FAIRSEQ
from tests.harness import requires_feature
from tests.int8_backends import BACKENDS, ready_backend  # noqa: F401 (an autouse fixture)

HF_INT8 = requires_feature("int8")
pytestmark = pytest.mark.skipif(int8_linear.unavailable() is not None, reason=str(int8_linear.unavailable()))

DEFAULT_FEATURES = sorted(set(registry.known_features()) - registry.OPT_IN_FEATURES)


def _weights(rows: int, cols: int, seed: int, zero_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator) * 0.1
    if zero_row:
        weight[0] = 0
    return weight, torch.randn(rows, generator=generator)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    k=st.integers(int8_linear.MIN_IN_FEATURES, 70),
    n=st.integers(1, 90),
    seed=st.integers(0, 10**6),
    zero_row=st.booleans(),
    bias=st.booleans(),
)
def test_int_mm_backend_is_the_reference_bit_for_bit(rows, k, n, seed, zero_row, bias):
    weight, b = _weights(n, k, seed, zero_row)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1))
    if zero_row:
        x[0] = 0  # an all-zero activation row (scale 1, codes 0)
    b = b if bias else None
    result = int8_linear.int8_linear(x, int8_linear.Int8Weight(weight, "int_mm"), b)
    assert torch.equal(result, int8_linear.int8_linear_reference(x, weight, b))


def test_int_mm_is_the_reference_on_the_symmetric_grid_too(monkeypatch):
    monkeypatch.setattr(int8_linear, "GRID", "symmetric")
    weight, b = _weights(40, 72, 3, zero_row=True)
    x = torch.randn(9, 72, generator=torch.Generator().manual_seed(4))
    x[0] = 0
    result = int8_linear.int8_linear(x, int8_linear.Int8Weight(weight, "int_mm"), b)
    assert torch.equal(result, int8_linear.int8_linear_reference(x, weight, b, grid="symmetric"))
    assert not torch.equal(result, int8_linear.int8_linear_reference(x, weight, b, grid="asymmetric"))


@pytest.mark.parametrize("activation", [F.gelu, F.relu])
def test_asymmetric_grid_halves_the_error_on_one_signed_rows(activation):
    """A feed-forward block's second product takes post-GELU/ReLU rows: the symmetric grid wastes half its
    codes there. With weights on their own grid (no weight error), the asymmetric grid's error against fp32
    is about half; on two-signed rows it is never larger."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (96, 512), generator=generator)
    codes[:, 0] = 127  # every row's max|W| is 127 codes: the weight grid holds W exactly
    weight = codes.float() * 2**-10

    def error(x, grid):
        return (int8_linear.int8_linear_reference(x, weight, grid=grid) - F.linear(x, weight)).abs().mean().item()

    one_signed = activation(torch.randn(64, 512, generator=generator) * 2)
    assert error(one_signed, "asymmetric") < 0.6 * error(one_signed, "symmetric")
    two_signed = torch.randn(64, 512, generator=generator)
    assert error(two_signed, "asymmetric") <= 1.02 * error(two_signed, "symmetric")


#: products of every size the per-row quantization must handle (rows x k inputs, n outputs)
PRODUCTS = dict(
    rows=st.integers(1, 40),
    k=st.integers(int8_linear.MIN_IN_FEATURES, 300),
    n=st.integers(1, 90),
    seed=st.integers(0, 10**6),
)


@pytest.mark.skipif("fbgemm" not in BACKENDS, reason="no fbgemm quantized engine in this torch")
@settings(max_examples=40, deadline=None)
@given(**PRODUCTS)
def test_fbgemm_backend_is_as_close_to_fp32_as_the_reference(rows, k, n, seed):
    weight, b = _weights(n, k, seed, zero_row=False)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1))
    exact = F.linear(x, weight, b)
    result = int8_linear.int8_linear(x, int8_linear.Int8Weight(weight, "fbgemm"), b)
    assert result.shape == exact.shape
    # Rounding bound per element: half an activation step times sum|W| plus half a weight step times
    # sum|x| (cross term and fbgemm's zero point: a factor 2). fbgemm's step over each row's [-1, 1]
    # is 2/255 of the row's max|x| (2/127 with 7-bit activations where there is no VNNI).
    levels = 127 if int8_linear.reduce_range() else 255
    step_x = x.abs().amax(dim=1, keepdim=True) * 2 / levels
    step_w = weight.abs().amax(dim=1) / 127
    bound = step_x * weight.abs().sum(dim=1) + step_w * x.abs().sum(dim=1, keepdim=True) + 1e-5
    assert ((result - exact).abs() <= bound).all()


@pytest.mark.skipif("onednn" not in BACKENDS, reason="no oneDNN quantized linear (or no VNNI) here")
@settings(max_examples=40, deadline=None)
@given(**PRODUCTS, zero_row=st.booleans())
def test_onednn_backend_is_the_reference_up_to_float_rounding(rows, k, n, seed, zero_row):
    """Same codes and integer sums as the reference; only the float scaling's order differs, and a code
    may round the other way where ``x / max * 127`` and ``x / (max / 127)`` fall on either side of a half
    (seen about once in a few hundred codes), which moves an output by at most one activation step."""
    weight, b = _weights(n, k, seed, zero_row)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1))
    if zero_row:
        x[0] = 0
    result = int8_linear.int8_linear(x, int8_linear.Int8Weight(weight, "onednn"), b)
    reference = int8_linear.int8_linear_reference(x, weight, b)
    one_code = x.abs().amax(dim=1, keepdim=True) / 127 * weight.abs().amax(dim=1)  # one activation step
    assert ((result - reference).abs() <= 2 * one_code + 1e-5 * reference.abs() + 1e-6).all()


@pytest.mark.skipif(int8_linear.backend() != "auto", reason="auto needs both fbgemm and oneDNN")
def test_auto_packs_each_weight_once_for_the_backend_its_first_product_needs(monkeypatch):
    monkeypatch.setenv("FASTGEN_CPU_KERNELS", "0")  # without the fused kernels: by product size
    big = int8_linear.Int8Weight(torch.randn(8192, 64), "auto")
    small = int8_linear.Int8Weight(torch.randn(64, 64), "auto")
    assert big.kind == small.kind == "auto" and big.packed is None  # nothing packed before a product
    big.matmul(torch.randn(32, 64))
    small.matmul(torch.randn(32, 64))
    assert (big.kind, small.kind) == ("onednn", "fbgemm")
    assert big._codes is None and small._codes is None  # the codes are dropped once packed
    small.matmul(torch.randn(4096, 64))  # a later, larger product keeps the first choice
    assert small.kind == "fbgemm" and small.nbytes == 64 * 64 + 3 * 64 * 4  # codes; scales and two sums


@pytest.mark.skipif(int8_linear.backend() != "auto", reason="auto needs both fbgemm and oneDNN")
@pytest.mark.skipif(not cpu_kernels.available(), reason=str(cpu_kernels.unavailable_reason()))
def test_auto_with_the_fused_kernels_takes_onednn_or_an_own_op_for_every_product():
    small = int8_linear.Int8Weight(torch.randn(64, 64), "auto")
    small.matmul(torch.randn(4, 64))
    assert small.kind == ("onednn" if small.choice_ms is None else int8_linear.preferred_kind(small.choice_ms))
    assert small.kind in ("onednn", "vnni", "amx")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "int_mm"])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_fused_kernels_compute_what_torch_ops_compute(backend, rows, monkeypatch):
    """The CPU kernels' passes (quantize rows, scale rows and add the bias) against torch's ops."""
    if not cpu_kernels.available():
        pytest.skip(str(cpu_kernels.unavailable_reason()))
    weight, bias = _weights(96, 80, seed=rows, zero_row=True)
    x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(7)) * 3
    x[0] = 0  # an all-zero row: finite scale, zero codes
    prepared = int8_linear.Int8Weight(weight, backend)
    fused = int8_linear.int8_linear(x, prepared, bias)
    monkeypatch.setenv("FASTGEN_CPU_KERNELS", "0")
    plain = int8_linear.int8_linear(x, prepared, bias)
    one_code = x.abs().amax(dim=1, keepdim=True) / 127 * weight.abs().amax(dim=1)  # a code apart at most
    assert ((fused - plain).abs() <= one_code + 1e-5 * plain.abs() + 1e-5).all()
    assert torch.equal(fused[0], plain[0]) and not torch.equal(fused, torch.zeros_like(fused))


def test_torch_int_mm_is_wrong_for_one_input_feature_so_narrow_weights_are_refused():
    a = torch.tensor([[3], [-5]], dtype=torch.int8)
    b = torch.tensor([[1], [2], [7]], dtype=torch.int8).t().contiguous()  # (1, 3): its stride stays (1, 1)
    if torch.equal(torch._int_mm(a, b), a.int() @ b.int()):
        pytest.skip("this torch computes it right; MIN_IN_FEATURES could drop")
    with pytest.raises(ValueError, match="int8 weights need"):
        int8_linear.Int8Weight(torch.randn(4, int8_linear.MIN_IN_FEATURES - 1), "int_mm")
    assert "features each way" in int8_linear.module_problem(torch.nn.Linear(1, 16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_non_contiguous_inputs(backend):
    weight, b = _weights(24, 16, 0, zero_row=False)
    x = torch.randn(3, 16, 5).transpose(1, 2)  # (3, 5, 16), not contiguous
    result = int8_linear.int8_linear(x, int8_linear.Int8Weight(weight, backend), b)
    expected = int8_linear.int8_linear(x.contiguous(), int8_linear.Int8Weight(weight, backend), b)
    assert result.shape == (3, 5, 24) and torch.equal(result, expected)


def test_off_by_default():
    assert "int8" in registry.OPT_IN_FEATURES
    with fastgen.patched():
        assert not registry.feature_enabled("int8")


#: (largest, mean) logit error relative to the step's largest logit, measured on the tiny models with
#: margin. Random tiny models are a worst case for per-row activation scales (wide init, outliers: T5
#: and Llama without a trained norm); quality on a trained model: benchmarks/trained_agreement.py.
#: T5's ReLU feed-forward output is one-signed, so the symmetric per-row grid (the reference formula, which
#: oneDNN computes: int_mm and auto measured 0.65 / 0.10 here) uses half its codes; fbgemm's asymmetric one
#: measured 0.33 / 0.04.
TOLERANCE = {"t5": (0.8, 0.15), "llama": (0.25, 0.04)}
DEFAULT_TOLERANCE = (0.08, 0.02)


def _assert_scores_close(reference, candidate, tolerance=DEFAULT_TOLERANCE):
    """int8 moves logits by its quantization error: a few percent of the step's largest logit."""
    for ref, cand in zip(reference, candidate, strict=True):
        scale = ref.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
        finite = torch.isfinite(ref) & torch.isfinite(cand)
        error = ((ref - cand).abs() / scale)[finite]
        assert error.max().item() <= tolerance[0] and error.mean().item() <= tolerance[1]


@HF_INT8
@pytest.mark.parametrize("family", ["bart", "marian", "t5", "llama", "gpt2"])
def test_generation_runs_in_int8_and_stays_close(family):
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=3)
    kwargs = dict(max_new_tokens=1, num_beams=1, return_dict_in_generate=True, output_logits=True)
    with fastgen.patched(DEFAULT_FEATURES):
        reference = model.generate(**inputs, **kwargs)
    with fastgen.patched([*DEFAULT_FEATURES, "int8"]), fastgen.report() as report:
        candidate = model.generate(**inputs, **kwargs)
    assert report.fast_path("int8"), report
    assert "gemm" not in report.ran  # the head is int8's, gemm steps aside silently
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear or linear_modes.is_conv1d(m)]
    assert linears and not any("forward" in m.__dict__ for m in linears)  # removed when the call ended
    assert not torch.equal(reference.logits[0], candidate.logits[0])  # it did quantize
    _assert_scores_close(reference.logits, candidate.logits, TOLERANCE.get(family, DEFAULT_TOLERANCE))


@HF_INT8
def test_with_fast_gemm_on_too_int8_serves():
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    with fastgen.patched([*DEFAULT_FEATURES, "int8"]):
        int8_only = model.generate(**inputs, max_new_tokens=5, num_beams=2)
    with fastgen.patched([*DEFAULT_FEATURES, "fast_gemm", "int8"]), fastgen.report() as report:
        both = model.generate(**inputs, max_new_tokens=5, num_beams=2)
    assert report.fast_path("int8") and "fast_gemm" not in report.ran, report
    assert not any(feature == "fast_gemm" for feature, _ in report.fell_back), report
    assert torch.equal(int8_only, both)


@pytest.mark.parametrize("feature", ["int8", "fast_gemm"])
def test_other_dtypes_fall_back_with_a_reason(feature):
    if harness.feature_unavailable(feature):
        pytest.skip(harness.feature_unavailable(feature))
    model = harness.tiny_hf_model("bart").double()
    inputs = harness.tiny_inputs(model, batch=2)
    with fastgen.unpatched():
        reference = model.generate(**inputs, max_new_tokens=4, num_beams=2)
    with fastgen.patched([feature]), fastgen.report() as report:
        candidate = model.generate(**inputs, max_new_tokens=4, num_beams=2)
    assert torch.equal(reference, candidate)
    assert (feature, "no CPU float32 nn.Linear modules in the model") in report.fell_back


@pytest.mark.parametrize("scope", [linear_modes.int8_linears, linear_modes.packed_linears])
def test_compiled_linear_inside_the_scope_traces_f_linear(scope):
    model = harness.tiny_hf_model("bart")
    head = model.get_output_embeddings()
    x = torch.randn(4, 1, model.config.d_model)
    with scope(model), torch.no_grad():
        explanation = torch._dynamo.explain(head)(x)
        result = torch.compile(head, backend="eager", fullgraph=True)(x)
    assert explanation.graph_break_count == 0
    assert torch.equal(result, F.linear(x, head.weight))


def test_autograd_calls_run_upstream_op():
    model = harness.tiny_hf_model("bart")
    head = model.get_output_embeddings()
    x = torch.randn(2, 3, model.config.d_model, requires_grad=True)
    with linear_modes.int8_linears(model):
        result = head(x)
    assert torch.equal(result, F.linear(x, head.weight))


def test_reports_the_int8_copies_bytes():
    model = harness.tiny_hf_model("bart")
    linear_modes.forget_int8()
    with linear_modes.int8_linears(model):
        pass
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    distinct = {id(m): m for m in linears}.values()
    expected = sum(m.weight.numel() + 12 * m.weight.shape[0] for m in distinct)  # a byte a weight; 3 fp32 a row
    assert linear_modes.int8_bytes() == expected


@pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")
def test_fairseq_generation_runs_in_int8_and_stays_close():
    model, dictionary = harness.tiny_fairseq_transformer(vocab=200)
    sample = harness.tiny_fairseq_sample(dictionary, batch=3)
    with fastgen.patched(DEFAULT_FEATURES):
        reference = harness.fairseq_generate(model, dictionary, sample, beam_size=1, max_len_b=1, min_len=1)
    with fastgen.patched([*DEFAULT_FEATURES, "int8"]), fastgen.report() as report:
        candidate = harness.fairseq_generate(model, dictionary, sample, beam_size=1, max_len_b=1, min_len=1)
    assert report.fast_path("int8"), report
    assert not any(f == "gemm" for f, _ in report.fell_back), report
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears and not any("forward" in m.__dict__ for m in linears)
    ref = torch.stack([hypos[0]["positional_scores"][0] for hypos in reference])
    cand = torch.stack([hypos[0]["positional_scores"][0] for hypos in candidate])
    assert not torch.equal(ref, cand)
    _assert_scores_close([ref], [cand])


@pytest.mark.parametrize("rows", [3, 400])  # the decode-step form and the large-input form
def test_row_max_is_the_largest_magnitude_of_each_row(rows):
    x = torch.randn(rows, 300)
    x[0] = 0
    x[1, 7] = -50.0  # a row whose largest magnitude is negative
    expected = x.abs().amax(dim=1, keepdim=True).clamp_min(int8_linear.TINY)
    assert torch.equal(int8_linear._row_max(x), expected)


@pytest.mark.parametrize("scope", ["int8", "fast_gemm"])
def test_another_thread_meanwhile_runs_upstream_op(scope):
    """The forwards are installed on the shared modules, but serve only the thread inside the scope."""
    import threading

    model = harness.tiny_hf_model("bart")
    head = model.get_output_embeddings()
    x = torch.randn(3, model.config.d_model)
    entered, done = threading.Event(), threading.Event()

    def inside():
        with (linear_modes.int8_linears if scope == "int8" else linear_modes.packed_linears)(model):
            entered.set()
            done.wait(timeout=30)

    thread = threading.Thread(target=inside)
    thread.start()
    try:
        assert entered.wait(timeout=30)
        assert linear_modes.installed(head) == scope
        with torch.no_grad():
            assert torch.equal(head(x), F.linear(x, head.weight))
    finally:
        done.set()
        thread.join()
    assert linear_modes.installed(head) is None
