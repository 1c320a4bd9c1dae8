"""Generation hooks that keep encoder-decoder cross-attention at one row per input ("dedup").

Decoder-only models share the same three patch points for the prompt's K/V instead: step 2 hands
them to :func:`~fastgen.optimizer.transformers.prompt_dedup.prepare_decoder_only_cache`, step 3
wraps every attention function with :func:`~fastgen.models.decoder_only.prefix_attention`, and a
fourth hook (``_prefill``) lives in :mod:`.prompt_dedup`.

``generate`` with ``num_beams=M`` (or ``num_return_sequences=M`` when sampling) expands every
input ``M`` times before decoding. Three small hooks change that for the families of
:data:`fastgen.models.encoder_decoder.CROSS_ATTENTION_FAMILIES`:

1. ``GenerationMixin._expand_inputs_for_generation`` expands everything as upstream except
   ``encoder_outputs`` and the encoder ``attention_mask``, which stay at batch ``B``. It cannot
   see the decoding mode, so this is optimistic; step 2 confirms or undoes it.
2. ``GenerationMixin._prepare_cache_for_generation`` sees the mode and the cache. For beam
   search, beam sampling and multi-sample sampling with the default dynamic cache, it wraps the
   fresh cache in :class:`~fastgen.models.encoder_decoder.BeamSharedCrossAttentionCache`
   (reordering skips the cross layers). Otherwise (assisted decoding, static/quantized/user
   caches, no cache) it expands the two entries exactly as upstream would have, so the rest of
   ``generate`` runs upstream code on upstream shapes.
3. ``AttentionInterface.get_interface`` hands the model's sdpa/eager function back wrapped by
   :func:`~fastgen.models.encoder_decoder.grouped_attention`, which runs the ``B*M`` beam
   queries against the ``B`` cached K/V as ``M`` extra query rows per input. Calls with equal
   query/key batch (everything outside this path) go straight to the original function.

The cross-attention masks need nothing: Transformers builds them from the encoder states' batch
(``create_bidirectional_mask(..., encoder_hidden_states=...)``), so they come out at ``B``.
``return_dict_in_generate`` outputs are unchanged: upstream never expanded the encoder
hidden-state/attention tuples, and cross-attention weights (eager) are returned per beam.

Why not switch ``config._attn_implementation`` to a registered function instead of step 3:
the config is shared by concurrent calls, T5 deep-copies it into its decoder, and mask creation
is keyed on the implementation name, so a new name would silently drop the padding mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastgen.models.decoder_only import prefix_attention
from fastgen.models.encoder_decoder import (
    GROUPABLE_IMPLEMENTATIONS,
    BeamSharedCrossAttentionCache,
    grouped_attention,
    is_plain_dynamic_encoder_decoder_cache,
    shared_cross_attention_problem,
)
from fastgen.models.family_checks import cross_attention_call_problem, prime_cross_attention_cache
from fastgen.optimizer import registry, report
from fastgen.optimizer.registry import fallback
from fastgen.optimizer.transformers.contract import CACHE, unknown_structure
from fastgen.optimizer.transformers.prompt_dedup import note_attention_fallback, prepare_decoder_only_cache
from fastgen.optimizer.transformers.shared_modes import FEATURE, cache_problem, model_problem

#: The encoder-side entries of ``model_kwargs`` that stay at one row per input.
SHARED_KWARGS = ("encoder_outputs", "attention_mask")


def _shared_inputs_problem(model: Any, model_kwargs: dict[str, Any]) -> str | None:
    """Why the encoder-side inputs of this call cannot stay at batch B, or None."""
    problem = shared_cross_attention_problem(model) or model_problem(model)
    if problem is not None:
        return problem
    if model_kwargs.get("mm_encoder_outputs") is not None:
        return "multimodal encoder outputs"
    encoder_outputs = model_kwargs.get("encoder_outputs")
    hidden = getattr(encoder_outputs, "last_hidden_state", None)
    if not isinstance(hidden, torch.Tensor) or not hasattr(encoder_outputs, "items"):
        return "encoder_outputs is not a ModelOutput with last_hidden_state"
    extra = [k for k, v in encoder_outputs.items() if isinstance(v, torch.Tensor) and k != "last_hidden_state"]
    if extra:
        return f"encoder_outputs carries per-row tensors {extra}"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != hidden.shape[0]):
        return "attention_mask is not a 2-D per-input mask"
    return None


def make_expand_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GenerationMixin._expand_inputs_for_generation`` (see module docstring, 1)."""

    def _expand_inputs_for_generation(
        self: Any,
        expand_size: int = 1,
        is_encoder_decoder: bool = False,
        input_ids: torch.LongTensor | None = None,
        **model_kwargs: Any,
    ) -> tuple[torch.LongTensor | None, dict[str, Any]]:
        if expand_size > 1 and is_encoder_decoder:
            problem = _shared_inputs_problem(self, model_kwargs)
            if problem is None:
                shared = {key: model_kwargs.pop(key) for key in SHARED_KWARGS if key in model_kwargs}
                # is_encoder_decoder=False only skips upstream's expansion of encoder_outputs.
                input_ids, model_kwargs = original(
                    self, expand_size=expand_size, is_encoder_decoder=False, input_ids=input_ids, **model_kwargs
                )
                model_kwargs.update(shared)
                return input_ids, model_kwargs
            fallback(FEATURE, problem)
        return original(
            self, expand_size=expand_size, is_encoder_decoder=is_encoder_decoder, input_ids=input_ids, **model_kwargs
        )

    return _expand_inputs_for_generation


