"""Triton kernel for the retrieval half of :func:`fastgen.ops.beam_topk.beam_topk`.

One program per (hypothesis row, vocabulary chunk): it reads the chunk's logits once (any float
dtype, accumulated in float32), stores the chunk's max and sum of ``exp(logit - max)`` (over every
logit: bans come after the normalisation, as upstream's), and the chunk's k largest logits with the
bans applied as -inf, ties by smaller token id (an unbanned -inf before a banned one). Rows and
chunks run in parallel; combining the chunks' (max, sum) pairs is the online-softmax rescaling of
Amun's Algorithm 4, done by the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _retrieve_kernel(
    logits_ptr,
    logits_stride,
    mask_ptr,
    mask_stride,
    vocab,
    k,
    cand_values_ptr,
    cand_tokens_ptr,
    chunk_max_ptr,
    chunk_sum_ptr,
    num_chunks,
    HAS_MASK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = offs < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + offs, mask=inside, other=float("-inf"))
    x = x.to(tl.float32)
    top = tl.max(x, axis=0)
    # A chunk of -inf only contributes nothing (exp(-inf - -inf) would be NaN).
    total = tl.sum(tl.where(inside, tl.exp(x - top), 0.0), axis=0)
    total = tl.where(top == float("-inf"), 0.0, total)
    slot = row.to(tl.int64) * num_chunks + chunk
    tl.store(chunk_max_ptr + slot, top)
    tl.store(chunk_sum_ptr + slot, total)

    if HAS_MASK:
        ban = tl.load(mask_ptr + row.to(tl.int64) * mask_stride + offs, mask=inside, other=0) != 0
        x = tl.where(ban, float("-inf"), x)
    else:
        ban = offs < 0
    alive = inside
    out = slot * k
    for j in range(0, k):
        best = tl.max(tl.where(alive, x, float("-inf")), axis=0)
        # Ties: smaller token id, unbanned before banned (they differ when the row's log-probs are NaN).
        tied = alive & (x == best)
        pick = tl.min(tl.where(tied & ~ban, offs, vocab), axis=0)
        pick = tl.where(pick < vocab, pick, tl.min(tl.where(tied, offs, vocab), axis=0))
        found = pick < vocab
        tl.store(cand_values_ptr + out + j, tl.where(found, best, float("-inf")))
        tl.store(cand_tokens_ptr + out + j, tl.where(found, pick, -1).to(tl.int64))
        alive = alive & (offs != pick)


def retrieve(
    logits: torch.Tensor,
    mask: torch.Tensor | None,
    k: int,
    chunk: int,
    cand_values: torch.Tensor,
    cand_tokens: torch.Tensor,
    chunk_max: torch.Tensor,
    chunk_sum: torch.Tensor,
) -> None:
    """Fill the N×(chunks·k) candidates and N×chunks (max, sum) buffers (layouts: ``_run_kernel``)."""
    rows, vocab = logits.shape
    num_chunks = chunk_max.shape[1]
    if rows == 0:
        return
    mask_arg = mask if mask is not None else logits
    mask_stride = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    _retrieve_kernel[(rows, num_chunks)](
        logits,
        logits.stride(0),
        mask_arg,
        mask_stride,
        vocab,
        k,
        cand_values,
        cand_tokens,
        chunk_max,
        chunk_sum,
        num_chunks,
        HAS_MASK=mask is not None,
        CHUNK=chunk,
    )
