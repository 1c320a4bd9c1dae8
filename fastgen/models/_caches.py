"""Shared by the deduplicated caches: building upstream's plain cache from per-hypothesis K/V."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


def plain_dynamic_cache(layers: Iterable[tuple[torch.Tensor, torch.Tensor] | None]) -> DynamicCache:
    """A ``DynamicCache`` of plain ``DynamicLayer`` s holding the given K/V (None: an empty layer).

    Exactly what upstream's ``generate`` would hand back, so code that knows nothing of fastgen
    (``fastgen.unpatched()``, ``fastgen.disable()``, another library) can continue from it.
    """
    cache = DynamicCache()
    for kv in layers:
        layer = DynamicLayer()
        if kv is not None:
            keys, values = kv
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


def hypothesis_rows(inputs: torch.Tensor, group: int) -> torch.Tensor:
    """Row indices of the ``group`` consecutive hypotheses of each input in ``inputs`` (beam search's layout)."""
    return (inputs[:, None] * group + torch.arange(group, device=inputs.device)).reshape(-1)