def shared_group_size(model: Any, generation_config: Any, model_kwargs: dict[str, Any], batch_size: int) -> int:
    """Hypotheses per input when step 1 kept the encoder inputs at batch B for this call, else 1.

    Upstream always leaves ``B * max(num_beams, num_return_sequences)`` encoder rows here, so ``B``
    rows with a larger expansion can only come from step 1.
    """
    if not getattr(model.config, "is_encoder_decoder", False):
        return 1
    group = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    hidden = getattr(model_kwargs.get("encoder_outputs"), "last_hidden_state", None)
    if group > 1 and isinstance(hidden, torch.Tensor) and hidden.shape[0] == batch_size:
        return group
    return 1


def expand_shared_inputs(model_kwargs: dict[str, Any], group: int) -> None:
    """Expand the entries step 1 kept at batch B exactly as upstream's expansion does."""
    encoder_outputs = model_kwargs.get("encoder_outputs")
    if encoder_outputs is not None:
        for key in list(encoder_outputs.keys()):
            if isinstance(encoder_outputs[key], torch.Tensor):
                encoder_outputs[key] = encoder_outputs[key].repeat_interleave(group, dim=0)
    if isinstance(model_kwargs.get("attention_mask"), torch.Tensor):
        model_kwargs["attention_mask"] = model_kwargs["attention_mask"].repeat_interleave(group, dim=0)


def make_prepare_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GenerationMixin._prepare_cache_for_generation`` (see module docstring, 2)."""

    def _prepare_cache_for_generation(
        self: Any,
        generation_config: Any,
        model_kwargs: dict[str, Any],
        generation_mode: Any,
        batch_size: int,
        max_cache_length: int,
    ) -> Any:
        if not getattr(self.config, "is_encoder_decoder", False):
            return prepare_decoder_only_cache(
                original, self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        group = shared_group_size(self, generation_config, model_kwargs, batch_size)
        if group == 1:
            return original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        problem = cache_problem(generation_config, model_kwargs, generation_mode)
        problem = problem or cross_attention_call_problem(self, generation_config)
        if problem is not None:
            fallback(FEATURE, problem)
            expand_shared_inputs(model_kwargs, group)
            return original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        result = original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        cache = model_kwargs.get(CACHE)
        if is_plain_dynamic_encoder_decoder_cache(cache):
            shared = BeamSharedCrossAttentionCache.from_cache(cache)
            model_kwargs[CACHE] = shared
            report.note_ran(FEATURE, f"cross-attention K/V shared by {group} hypotheses per input")
            report.note_cache(shared.bytes_saved)
            prime_cross_attention_cache(self, shared, model_kwargs)
        else:
            # Not a cache we know how to wrap; it is still empty, so upstream shapes are safe.
            what = f"cache type {type(cache).__name__}"
            fallback(FEATURE, what if cache is not None else unknown_structure(f"no cache in model_kwargs[{CACHE!r}]"))
            expand_shared_inputs(model_kwargs, group)
        return result

    return _prepare_cache_for_generation


def make_get_interface(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``AttentionInterface.get_interface`` (see module docstring, 3).

    It runs inside every attention layer's forward, so it is installed without the registry's
    dispatcher (``traced=True``) and must not break a ``torch.compile`` graph: under compilation it
    returns upstream's function untouched (the per-call checks in ``shared_modes.model_problem``
    keep the deduplicated layout out of compiled forwards), and only in eager mode does it read
    whether ``dedup`` is on for this call (installed, the hook serves every thread) and hand out the
    wrapped function.
    """

    def get_interface(self: Any, attn_implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
        attention = original(self, attn_implementation, default)
        if torch.compiler.is_compiling() or not registry.feature_enabled(FEATURE):  # dedup on for this call?
            return attention
        if attn_implementation in GROUPABLE_IMPLEMENTATIONS:
            attention = grouped_attention(attention)
        # Every implementation gets the prefix check: a shared-prompt key must never reach one unexpanded.
        return prefix_attention(attention, attn_implementation, note_attention_fallback)

    return get_interface
