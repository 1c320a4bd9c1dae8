"""Attention of grouped beam queries over one shared key/value set per input.

Beam search runs ``G`` hypotheses (beams, or returned samples) per input. Everything the
hypotheses attend to that only depends on the input (encoder states for cross-attention, the
prompt for decoder-only models) is identical across the ``G`` rows, so it can be kept once per
input: ``key``/``value`` of shape ``(B, H, S, D)`` against queries of shape ``(B*G, H, q, D)``,
where rows ``b*G .. b*G+G-1`` belong to input ``b`` (the order of ``repeat_interleave``, which
is how Transformers and fairseq expand inputs).

The layout helpers turn that into an ordinary attention problem with ``G*q`` query rows per
input, so stock kernels (SDPA, eager matmul+softmax) run it unchanged and read each K/V once
per input instead of once per hypothesis. :func:`shared_kv_attention` is the torch reference of
the same computation that also returns the log-sum-exp, so a caller can merge it with attention
over per-hypothesis keys (:func:`merge_attention_states`) without concatenating caches.

Backends of :func:`shared_kv_attention`: a Triton kernel (:mod:`fastgen.ops.triton.attention`,
imported on first use) on CUDA tensors when it supports the call, else the torch reference.
``FASTGEN_BACKEND=triton|torch`` (or ``backend=``) forces one; Triton on CPU tensors runs only
under ``TRITON_INTERPRET=1``, which is how the CPU test suite exercises it.

Imports torch only (Triton lazily, inside the dispatcher).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

import torch

from fastgen._log import origin

_log = logging.getLogger("fastgen")
BACKENDS = ("triton", "torch")

__all__ = [
    "available_backends",
    "group_beam_queries",
    "layout_for_groups",
    "merge_attention_states",
    "prefix_shared_attention",
    "shared_kv_attention",
    "shared_kv_attention_backend",
    "shared_kv_attention_reference",
    "ungroup_beam_output",
    "ungroup_beam_rows",
]


def group_beam_queries(query: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(B*G, H, q, D) -> (B, H, G*q, D)``: a hypothesis' queries become extra rows of its input.

    Row ``g*q + i`` of input ``b`` is query ``i`` of hypothesis ``b*G + g``. Copies (the head
    axis moves), but only the small query tensor. Also lays out per-hypothesis masks/biases.
    """
    rows, heads, q_len, dim = query.shape
    batch = rows // group_size
    return (
        query.reshape(batch, group_size, heads, q_len, dim)
        .transpose(1, 2)
        .reshape(batch, heads, group_size * q_len, dim)
    )


