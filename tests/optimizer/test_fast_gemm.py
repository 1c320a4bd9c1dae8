"""The opt-in "fast_gemm" feature: packed linears (oneDNN's, or MKL's packed sgemm), close to upstream but not
bit-identical.

What is asserted: it is off by default; when on, it runs for every plain CPU fp32 ``nn.Linear`` of
the call and leaves the modules as they were; its logits stay within a few ulps of the step's
largest logit; it falls back to upstream's op for other dtypes and under ``torch.compile``.
"""

import pytest
import torch
import torch.nn.functional as F

import fastgen
from fastgen.ops import cpu_kernels, fast_linear
from fastgen.optimizer import linear_modes as fast_gemm
from fastgen.optimizer import registry
from tests import harness
from tests.conftest import HAS_FAIRSEQ
from tests.harness import requires_feature

#: needs the feature's Transformers patch (declared for 5.18+; CI also runs 5.15.1)
HF_FAST_GEMM = requires_feature("fast_gemm")
pytestmark = pytest.mark.skipif(fast_linear.unavailable() is not None, reason=str(fast_linear.unavailable()))

DEFAULT_FEATURES = sorted(set(registry.known_features()) - registry.OPT_IN_FEATURES)


def test_off_by_default():
    assert "fast_gemm" in registry.OPT_IN_FEATURES
    with fastgen.patched():
        states = {row.feature: row.state for row in fastgen.status()}
        assert states["fast_gemm"] == "disabled: feature not selected"
        assert registry.feature_enabled("gemm") and not registry.feature_enabled("fast_gemm")


