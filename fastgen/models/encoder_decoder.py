"""Beam-shared cross-attention for Transformers encoder-decoder models (FastSeq §4.1.2).

Upstream beam search repeats the encoder states ``num_beams`` times, projects cross-attention
K/V for every beam and ``index_select``s them at every step, although all beams of an input
hold the same values. Here the encoder states stay at batch ``B``, the cross-attention K/V are
projected and cached once per input, and attention treats an input's beams as extra query rows
against that shared K/V (:mod:`fastgen.ops.attention`), so the stock SDPA / eager kernels do the
work and the cache is ``1/num_beams`` of upstream's.

Two pieces live here, both keyed on the model family table :data:`CROSS_ATTENTION_FAMILIES`:

- :class:`BeamSharedCrossAttentionCache`, an ``EncoderDecoderCache`` whose beam reordering
  leaves the cross-attention layers alone;
- :func:`grouped_attention`, a wrapper around an attention function (as returned by
  ``AttentionInterface.get_interface``) that runs shared-K/V calls grouped.

Nothing here changes a call whose query and key batch sizes agree: only the dedup path (set up
by :mod:`fastgen.optimizer.transformers.dedup`) produces the mismatch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache

from fastgen.models._caches import hypothesis_rows, repeated_rows_cache
from fastgen.models._families import is_subclass_of_any, unsupported_attention, unsupported_family
from fastgen.ops import cpu_attention, reorder
from fastgen.ops.attention import group_beam_queries, layout_for_groups, ungroup_beam_output, ungroup_beam_rows
from fastgen.optimizer.linear_modes import approximate_here

log = logging.getLogger("fastgen")

#: ``config.model_type`` -> the attention class its decoder uses for cross-attention.
#: Every entry is verified against upstream generation in tests/models/test_dedup_encoder_decoder.py.
#: These classes project cross K/V from ``key_value_states`` (batch B here), cache them in the
#: ``EncoderDecoderCache`` cross layers, and call the attention function with
#: ``(module, query, key, value, attention_mask, **kwargs)``; T5 also passes ``position_bias``
#: (all zeros, ``(1, H, q, S)``, for cross-attention: T5 has no relative bias there).
CROSS_ATTENTION_FAMILIES: dict[str, str] = {
    "bart": "transformers.models.bart.modeling_bart.BartAttention",
    "mbart": "transformers.models.mbart.modeling_mbart.MBartAttention",
    "marian": "transformers.models.marian.modeling_marian.MarianAttention",
    "pegasus": "transformers.models.pegasus.modeling_pegasus.PegasusAttention",
    "t5": "transformers.models.t5.modeling_t5.T5Attention",
    # Added for issue 11; UMT5 and Whisper get their cross K/V primed (fastgen.models.family_checks).
    "m2m_100": "transformers.models.m2m_100.modeling_m2m_100.M2M100Attention",
    "mt5": "transformers.models.mt5.modeling_mt5.MT5Attention",
    "umt5": "transformers.models.umt5.modeling_umt5.UMT5Attention",
    "whisper": "transformers.models.whisper.modeling_whisper.WhisperAttention",
}

#: Attention implementations whose functions accept grouped queries unchanged (dense 4-D masks).
GROUPABLE_IMPLEMENTATIONS = frozenset({"sdpa", "eager"})

_SUPPORTED_CLASSES = frozenset(CROSS_ATTENTION_FAMILIES.values())


@functools.cache
def is_shared_kv_attention_module(cls: type) -> bool:
    """True for the attention classes of :data:`CROSS_ATTENTION_FAMILIES` (and their subclasses)."""
    return is_subclass_of_any(cls, _SUPPORTED_CLASSES)


def shared_cross_attention_problem(model: Any) -> str | None:
    """Why ``model`` cannot share cross-attention K/V across beams, or None if it can."""
    config = model.config
    if not getattr(config, "is_encoder_decoder", False):
        return "not an encoder-decoder model"
    if config.model_type not in CROSS_ATTENTION_FAMILIES:
        return unsupported_family(config.model_type, CROSS_ATTENTION_FAMILIES)
    if hasattr(model, "_reorder_cache"):
        return "the model reorders its cache itself (_reorder_cache)"
    configs = [config]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is not None and getattr(decoder, "config", None) is not None:
        configs.append(decoder.config)
    for cfg in configs:
        implementation = getattr(cfg, "_attn_implementation", None)
        if implementation not in GROUPABLE_IMPLEMENTATIONS:
            return unsupported_attention(implementation, GROUPABLE_IMPLEMENTATIONS)
    return None


class BeamSharedCrossAttentionCache(EncoderDecoderCache):
    """``EncoderDecoderCache`` whose cross-attention layers hold one row per input, not per beam.

    The self-attention cache has ``B*G`` rows (``G`` hypotheses per input, consecutive); the
    cross-attention cache has ``B``. Beam search only ever reorders hypotheses *within* an input
    (``beam_idx`` of input ``b`` lies in ``[b*G, b*G+G)``), and those share the cross K/V, so
    :meth:`reorder_cache` skips the cross layers: no per-step copy of the largest cache.
    """

    @classmethod
    def from_cache(cls, cache: EncoderDecoderCache) -> BeamSharedCrossAttentionCache:
        """Wrap the (empty) caches ``generate`` just built for this call."""
        return cls(cache.self_attention_cache, cache.cross_attention_cache)

    def group_size(self, layer_idx: int = 0) -> int:
        """Hypotheses per cross-attention row (1 once the caches have equal batch sizes)."""
        rows = []
        for cache in (self.self_attention_cache, self.cross_attention_cache):
            layers = cache.layers
            keys = getattr(layers[layer_idx], "keys", None) if layer_idx < len(layers) else None
            if not isinstance(keys, torch.Tensor) or keys.numel() == 0:
                return 1
            rows.append(keys.shape[0])
        return rows[0] // rows[1]

    def bytes_saved(self) -> int:
        """Cross-attention K/V bytes upstream would hold in addition (``G - 1`` more copies per input)."""
        return cache_nbytes(self)[1] * (self.group_size() - 1)

    def to_upstream(self) -> EncoderDecoderCache:
        """Upstream's layout (cross K/V repeated per hypothesis) as a plain ``EncoderDecoderCache``.

        For a cache handed back to the caller: it must work in upstream code, where nothing knows
        that the cross rows are shared. The self-attention cache is shared with this one (it already
        has upstream's layout); the cross layers repeat this cache's K/V per hypothesis into new
        tensors when first read (:class:`~fastgen.models._caches.RepeatedRowsLayer`), so a caller who
        never reads them never pays upstream's cross-attention memory, and this cache is left as it was.
        """
        layers = self.cross_attention_cache.layers
        cross = repeated_rows_cache(
            ((layer.keys, layer.values) if layer.is_initialized else None for layer in layers), self.group_size()
        )
        return EncoderDecoderCache(self.self_attention_cache, cross)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the self-attention cache only: beams of one input share their cross K/V."""
        self.self_attention_cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat hypotheses; the shared cross rows then serve ``G * repeats`` rows each."""
        self.check_dynamic_cache(self.batch_repeat_interleave.__name__)
        self.self_attention_cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Arbitrary row selection breaks the grouping: give every row its own cross K/V first."""
        self.check_dynamic_cache(self.batch_select_indices.__name__)
        group = self.group_size()
        if group > 1:
            self.cross_attention_cache.batch_repeat_interleave(group)
        self.self_attention_cache.batch_select_indices(indices)
        self.cross_attention_cache.batch_select_indices(indices)

    def batch_select_inputs(self, keep: torch.Tensor, beams: int) -> None:
        """Keep the inputs ``keep`` (ascending indices) with their ``beams`` consecutive hypotheses each.

        For finished inputs leaving beam search's batch (feature ``beam``): unlike
        :meth:`batch_select_indices` this keeps the sharing, selecting hypothesis rows of the
        self-attention cache and each kept input's one row of the cross-attention cache.
        """
        self.check_dynamic_cache(self.batch_select_inputs.__name__)
        group = self.group_size()
        rows = hypothesis_rows(keep, beams)
        self.self_attention_cache.batch_select_indices(rows)
        if group == beams:
            if not _keep_leading_rows(self.cross_attention_cache.layers, keep):
                self.cross_attention_cache.batch_select_indices(keep)
            return
        if group > 1:  # not beam search's grouping: per-hypothesis cross rows first
            self.cross_attention_cache.batch_repeat_interleave(group)
        self.cross_attention_cache.batch_select_indices(rows)


def _keep_leading_rows(layers: list[Any], keep: torch.Tensor) -> bool:
    """Each plain layer's K/V rows ``keep`` (ascending), moved to the front of the same memory and kept as a prefix
    view (what ``DynamicLayer.batch_select_indices`` computes, without new tensors); False, changing nothing, where a
    layer is not a filled contiguous CPU ``DynamicLayer`` or fastgen's reorder op is not loaded."""
    if not all(
        type(layer) is DynamicLayer
        and layer.is_initialized
        and layer.keys.is_contiguous()
        and layer.values.is_contiguous()
        and reorder.possible(layer.keys, keep)
        for layer in layers
    ):
        return False
    kept = keep.shape[0]
    rows = [tensor.view(1, tensor.shape[0], -1) for layer in layers for tensor in (layer.keys, layer.values)]
    reorder.rows_(rows, 1, keep)  # one "position", each input's K (or V) one contiguous row
    for layer in layers:
        layer.keys, layer.values = layer.keys[:kept], layer.values[:kept]
    return True


def is_plain_dynamic_encoder_decoder_cache(cache: Any) -> bool:
    """The cache ``generate`` builds by default (what :class:`BeamSharedCrossAttentionCache` wraps)."""
    return (
        type(cache) is EncoderDecoderCache
        and type(cache.self_attention_cache) is DynamicCache
        and type(cache.cross_attention_cache) is DynamicCache
    )


def cache_nbytes(cache: EncoderDecoderCache) -> tuple[int, int]:
    """Bytes held by the (self-attention, cross-attention) K/V tensors of ``cache``."""

    def nbytes(sub: Any) -> int:
        total = 0
        for layer in sub.layers:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total

    return nbytes(cache.self_attention_cache), nbytes(cache.cross_attention_cache)


AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def _per_hypothesis(tensor: Any, batch: int, group: int) -> Any:
    """Repeat a per-input mask/bias for every hypothesis (anything else is returned as is)."""
    if isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and tensor.shape[0] == batch > 1:
        return tensor.repeat_interleave(group, dim=0)
    return tensor


#: keyword arguments of an attention call that the CPU attention kernel honours (any other: stock attention)
_KERNEL_KWARGS = frozenset(
    {"dropout", "scaling", "is_causal", "output_attentions", "output_hidden_states", "use_cache", "return_dict",
     "position_ids", "cache_position"}
)  # fmt: skip


def _approximate_cpu_attention(
    attention: AttentionFunction,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """The CPU attention kernel's output ``(B, M, H, D)`` for an SDPA call of the opt-in fast modes, else None.

    Only where this thread runs the module's projections in ``fast_gemm`` or ``int8`` (approximate
    arithmetic was asked for), the call is what the kernel computes (no dropout, bias, soft-capping,
    attention weights or causal masking left to SDPA), and the tensors suit it
    (:func:`fastgen.ops.cpu_attention.supports`). Never under ``torch.compile`` (an opaque op there).
    """
    if args or getattr(attention, "__name__", None) != "sdpa_attention_forward" or torch.compiler.is_compiling():
        return None
    if not kwargs.keys() <= _KERNEL_KWARGS or kwargs.get("dropout") or kwargs.get("output_attentions"):
        return None
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if causal and mask is None and query.shape[2] > 1:
        return None
    if not approximate_here(module) or not cpu_attention.supports(query, key, value, mask):
        return None
    scaling = kwargs.get("scaling")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return cpu_attention.attention(query, key, value, mask, scale)


def _run_grouped(
    attention: AttentionFunction,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    batch = key.shape[0]
    group = query.shape[0] // batch
    q_len = query.shape[2]
    mask = attention_mask
    bias = kwargs.get("position_bias")
    # Dropout (training) draws one mask per attention-weight element: grouping would change the stream.
    groupable = not kwargs.get("dropout") and not getattr(module, "is_causal", False) and not kwargs.get("is_causal")
    if groupable and isinstance(mask, torch.Tensor):
        mask = layout_for_groups(mask, batch, group, q_len)
        groupable = mask is not None
    elif mask is not None:  # e.g. a flex BlockMask: no grouped layout
        groupable = False
    if groupable and isinstance(bias, torch.Tensor):
        bias = layout_for_groups(bias, batch, group, q_len)
        groupable = bias is not None
    if not groupable:
        # Correct for any call, just not faster: give every hypothesis its own K/V (and mask), as upstream.
        key, value = key.repeat_interleave(group, dim=0), value.repeat_interleave(group, dim=0)
        attention_mask = _per_hypothesis(attention_mask, batch, group)
        if isinstance(kwargs.get("position_bias"), torch.Tensor):
            kwargs = {**kwargs, "position_bias": _per_hypothesis(kwargs["position_bias"], batch, group)}
        return attention(module, query, key, value, attention_mask, *args, **kwargs)
    if bias is not None:
        kwargs = {**kwargs, "position_bias": bias}
    grouped = group_beam_queries(query, group)
    fast = _approximate_cpu_attention(attention, module, grouped, key, value, mask, args, kwargs)
    if fast is not None:
        return ungroup_beam_output(fast, group), None
    output, weights = attention(module, grouped, key, value, mask, *args, **kwargs)
    if weights is not None:
        weights = ungroup_beam_rows(weights, group)
    return ungroup_beam_output(output, group), weights


@functools.cache
def grouped_attention(attention: AttentionFunction) -> AttentionFunction:
    """Wrap an attention function so shared-K/V cross-attention calls run grouped.

    A call is grouped when the module is a supported cross-attention class and its query batch
    is a multiple ``G > 1`` of the key batch (the dedup layout: ``B*G`` hypothesis rows over ``B``
    cached inputs). Every other call goes to ``attention`` untouched. Cached per function so the
    per-step lookup returns the same object.
    """

    @functools.wraps(attention)
    def attention_with_shared_kv(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows, kv_rows = query.shape[0], key.shape[0]
        if rows == kv_rows or kv_rows == 0 or rows % kv_rows or not is_shared_kv_attention_module(type(module)):
            fast = _approximate_cpu_attention(attention, module, query, key, value, attention_mask, args, kwargs)
            if fast is not None:
                return fast, None
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        return _run_grouped(attention, module, query, key, value, attention_mask, args, kwargs)

    return attention_with_shared_kv
