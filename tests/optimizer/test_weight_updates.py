"""fast_gemm's packed and int8's quantized weight copies follow every way a user changes a weight.

Issue 24 found packed copies keyed on ``(weight._version, data_ptr())`` served stale weights after
``w.data.add_()`` / ``p.data.mul_()`` (``.data`` has its own version counter). The oracle here: after
the change, a ``generate`` with the warm cache equals one whose copies were all rebuilt from scratch,
and differs from the output before the change (so the change mattered).
"""

import pytest
import torch

import fastgen
from fastgen.ops import cpu_kernels, fast_linear, int8_linear
from fastgen.ops.weight_cache import DerivedWeights, fingerprint
from fastgen.optimizer import linear_modes, registry
from tests import harness
from tests.harness import requires_feature

DEFAULT_FEATURES = sorted(set(registry.known_features()) - registry.OPT_IN_FEATURES)
FORGET = {"fast_gemm": lambda: fast_linear.forget_packed(keep_choices=True), "int8": linear_modes.forget_int8}
MODES = [
    pytest.param("fast_gemm", marks=pytest.mark.skipif(fast_linear.unavailable() is not None, reason="no oneDNN")),
    pytest.param("int8", marks=pytest.mark.skipif(int8_linear.unavailable() is not None, reason="no int8 kernels")),
]


def _first_linear(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if type(m) is torch.nn.Linear or linear_modes.is_conv1d(m))


def _sgd_step(model: torch.nn.Module) -> None:
    module = _first_linear(model)
    optimizer = torch.optim.SGD([module.weight], lr=0.5)
    module.weight.grad = torch.randn_like(module.weight)
    optimizer.step()


def _load_state_dict(model: torch.nn.Module) -> None:
    state = {name: value * 1.5 for name, value in model.state_dict().items()}
    model.load_state_dict(state)


def _new_parameter(model: torch.nn.Module) -> None:
    module = _first_linear(model)
    module.weight = torch.nn.Parameter(module.weight.detach() * 2)


def _assign_data(model: torch.nn.Module) -> None:
    module = _first_linear(model)
    module.weight.data = module.weight.detach() * 2


def _no_grad_in_place(model: torch.nn.Module) -> None:
    with torch.no_grad():
        _first_linear(model).weight.mul_(2)


def _data_add(model: torch.nn.Module) -> None:
    weight = _first_linear(model).weight
    weight.data.add_(torch.randn_like(weight))


def _data_mul_every_parameter(model: torch.nn.Module) -> None:
    for param in model.parameters():
        param.data.mul_(1.5)


def _data_neg_every_linear(model: torch.nn.Module) -> None:
    for module in model.modules():
        if type(module) is torch.nn.Linear or linear_modes.is_conv1d(module):
            module.weight.data.neg_()  # every 32-bit word gains 2**31: a per-row bit sum cannot see it


def _data_one_element(model: torch.nn.Module) -> None:
    _first_linear(model).weight.data[0, 0] += 3.0


UPDATES = {
    "data.add_": _data_add,
    "p.data.mul_ (all)": _data_mul_every_parameter,
    "data[0, 0] +=": _data_one_element,
    "data.neg_ (every linear)": _data_neg_every_linear,
    "optimizer step": _sgd_step,
    "load_state_dict": _load_state_dict,
    "new Parameter": _new_parameter,
    "weight.data = t": _assign_data,
    "no_grad in-place": _no_grad_in_place,
}


def _logits(model, inputs, mode):
    with fastgen.patched([*DEFAULT_FEATURES, mode]), fastgen.report() as report:
        out = model.generate(**inputs, max_new_tokens=3, num_beams=1, return_dict_in_generate=True, output_logits=True)
    assert report.fast_path(mode), report
    return torch.stack(out.logits)


@requires_feature("int8")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["bart", "gpt2"])
@pytest.mark.parametrize("update", list(UPDATES))
def test_copies_follow_the_update(mode, family, update, monkeypatch):
    monkeypatch.setattr(fast_linear, "CALIBRATE_AFTER", 10**9)  # no form switch between the runs compared
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=2)
    before = _logits(model, inputs, mode)  # warms the copies
    UPDATES[update](model)
    warm = _logits(model, inputs, mode)
    FORGET[mode]()
    fresh = _logits(model, inputs, mode)
    assert not torch.equal(before, fresh), "the update changed nothing: the test would be vacuous"
    assert torch.equal(warm, fresh)