@pytest.mark.parametrize("shape", [(5, 48), (3, 1, 48), (2, 7, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_close_to_f_linear(shape, bias):
    module = torch.nn.Linear(48, 130, bias=bias)
    x = torch.randn(shape)
    with torch.no_grad():
        result = fast_linear.packed_linear(module, x)
        expected = F.linear(x, module.weight, module.bias)
    assert result.shape == expected.shape
    torch.testing.assert_close(result, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)


def test_packed_weight_follows_weight_updates():
    module = torch.nn.Linear(16, 64)
    x = torch.randn(4, 16)
    with torch.no_grad():
        fast_linear.packed_linear(module, x)
        module.weight.mul_(2)
        torch.testing.assert_close(fast_linear.packed_linear(module, x), F.linear(x, module.weight, module.bias))


@HF_FAST_GEMM
@pytest.mark.parametrize("family", ["bart", "marian", "t5", "llama", "gpt2"])
def test_generation_runs_packed_and_stays_close(family):
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=3)
    kwargs = dict(max_new_tokens=6, num_beams=4, return_dict_in_generate=True, output_scores=True)
    with fastgen.patched(DEFAULT_FEATURES):
        reference = model.generate(**inputs, **kwargs)
    with fastgen.patched([*DEFAULT_FEATURES, "fast_gemm"]), fastgen.report() as report:
        candidate = model.generate(**inputs, **kwargs)
    assert report.fast_path("fast_gemm"), report
    assert "gemm" not in report.ran or report.fast_path("gemm")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert not any("forward" in m.__dict__ for m in linears)  # removed when the call ended
    # Tiny models: close enough that the same tokens win (real shapes: see README's measured agreement).
    assert torch.equal(reference.sequences, candidate.sequences)
    for ref, cand in zip(reference.scores, candidate.scores, strict=True):
        harness.assert_close_scores(ref, cand, "scores", atol=1e-5, rtol=1e-5)


def test_installs_on_every_linear_during_the_call_only():
    model = harness.tiny_hf_model("bart")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with fast_gemm.packed_linears(model):
        assert all(fast_gemm.installed(m) and "forward" in m.__dict__ for m in linears)
        with fast_gemm.packed_linears(model):
            pass
        assert all(fast_gemm.installed(m) for m in linears)
    assert not any(fast_gemm.installed(m) or "forward" in m.__dict__ for m in linears)


@pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")
@pytest.mark.parametrize("beam", [1, 4])
def test_fairseq_generation_runs_packed_and_stays_close(beam):
    model, dictionary = harness.tiny_fairseq_transformer(vocab=200)
    sample = harness.tiny_fairseq_sample(dictionary, batch=3)
    with fastgen.patched(DEFAULT_FEATURES):
        reference = harness.fairseq_generate(model, dictionary, sample, beam_size=beam, max_len_b=8)
    with fastgen.patched([*DEFAULT_FEATURES, "fast_gemm"]), fastgen.report() as report:
        candidate = harness.fairseq_generate(model, dictionary, sample, beam_size=beam, max_len_b=8)
    assert report.fast_path("fast_gemm"), report
    assert not any(f == "gemm" for f, _ in report.fell_back), report  # gemm steps aside silently
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears and not any("forward" in m.__dict__ for m in linears)
    for ref_hypos, cand_hypos in zip(reference, candidate, strict=True):
        for ref, cand in zip(ref_hypos, cand_hypos, strict=True):
            assert torch.equal(ref["tokens"], cand["tokens"])
            harness.assert_close_scores(ref["positional_scores"], cand["positional_scores"], "scores", 1e-5, 1e-5)


def test_gpt2_conv1d_layers_run_packed_and_close():
    from transformers.pytorch_utils import Conv1D

    from fastgen.optimizer import linear_modes as fast_gemm_scope

    model = harness.tiny_hf_model("gpt2")
    convs = [m for m in model.modules() if type(m) is Conv1D]
    assert convs and all(fast_gemm_scope.is_conv1d(m) for m in convs)
    x = torch.randn(3, 2, model.config.n_embd)
    with torch.no_grad():
        expected = convs[0](x)
        with fast_gemm.packed_linears(model):
            assert all(fast_gemm.installed(m) for m in convs)
            result = convs[0](x)
    assert "forward" not in convs[0].__dict__
    torch.testing.assert_close(result, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)


def _force_timings(monkeypatch, packed_ms: float, linear_ms: float, mkl_ms: float = 3.0) -> None:
    """Make the calibration see these timings (the choice logic is under test, not the machine)."""

    def fake_time_into(run, times, repeats=1):
        run()
        names = run.__code__.co_names
        times.append(packed_ms if "_run_packed" in names else mkl_ms if "_run_mkl" in names else linear_ms)

    monkeypatch.setattr(fast_linear, "_time_into", fake_time_into)


FORMS = [(1.0, 2.0, 3.0, "packed"), (2.0, 1.0, 3.0, "linear"), (2.0, 3.0, 1.0, "mkl")]


@pytest.mark.parametrize(("packed_ms", "linear_ms", "mkl_ms", "kept"), FORMS)
def test_each_shape_keeps_the_faster_form(monkeypatch, packed_ms, linear_ms, mkl_ms, kept):
    mkl = fast_linear.mkl_unavailable() is None
    if kept == "mkl" and not mkl:
        pytest.skip(fast_linear.mkl_unavailable())
    fast_linear.forget_packed()
    _force_timings(monkeypatch, packed_ms, linear_ms, mkl_ms)
    module = torch.nn.Linear(48, 130)
    x = torch.randn(6, 48)
    with torch.no_grad():
        for _ in range(fast_linear.CALIBRATE_AFTER + 2):
            result = fast_linear.packed_linear(module, x)
    (timed,) = fast_linear.choices().values()
    assert timed == {"packed": packed_ms, "linear": linear_ms} | ({"mkl": mkl_ms} if mkl else {})
    assert fast_linear.settled_form(module.weight, 6) == kept
    if kept == "linear":  # upstream's op, bit for bit, once it measured faster
        assert torch.equal(result, F.linear(x, module.weight, module.bias))
    elif kept == "mkl":
        assert torch.equal(result, fast_linear._run_mkl(module, x))
    else:
        assert torch.equal(result, fast_linear._run_packed(module, x))
    fast_linear.forget_packed()


requires_mkl = pytest.mark.skipif(
    not cpu_kernels.available() or fast_linear.mkl_unavailable() is not None,  # builds the kernels if need be
    reason=str(cpu_kernels.unavailable_reason() or fast_linear.mkl_unavailable()),
)


@requires_mkl
@pytest.mark.parametrize("shape", [(1, 48), (4, 48), (17, 48), (3, 1, 48), (2, 7, 48), (0, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_mkl_packed_linear_close_to_f_linear(shape, bias):
    module = torch.nn.Linear(48, 130, bias=bias)
    x = torch.randn(shape)
    before = None if module.bias is None else module.bias.detach().clone()
    with torch.no_grad():
        packed = torch.ops.fastgen_cpu.mkl_pack_weight(module.weight)
        result = torch.ops.fastgen_cpu.mkl_packed_linear(x, packed, 130, module.bias)
        expected = F.linear(x, module.weight, module.bias)
    assert result.shape == expected.shape
    torch.testing.assert_close(result, expected, atol=1e-5 * max([1.0, *expected.abs().flatten().tolist()]), rtol=1e-5)
    if before is not None:  # the output starts as a copy of the bias, never the bias itself (one row included)
        assert torch.equal(module.bias, before)


@requires_mkl
def test_mkl_packed_linear_refuses_a_weight_of_another_shape():
    packed = torch.ops.fastgen_cpu.mkl_pack_weight(torch.randn(130, 48))
    with pytest.raises(RuntimeError, match="packed form"):
        torch.ops.fastgen_cpu.mkl_packed_linear(torch.randn(3, 64), packed, 130, None)


@requires_mkl
def test_the_mkl_copy_follows_writes_through_data(monkeypatch):
    """A ``.data`` write moves neither version nor pointer: the content check at the next call rebuilds the copy."""
    fast_linear.forget_packed()
    _force_timings(monkeypatch, 2.0, 3.0, 1.0)  # MKL's form kept
    module = torch.nn.Linear(48, 130)
    x = torch.randn(20, 48)
    with torch.no_grad():
        fast_linear.packed_linear(module, x)
        assert fast_linear.settled_form(module.weight, 20) == "mkl"
        module.weight.data.mul_(-3)
        fast_linear.prepack(module)  # what each generate call's scope does on entry
        result = fast_linear.packed_linear(module, x)
    torch.testing.assert_close(result, F.linear(x, module.weight, module.bias), atol=1e-4, rtol=1e-5)
    fast_linear.forget_packed()


@pytest.mark.parametrize(("packed_ms", "linear_ms"), [(1.0, 2.0), (2.0, 1.0)])
def test_every_result_of_a_shape_comes_from_one_form(monkeypatch, packed_ms, linear_ms):
    """The choice is made before a shape's first result: identical calls give identical outputs."""
    fast_linear.forget_packed()
    _force_timings(monkeypatch, packed_ms, linear_ms)
    module = torch.nn.Linear(48, 130)
    x = torch.randn(6, 48)
    with torch.no_grad():
        results = [fast_linear.packed_linear(module, x) for _ in range(12)]
    assert all(torch.equal(results[0], r) for r in results[1:])
    fast_linear.forget_packed()


@HF_FAST_GEMM
def test_repeated_generate_calls_are_identical():
    fast_linear.forget_packed()
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    kwargs = dict(num_beams=2, max_new_tokens=6, return_dict_in_generate=True, output_logits=True)
    with fastgen.patched([*DEFAULT_FEATURES, "fast_gemm"]):
        runs = [torch.stack(model.generate(**inputs, **kwargs).logits) for _ in range(4)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    fast_linear.forget_packed()


@requires_mkl
def test_both_copies_of_a_weight_are_checked_with_one_pass_over_it(monkeypatch):
    from fastgen.ops import weight_cache

    fast_linear.forget_packed()
    _force_timings(monkeypatch, 2.0, 3.0, 1.0)
    module = torch.nn.Linear(48, 130)
    with torch.no_grad():
        fast_linear.packed_linear(module, torch.randn(20, 48))  # the timing made both copies
    calls = []
    original = weight_cache.fingerprint

    def counted(weight):
        calls.append(weight)
        return original(weight)

    monkeypatch.setattr(fast_linear, "fingerprint", counted)
    monkeypatch.setattr(weight_cache, "fingerprint", counted)
    assert fast_linear.prepack(module) > 0
    assert len(calls) == 1
    fast_linear.forget_packed()


@requires_mkl
def test_a_module_holds_only_the_packed_forms_its_keys_use(monkeypatch):
    """Copies are made when a form first runs: after the timing kept MKL's form, another weight of the shape gets
    MKL's copy only, and entering a call builds nothing."""
    fast_linear.forget_packed()
    _force_timings(monkeypatch, 2.0, 3.0, 1.0)
    timed, other = torch.nn.Linear(48, 130), torch.nn.Linear(48, 130)
    x = torch.randn(20, 48)
    with torch.no_grad():
        assert fast_linear.prepack(other) == 0  # nothing held yet: nothing built, nothing hashed
        fast_linear.packed_linear(timed, x)  # the timing ran every form on this one
        fast_linear.packed_linear(other, x)
    assert fast_linear._packed.holds(timed) and fast_linear._mkl_packed.holds(timed)
    assert not fast_linear._packed.holds(other) and fast_linear._mkl_packed.holds(other)
    fast_linear.forget_packed()
