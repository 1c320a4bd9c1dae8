"""The Triton shared-K/V attention kernel against the torch reference, and the backend dispatch.

On CPU the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, set by CI for the
whole run; without it these tests skip). Shapes stay small: the interpreter executes each
program in numpy. The ``gpu`` test runs the compiled kernel on CUDA.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastgen.ops import attention
from fastgen.ops.attention import (
    merge_attention_states,
    shared_kv_attention,
    shared_kv_attention_backend,
    shared_kv_attention_reference,
)

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1")
TOLERANCE = {  # (atol, rtol) of the output; lse is float32 from the same products for every dtype
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
LSE_TOLERANCE = (1e-4, 1e-5)


def _kernels():
    from fastgen.ops.triton import attention as kernels  # imported only once the interpreter is known

    return kernels


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    """Like ``assert_close`` but lists the mismatching elements (index, got, want)."""
    actual, expected = actual.double(), expected.double()
    bad = ~((actual - expected).abs() <= atol + rtol * expected.abs())
    if bad.any():
        index = bad.nonzero()[:10]
        rows = [
            f"  {tuple(i.tolist())}: got {actual[tuple(i)].item():.6g}, want {expected[tuple(i)].item():.6g}"
            for i in index
        ]
        pytest.fail(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements differ (atol={atol}, rtol={rtol})\n" + "\n".join(rows)
        )


def _assert_matches_reference(query, key, value, mask, scale=None, **launch) -> None:
    out, lse = _kernels().shared_kv_attention(query, key, value, mask, scale, **launch)
    ref_out, ref_lse = shared_kv_attention_reference(query, key, value, mask, scale)
    assert out.dtype == query.dtype and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows with lse=-inf differ"
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.all(out[empty] == 0), "fully masked rows must give out=0"
    _assert_close(out.float(), ref_out.float(), *TOLERANCE[query.dtype], what=f"out ({query.dtype})")
    _assert_close(lse[~empty], ref_lse[~empty], *LSE_TOLERANCE, what="lse")


def _mask(kind: str, batch: int, group: int, heads: int, q_len: int, kv_len: int, gen: torch.Generator):
    """None, or a mask of the given kind; about a third of the masked cases have fully masked rows."""
    if kind == "none":
        return None
    bool_mask, shape_kind = kind.split("-")
    rows = {"input": batch, "hyp": batch * group, "one": 1}[shape_kind]
    shape = (rows, heads, q_len, kv_len) if shape_kind == "one" else (rows, 1, 1, kv_len)
    keep = torch.rand(shape, generator=gen) > 0.3
    if torch.rand((), generator=gen) < 0.35:  # some rows attend to nothing
        keep[torch.rand(shape[:-1], generator=gen) < 0.5] = False
    if bool_mask == "bool":
        return keep
    bias = torch.randn(shape, generator=gen)
    return bias.masked_fill(~keep, float("-inf"))


shapes = st.tuples(
    st.integers(1, 3),  # batch
    st.integers(1, 4),  # group (beams)
    st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 2), (4, 1)]),  # heads, kv heads: GQA ratios 1, 2, 4
    st.integers(1, 3),  # q
    st.one_of(st.integers(1, 20), st.integers(1, 300)),  # S: below, at, across block sizes
    st.sampled_from([16, 32, 64]),  # D
    st.sampled_from([None, 16, 24]),  # Dv (None: = D; 24 is padded to a power of two)
)
launches = st.sampled_from([{}, {"block_n": 16}, {"block_n": 16, "num_splits": 3}, {"num_splits": 2}])
mask_kinds = st.sampled_from(["none", "bool-input", "bool-hyp", "float-input", "float-hyp", "float-one"])
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


@needs_interpreter
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, mask_kind=mask_kinds, dtype=dtypes, launch=launches, seed=st.integers(0, 2**16))
def test_kernel_matches_reference(shape, mask_kind, dtype, launch, seed) -> None:
    batch, group, (heads, kv_heads), q_len, kv_len, dim, value_dim = shape
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch * group, heads, q_len, dim, generator=gen).to(dtype)
    key = torch.randn(batch, kv_heads, kv_len, dim, generator=gen).to(dtype)
    value = torch.randn(batch, kv_heads, kv_len, value_dim or dim, generator=gen).to(dtype)
    mask = _mask(mask_kind, batch, group, heads, q_len, kv_len, gen)
    if mask is not None and mask.is_floating_point() and torch.rand((), generator=gen) < 0.5:
        mask = mask.to(dtype)  # additive masks usually come in the model dtype
    _assert_matches_reference(query, key, value, mask, scale=None if seed % 2 else 0.3, **launch)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_inputs_and_many_query_rows(dtype: torch.dtype) -> None:
    """HF hands over transposed queries, expanded masks and sliced caches; rows > one 64-row block."""
    torch.manual_seed(0)
    batch, group, heads, kv_heads, q_len, kv_len, dim = 2, 4, 4, 1, 5, 40, 16  # 4*4*5 = 80 rows per kv head
    query = torch.randn(batch * group, q_len, heads, dim, dtype=dtype).transpose(1, 2)
    cache = torch.randn(batch, kv_heads, 2 * kv_len, 2 * dim, dtype=dtype)
    key, value = cache[:, :, :kv_len, :dim], cache[:, :, kv_len:, dim:]
    mask = (torch.rand(batch, 1, 1, kv_len) > 0.2).expand(batch, heads, q_len, kv_len)  # stride-0 head/query axes
    _assert_matches_reference(query, key, value, mask, block_n=16, num_splits=2)


@needs_interpreter
@pytest.mark.parametrize("bool_mask", [True, False])
def test_empty_splits_and_fully_masked_rows(bool_mask: bool) -> None:
    """Splits that see only masked keys merge as nothing; rows that see none give lse=-inf, out=0."""
    torch.manual_seed(1)
    batch, group, heads, kv_len, dim = 2, 3, 2, 80, 16
    query = torch.randn(batch * group, heads, 1, dim)
    key, value = torch.randn(batch, heads, kv_len, dim), torch.randn(batch, heads, kv_len, dim)
    keep = torch.zeros(batch * group, 1, 1, kv_len, dtype=torch.bool)
    keep[:, ..., 70:] = True  # only the last split attends
    keep[1] = False  # hypothesis 1 attends to nothing at all
    mask = keep if bool_mask else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    _assert_matches_reference(query, key, value, mask, block_n=16, num_splits=4)
    out, lse = _kernels().shared_kv_attention(query, key, value, mask, block_n=16, num_splits=4)
    assert torch.isneginf(lse[1]).all() and torch.all(out[1] == 0)
    assert torch.isfinite(lse[0]).all()


@needs_interpreter
def test_finite_min_mask_matches_reference() -> None:
    """Transformers masks with ``finfo.min``, not -inf: a fully masked row is then uniform, as upstream."""
    torch.manual_seed(2)
    query, key, value = torch.randn(4, 2, 1, 16), torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16)
    mask = torch.zeros(2, 1, 1, 30)
    mask[0] = torch.finfo(torch.float32).min
    _assert_matches_reference(query, key, value, mask, block_n=16, num_splits=2)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_triton_prefix_with_per_beam_suffix(dtype: torch.dtype) -> None:
    """Shared prefix (Triton, once per input) + per-beam suffix, merged == attention over the concatenation."""
    torch.manual_seed(3)
    batch, group, heads, kv_heads, prefix, suffix, dim = 2, 3, 4, 2, 37, 5, 16
    query = torch.randn(batch * group, heads, 1, dim, dtype=dtype)
    prefix_k, prefix_v = torch.randn(2, batch, kv_heads, prefix, dim, dtype=dtype)
    suffix_k, suffix_v = torch.randn(2, batch * group, kv_heads, suffix, dim, dtype=dtype)
    prefix_mask = torch.ones(batch, 1, 1, prefix, dtype=torch.bool)
    prefix_mask[1, ..., :7] = False  # left padding of input 1
    out_a, lse_a = shared_kv_attention(query, prefix_k, prefix_v, prefix_mask, backend="triton")
    out_b, lse_b = shared_kv_attention_reference(query, suffix_k, suffix_v)
    merged, merged_lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    full_k = torch.cat([prefix_k.repeat_interleave(group, 0), suffix_k], dim=2)
    full_v = torch.cat([prefix_v.repeat_interleave(group, 0), suffix_v], dim=2)
    full_mask = torch.cat([prefix_mask.repeat_interleave(group, 0), torch.ones(batch * group, 1, 1, suffix).bool()], -1)
    expected, expected_lse = shared_kv_attention_reference(query, full_k, full_v, full_mask)
    _assert_close(merged.float(), expected.float(), *TOLERANCE[dtype], what="merged out")
    _assert_close(merged_lse, expected_lse, *LSE_TOLERANCE, what="merged lse")


def _small_call(mask=None):
    return torch.randn(4, 2, 1, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16), mask


def test_cpu_default_is_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTGEN_BACKEND", raising=False)
    assert shared_kv_attention_backend(*_small_call()) == "torch"


@needs_interpreter
def test_forcing_a_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    call = _small_call()
    monkeypatch.setenv("FASTGEN_BACKEND", "triton")
    assert shared_kv_attention_backend(*call) == "triton"
    out, lse = shared_kv_attention(*call)
    ref_out, ref_lse = shared_kv_attention_reference(*call)
    _assert_close(out, ref_out, *TOLERANCE[torch.float32], what="out")
    _assert_close(lse, ref_lse, *LSE_TOLERANCE, what="lse")
    assert shared_kv_attention_backend(*call, backend="torch") == "torch"
    monkeypatch.setenv("FASTGEN_BACKEND", "cuda")  # no CUDA-extension kernel for this op: the reference
    assert shared_kv_attention_backend(*call) == "torch"
    monkeypatch.setenv("FASTGEN_BACKEND", "torch")
    assert shared_kv_attention_backend(*call) == "torch"
    assert shared_kv_attention_backend(*call, backend="triton") == "triton"


@needs_interpreter
def test_unsupported_calls_fall_back_unless_forced_by_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTGEN_BACKEND", "triton")
    odd_mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)  # mask q=3 for q=1: not a supported layout
    for call in (_small_call(odd_mask), (*_small_call()[:3], torch.ones(2, 1, 1, 5, dtype=torch.int64))):
        assert shared_kv_attention_backend(*call) == "torch"
        with pytest.raises(NotImplementedError, match="attn_mask"):
            shared_kv_attention(*call, backend="triton")
    double = [t.double() for t in _small_call()[:3]]
    assert shared_kv_attention_backend(*double) == "torch"
    with pytest.raises(ValueError, match="unknown backend"):
        shared_kv_attention(*_small_call(), backend="cuda")


def test_available_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTGEN_BACKEND", raising=False)
    cpu = attention.available_backends("cpu")
    assert cpu["torch"] is None
    assert (cpu["triton"] is None) == INTERPRET
    if not torch.cuda.is_available():
        assert attention.available_backends("cuda") == {"triton": "no CUDA device", "torch": None}


def test_triton_import_failure_is_reported_once(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setattr(attention, "_TRITON_MODULE", "fastgen.ops.triton._no_such_module")
    monkeypatch.setenv("FASTGEN_BACKEND", "triton")
    attention._load_triton.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="fastgen"):
            call = _small_call()
            for _ in range(3):
                assert shared_kv_attention_backend(*call) == "torch"
            out, _ = shared_kv_attention(*call)
        with pytest.raises(NotImplementedError, match="failed to import"):
            shared_kv_attention(*call, backend="triton")
    finally:
        attention._load_triton.cache_clear()
    assert len([r for r in caplog.records if "Triton attention backend unavailable" in r.message]) == 1
    torch.testing.assert_close(out, shared_kv_attention_reference(*call)[0])


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="no NVIDIA Triton backend")
def test_kernels_compile_for_sm90_without_spills() -> None:
    """What the interpreter cannot check: the kernels compile for a real GPU, and fit in registers."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.ops.triton_compile_check"], cwd=root, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="runs the compiled kernel: unset TRITON_INTERPRET")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [64, 128])