def test_fingerprint_sees_a_single_bit_and_moved_rows():
    weight = torch.randn(6, 10)
    print_ = fingerprint(weight)
    flipped = weight.clone()
    flipped.view(torch.int32)[3, 7] ^= 1  # one ulp of one element
    assert print_ != fingerprint(flipped)
    assert print_ != fingerprint(weight.flip(0))
    assert print_ != fingerprint(weight.flip(1))  # moved within rows
    assert print_ == fingerprint(weight.clone())


@pytest.mark.parametrize("kernels", [True, False])
def test_fingerprint_sees_edits_that_change_every_element_alike(kernels, monkeypatch):
    """A sign flip adds 2**31 to every word (an even count cancels in a sum of bits) and doubling adds 2**23
    (512 of them cancel): the hash must see both, with and without fastgen's kernels."""
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "available", lambda build=True: False)  # BLAKE2b
    elif not cpu_kernels.available():
        pytest.skip(str(cpu_kernels.unavailable_reason()))
    weight = torch.randn(8, 512)
    print_ = fingerprint(weight)
    for edited in (-weight, weight * 2, weight * 0.5, weight.t().contiguous().reshape(8, 512)):
        assert print_ != fingerprint(edited)
    assert print_ == fingerprint(weight.clone())
    assert fingerprint(torch.zeros(4, 6)) != fingerprint(torch.zeros(6, 4))  # the shape counts


def _lane_hash(tensor: torch.Tensor) -> list[int]:
    """``fastgen_cpu::content_hash`` written out (csrc/cpu/content_hash.cpp): 128 lanes of two states, the tail
    bytes and the final folds, in Python integers."""
    mask32, mask64 = 2**32 - 1, 2**64 - 1
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    full = len(data) // 4 // 128 * 128

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask32

    def fmix64(k: int) -> int:
        for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
            k = ((k ^ (k >> 33)) * multiplier) & mask64
        return k ^ (k >> 33)

    a = [(0x9747B28C + lane * 0x85EBCA6B) & mask32 for lane in range(128)]
    b = [(0x2545F491 + lane * 0xC2B2AE35) & mask32 for lane in range(128)]
    for index in range(full):
        word, lane = int.from_bytes(data[4 * index : 4 * index + 4], "little"), index % 128
        a[lane] = (rotl(a[lane] ^ word, 13) * 0xCC9E2D51) & mask32
        b[lane] = (rotl(b[lane] ^ word, 19) * 0x9E3779B1) & mask32
    tail = 0x51ED270B27
    for index in range(full * 4, len(data)):
        tail = fmix64(tail ^ (data[index] << ((index % 8) * 8)))
    h1, h2 = fmix64(len(data)), fmix64(len(data) ^ tail)
    for lane in range(128):
        h1 = fmix64(h1 ^ ((a[lane] << 32) | b[lane]))
        h2 = fmix64(h2 ^ ((b[lane] << 32) | a[lane]) ^ tail)
    return [h - 2**64 if h >= 2**63 else h for h in (h1, h2)]


@pytest.mark.parametrize("numel", [1, 127, 128, 129, 1000, 4099])
def test_the_hash_kernel_computes_its_lanes_formula(numel):
    """Whatever path the build takes (AVX-512 registers or the plain loop), the digest is the formula's."""
    if not cpu_kernels.available():
        pytest.skip(str(cpu_kernels.unavailable_reason()))
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    assert torch.ops.fastgen_cpu.content_hash(tensor).tolist() == _lane_hash(tensor)
    odd = torch.arange(numel * 4 + 3, dtype=torch.int8)  # a byte tail past the last whole word
    assert torch.ops.fastgen_cpu.content_hash(odd).tolist() == _lane_hash(odd)


def test_derived_weights_rebuild_only_when_the_weight_changes():
    builds = []
    cache = DerivedWeights(lambda module: (builds.append(1) or module.weight.detach().clone(), 8))
    module = torch.nn.Linear(8, 4)
    cache.refresh(module)
    cache.refresh(module)
    cache.get(module)
    assert len(builds) == 1
    module.weight.data.mul_(2)  # invisible to version and pointer: get() keeps the copy, refresh() sees it
    assert torch.equal(cache.get(module), module.weight.detach() / 2)
    cache.refresh(module)
    assert len(builds) == 2 and torch.equal(cache.get(module), module.weight.detach())