def ungroup_beam_output(output: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(B, G*q, H, D) -> (B*G, q, H, D)``: undo :func:`group_beam_queries` on a transposed output.

    Attention functions in Transformers return ``(batch, q, heads, dim)``; in that layout the
    grouped rows are already hypothesis-major, so this is a view (no copy) when contiguous.
    """
    batch, grouped_len = output.shape[:2]
    return output.reshape(batch * group_size, grouped_len // group_size, *output.shape[2:])


def ungroup_beam_rows(tensor: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(B, H, G*q, X) -> (B*G, H, q, X)``: undo :func:`group_beam_queries` (outputs, attention weights)."""
    batch, heads, grouped_len = tensor.shape[:3]
    q_len = grouped_len // group_size
    rest = tensor.shape[3:]
    return (
        tensor.reshape(batch, heads, group_size, q_len, *rest)
        .transpose(1, 2)
        .reshape(batch * group_size, heads, q_len, *rest)
    )


def layout_for_groups(tensor: torch.Tensor, batch: int, group_size: int, q_len: int) -> torch.Tensor | None:
    """Lay a 4-D mask or bias ``(b, h, qq, S)`` out for grouped queries ``(B, H, G*q, S)``.

    ``b`` may be 1 or ``B`` (shared by an input's hypotheses: returned as is when ``qq == 1``, so
    it broadcasts over the ``G*q`` rows) or ``B*G`` (one per hypothesis: regrouped like the
    queries). ``qq`` is 1 or ``q``. Returns None for any other shape, so the caller can fall back.
    """
    if tensor.dim() != 4:
        return None
    rows, heads, mask_q, kv_len = tensor.shape
    if mask_q not in (1, q_len):
        return None
    if rows == batch * group_size and group_size > 1:
        if mask_q != q_len:
            tensor = tensor.expand(rows, heads, q_len, kv_len)
        return group_beam_queries(tensor, group_size)
    if rows in (1, batch):
        if mask_q == 1:
            return tensor
        return (
            tensor.unsqueeze(2)
            .expand(rows, heads, group_size, q_len, kv_len)
            .reshape(rows, heads, group_size * q_len, kv_len)
        )
    return None


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf")).expand(mask.shape)


def shared_kv_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``B*G`` hypothesis rows over ``B`` shared key/value sets, with its log-sum-exp.

    Semantics, shapes and the empty-row convention: :func:`shared_kv_attention_reference`.
    ``backend`` (``"triton"`` or ``"torch"``) forces a backend and raises if it cannot run the
    call; without it, :func:`shared_kv_attention_backend` picks one and falls back to torch.
    """
    choice = shared_kv_attention_backend(query, key, value, attn_mask, backend=backend)
    if choice == "triton":
        kernels, _ = _load_triton()
        return kernels.shared_kv_attention(query, key, value, attn_mask, scale)  # type: ignore[union-attr]
    return shared_kv_attention_reference(query, key, value, attn_mask, scale)


def shared_kv_attention_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> str:
    """The backend :func:`shared_kv_attention` uses for this call (shapes, dtypes, devices only: no sync).

    Order: Triton on CUDA tensors, else torch. ``FASTGEN_BACKEND`` narrows that to one backend plus
    the torch reference, which always supports the call (a global switch must not break ops or
    shapes a kernel lacks); an explicit ``backend`` argument is strict and raises with the reasons.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    forced = backend or _env_backend()
    if forced == "torch" or (forced is None and query.device.type != "cuda"):
        return "torch"
    if forced not in (None, "triton"):  # e.g. FASTGEN_BACKEND=cuda: this op has no CUDA-extension kernel
        return "torch"
    kernels, import_error = _load_triton()
    reasons = [import_error] if kernels is None else kernels.not_supported_reasons(query, key, value, attn_mask)
    if not reasons:
        return "triton"
    if backend == "triton":
        raise NotImplementedError(f"triton backend cannot run this shared_kv_attention call: {'; '.join(reasons)}")
    _log.debug("shared_kv_attention: torch reference instead of triton: %s", "; ".join(reasons))
    return "torch"


def available_backends(device: str | torch.device = "cuda") -> dict[str, str | None]:
    """Each backend with None if it can run a plain fp16 decode call on ``device``, else why not.

    For ``python -m fastgen.info``; same convention as the other ops' ``available_backends``.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return {"triton": "no CUDA device", "torch": None}
    kernels, import_error = _load_triton()
    if kernels is None:
        return {"triton": import_error, "torch": None}
    query = torch.empty(2, 1, 1, 16, dtype=torch.float16, device=device)
    key_value = torch.empty(1, 1, 4, 16, dtype=torch.float16, device=device)
    return {"triton": "; ".join(kernels.not_supported_reasons(query, key_value, key_value)) or None, "torch": None}


def _env_backend() -> str | None:
    """``FASTGEN_BACKEND``, read per call (cheap) so tests and users can switch it at run time."""
    value = os.environ.get("FASTGEN_BACKEND", "").strip().lower() or None
    if value in (None, "cuda", "triton", "torch"):
        return value
    if value not in _WARNED_ENV:
        _WARNED_ENV.add(value)
        _log.warning("%signoring FASTGEN_BACKEND=%r (expected cuda, triton or torch)", origin(), value)
    return None


_WARNED_ENV: set[str] = set()
_TRITON_MODULE = "fastgen.ops.triton.attention"


@functools.cache
def _load_triton() -> tuple[ModuleType | None, str]:
    """Import the Triton kernels once: (module, "") or (None, why). A failure is logged once, then skipped."""
    try:
        return importlib.import_module(_TRITON_MODULE), ""
    except Exception as exc:  # ImportError, or a Triton that breaks while initialising its driver
        reason = f"triton failed to import ({type(exc).__name__}: {exc})"
        _log.warning("%sTriton attention backend unavailable, using torch: %s", origin(), reason)
        return None, reason


def shared_kv_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``B*G`` hypothesis rows over ``B`` shared key/value sets, with its log-sum-exp.

    Args:
        query: ``(B*G, H, q, D)``; rows ``b*G .. b*G+G-1`` belong to input ``b``.
        key: ``(B, Hkv, S, D)`` and value ``(B, Hkv, S, Dv)``; ``H`` must be a multiple of ``Hkv``
            (grouped-query attention: query head ``h`` reads key head ``h // (H // Hkv)``).
        attn_mask: optional 4-D mask, boolean (True = attend) or additive float, of shape
            ``(1 | B | B*G, 1 | H, 1 | q, S)``.
        scale: score scale, default ``D ** -0.5``.

    Returns:
        ``out`` ``(B*G, H, q, Dv)`` in the query dtype, and ``lse`` ``(B*G, H, q)`` in float32:
        ``log(sum_s exp(score_s))`` over the attended keys. A row that attends to nothing has
        ``lse = -inf`` and ``out = 0``, which :func:`merge_attention_states` treats as empty.

    Computes in float32 (this is the reference; kernels must match it within dtype tolerance).
    """
    rows, heads, q_len, dim = query.shape
    batch, kv_heads = key.shape[:2]
    if rows % batch or heads % kv_heads:
        raise ValueError(f"query rows/heads {rows}/{heads} are not multiples of key rows/heads {batch}/{kv_heads}")
    group_size = rows // batch
    if kv_heads != heads:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    scale = dim**-0.5 if scale is None else scale
    grouped = group_beam_queries(query, group_size).float()
    scores = torch.matmul(grouped, key.float().transpose(-1, -2)) * scale
    if attn_mask is not None:
        laid_out = layout_for_groups(attn_mask, batch, group_size, q_len)
        if laid_out is None:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not fit query {tuple(query.shape)}")
        scores = scores + _additive(laid_out, scores.dtype)
    lse = torch.logsumexp(scores, dim=-1)
    # softmax, not exp(scores - lse): near finfo.min (Transformers' mask value) lse absorbs log(S) in
    # rounding and exp(scores - lse) would sum to S, where upstream softmax gives a uniform row.
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(probs), probs)
    out = torch.matmul(probs, value.float())
    return ungroup_beam_rows(out, group_size).to(query.dtype), ungroup_beam_rows(lse.unsqueeze(-1), group_size)[..., 0]


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union.

    ``out_*`` are ``(..., q, Dv)`` and ``lse_*`` ``(..., q)`` as returned by
    :func:`shared_kv_attention`. Softmax over the union is the lse-weighted mix of the parts;
    a part with ``lse = -inf`` (nothing attended) contributes nothing.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = ~torch.isneginf(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    weight_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse)).unsqueeze(-1)
    weight_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse)).unsqueeze(-1)
    out = weight_a * out_a.float() + weight_b * out_b.float()
    return out.to(out_a.dtype), lse


