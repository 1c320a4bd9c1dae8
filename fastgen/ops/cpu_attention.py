"""Attention on CPU for the opt-in fast modes: one C++ kernel for decode steps and encoders.

Why: stock SDPA on CPU runs its flash kernel per (batch, head) pair with blocked GEMM calls. In a
beam-search decode step each input's ``beams x 1`` query rows attend over its encoder keys
(cross-attention, keys shared across the beams) and each hypothesis' one query over its own cache
(self-attention): on bart-base shapes (beam 4, 256 source tokens, one core of an AMD EPYC with
AVX-512) SDPA took ~290 us per cross-attention call (hot) where the kernel
(``csrc/cpu/attention.cpp``) takes ~200, and ~100 us per self-attention call where it takes ~45;
on the encoder (256 x 256 per pair) 10.7 ms against 8.1 ms. Where it measured slower (head size 128
with long queries, head sizes like 40 or 80 with several query rows) :func:`supports` leaves the call
to SDPA.

It sums in another order than SDPA (results agree to float32 rounding, not bit for bit), so only
``fast_gemm`` and ``int8`` use it, never the default exact mode. It is built on first use
(:mod:`fastgen.ops.cpu_kernels`); where it can't be, or with ``FASTGEN_CPU_ATTENTION=0``, the stock
attention runs (:func:`unavailable_reason` says why).

:func:`attention_reference` is the same computation in torch, for the tests.
"""

from __future__ import annotations

import os

import torch

from fastgen.ops import cpu_kernels

#: the kernel's way for up to this many query rows (dot products over untransposed keys)
FEW_QUERY_ROWS = 16


def unavailable_reason() -> str | None:
    """Why the kernel can't run (None: it can); builds the CPU kernels on the first call."""
    if os.environ.get("FASTGEN_CPU_ATTENTION", "1").strip().lower() in cpu_kernels.OFF:
        return "FASTGEN_CPU_ATTENTION=0"
    return cpu_kernels.unavailable_reason()


def takes_rows(rows: int, dim: int) -> bool:
    """Whether the kernel takes ``rows`` query rows per (batch, head) pair of head size ``dim`` (elsewhere SDPA
    measured faster: module docs)."""
    return dim == 64 or rows == 1 or (dim == 128 and rows <= FEW_QUERY_ROWS)


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel takes these tensors (else the caller runs stock attention)."""
    if query.device.type != "cpu" or not (query.dtype == key.dtype == value.dtype == torch.float32):
        return False
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    if not takes_rows(query.shape[2], query.shape[3]):
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


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` laid out ``(B, M, H, D)``; call :func:`supports` first."""
    return torch.ops.fastgen_cpu.attention(query, key, value, mask, float(scale))


def attention_reference(
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
