"""Copies derived from a module's weight (packed fp32, int8), rebuilt whenever the weight changes.

Why a content check: a weight can change without any sign torch keeps. ``weight.data.add_(...)`` and
``p.data.mul_(...)`` write through ``.data``, a tensor with its own version counter, so neither the
parameter's ``_version`` nor its ``data_ptr()`` moves; a copy keyed on those two served stale weights.
So each entry also keeps a *fingerprint* of the weight's bytes: a 128-bit hash in which every 32-bit word
goes through murmur3's mixing (``fastgen_cpu::content_hash``, one pass at memory speed: ~14 GB/s on one core
of an Intel Xeon, 2.2 ms for the 32 MB of a 7.9M-parameter BART's linear weights), or BLAKE2b where fastgen's
CPU kernels are not available (~0.6 GB/s). An earlier fingerprint, each row's bits summed, missed edits that
change every element alike (``neg_()`` on an even width, ``mul_(2)`` on a width of 512): a hash has no such
blind spot.

The fingerprint is checked by :meth:`DerivedWeights.refresh`, which the scopes call once per
``generate`` call (not per forward: that would add a pass over the weights to every step); between
those checks a forward still notices the cheap signs (version, storage, shape).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fastgen.ops import cpu_kernels

Stamp = tuple[int, int, tuple[int, ...]]


def stamp(weight: torch.Tensor) -> Stamp:
    """The cheap signs of a change: version counter, storage address, shape."""
    return weight._version, weight.data_ptr(), tuple(weight.shape)


def fingerprint(weight: torch.Tensor) -> tuple[int, ...]:
    """A 128-bit hash of the weight's bytes (with its dtype and shape): changes with any bit of any element."""
    tensor = weight.detach().contiguous()
    # prebuilt or cached kernels are loaded here if they are not yet (never built): a first digest taken with
    # BLAKE2b and later ones with the kernel would differ once and rebuild every derived weight
    if cpu_kernels.available(build=False) and hasattr(torch.ops.fastgen_cpu, "content_hash"):
        digest = tuple(torch.ops.fastgen_cpu.content_hash(tensor).tolist())
    else:
        data = tensor.view(torch.uint8).reshape(-1).numpy() if tensor.numel() else b""
        digest = (int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little"),)
    return (*digest, str(tensor.dtype), *tensor.shape)


class DerivedWeights:
    """Per-module cache of ``build(module) -> derived`` (with its size in bytes), kept fresh.

    Entries live as long as their module (weak keys). ``get`` is what a forward calls: it rebuilds on
    a changed stamp. ``refresh`` also compares the content fingerprint (once per ``generate`` call).
    """

    def __init__(self, build: Callable[[torch.nn.Module], tuple[Any, int]]) -> None:
        self._build = build
        self._lock = threading.Lock()
        # module -> (stamp, fingerprint, derived, bytes)
        self._entries: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Stamp, tuple[int, ...], Any, int]] = (
            weakref.WeakKeyDictionary()
        )

    def _rebuild(
        self, module: torch.nn.Module, digest: tuple[int, ...] | None = None
    ) -> tuple[Stamp, tuple[int, ...], Any, int]:
        with torch.no_grad():
            derived, size = self._build(module)
            entry = (stamp(module.weight), fingerprint(module.weight) if digest is None else digest, derived, size)
        self._entries[module] = entry
        return entry

    def get(self, module: torch.nn.Module) -> Any:
        """The derived copy of ``module.weight``, rebuilt if the weight's stamp moved."""
        entry = self._entries.get(module)
        if entry is None or entry[0] != stamp(module.weight):
            with self._lock:
                entry = self._rebuild(module)
        return entry[2]

    def refresh(self, module: torch.nn.Module, digest: tuple[int, ...] | None = None) -> int:
        """Check stamp *and* content (rebuilding if either changed); returns the derived copy's bytes. ``digest``:
        the weight's :func:`fingerprint` where the caller took it already (two caches of one weight hash it once)."""
        with self._lock:
            entry = self._entries.get(module)
            if entry is None or entry[0] != stamp(module.weight):
                entry = self._rebuild(module, digest)
            else:
                digest = fingerprint(module.weight) if digest is None else digest
                if entry[1] != digest:
                    entry = self._rebuild(module, digest)
            return entry[3]

    def holds(self, module: torch.nn.Module) -> bool:
        return module in self._entries

    def refresh_held(self, module: torch.nn.Module, digest: tuple[int, ...] | None = None) -> int:
        """:meth:`refresh` where ``module`` has a derived copy already (0 bytes, and nothing built, where not)."""
        return self.refresh(module, digest) if module in self._entries else 0

    def total_bytes(self) -> int:
        """Bytes held by every derived copy alive in this process."""
        return sum(entry[3] for entry in list(self._entries.values()))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
