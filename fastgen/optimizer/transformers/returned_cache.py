"""What leaves ``generate`` has upstream's layout ("dedup", DESIGN.md §8).

Inside a call the deduplicated caches hold one row per input where upstream holds one per
hypothesis (cross-attention K/V, a decoder-only prompt). A cache handed to the caller
(``return_dict_in_generate=True`` with a cache) must work in upstream code — inside
``fastgen.unpatched()``, after ``fastgen.disable()``, in a model fastgen does not know — so the
``generate`` hook folds it back into upstream's classes and shapes once, at the end. A call that
returns no cache pays nothing. It also closes the call's entry in an open :func:`fastgen.report`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastgen.models.decoder_only import SharedPrefixCache
from fastgen.models.encoder_decoder import BeamSharedCrossAttentionCache
from fastgen.optimizer import report
from fastgen.optimizer.transformers.contract import CACHE

#: Caches that may be returned, each with ``to_upstream()`` giving upstream's class and layout.
DEDUP_CACHES = (BeamSharedCrossAttentionCache, SharedPrefixCache)


def to_upstream_layout(outputs: Any) -> Any:
    """Replace a deduplicated cache in ``generate``'s outputs by upstream's layout."""
    cache = outputs.get(CACHE) if hasattr(outputs, "keys") else None
    if isinstance(cache, DEDUP_CACHES):
        outputs[CACHE] = cache.to_upstream()
    return outputs


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GenerationMixin.generate``: upstream's call, then the returned cache folded."""

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = original(self, *args, **kwargs)
        report.settle_caches()  # measure the savings before the fold repeats the shared rows
        return to_upstream_layout(outputs)

    return generate
