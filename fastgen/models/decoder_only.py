"""Beam-shared prompt K/V for Transformers decoder-only models (FastSeq §4.1.1).

Upstream beam search (and multi-sample sampling) repeats the prompt ``G`` times, so every layer
caches ``G`` identical copies of the prompt K/V and ``index_select``s all of them at every step.
Here each layer keeps the prompt K/V once per input (the *prefix*, ``B`` rows) and only the
generated tokens' K/V per hypothesis (the *suffix*, ``B*G`` rows, in the ordinary ``keys``/``values``
fields, so upstream's ``reorder_cache`` moves nothing else). Attention combines the two exactly
(:func:`fastgen.ops.attention.prefix_shared_attention`).

Two pieces live here, keyed on the family table :data:`PROMPT_SHARING_FAMILIES`:

- :class:`SharedPrefixCache` / :class:`SharedPrefixLayer`, a ``DynamicCache`` whose layers store
  their first update (the prefill) as the prefix and report prefix + suffix lengths, so
  Transformers builds full-length masks and positions;
- :func:`prefix_attention`, a wrapper around an attention function that recognises a suffix key
  returned by :meth:`SharedPrefixLayer.update` and attends over prefix and suffix.

How attention finds the prefix: the attention function receives only the tensors ``update``
returned, not the cache. The suffix key tensor carries its layer's prefix as an attribute
(:data:`PREFIX_ATTR`), so the binding travels with the data: no global or context state that
concurrent or nested ``generate`` calls (assisted decoding's second model) could confuse, and a
key that was not produced by this cache (or was transformed on the way) is never mistaken for
one. The attribute references the prefix tensors, not the layer, so it creates no reference cycle.

Safety: a tagged key reaching an attention call the fast path does not support (another
implementation, dropout, soft-capping outside eager, an unknown module) is attended over the
materialised per-hypothesis concatenation, i.e. exactly upstream's K/V. A layer whose
``attention_ready`` callback says the wrapper is not installed (``fastgen.unpatched()``,
``disable()``, a returned cache reused later) folds its prefix back into per-row K/V first and
behaves as a plain ``DynamicLayer`` from then on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from fastgen.models._caches import hypothesis_rows, plain_dynamic_cache
from fastgen.models._families import is_subclass_of_any, unsupported_attention, unsupported_family
from fastgen.models.family_checks import shared_prompt_family_problem
from fastgen.ops.attention import prefix_shared_attention, shared_kv_attention_backend

#: ``config.model_type`` -> the self-attention class its layers use. Every entry is verified
#: against upstream generation in tests/models/test_dedup_decoder_only.py. These classes call
#: ``past_key_values.update(k, v, self.layer_idx)`` and pass the returned tensors unchanged to
#: ``ALL_ATTENTION_FUNCTIONS.get_interface(...)(module, query, key, value, mask, scaling=..., ...)``.
PROMPT_SHARING_FAMILIES: dict[str, str] = {
    "gpt2": "transformers.models.gpt2.modeling_gpt2.GPT2Attention",
    "llama": "transformers.models.llama.modeling_llama.LlamaAttention",
    "qwen2": "transformers.models.qwen2.modeling_qwen2.Qwen2Attention",
    # Added for issue 11; sliding windows, soft-capping and layer types: fastgen.models.family_checks.
    "mistral": "transformers.models.mistral.modeling_mistral.MistralAttention",
    "qwen3": "transformers.models.qwen3.modeling_qwen3.Qwen3Attention",
    "gemma2": "transformers.models.gemma2.modeling_gemma2.Gemma2Attention",
    "gemma3_text": "transformers.models.gemma3.modeling_gemma3.Gemma3Attention",
    "phi3": "transformers.models.phi3.modeling_phi3.Phi3Attention",
}

#: Attention implementations the fast path replaces (it needs a dense mask, or none).
PREFIX_IMPLEMENTATIONS = frozenset({"sdpa", "eager"})

#: Attribute of a suffix key tensor that holds its :class:`SharedPrefix`.
PREFIX_ATTR = "_fastgen_shared_prefix"

_SUPPORTED_CLASSES = frozenset(PROMPT_SHARING_FAMILIES.values())


@functools.cache
def is_prefix_sharing_module(cls: type) -> bool:
    """True for the attention classes of :data:`PROMPT_SHARING_FAMILIES` (and their subclasses)."""
    return is_subclass_of_any(cls, _SUPPORTED_CLASSES)


def shared_prompt_problem(model: Any) -> str | None:
    """Why ``model`` cannot share the prompt K/V across hypotheses, or None if it can."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model (its decoder prompt is not deduplicated)"
    if config.model_type not in PROMPT_SHARING_FAMILIES:
        return unsupported_family(config.model_type, PROMPT_SHARING_FAMILIES)
    if hasattr(model, "_reorder_cache"):
        return "the model reorders its cache itself (_reorder_cache)"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in PREFIX_IMPLEMENTATIONS:
        return unsupported_attention(implementation, PREFIX_IMPLEMENTATIONS)
    if not getattr(config, "is_causal", True):
        return "bidirectional attention (config.is_causal=False)"
    if getattr(config, "reorder_and_upcast_attn", False):
        return "GPT-2 reorder_and_upcast_attn (its eager path bypasses the attention interface)"
    if getattr(config, "add_cross_attention", False):
        return "a decoder with cross-attention (add_cross_attention)"
    return shared_prompt_family_problem(model)


