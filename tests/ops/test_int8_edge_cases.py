"""int8 linears on inputs a user's model can hand them: strided parameters and non-finite activations.

What is asserted, on every int8 backend this torch has, with fastgen's CPU kernels and without:

* a weight stored as a transposed view (``Parameter(w.t())``) and a strided bias give the results of their
  contiguous copies, in the op and in ``generate``;
* a row holding a NaN or an infinity comes out NaN, as :func:`int8_linear_reference` defines, and the
  other rows are what they are without it (per-row scales: rows do not mix, except on fbgemm's per-tensor
  grid, where they stay within its rounding); ``generate`` on a model whose
  activations hold NaN runs and gives upstream fp32's tokens.
"""

import pytest
import torch
import torch.nn.functional as F

import fastgen
from fastgen.ops import cpu_kernels, int8_linear
from fastgen.optimizer import linear_modes, registry
from tests import harness
from tests.int8_backends import BACKENDS, ready_backend  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.skipif(int8_linear.unavailable() is not None, reason=str(int8_linear.unavailable()))

KERNELS = ["kernels", "torch-ops"]
DEFAULT_FEATURES = sorted(set(registry.known_features()) - registry.OPT_IN_FEATURES)


@pytest.fixture(params=KERNELS)
def kernels(request, monkeypatch):
    """Both forms of the passes around the product: fastgen's CPU kernels and torch's ops."""
    if request.param == "kernels" and not cpu_kernels.available():
        pytest.skip(str(cpu_kernels.unavailable_reason()))
    if request.param == "torch-ops":
        monkeypatch.setenv("FASTGEN_CPU_KERNELS", "0")
    return request.param


def _within_a_code(result: torch.Tensor, reference: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """NaN exactly where the reference has NaN; elsewhere within the two grids' rounding (oneDNN's codes are
    the reference's up to a code; fbgemm's 255-level asymmetric grid rounds apart: the bound of
    tests/optimizer/test_int8.py, doubled; activations stretch an error by at most 1.2)."""
    assert torch.equal(result.isnan(), reference.isnan())
    finite_x = torch.where(torch.isfinite(x), x, 0.0)
    step_x = finite_x.abs().amax(dim=1, keepdim=True) * 2 / 127
    step_w = weight.abs().amax(dim=1) / 127
    bound = 1.2 * (step_x * weight.abs().sum(dim=1) + step_w * finite_x.abs().sum(dim=1, keepdim=True)) + 1e-5
    keep = ~reference.isnan()
    assert ((result - reference).abs() <= bound)[keep].all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_view_weight_and_strided_bias_equal_their_contiguous_copies(backend, kernels):
    generator = torch.Generator().manual_seed(0)
    stored = torch.randn(80, 96, generator=generator) * 0.1  # (in, out): the weight is its transpose
    bias_storage = torch.randn(2 * 96, generator=generator)
    weight, bias = stored.t(), bias_storage[::2]
    assert not weight.is_contiguous() and not bias.is_contiguous()
    x = torch.randn(7, 80, generator=generator)
    for activation in (0, int8_linear.GELU, int8_linear.RELU):
        result = int8_linear.int8_linear(x, int8_linear.Int8Weight(weight, backend), bias, activation)
        dense = int8_linear.Int8Weight(weight.contiguous(), backend)
        assert torch.equal(result, int8_linear.int8_linear(x, dense, bias.contiguous(), activation))
    reference = int8_linear.int8_linear_reference(x, weight.contiguous(), bias.contiguous())
    _within_a_code(int8_linear.int8_linear(x, int8_linear.Int8Weight(weight, backend), bias), reference, x, weight)
    assert ((reference - F.linear(x, weight, bias)).abs() < 0.05).all()  # and the reference is near fp32


def _strided_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same model with every linear's weight a transposed view and every bias a strided view."""
    import copy

    strided = copy.deepcopy(model)
    with torch.no_grad():
        for module in strided.modules():
            if type(module) is torch.nn.Linear:
                module.weight = torch.nn.Parameter(module.weight.detach().t().contiguous().t())
                if module.bias is not None:
                    wide = torch.zeros(2 * module.bias.numel())
                    wide[::2] = module.bias.detach()
                    module.bias = torch.nn.Parameter(wide[::2])
    return strided


@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_with_strided_parameters_equals_the_contiguous_model(num_beams, kernels):
    model = harness.tiny_hf_model("bart")
    strided = _strided_copy(model)
    head = strided.get_output_embeddings()  # tied to the embeddings: a transposed view only if untied
    assert not strided.model.encoder.layers[0].fc1.weight.is_contiguous()
    assert head is not None
    inputs = harness.tiny_inputs(model, batch=3)
    kwargs = dict(max_new_tokens=6, num_beams=num_beams, return_dict_in_generate=True, output_logits=True)
    linear_modes.forget_int8()
    with fastgen.patched([*DEFAULT_FEATURES, "int8"]), fastgen.report() as report:
        dense_out = model.generate(**inputs, **kwargs)
        strided_out = strided.generate(**inputs, **kwargs)
    assert report.fast_path("int8"), report
    assert torch.equal(dense_out.sequences, strided_out.sequences)
    for a, b in zip(dense_out.logits, strided_out.logits, strict=True):
        assert torch.equal(a, b)


NONFINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [5, 300])  # a decode step's few rows and the large-input row maximum
def test_rows_with_nan_or_inf_come_out_nan_and_the_others_are_untouched(backend, rows, kernels):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 64, generator=generator) * 0.1
    bias = torch.randn(48, generator=generator)
    clean = torch.randn(rows, 64, generator=generator)
    x = clean.clone()
    for row, value in enumerate(NONFINITE):
        x[row + 1, 3 * row + 5] = value  # rows 1-3: one NaN, +inf, -inf
    reference = int8_linear.int8_linear_reference(x, weight, bias)
    assert reference[1:4].isnan().all() and not reference[0].isnan().any() and not reference[4:].isnan().any()
    prepared = int8_linear.Int8Weight(weight, backend)
    for activation, torch_form in int8_linear.ACTIVATIONS.items():
        result = int8_linear.int8_linear(x, prepared, bias, activation)
        assert result[1:4].isnan().all(), (activation, result[1:4])
        if backend != "fbgemm":  # fbgemm's grid spans the whole tensor: there rows do mix (bounded below)
            untouched = int8_linear.int8_linear(clean, prepared, bias, activation)
            keep = torch.ones(rows, dtype=torch.bool)
            keep[1:4] = False
            assert torch.equal(result[keep], untouched[keep])
        _within_a_code(result, torch_form(reference), x, weight)
    _within_a_code(int8_linear.int8_linear(x, prepared, bias), reference, x, weight)


