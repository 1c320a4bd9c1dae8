"""Decode-step attention on CPU for the opt-in fast modes: a few query rows over many keys, one pass.

Why: in a CPU beam-search step each input's ``beams x 1`` query rows attend over its encoder keys
(cross-attention, keys shared across the beams) and each hypothesis' one query over its own cache
(self-attention). Stock SDPA runs its flash kernel per (batch, head) pair with blocked GEMM calls
sized for long queries: on bart-base (beam 4, 256 source tokens, one core of an AMD EPYC) a
cross-attention call took ~620 us where reading its K/V once takes ~200 us, and a self-attention
call ~100 us for a few KB of work. The C++ kernel (``csrc/cpu/decode_attention.cpp``) reads each key
and value row once and is 1.5x (cross) and 2.3x (self) faster there.

It sums in another order than SDPA (results agree to float32 rounding, not bit for bit), so only
``fast_gemm`` and ``int8`` use it, never the default exact mode. It is built on first use
(:mod:`fastgen.ops.cpu_kernels`); where it can't be, or with ``FASTGEN_CPU_ATTENTION=0``, the stock
attention runs (:func:`unavailable_reason` says why).

:func:`decode_attention_reference` is the same computation in torch, for the tests.
"""

from __future__ import annotations

import os

import torch

from fastgen.ops import cpu_kernels

MAX_QUERY_ROWS = 16  # beyond this a GEMM-based kernel (SDPA's) is the better tool


def unavailable_reason() -> str | None:
    """Why the kernel can't run (None: it can); builds the CPU kernels on the first call."""
    if os.environ.get("FASTGEN_CPU_ATTENTION", "1").strip().lower() in cpu_kernels.OFF:
        return "FASTGEN_CPU_ATTENTION=0"
    return cpu_kernels.unavailable_reason()


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel takes these tensors (else the caller runs stock attention)."""
    if query.device.type != "cpu" or not (query.dtype == key.dtype == value.dtype == torch.float32):
        return False
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[2] > MAX_QUERY_ROWS:
        return False
    if key.shape[:2] != query.shape[:2] or value.shape[:3] != key.shape[:3] or key.shape[3] != query.shape[3]:
        return False  # grouped-query heads or odd shapes: SDPA handles them
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    if mask is not None:
        if mask.dim() != 4 or mask.device.type != "cpu" or mask.dtype not in (torch.bool, torch.float32):
            return False
        broadcasts = all(m in (1, t) for m, t in zip(mask.shape[:3], query.shape[:3], strict=True))
        if mask.shape[3] != key.shape[2] or not broadcasts:
            return False
    return unavailable_reason() is None


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` laid out ``(B, M, H, D)``; call :func:`supports` first."""
    return torch.ops.fastgen_cpu.decode_attention(query, key, value, mask, float(scale))


def decode_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The kernel's semantics in torch: a bool mask keeps True positions, a float mask is added; a row
    with every position masked out gives zeros (SDPA would give NaN there)."""
    scores = torch.matmul(query.double(), key.double().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return torch.matmul(weights, value.double()).to(query.dtype).transpose(1, 2)
