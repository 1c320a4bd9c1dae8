"""The CPU attention kernel of the opt-in fast modes (``csrc/cpu/attention.cpp``).

What is asserted: the kernel computes its torch reference (float64) to float32 rounding for every mask
kind and broadcast, strided K/V, few and many query rows (its two ways) and odd head sizes, and agrees
with SDPA where SDPA is defined; a fully masked row gives zeros; ``supports`` refuses what the kernel
does not compute and the shapes where SDPA measured faster; in ``fast_gemm`` and ``int8`` generation the
kernel serves the encoder's, the cross- and the self-attention and changes no token and no score beyond
float rounding (fp32) or the quantization grid (int8) against the same mode with the CPU kernels off;
the default (exact) mode never calls it.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fastgen
from fastgen.ops import cpu_attention
from fastgen.optimizer import registry
from tests import harness

REASON = cpu_attention.unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=str(REASON))
DEFAULT_FEATURES = sorted(set(registry.known_features()) - registry.OPT_IN_FEATURES)


def test_the_kernel_builds_where_a_compiler_is_present():
    if os.environ.get("FASTGEN_CPU_ATTENTION") == "0" or os.environ.get("FASTGEN_JIT") == "0":
        pytest.skip("disabled in the environment")
    if not any(os.access(os.path.join(p, "g++"), os.X_OK) for p in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("no g++ on PATH")
    assert REASON is None, REASON


def _problem(batch, heads, rows, keys, dim, seed, strided):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, rows, dim, generator=generator)
    if strided:  # the layout projections give: (B, S, H, D) viewed as (B, H, S, D)
        key = torch.randn(batch, keys, heads, dim, generator=generator).transpose(1, 2)
        value = torch.randn(batch, keys, heads, dim, generator=generator).transpose(1, 2)
    else:
        key = torch.randn(batch, heads, keys, dim, generator=generator)
        value = torch.randn(batch, heads, keys, dim, generator=generator)
    return query, key, value, generator


def _mask(kind, shape, generator):
    if kind == "none":
        return None
    keep = torch.rand(shape, generator=generator) > 0.3
    keep[..., 0] = True  # no row fully masked here (see the test of that case)
    if kind == "bool":
        return keep
    return torch.where(keep, torch.randn(shape, generator=generator), torch.finfo(torch.float32).min)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 4),
    rows=st.integers(1, 3 * cpu_attention.FEW_QUERY_ROWS),
    keys=st.integers(1, 70),
    dim=st.sampled_from([8, 40, 64, 128]),
    seed=st.integers(0, 10**6),
    strided=st.booleans(),
    mask_kind=st.sampled_from(["none", "bool", "float"]),
    broadcast=st.sampled_from([(True, True, True), (False, True, True), (False, False, False), (True, True, False)]),
)
def test_kernel_is_its_reference_and_sdpa_to_float_rounding(
    batch, heads, rows, keys, dim, seed, strided, mask_kind, broadcast
):
    query, key, value, generator = _problem(batch, heads, rows, keys, dim, seed, strided)
    shape = (*(1 if b else n for b, n in zip(broadcast, (batch, heads, rows), strict=True)), keys)
    mask = _mask(mask_kind, shape, generator)
    scale = dim**-0.5
    result = cpu_attention.attention(query, key, value, mask, scale)
    assert result.shape == (batch, rows, heads, dim) and result.is_contiguous()
    reference = cpu_attention.attention_reference(query, key, value, mask, scale)
    torch.testing.assert_close(result, reference, rtol=2e-5, atol=2e-6)
    sdpa = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale).transpose(1, 2)
    torch.testing.assert_close(result, sdpa, rtol=2e-5, atol=2e-6)
    assert not torch.equal(result[..., :1, :], result[..., -1:, :]) or heads == 1  # heads differ: not vacuous


@needs_kernel
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_fully_masked_row_gives_zeros(kind):
    query, key, value, _ = _problem(2, 2, 3, 5, 64, seed=3, strided=True)
    keep = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    keep[1, 0, 2] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    result = cpu_attention.attention(query, key, value, mask, 0.125)
    assert torch.equal(result[1, 2], torch.zeros(2, 64))
    torch.testing.assert_close(result, cpu_attention.attention_reference(query, key, value, mask, 0.125))
    assert result[0].abs().sum() > 0


@needs_kernel
def test_supports_refuses_what_the_kernel_does_not_compute():
    query, key, value, _ = _problem(2, 4, 2, 6, 64, seed=0, strided=False)
    assert cpu_attention.supports(query, key, value, None)
    assert not cpu_attention.supports(query.double(), key.double(), value.double(), None)
    assert not cpu_attention.supports(query, key[:, :2], value[:, :2], None)  # grouped-query heads
    for rows, dim, taken in ((40, 64, True), (1, 40, True), (4, 128, True), (40, 128, False), (5, 80, False)):
        q, k, v, _ = _problem(2, 4, rows, 6, dim, seed=0, strided=True)
        assert cpu_attention.supports(q, k, v, None) is taken, (rows, dim)
    assert not cpu_attention.supports(query, key.transpose(-1, -2).contiguous().transpose(-1, -2), value, None)
    assert not cpu_attention.supports(query, key, value, torch.zeros(2, 4, 2, 6, dtype=torch.float16))
    assert not cpu_attention.supports(query, key, value, torch.zeros(2, 4, 2, 7))
    assert not cpu_attention.supports(query, key, value, torch.zeros(3, 4, 2, 6))


def test_switch_off_in_the_environment(monkeypatch):
    monkeypatch.setenv("FASTGEN_CPU_ATTENTION", "0")
    assert cpu_attention.unavailable_reason() == "FASTGEN_CPU_ATTENTION=0"
    query, key, value, _ = _problem(1, 1, 1, 3, 8, seed=0, strided=False)
    assert not cpu_attention.supports(query, key, value, None)


class _Spy:
    """Counts kernel calls by query rows (1: self-attention of a hypothesis; beams: grouped cross-attention)."""

    def __init__(self, monkeypatch):
        self.rows: list[int] = []
        real = cpu_attention.attention

        def counted(query, key, value, mask, scale):
            self.rows.append(query.shape[2])
            return real(query, key, value, mask, scale)

        monkeypatch.setattr(cpu_attention, "attention", counted)


def _generate(model, inputs, features, kernel, monkeypatch, **kwargs):
    """With or without the attention kernel; the other CPU kernels (int8's passes, its oneDNN backend) in both.
    The decode step in Python, whose attention calls the spy sees (the C++ step calls the same kernel from C++;
    tests/models/test_compiled_step.py compares its bits with this step's)."""
    monkeypatch.setenv("FASTGEN_CPU_ATTENTION", "1" if kernel else "0")
    monkeypatch.setenv("FASTGEN_COMPILED_STEP", "0")
    with fastgen.patched(features), torch.inference_mode():
        return model.generate(**inputs, **kwargs)


#: head size 64, where the kernel serves every attention call (supports())
HEAD_64 = dict(d_model=128, encoder_attention_heads=2, decoder_attention_heads=2)

GENERATIONS = {
    "beam": dict(num_beams=3, max_new_tokens=8, no_repeat_ngram_size=2),
    "greedy": dict(num_beams=1, do_sample=False, max_new_tokens=8),
    "sampling": dict(do_sample=True, num_beams=1, max_new_tokens=8, num_return_sequences=2),
}


@needs_kernel
@pytest.mark.parametrize("feature", ["fast_gemm", "int8"])
@pytest.mark.parametrize("family", ["bart", "marian"])
@pytest.mark.parametrize("search", list(GENERATIONS))
def test_fast_modes_run_the_kernel_and_change_nothing_beyond_rounding(feature, family, search, monkeypatch):
    if harness.feature_unavailable(feature):
        pytest.skip(harness.feature_unavailable(feature))
    model = harness.tiny_hf_model(family, **HEAD_64)
    inputs = harness.tiny_inputs(model, batch=3)  # padded rows of different lengths
    assert (inputs["attention_mask"] == 0).any()
    kwargs = dict(GENERATIONS[search], return_dict_in_generate=True, output_scores=True)
    features = [*DEFAULT_FEATURES, feature]
    spy = _Spy(monkeypatch)
    torch.manual_seed(0)
    without = _generate(model, inputs, features, False, monkeypatch, **kwargs)
    assert spy.rows == []  # FASTGEN_CPU_ATTENTION=0: stock attention
    torch.manual_seed(0)
    with_kernel = _generate(model, inputs, features, True, monkeypatch, **kwargs)
    assert 1 in spy.rows  # self-attention of each hypothesis
    assert inputs["input_ids"].shape[1] in spy.rows  # the encoder's
    if search == "beam":
        assert kwargs["num_beams"] in spy.rows  # cross-attention, beams grouped over the shared K/V
    assert torch.equal(without.sequences, with_kernel.sequences)
    # int8 quantizes each row of the attention output again: a rounding difference there can move a code
    # by one step, so its scores agree to the quantization grid, fp32's to float rounding
    tolerance = 1e-4 if feature == "fast_gemm" else 1e-2
    for a, b in zip(without.scores, with_kernel.scores, strict=True):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        torch.testing.assert_close(a[finite], b[finite], rtol=tolerance, atol=tolerance)


@needs_kernel
def test_exact_mode_never_calls_the_kernel(monkeypatch):
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    spy = _Spy(monkeypatch)
    with fastgen.unpatched():
        upstream = model.generate(**inputs, num_beams=3, max_new_tokens=6)
    patched = _generate(model, inputs, DEFAULT_FEATURES, True, monkeypatch, num_beams=3, max_new_tokens=6)
    assert spy.rows == [] and torch.equal(upstream, patched)