@dataclasses.dataclass(frozen=True, eq=False)
class SharedPrefix:
    """The prompt K/V a suffix key continues; attached to that key by :meth:`SharedPrefixLayer.update`."""

    keys: torch.Tensor  # (B, Hkv, P, D)
    values: torch.Tensor  # (B, Hkv, P, Dv)
    suffix_values: torch.Tensor  # the value tensor returned with the key (identity-checked)

    def concatenated(self, suffix_keys: torch.Tensor, suffix_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-hypothesis ``[prefix ; suffix]``: upstream's K/V, for calls the fast path does not take."""
        group = suffix_keys.shape[0] // self.keys.shape[0]
        keys = torch.cat([self.keys.repeat_interleave(group, dim=0), suffix_keys], dim=-2)
        values = torch.cat([self.values.repeat_interleave(group, dim=0), suffix_values], dim=-2)
        return keys, values


class SharedPrefixLayer(DynamicLayer):
    """A ``DynamicLayer`` that keeps its first update (the prompt) once per input.

    ``keys``/``values`` hold only the suffix (tokens added after the prompt, one row per
    hypothesis), so the inherited row operations and upstream's beam reordering never touch the
    prefix. ``hypotheses`` is the number of query rows ``generate`` will run (``B*G``); the
    prefix may have ``B`` rows (shared) or ``B*G`` (a prefill that ran per hypothesis: correct,
    just not smaller).
    """

    def __init__(self, hypotheses: int, attention_ready: Callable[[], bool]) -> None:
        super().__init__()
        self.prefix_keys: torch.Tensor | None = None
        self.prefix_values: torch.Tensor | None = None
        self.hypotheses = hypotheses
        self._attention_ready = attention_ready

    @property
    def prefix_length(self) -> int:
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[-2]

    @property
    def suffix_length(self) -> int:
        return 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]

    def group_size(self) -> int:
        """Hypotheses per prefix row."""
        if self.prefix_keys is None:
            return 1
        rows = self.keys.shape[0] if self.suffix_length else self.hypotheses
        return rows // self.prefix_keys.shape[0]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the first update as the prefix; afterwards return the suffix, tagged with the prefix."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            # A compact copy, as upstream's concatenation makes (the states may view a fused QKV output).
            self.prefix_keys = key_states.clone(memory_format=torch.contiguous_format)
            self.prefix_values = value_states.clone(memory_format=torch.contiguous_format)
            return self.prefix_keys, self.prefix_values  # the prompt attends to itself: an ordinary call
        # Compiled code never gets the attention wrapper (and cannot read its ContextVar): upstream's K/V.
        if self.prefix_keys is not None and (torch.compiler.is_compiling() or not self._attention_ready()):
            self.materialize()
        if self.prefix_keys is None:
            return super().update(key_states, value_states, *args, **kwargs)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        setattr(self.keys, PREFIX_ATTR, SharedPrefix(self.prefix_keys, self.prefix_values, self.values))
        return self.keys, self.values

    def per_hypothesis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V as upstream stores them (prefix repeated per hypothesis), without changing it."""
        if self.prefix_keys is None or self.prefix_values is None:
            return self.keys, self.values
        group = self.group_size()
        # An empty suffix is upstream's 1-D empty tensor, which ``cat`` skips.
        keys = torch.cat([self.prefix_keys.repeat_interleave(group, dim=0), self.keys], dim=-2)
        values = torch.cat([self.prefix_values.repeat_interleave(group, dim=0), self.values], dim=-2)
        return keys, values

    def materialize(self) -> None:
        """Fold the prefix into per-hypothesis K/V: from now on a plain ``DynamicLayer`` (upstream's layout)."""
        if self.prefix_keys is not None:
            self.keys, self.values = self.per_hypothesis()
            self.prefix_keys = self.prefix_values = None

    def get_seq_length(self) -> int:
        """Prefix + suffix: masks and positions are built for the full sequence, as upstream."""
        if not self.is_initialized:
            return 0
        return self.prefix_length + self.suffix_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the suffix only: beam search keeps hypotheses within their input, which share the prefix."""
        if self.suffix_length:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    def crop(self, tokens_to_remove: int) -> None:
        if self.prefix_keys is not None and tokens_to_remove < 0 and -tokens_to_remove > self.suffix_length:
            self.materialize()  # cutting into the prompt: per-row K/V from here on
        if self.suffix_length or self.prefix_keys is None:
            super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.hypotheses *= repeats
        if self.suffix_length or self.prefix_keys is None:
            super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Arbitrary row selection breaks the grouping: give every row its own prefix first."""
        self.materialize()
        self.hypotheses = len(indices)
        super().batch_select_indices(indices)

    def batch_select_inputs(self, keep: torch.Tensor, beams: int) -> None:
        """Keep the inputs ``keep`` (ascending) with their ``beams`` consecutive hypotheses, prefix still shared."""
        rows = hypothesis_rows(keep, beams)
        if self.prefix_keys is not None and self.group_size() != beams:
            self.materialize()  # not beam search's grouping: per-hypothesis rows from here on
        if self.prefix_keys is not None:
            self.prefix_keys, self.prefix_values = self.prefix_keys[keep], self.prefix_values[keep]
        if self.suffix_length or (self.prefix_keys is None and self.is_initialized):
            self.keys, self.values = self.keys[rows], self.values[rows]
        self.hypotheses = len(rows)

    def reset(self) -> None:
        self.prefix_keys = self.prefix_values = None
        super().reset()


class SharedPrefixCache(DynamicCache):
    """A ``DynamicCache`` of :class:`SharedPrefixLayer` s (see the module docstring)."""

    def __init__(self, num_layers: int, hypotheses: int, group_size: int, attention_ready: Callable[[], bool]) -> None:
        Cache.__init__(self, layers=[SharedPrefixLayer(hypotheses, attention_ready) for _ in range(num_layers)])
        #: Hypotheses per input that ``generate`` planned (``max(num_beams, num_return_sequences)``).
        self.hypotheses_per_input = group_size
        #: The cache ``generate`` built, kept so a call that cannot share its prompt can run on it.
        self.upstream_cache: Cache | None = None

    @classmethod
    def from_cache(
        cls, cache: Any, hypotheses: int, group_size: int, attention_ready: Callable[[], bool]
    ) -> SharedPrefixCache | None:
        """Replace the empty default cache ``generate`` just built; None if it is not one we can replace."""
        if (
            type(cache) is not DynamicCache
            or cache.offloading
            or not cache.layers
            or any(type(layer) not in _REPLACEABLE_LAYERS or layer.is_initialized for layer in cache.layers)
        ):
            return None
        return cls(len(cache.layers), hypotheses, group_size, attention_ready)

    def batch_select_inputs(self, keep: torch.Tensor, beams: int) -> None:
        """Keep the inputs ``keep`` (ascending indices) with their ``beams`` consecutive hypotheses each.

        For finished inputs leaving beam search's batch (feature ``beam``): unlike
        ``batch_select_indices`` this keeps each kept input's one prefix row shared.
        """
        for layer in self.layers:
            layer.batch_select_inputs(keep, beams)

    def bytes_saved(self) -> int:
        """Prompt K/V bytes upstream would hold in addition (``G - 1`` more copies per input)."""
        total = 0
        for layer in self.layers:
            if layer.prefix_keys is not None and layer.prefix_values is not None:
                size = layer.prefix_keys.numel() * layer.prefix_keys.element_size()
                size += layer.prefix_values.numel() * layer.prefix_values.element_size()
                total += size * (layer.group_size() - 1)
        return total

    def to_upstream(self) -> DynamicCache:
        """Upstream's layout (the prompt repeated per hypothesis) in upstream's own cache object.

        For a cache handed back to the caller, which upstream code must be able to continue from.
        The per-hypothesis K/V go through the ``update`` of the (still empty) cache ``generate``
        built, so its layer types (e.g. sliding-window layers) and their counters are upstream's.
        """
        target = self.upstream_cache
        if (
            target is None
            or len(target.layers) != len(self.layers)
            or any(layer.is_initialized for layer in target.layers)
        ):
            return plain_dynamic_cache(
                layer.per_hypothesis() if layer.is_initialized else None for layer in self.layers
            )
        for layer, fresh in zip(self.layers, target.layers, strict=True):
            if layer.is_initialized:
                fresh.update(*layer.per_hypothesis())
        return target

    def __iter__(self) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None, None]]:
        """Per-hypothesis K/V as ``DynamicCache`` yields them (the prefix repeated, not stored)."""
        for layer in self.layers:
            yield (*layer.per_hypothesis(), None)


