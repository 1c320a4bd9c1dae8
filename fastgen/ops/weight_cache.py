"""Copies derived from a module's weight (packed fp32, int8), rebuilt whenever the weight changes.

Why a content check: a weight can change without any sign torch keeps. ``weight.data.add_(...)`` and
``p.data.mul_(...)`` write through ``.data``, a tensor with its own version counter, so neither the
parameter's ``_version`` nor its ``data_ptr()`` moves; a copy keyed on those two served stale weights
(issue 24). So each entry also keeps a *fingerprint* of the weight's bits: the sum of every row's
elements read as int32 (wrapping), one vectorised pass (about 9 ms for a 50k x 768 vocabulary
projection on one core). Any change of an element's bits changes its row's sum, and moving rows changes
the vector; only a permutation *within* a row, bit pattern for bit pattern, keeps it.

The fingerprint is checked by :meth:`DerivedWeights.refresh`, which the scopes call once per
``generate`` call (not per forward: that would add a pass over the weights to every step); between
those checks a forward still notices the cheap signs (version, storage, shape).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

Stamp = tuple[int, int, tuple[int, ...]]


def stamp(weight: torch.Tensor) -> Stamp:
    """The cheap signs of a change: version counter, storage address, shape."""
    return weight._version, weight.data_ptr(), tuple(weight.shape)


def fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """Per-row sums of the weight's bits read as int32 (wrapping): changes with any element's bits."""
    bits = weight.detach().contiguous().view(torch.int32)
    return bits.reshape(bits.shape[0], -1).sum(dim=1, dtype=torch.int32)


class DerivedWeights:
    """Per-module cache of ``build(module) -> derived`` (with its size in bytes), kept fresh.

    Entries live as long as their module (weak keys). ``get`` is what a forward calls: it rebuilds on
    a changed stamp. ``refresh`` also compares the content fingerprint (once per ``generate`` call).
    """

    def __init__(self, build: Callable[[torch.nn.Module], tuple[Any, int]]) -> None:
        self._build = build
        self._lock = threading.Lock()
        # module -> (stamp, fingerprint, derived, bytes)
        self._entries: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Stamp, torch.Tensor, Any, int]] = (
            weakref.WeakKeyDictionary()
        )

    def _rebuild(self, module: torch.nn.Module) -> tuple[Stamp, torch.Tensor, Any, int]:
        with torch.no_grad():
            derived, size = self._build(module)
            entry = (stamp(module.weight), fingerprint(module.weight), derived, size)
        self._entries[module] = entry
        return entry

    def get(self, module: torch.nn.Module) -> Any:
        """The derived copy of ``module.weight``, rebuilt if the weight's stamp moved."""
        entry = self._entries.get(module)
        if entry is None or entry[0] != stamp(module.weight):
            with self._lock:
                entry = self._rebuild(module)
        return entry[2]

    def refresh(self, module: torch.nn.Module) -> int:
        """Check stamp *and* content (rebuilding if either changed); returns the derived copy's bytes."""
        with self._lock:
            entry = self._entries.get(module)
            if (
                entry is None
                or entry[0] != stamp(module.weight)
                or not torch.equal(entry[1], fingerprint(module.weight))
            ):
                entry = self._rebuild(module)
            return entry[3]

    def total_bytes(self) -> int:
        """Bytes held by every derived copy alive in this process."""
        return sum(entry[3] for entry in list(self._entries.values()))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
