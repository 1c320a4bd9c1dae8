"""Triton kernel for n-gram blocking (semantics: :func:`fastgen.ops.ngram.ban_repeated_ngrams`).

One program per (hypothesis row, block of BLOCK window starts): each lane compares the n-1 tokens
of its window with the row's prefix and, on a match, stores -inf at the successor's score. Rows of
any length are covered by the second grid axis, so there is no 1024-window ceiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ban_ngrams_kernel(
    hay_ptr,
    hay_stride,
    hay_width,
    tok_ptr,
    tok_stride,
    tok_width,
    len_ptr,
    len_scalar,
    scores_ptr,
    scores_stride,
    vocab,
    n,
    beams,
    HAS_LENGTHS: tl.constexpr,
    DECODER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    length = tl.load(len_ptr + row) if HAS_LENGTHS else len_scalar + tl.zeros((), dtype=tl.int64)
    length = tl.minimum(tl.maximum(length, 0), tok_width)
    # The decoder variant searches the row's own valid tokens; the encoder variant the whole input row.
    hay_len = length if DECODER else hay_width + tl.zeros((), dtype=tl.int64)
    prefix_start = length - (n - 1)
    # A row without n-1 valid tokens has no prefix, hence no windows (decoder rows: implied).
    num_windows = tl.where(prefix_start >= 0, hay_len - n + 1, 0)

    starts = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = starts < num_windows
    hay_row = hay_ptr + (row // beams).to(tl.int64) * hay_stride
    tok_row = tok_ptr + row.to(tl.int64) * tok_stride
    for k in range(0, n - 1):
        # Every lane reads the same prefix token (one broadcast transaction); masked by `ok` because
        # rows without a full prefix must not read before their start.
        want = tl.load(tok_row + (prefix_start + k) + tl.zeros((BLOCK,), dtype=tl.int64), mask=ok, other=0)
        have = tl.load(hay_row + starts + k, mask=ok, other=0)
        ok = ok & (have == want)
    banned = tl.load(hay_row + starts + (n - 1), mask=ok, other=0)
    ok = ok & (banned >= 0) & (banned < vocab)
    neg_inf = tl.full((BLOCK,), float("-inf"), tl.float32).to(scores_ptr.dtype.element_ty)
    tl.store(scores_ptr + row.to(tl.int64) * scores_stride + banned, neg_inf, mask=ok)


def _block_size(num_windows: int) -> int:
    """Few distinct sizes (each one is a separate compile): whole short rows per program, 512 for long ones."""
    for block in (128, 256):
        if num_windows <= block:
            return block
    return 512


def ban_ngrams(
    hay: torch.Tensor,
    tokens: torch.Tensor,
    lengths: torch.Tensor | None,
    length_scalar: int,
    scores: torch.Tensor,
    n: int,
    beams: int,
    decoder: bool,
) -> None:
    """Launch on rows of ``scores`` (in place). ``hay`` is ``tokens`` (decoder) or the B×S input ids."""
    hay = hay if hay.stride(1) == 1 else hay.contiguous()
    tokens = tokens if tokens.stride(1) == 1 else tokens.contiguous()
    num_rows = tokens.shape[0]
    max_windows = hay.shape[1] - n + 1
    if num_rows == 0 or max_windows <= 0:
        return
    block = _block_size(max_windows)
    grid = (num_rows, triton.cdiv(max_windows, block))
    _ban_ngrams_kernel[grid](
        hay,
        hay.stride(0),
        hay.shape[1],
        tokens,
        tokens.stride(0),
        tokens.shape[1],
        lengths if lengths is not None else tokens,
        length_scalar,
        scores,
        scores.stride(0),
        scores.shape[1],
        n,
        beams,
        HAS_LENGTHS=lengths is not None,
        DECODER=decoder,
        BLOCK=block,
    )
