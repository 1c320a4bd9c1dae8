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


def _built_on_access(name: str) -> property:
    """An attribute of :class:`RepeatedRowsLayer` that builds the repeated K/V before any read or write."""

    def get(layer: RepeatedRowsLayer) -> torch.Tensor | None:
        layer._build()
        return layer.__dict__.get(name)

    def set_(layer: RepeatedRowsLayer, value: torch.Tensor | None) -> None:
        layer._build()
        layer.__dict__[name] = value

    return property(get, set_)


class RepeatedRowsLayer(DynamicLayer):
    """A ``DynamicLayer`` whose K/V are per-input tensors repeated ``group`` times along the rows, built on
    first use.

    Why: ``generate`` hands back per-hypothesis cross-attention K/V, and building them costs upstream's
    whole cross-attention cache at the end of a call (on a GPU: about twice upstream's peak memory,
    measured), although most callers never read them. Reading ``keys`` or ``values`` (or writing either)
    builds both, and from then on the layer is an ordinary ``DynamicLayer``; copies and pickles stay lazy.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, group: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.__dict__["_shared"] = (keys, values, group)

    def _build(self) -> None:
        shared = self.__dict__.get("_shared")
        if shared is not None:
            keys, values, group = shared
            self.__dict__.update(keys=keys.repeat_interleave(group, 0), values=values.repeat_interleave(group, 0))
            self.__dict__["_shared"] = None

    keys = _built_on_access("keys")
    values = _built_on_access("values")

    def get_seq_length(self) -> int:
        """Answered from the shared K/V (``EncoderDecoderCache`` asks every layer when it is made)."""
        shared = self.__dict__.get("_shared")
        return super().get_seq_length() if shared is None else shared[0].shape[-2]

    @property
    def built(self) -> bool:
        """Whether the per-hypothesis K/V exist yet."""
        return self.__dict__.get("_shared") is None


def repeated_rows_cache(layers: Iterable[tuple[torch.Tensor, torch.Tensor] | None], group: int) -> DynamicCache:
    """:func:`plain_dynamic_cache` of the given per-input K/V repeated ``group`` times, built on first use."""
    cache = DynamicCache()
    for kv in layers:
        cache.layers.append(RepeatedRowsLayer(*kv, group) if kv is not None else DynamicLayer())
    return cache


def hypothesis_rows(inputs: torch.Tensor, group: int) -> torch.Tensor:
    """Row indices of the ``group`` consecutive hypotheses of each input in ``inputs`` (beam search's layout)."""
    return (inputs[:, None] * group + torch.arange(group, device=inputs.device)).reshape(-1)
