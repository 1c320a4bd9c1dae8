"""Triton kernel for :func:`fastgen.ops.ragged_attention.ragged_attention` (BASS-PAD).

One program per (row, query head, block of query positions). It loops over key blocks from the
row's first valid slot ``T - lengths[b]`` (rounded down to a block) to its last visible slot, with
an online softmax in float32 (fp16/bf16 operands go to the tensor cores with fp32 accumulation;
fp32 operands use IEEE products, no TF32); slots outside ``[T - lengths[b], T - q + i]`` get ``-inf``. So a row
pays for its own length only, not the batch maximum, except for the one partly padded block:
the compute saving of BASS-SPLIT inside BASS-PAD's single launch.

Layers: kernel -> :func:`ragged_attention` (launcher).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ragged_attention"]


@triton.jit
def _ragged_attention_kernel(
    Q, K, V, Out, Lengths,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    scale,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    Q_LEN: tl.constexpr,
    WIDTH: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = (pid_bh // HEADS).to(tl.int64)
    h = pid_bh % HEADS
    kv_h = h // GROUP
    length = tl.load(Lengths + b)
    first = WIDTH - length

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Q_LEN
    dim_ok = offs_d < DIM
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    last = WIDTH - Q_LEN + offs_m  # last slot each query may read

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = (first // BLOCK_N) * BLOCK_N
    for n0 in range(start, WIDTH, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < WIDTH
        k = tl.load(
            K + b * stride_kb + kv_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
            mask=col_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # ieee: no TF32 on fp32
        visible = (offs_n[None, :] >= first) & (offs_n[None, :] <= last[:, None]) & col_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(
            V + b * stride_vb + kv_h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=col_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def ragged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Launch the kernel; same contract as :func:`fastgen.ops.ragged_attention.ragged_attention`."""
    batch, heads, q_len, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads is not a multiple of {kv_heads} kv heads")
    out = torch.empty_like(query)
    block_m = max(16, triton.next_power_of_2(q_len)) if q_len <= 64 else 64
    block_d = max(16, triton.next_power_of_2(dim))
    grid = (batch * heads, triton.cdiv(q_len, block_m))
    _ragged_attention_kernel[grid](
        query, key, value, out, lengths.to(torch.int32).contiguous(),
        *query.stride(), *key.stride(), *value.stride(), *out.stride(),
        dim**-0.5 if scale is None else scale,
        HEADS=heads, GROUP=heads // kv_heads, Q_LEN=q_len, WIDTH=width, DIM=dim,
        BLOCK_M=block_m, BLOCK_N=32, BLOCK_D=block_d,
    )  # fmt: skip
    return out
