"""The approximate modes' feed-forward activation fused into ``fc1``'s op (fastgen.optimizer.fused_activation).

What is asserted: the kernels' GELU, ReLU and SiLU (int8's scaling pass, MKL's packed linear) equal torch's to float
rounding; in int8 and fast_gemm generation (BART: GELU, Marian: SiLU, Whisper: GELU) the fused path runs, changes no
token and no score beyond float rounding against the unfused path, and puts every layer's own activation module
back; a hook on ``fc1`` turns the fusion off for it (the hook sees upstream's ``fc1`` output); the stand-in applies
the original activation to any tensor but the one its ``fc1`` just produced.
"""

import pytest
import torch
import torch.nn.functional as F

import fastgen
from fastgen.ops import cpu_kernels, int8_linear
from fastgen.optimizer import fused_activation, registry
from tests import harness

pytestmark = pytest.mark.skipif(harness.feature_unavailable("int8") is not None, reason="int8 unavailable")
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=str(cpu_kernels.unavailable_reason()))
DEFAULT_FEATURES = sorted(set(registry.known_features()) - registry.OPT_IN_FEATURES)


@needs_kernels
@pytest.mark.parametrize("code", [fused_activation.GELU, fused_activation.RELU, fused_activation.SILU])
def test_kernel_activations_are_torch_to_float_rounding(code):
    generator = torch.Generator().manual_seed(code)
    y = torch.randn(37, 300, generator=generator) * 4
    scale, bias = torch.rand(37, 1, generator=generator) + 0.5, torch.randn(300, generator=generator)
    fused = torch.ops.fastgen_cpu.scale_rows_add_(y.clone(), scale, bias, code)
    expected = int8_linear.ACTIVATIONS[code](y * scale + bias)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("code", [fused_activation.GELU, fused_activation.RELU, fused_activation.SILU])
def test_mkl_packed_activations_are_torch_to_float_rounding(code):
    from fastgen.ops import linear

    if linear.mkl_op() is None:
        pytest.skip("no MKL packed sgemm here")
    generator = torch.Generator().manual_seed(code)
    x, w, b = (torch.randn(shape, generator=generator) for shape in ((37, 64), (300, 64), (300,)))
    packed = torch.ops.fastgen_cpu.mkl_pack_weight(w)
    fused = torch.ops.fastgen_cpu.mkl_packed_linear(x, packed, 300, b, code)
    expected = int8_linear.ACTIVATIONS[code](torch.ops.fastgen_cpu.mkl_packed_linear(x, packed, 300, b))
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-6)


def _generate(model, inputs, fuse, monkeypatch, mode="int8", **kwargs):
    if not fuse:
        monkeypatch.setattr(fused_activation, "fusable_layers", lambda model, served: [])
    with fastgen.patched([*DEFAULT_FEATURES, mode]):
        out = model.generate(**inputs, **kwargs)
    monkeypatch.undo()
    return out


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "fast_gemm"])
@pytest.mark.parametrize("family", ["bart", "marian", "whisper"])
def test_fused_generation_changes_nothing_beyond_rounding(family, mode, monkeypatch):
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_log_mel(model.config) if family == "whisper" else harness.tiny_inputs(model, batch=3)
    activations = {id(layer): layer.activation_fn for layer in model.modules() if hasattr(layer, "fc1")}
    assert activations and all(fused_activation.activation_code(a) for a in activations.values())
    kwargs = dict(num_beams=3, max_new_tokens=6, return_dict_in_generate=True, output_scores=True, mode=mode)
    unfused = _generate(model, inputs, False, monkeypatch, **kwargs)
    fused_outputs = []
    real = fused_activation.remember_fused
    monkeypatch.setattr(fused_activation, "remember_fused", lambda y: real(y) if not fused_outputs.append(1) else y)
    fused = _generate(model, inputs, True, monkeypatch, **kwargs)
    assert fused_outputs  # the fused path ran
    assert torch.equal(unfused.sequences, fused.sequences)
    for a, b in zip(unfused.scores, fused.scores, strict=True):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        torch.testing.assert_close(a[finite], b[finite], rtol=1e-4, atol=1e-4)
    after = {id(layer): layer.activation_fn for layer in model.modules() if hasattr(layer, "fc1")}
    assert all(after[key] is activations[key] for key in activations)  # the user's modules are back


@needs_kernels
def test_a_hook_on_fc1_sees_upstream_output(monkeypatch):
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    seen = []
    handle = model.model.encoder.layers[0].fc1.register_forward_hook(lambda m, i, o: seen.append(o.min().item()))
    try:
        with fastgen.patched([*DEFAULT_FEATURES, "int8"]):
            model.generate(**inputs, num_beams=2, max_new_tokens=3)
    finally:
        handle.remove()
    assert seen and min(seen) < -0.2  # before GELU (whose minimum is about -0.17)


@needs_kernels
@pytest.mark.parametrize("family", ["bart", "marian", "m2m_100", "whisper"])
@pytest.mark.parametrize("kind", ["forward", "pre"])
def test_hooks_on_the_activation_run_as_upstream(family, kind):
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_log_mel(model.config) if family == "whisper" else harness.tiny_inputs(model, batch=2)
    activation = model.get_encoder().layers[0].activation_fn
    calls = []
    if kind == "forward":
        handle = activation.register_forward_hook(lambda m, i, o: calls.append(torch.equal(o, m.forward(i[0]))))
    else:
        handle = activation.register_forward_pre_hook(lambda m, i: calls.append(i[0].min().item() < -0.2))
    try:
        with fastgen.unpatched():
            model.generate(**inputs, num_beams=2, max_new_tokens=3)
        upstream, calls[:] = list(calls), []
        with fastgen.patched([*DEFAULT_FEATURES, "int8"]):
            model.generate(**inputs, num_beams=2, max_new_tokens=3)
    finally:
        handle.remove()
    assert upstream and all(upstream)  # the hook sees the activation's own input and output
    assert len(calls) == len(upstream) and all(calls)
    assert model.get_encoder().layers[0].activation_fn is activation


def test_the_stand_in_passes_through_only_the_fused_tensor():
    stand_in = fused_activation.PassThroughFused(torch.nn.GELU())
    x = torch.randn(4, 8)
    assert torch.equal(stand_in(x), F.gelu(x))  # not produced by a fused fc1: the activation runs
    fused_activation.remember_fused(x)
    assert stand_in(x) is x  # this thread's fused fc1 output: already activated
    assert torch.equal(stand_in(x), F.gelu(x))  # once only


def test_only_activations_computed_exactly_so_are_fused():
    assert fused_activation.activation_code(torch.nn.GELU()) == fused_activation.GELU
    assert fused_activation.activation_code(torch.nn.GELU(approximate="tanh")) is None
    assert fused_activation.activation_code(torch.nn.ReLU()) == fused_activation.RELU
    assert fused_activation.activation_code(torch.nn.SiLU()) == fused_activation.SILU
    assert fused_activation.activation_code(torch.nn.Tanh()) is None