def test_cuda_kernel_matches_reference(dtype: torch.dtype, dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTGEN_BACKEND", raising=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, group, heads, kv_heads, q_len, kv_len in [
        (4, 4, 8, 2, 1, 1000),
        (32, 4, 16, 16, 1, 1024),
        (1, 8, 8, 8, 2, 3001),
    ]:

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

        query, key, value = (
            rand(batch * group, heads, q_len, dim),
            rand(batch, kv_heads, kv_len, dim),
            rand(batch, kv_heads, kv_len, dim),
        )
        keep = torch.rand(batch * group, 1, 1, kv_len, device="cuda", generator=gen) > 0.2
        keep[0] = False
        per_input = keep[::group].contiguous()
        for mask in (
            None,
            per_input,
            keep,
            torch.zeros(keep.shape, device="cuda", dtype=dtype).masked_fill(~keep, float("-inf")),
        ):
            assert shared_kv_attention_backend(query, key, value, mask) == "triton"
            for launch in ({}, {"num_splits": 1}, {"num_splits": 5}):
                _assert_matches_reference(query, key, value, mask, **launch)


def test_prefix_shared_attention_merges_the_kernel_output(monkeypatch):
    """With Triton chosen, the decoder-only merge (kernel prefix + reference suffix, log-sum-exp)
    equals the single concatenated softmax."""
    from fastgen.ops.attention import prefix_shared_attention

    torch.manual_seed(0)
    batch, group, heads, kv_heads, prefix_len, suffix_len, dim = 2, 3, 4, 2, 13, 4, 16
    query = torch.randn(batch * group, heads, 1, dim)
    prefix_key, prefix_value = torch.randn(2, batch, kv_heads, prefix_len, dim).unbind(0)
    suffix_key, suffix_value = torch.randn(2, batch * group, kv_heads, suffix_len, dim).unbind(0)
    mask = torch.ones(batch * group, 1, 1, prefix_len + suffix_len, dtype=torch.bool)
    mask[group:, :, :, :3] = False  # the second input's prompt is left-padded by 3
    monkeypatch.setenv("FASTGEN_BACKEND", "torch")
    expected, _ = prefix_shared_attention(query, prefix_key, prefix_value, suffix_key, suffix_value, mask)
    monkeypatch.setenv("FASTGEN_BACKEND", "triton")
    merged, _ = prefix_shared_attention(query, prefix_key, prefix_value, suffix_key, suffix_value, mask)
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generation_through_the_triton_prefix_merge(monkeypatch, family):
    """End to end: decoder-only beam search with the prompt attended by the Triton kernel."""
    import fastgen.ops.attention as attention_ops
    from tests import harness

    if harness.feature_unavailable("dedup"):
        pytest.skip(harness.feature_unavailable("dedup"))
    calls = []
    original = attention_ops._prefix_shared_attention_merged
    monkeypatch.setattr(attention_ops, "_prefix_shared_attention_merged", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setenv("FASTGEN_BACKEND", "triton")
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    harness.assert_same_generation(model, inputs, features=["dedup"], max_new_tokens=5, num_beams=3)
    assert calls, "the Triton merge path did not run"