#: Empty layers :meth:`SharedPrefixCache.from_cache` replaces. A sliding-window layer is replaced only for
#: calls whose whole sequence fits in the window (``shared_prompt_call_problem``): it then keeps every token.
_REPLACEABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)

AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def _fast_path_problem(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    prefix: SharedPrefix,
    kwargs: dict[str, Any],
) -> str | None:
    if not is_prefix_sharing_module(type(module)):
        return f"attention module {type(module).__name__} is not in the shared-prompt family table"
    if kwargs.get("dropout", 0.0):
        return "attention dropout (training mode)"
    for name in ("position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            return f"attention argument {name!r}"
    # ``sliding_window`` needs nothing: sdpa and eager ignore it (the window is in the mask, built over the
    # cached length), and calls whose window would cut into the cache are refused before the cache exists.
    if value is not prefix.suffix_values:
        return "the value tensor is not the one the cache returned with the key"
    if query.shape[0] % prefix.keys.shape[0] or query.shape[1] % prefix.keys.shape[1]:
        return "query rows/heads are not multiples of the cached prefix's"
    total = prefix.keys.shape[-2] + key.shape[-2]
    if attention_mask is not None and (
        not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4 or attention_mask.shape[-1] != total
    ):
        return "the attention mask is not a dense 4-D mask over the cached length"
    return None


def _softcap_problem(implementation: str | None, softcap: float | None) -> str | None:
    """Soft-capping (Gemma 2) is exact as eager attention applies it; sdpa refuses it upstream (so here too)."""
    if softcap is not None and implementation != "eager":
        return f"attention argument 'softcap' with implementation {implementation!r}"
    return None


#: Half-precision dtypes: in these the torch path's split products round differently from upstream's kernels.
_HALF = (torch.float16, torch.bfloat16)


def _half_precision_exact(query: torch.Tensor, prefix: SharedPrefix, attention_mask: Any) -> bool:
    """True when a half-precision call would take the torch path, whose eager-style products (rounded to
    the dtype per part) flip near-ties that upstream's fused sdpa or single eager product do not
    (benchmarks/half_precision.py). Such calls attend with upstream's own function over the
    materialised per-hypothesis K/V (upstream's tensors; the cache still holds the prompt once)."""
    if query.dtype not in _HALF:
        return False
    mask = attention_mask[..., : prefix.keys.shape[-2]] if isinstance(attention_mask, torch.Tensor) else None
    return shared_kv_attention_backend(query, prefix.keys, prefix.values, mask) != "triton"


def _causal_mask(q_len: int, total: int, device: torch.device) -> torch.Tensor:
    """Lower-right aligned causal mask: the ``q_len`` queries are the last positions of ``total``."""
    rows = torch.arange(total - q_len, total, device=device)
    return (torch.arange(total, device=device) <= rows[:, None]).view(1, 1, q_len, total)


@functools.cache
def prefix_attention(
    attention: AttentionFunction, implementation: str | None, on_fallback: Callable[[str], None] | None = None
) -> AttentionFunction:
    """Wrap ``attention`` (the function of ``implementation``) so tagged suffix keys see their prefix.

    Untagged calls (everything outside the shared-prompt path) go to ``attention`` untouched. Tagged
    calls take the fast path for sdpa and eager (returning probabilities as eager does, None as sdpa
    does); for any other implementation, or a call the fast path does not support, ``attention``
    gets the materialised per-hypothesis K/V and ``on_fallback`` is told why. Cached per argument
    set so the per-layer lookup returns the same object.
    """
    fast = implementation in PREFIX_IMPLEMENTATIONS

    @functools.wraps(attention)
    def attention_with_shared_prefix(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        prefix: SharedPrefix | None = getattr(key, PREFIX_ATTR, None)
        if prefix is None:
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        problem = None if fast else f"attention implementation {implementation!r}"
        problem = problem or ("positional arguments after the mask" if args else None)
        problem = problem or _fast_path_problem(module, query, key, value, attention_mask, prefix, kwargs)
        problem = problem or _softcap_problem(implementation, kwargs.get("softcap"))
        if problem is not None:
            if on_fallback is not None:
                on_fallback(problem)
            key, value = prefix.concatenated(key, value)
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        if _half_precision_exact(query, prefix, attention_mask):
            key, value = prefix.concatenated(key, value)
            return attention(module, query, key, value, attention_mask, **kwargs)
        q_len, total = query.shape[2], prefix.keys.shape[-2] + key.shape[-2]
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        if attention_mask is None and q_len > 1 and causal:
            attention_mask = _causal_mask(q_len, total, query.device)  # sdpa skipped the mask: plain causal
        out, weights = prefix_shared_attention(
            query,
            prefix.keys,
            prefix.values,
            key,
            value,
            attention_mask,
            scale=kwargs.get("scaling"),
            softcap=kwargs.get("softcap"),
            return_weights=implementation == "eager",
        )
        return out.transpose(1, 2), weights

    return attention_with_shared_prefix
