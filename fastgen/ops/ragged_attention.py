"""Attention over ragged rows (BASS-PAD): each row's keys are the last ``lengths[b]`` of ``T`` slots.

Batched speculative decoding leaves the rows of a KV cache with different numbers of valid
tokens. BASS-PAD (Qian et al. 2024, §3.2) keeps one padded ``(B, Hkv, T, D)`` tensor and gives the
padded slots zero probability; BASS-SPLIT launches one kernel per row instead. fastgen uses the
PAD layout (docs/how-it-works/speculative.md says why) with rows right-aligned (:mod:`fastgen.models.ragged_cache`):

- row ``b`` has valid key/value slots ``[T - lengths[b], T)``;
- its ``q`` queries are the newest ``q`` of those tokens, so query ``i`` sees slots
  ``[T - lengths[b], T - q + i]`` (causal among the new tokens);
- ``H`` query heads share ``Hkv`` key/value heads (GQA: head ``h`` reads kv head ``h // (H/Hkv)``).

:func:`ragged_attention_reference` is the torch oracle (fp32 softmax over a boolean mask). The
Triton kernel (:mod:`fastgen.ops.triton.ragged_attention`) starts each row's key loop at its first
valid block, so padding costs no compute beyond the partly valid first block. Dispatch: Triton on
CUDA tensors, else torch; ``FASTGEN_BACKEND=triton|torch`` or ``backend=`` forces one (Triton on
CPU tensors only under ``TRITON_INTERPRET=1``).

Imports torch only (Triton lazily).
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("triton", "torch")


def ragged_mask(lengths: torch.Tensor, q_len: int, width: int) -> torch.Tensor:
    """(B, 1, q, T) bool: which slot each query of each row may read."""
    slots = torch.arange(width, device=lengths.device)
    first = (width - lengths)[:, None, None, None]
    last = (width - q_len + torch.arange(q_len, device=lengths.device))[None, None, :, None]
    return (slots >= first) & (slots <= last)


def ragged_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Torch oracle: (B, H, q, D) output, computed in float32 and cast back to ``query.dtype``."""
    _batch, heads, q_len, dim = query.shape
    group = heads // key.shape[1]
    scale = dim**-0.5 if scale is None else scale
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = (query.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~ragged_mask(lengths, q_len, key.shape[2]), float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)  # a query with no valid slot (lengths < q) gets zeros
    return (probs @ v).to(query.dtype)


@functools.cache
def _triton():
    from fastgen.ops.triton import ragged_attention as kernels

    return kernels


def ragged_attention_backend(query: torch.Tensor, backend: str | None = None) -> str:
    """The backend :func:`ragged_attention` uses for this call."""
    forced = backend or os.environ.get("FASTGEN_BACKEND") or None
    if forced not in (None, *BACKENDS, "cuda"):
        raise ValueError(f"unknown backend {forced!r}; expected one of {BACKENDS}")
    if forced == "torch":
        return "torch"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if (forced == "triton" or (forced is None and query.is_cuda)) and (query.is_cuda or interpret):
        try:
            _triton()
            return "triton"
        except ImportError:
            if forced == "triton":
                raise
    if forced == "triton":
        raise NotImplementedError("triton ragged attention needs CUDA tensors or TRITON_INTERPRET=1")
    return "torch"


def ragged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of the newest ``q`` tokens of each row over its ``lengths[b]`` valid, right-aligned slots.

    ``query`` (B, H, q, D); ``key``/``value`` (B, Hkv, T, D); ``lengths`` (B,) int, ``q <= lengths[b] <= T``.
    """
    if ragged_attention_backend(query, backend) == "triton":
        return _triton().ragged_attention(query, key, value, lengths, scale)
    return ragged_attention_reference(query, key, value, lengths, scale)
