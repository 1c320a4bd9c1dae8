"""When a ``generate`` call may keep per-input state at one row per input (both "dedup" hooks ask this)."""

from __future__ import annotations

from typing import Any

from transformers.generation.configuration_utils import GenerationMode

FEATURE = "dedup"

#: Decoding modes whose loops only feed the model and reorder the cache (no per-row surgery).
SHARED_MODES = frozenset({GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE, GenerationMode.SAMPLE})


def cache_problem(generation_config: Any, model_kwargs: dict[str, Any], generation_mode: Any) -> str | None:
    """Why this call must keep upstream's per-hypothesis cache, or None. Ask before the cache is built."""
    if generation_mode not in SHARED_MODES:
        return f"generation mode {generation_mode}"
    if model_kwargs.get("past_key_values") is not None:
        return "a user-provided cache"
    if generation_config.use_cache is False:
        return "use_cache=False"
    if generation_config.cache_implementation not in (None, "dynamic"):
        return f"cache_implementation={generation_config.cache_implementation!r}"
    if getattr(generation_config, "is_assistant", False):
        return "assistant model"
    return None