def prefix_shared_attention(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``B*G`` hypotheses over a prefix shared per input followed by their own suffix.

    Decoder-only beam search (FastSeq §4.1.1): the prompt's keys/values are the same for all ``G``
    hypotheses of an input, the generated tokens' are not. This is attention over the per-hypothesis
    concatenation ``[prefix ; suffix]`` without building it: the prefix scores are one matmul per
    input with the ``G`` hypotheses (and the ``H // Hkv`` query heads of a key head) as extra query
    rows, so each prefix K/V is read once per input; one softmax then runs over the concatenated
    scores, as eager attention does, and the two value products are summed.

    Args:
        query: ``(B*G, H, q, D)``; rows ``b*G .. b*G+G-1`` belong to input ``b``.
        prefix_key / prefix_value: ``(B, Hkv, P, D)`` / ``(B, Hkv, P, Dv)``, ``H`` a multiple of ``Hkv``
            (query head ``h`` reads key head ``h // (H // Hkv)``, as ``repeat_kv`` lays them out).
        suffix_key / suffix_value: ``(B*G, Hkv, T, D)`` / ``(B*G, Hkv, T, Dv)``; ``T`` may be 0.
        attn_mask: optional mask over the concatenated keys, boolean (True = attend) or additive,
            broadcastable to ``(B*G, H, q, P+T)`` (what Transformers builds for the full cache).
            None attends to every key. Masked scores get the dtype's minimum, as Transformers' eager
            masks do (a fully masked row becomes uniform rather than NaN).
        scale: score scale, default ``D ** -0.5``; applied after the product, as eager attention does.
        return_weights: also return the attention probabilities ``(B*G, H, q, P+T)``.
        softcap: logit soft-capping (Gemma 2): scaled scores become ``softcap * tanh(scores / softcap)``
            before the mask, as Transformers' eager attention does.

    Returns:
        ``out`` ``(B*G, H, q, Dv)`` in the query dtype (softmax in float32), and the weights or None.
    """
    rows, heads, q_len, dim = query.shape
    batch, kv_heads, prefix_len = prefix_key.shape[:3]
    if rows % batch or heads % kv_heads or tuple(suffix_key.shape[:2]) != (rows, kv_heads):
        shapes = f"query {tuple(query.shape)}, prefix {tuple(prefix_key.shape)}, suffix {tuple(suffix_key.shape)}"
        raise ValueError(f"shapes do not fit: {shapes}")
    if (
        not return_weights
        and softcap is None
        and _merge_with_kernel(query, prefix_key, prefix_value, attn_mask, prefix_len)
    ):
        return _prefix_shared_attention_merged(
            query, prefix_key, prefix_value, suffix_key, suffix_value, attn_mask, scale
        ), None
    group, n_rep = rows // batch, heads // kv_heads
    suffix_len, value_dim = suffix_key.shape[2], prefix_value.shape[-1]
    scale = dim**-0.5 if scale is None else scale

    def to_prefix_layout(t: torch.Tensor) -> torch.Tensor:  # (B*G, H, q, X) -> (B, Hkv, G*n_rep*q, X)
        t = t.reshape(batch, group, kv_heads, n_rep * q_len, t.shape[-1]).transpose(1, 2)
        return t.reshape(batch, kv_heads, group * n_rep * q_len, t.shape[-1])

    def from_prefix_layout(t: torch.Tensor) -> torch.Tensor:  # inverse of to_prefix_layout
        t = t.reshape(batch, kv_heads, group, n_rep * q_len, t.shape[-1]).transpose(1, 2)
        return t.reshape(rows, heads, q_len, t.shape[-1])

    per_kv_head = query.reshape(rows, kv_heads, n_rep * q_len, dim)
    prefix_scores = from_prefix_layout(torch.matmul(to_prefix_layout(query), prefix_key.transpose(-1, -2)))
    suffix_scores = torch.matmul(per_kv_head, suffix_key.transpose(-1, -2)).reshape(rows, heads, q_len, suffix_len)
    scores = torch.cat([prefix_scores, suffix_scores], dim=-1) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    prefix_probs, suffix_probs = probs[..., :prefix_len], probs[..., prefix_len:]
    out = from_prefix_layout(torch.matmul(to_prefix_layout(prefix_probs), prefix_value))
    suffix_out = torch.matmul(suffix_probs.reshape(rows, kv_heads, n_rep * q_len, suffix_len), suffix_value)
    out = out + suffix_out.reshape(rows, heads, q_len, value_dim)
    return out, probs if return_weights else None


def _prefix_mask(attn_mask: torch.Tensor | None, prefix_len: int) -> torch.Tensor | None:
    return None if attn_mask is None else attn_mask[..., :prefix_len]


def _merge_with_kernel(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    prefix_len: int,
) -> bool:
    """Whether the prefix part goes to the shared-K/V kernel (Triton) and is merged by log-sum-exp.

    Only where :func:`shared_kv_attention` picks Triton (CUDA tensors, or ``FASTGEN_BACKEND=triton``
    under the interpreter): on CPU the single concatenated softmax is both faster and rounds like
    upstream's eager attention.
    """
    if attn_mask is not None and attn_mask.dim() != 4:
        return False
    prefix_mask = _prefix_mask(attn_mask, prefix_len)
    return shared_kv_attention_backend(query, prefix_key, prefix_value, prefix_mask) == "triton"


def _prefix_shared_attention_merged(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """:func:`prefix_shared_attention` as two attentions merged by log-sum-exp: the prefix through the
    shared-K/V kernel (each prefix tile read once per input), the short per-hypothesis suffix through
    the reference (one "input" per hypothesis)."""
    prefix_len = prefix_key.shape[2]
    prefix_mask = _prefix_mask(attn_mask, prefix_len)
    suffix_mask = None if attn_mask is None else attn_mask[..., prefix_len:]
    out_p, lse_p = shared_kv_attention(query, prefix_key, prefix_value, prefix_mask, scale)
    out_s, lse_s = shared_kv_attention_reference(query, suffix_key, suffix_value, suffix_mask, scale)
    return merge_attention_states(out_p, lse_p, out_s, lse_s)[0]