def test_reference_rows_are_independent_of_nonfinite_neighbours():
    weight = torch.randn(16, 32)
    x = torch.randn(4, 32)
    poisoned = x.clone()
    poisoned[2, 0] = float("nan")
    reference = int8_linear.int8_linear_reference(poisoned, weight)
    assert reference[2].isnan().all()
    assert torch.equal(reference[[0, 1, 3]], int8_linear.int8_linear_reference(x[[0, 1, 3]], weight))


@pytest.mark.parametrize("value", NONFINITE)
def test_generate_with_nonfinite_activations_runs_and_keeps_upstream_tokens(value, kernels):
    """One input token's embedding poisoned: upstream's logits for that sentence are all NaN (attention
    mixes it everywhere); int8's must be too, the other sentence stays finite, and the tokens are upstream's."""
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    poison = next(t for t in range(5, model.config.vocab_size) if t not in inputs["input_ids"].tolist()[1])
    inputs["input_ids"][0, 2] = poison
    with torch.no_grad():
        model.model.encoder.embed_tokens.weight[poison, 0] = value  # (untied from the decoder in these configs)
    kwargs = dict(max_new_tokens=4, num_beams=1, return_dict_in_generate=True, output_logits=True)
    with fastgen.unpatched():
        upstream = model.generate(**inputs, **kwargs)
    linear_modes.forget_int8()
    with fastgen.patched([*DEFAULT_FEATURES, "int8"]), fastgen.report() as report:
        candidate = model.generate(**inputs, **kwargs)
    assert report.fast_path("int8"), report
    assert upstream.logits[0][0].isnan().all()  # the premise: fp32 loses the poisoned sentence
    for ref, cand in zip(upstream.logits, candidate.logits, strict=True):
        assert ref[0].isnan().all() and cand[0].isnan().all() and torch.isfinite(cand[1]).all()
    assert torch.equal(upstream.sequences[0], candidate.sequences[0])
