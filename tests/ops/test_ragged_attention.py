"""Ragged (BASS-PAD) attention: the torch reference against per-row attention over only the valid
slots, padding that cannot leak, and the Triton kernel (under ``TRITON_INTERPRET=1`` on CPU)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from fastgen.ops.ragged_attention import ragged_attention, ragged_attention_backend, ragged_attention_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1")
CASES = [  # batch, heads, kv heads, q, width, dim
    (3, 4, 2, 1, 13, 16),
    (4, 4, 4, 5, 40, 32),
    (2, 6, 2, 8, 70, 24),
]


def _inputs(batch, heads, kv_heads, q_len, width, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, q_len, dim, generator=g)
    key = torch.randn(batch, kv_heads, width, dim, generator=g)
    value = torch.randn(batch, kv_heads, width, dim, generator=g)
    lengths = torch.randint(q_len, width + 1, (batch,), generator=g)
    lengths[0] = width  # one full row, one row with exactly its new tokens
    lengths[-1] = q_len
    return query, key, value, lengths


def _per_row(query, key, value, lengths):
    """Each row alone, over only its valid slots, with PyTorch's causal SDPA (bottom-right aligned)."""
    group = query.shape[1] // key.shape[1]
    rows = []
    for b, n in enumerate(lengths.tolist()):
        k = key[b : b + 1, :, -n:].repeat_interleave(group, 1)
        v = value[b : b + 1, :, -n:].repeat_interleave(group, 1)
        q_len = query.shape[2]
        mask = torch.ones(q_len, n, dtype=torch.bool).tril(diagonal=n - q_len)
        rows.append(F.scaled_dot_product_attention(query[b : b + 1], k, v, attn_mask=mask))
    return torch.cat(rows)


@pytest.mark.parametrize("case", CASES)
def test_reference_equals_attention_over_each_rows_valid_slots(case) -> None:
    query, key, value, lengths = _inputs(*case)
    torch.testing.assert_close(
        ragged_attention_reference(query, key, value, lengths), _per_row(query, key, value, lengths)
    )


@pytest.mark.parametrize("case", CASES)
def test_padding_slots_are_never_read(case) -> None:
    query, key, value, lengths = _inputs(*case)
    expected = ragged_attention_reference(query, key, value, lengths)
    slots = torch.arange(key.shape[2])
    padding = (slots[None, :] < (key.shape[2] - lengths)[:, None])[:, None, :, None]
    garbage_k = torch.where(padding, torch.full_like(key, 1e4), key)
    garbage_v = torch.where(padding, torch.full_like(value, -1e4), value)
    backends = ["torch", "triton"] if INTERPRET else ["torch"]
    for backend in backends:
        got = ragged_attention(query, garbage_k, garbage_v, lengths, backend=backend)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@needs_interpreter
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case) -> None:
    query, key, value, lengths = _inputs(*case, seed=5)
    got = ragged_attention(query, key, value, lengths, backend="triton")
    torch.testing.assert_close(got, ragged_attention_reference(query, key, value, lengths), atol=2e-5, rtol=2e-5)


@needs_interpreter
def test_triton_fp16_matches_reference() -> None:
    query, key, value, lengths = (t.half() if t.is_floating_point() else t for t in _inputs(3, 4, 2, 6, 50, 32, seed=2))
    got = ragged_attention(query, key, value, lengths, backend="triton")
    torch.testing.assert_close(got, ragged_attention_reference(query, key, value, lengths), atol=2e-3, rtol=4e-3)


def test_backend_choice_on_cpu() -> None:
    query = torch.zeros(1, 1, 1, 8)
    assert ragged_attention_backend(query, "torch") == "torch"
    if not INTERPRET:
        assert ragged_attention_backend(query) == "torch"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [*CASES, (8, 12, 12, 5, 300, 64), (8, 32, 8, 1, 1000, 128)])
def test_triton_on_cuda_matches_reference(case, dtype) -> None:
    """The compiled kernel (not the interpreter): fp32 within float rounding, half precision within its own."""
    query, key, value, lengths = (t.cuda() for t in _inputs(*case, seed=7))
    expected = ragged_attention_reference(query.double(), key.double(), value.double(), lengths)
    cast = [t.to(dtype) for t in (query, key, value)]
    assert ragged_attention_backend(cast[0]) == "triton"
    got = ragged_attention(*cast, lengths)
    assert got.dtype == dtype and torch.isfinite(got).all()
    tolerance = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)
