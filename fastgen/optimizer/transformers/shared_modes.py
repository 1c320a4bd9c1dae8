"""When a ``generate`` call may keep per-input state at one row per input (both "dedup" hooks ask this).

Every check here runs once per call, before anything is computed, so a call that cannot take the
fast path runs upstream's code from the start (a fallback is whole: inputs, prefill, cache, random
streams).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from transformers.generation.configuration_utils import GenerationMode

from fastgen.optimizer.transformers.contract import CACHE

FEATURE = "dedup"

#: Decoding modes whose loops only feed the model and reorder the cache (no per-row surgery).
SHARED_MODES = frozenset({GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE, GenerationMode.SAMPLE})

#: Module attributes that hold a dropout probability applied in the forward (HF attention classes
#: pass ``dropout=self.attention_dropout`` / ``self.dropout`` to the attention function).
_DROPOUT_ATTRIBUTES = ("dropout", "attention_dropout", "attn_dropout", "p")


def _active_dropout(model: torch.nn.Module) -> bool:
    """Whether the forward draws random numbers: training mode with some dropout probability > 0."""
    if not model.training:
        return False
    for module in model.modules():
        if not module.training:
            continue
        for name in _DROPOUT_ATTRIBUTES:
            value = module.__dict__.get(name)
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0:
                return True
    return False


def _compiled_forward(model: Any) -> bool:
    """``model.compile()`` or ``model.forward = torch.compile(model.forward)``: the fast path's
    attention wrappers step aside inside compiled code, so such a model must run upstream's layout."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        return True
    forward = model.__dict__.get("forward")
    return forward is not None and hasattr(forward, "_torchdynamo_orig_callable")


def model_problem(model: Any) -> str | None:
    """Why this model, as it is now, must run upstream's per-hypothesis layout, or None."""
    if torch.compiler.is_compiling():
        return "generate is being compiled"
    if _compiled_forward(model):
        return "the model's forward is compiled (torch.compile)"
    if _active_dropout(model):
        return "training mode with dropout (the random stream depends on the layout)"
    return None


def cache_problem(generation_config: Any, model_kwargs: dict[str, Any], generation_mode: Any) -> str | None:
    """Why this call must keep upstream's per-hypothesis cache, or None. Ask before the cache is built."""
    if generation_mode not in SHARED_MODES:
        return f"generation mode {generation_mode}"
    if model_kwargs.get(CACHE) is not None:
        return "a user-provided cache"
    if generation_config.use_cache is False:
        return "use_cache=False"
    if generation_config.cache_implementation not in (None, "dynamic"):
        return f"cache_implementation={generation_config.cache_implementation!r}"
    if getattr(generation_config, "is_assistant", False):
        return "assistant model"
    return None
