"""A self-attention cache layer that grows in place, for the lean decode step.

Upstream's ``DynamicLayer`` appends a step's K/V with ``torch.cat``: every step copies the whole cache
into a new tensor, and beam search's reorder copies it once more. This layer keeps K/V in time-major
buffers with room to grow (``(capacity, rows, heads, head_dim)``): a step writes only its own position,
the reorder moves in place only the rows whose parent is another row (:mod:`fastgen.ops.reorder`; elsewhere
it gathers the filled prefix into a second buffer, one copy, as upstream's), rows that leave (finished inputs)
leave the kept ones at the front of the same buffers (a view of fewer rows: no new buffers), and ``keys`` /
``values`` are views of the filled prefix in upstream's ``(rows, heads, length, head_dim)`` shape. Attention
reads the same numbers through other strides; SDPA and fastgen's CPU attention give the same bits
(``tests/models/test_lean_step.py``).

Every other method of ``DynamicLayer`` works on the views (upstream's code sees a ``DynamicLayer``);
:func:`plain_layers` puts ordinary contiguous layers back before a cache leaves ``generate``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from fastgen.ops import reorder


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose K/V live in preallocated time-major buffers (module docstring)."""

    def __init__(self, layer: DynamicLayer) -> None:
        super().__init__()
        self.__dict__.update({k: v for k, v in layer.__dict__.items() if k not in ("keys", "values")})
        self._adopt(layer.keys, layer.values, extra=max(32, layer.keys.shape[-2]))

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, extra: int) -> None:
        """Copy ``(rows, heads, length, dim)`` K/V into new buffers with ``extra`` free positions."""
        rows, heads, length, dim = keys.shape
        count = 2 if getattr(self, "_buffers", None) is not None and self.pinned else 4  # K, V (, spare K, V)
        self._buffers = [keys.new_empty(length + extra, rows, heads, dim) for _ in range(count)]
        self._buffers[0][:length] = keys.permute(2, 0, 1, 3)
        self._buffers[1][:length] = values.permute(2, 0, 1, 3)
        self._length = length
        self._publish()

    def _publish(self) -> None:
        self.keys = self._buffers[0][: self._length].permute(1, 2, 0, 3)
        self.values = self._buffers[1][: self._length].permute(1, 2, 0, 3)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:  # after reset(): upstream's first update, then buffers again
            super().update(key_states, value_states, *args, **kwargs)
            self._adopt(self.keys, self.values, extra=32)
            return self.keys, self.values
        new = key_states.shape[-2]
        self.reserve(new)  # doubles the room when full
        end = self._length + new
        self._buffers[0][self._length : end] = key_states.permute(2, 0, 1, 3)
        self._buffers[1][self._length : end] = value_states.permute(2, 0, 1, 3)
        self.advance(new)
        return self.keys, self.values

    @property
    def length(self) -> int:
        return self._length

    @property
    def key_buffer(self) -> torch.Tensor:
        """The time-major key buffer ``(capacity, rows, heads, dim)``; positions from :attr:`length` are free."""
        return self._buffers[0]

    @property
    def value_buffer(self) -> torch.Tensor:
        return self._buffers[1]

    def reserve(self, new: int) -> None:
        """Room for ``new`` more positions in the buffers (for a writer of its own: the compiled step)."""
        if self._length + new > self._buffers[0].shape[0]:
            self._adopt(self.keys, self.values, extra=max(new, self._length))

    def clear_free(self) -> None:
        """Zero every buffer's free positions (a reader that masks them, the CUDA-graph step, then multiplies
        finite numbers by zero: never NaN from uninitialised memory)."""
        for buffer in self._buffers:
            buffer[self._length :].zero_()

    def advance(self, new: int) -> None:
        """``new`` positions past :attr:`length` were written in the buffers: they are part of the cache now."""
        self._length += new
        self._publish()

    def pin(self) -> None:
        """Keep the K/V at their addresses from here on (a CUDA graph reads them there): the spare buffers go,
        and a reorder gathers into a temporary and copies back, one copy more than swapping buffers."""
        self._buffers[2:] = []

    @property
    def pinned(self) -> bool:
        return len(self._buffers) == 2

    def _select_rows(self, indices: torch.Tensor) -> None:
        length = self._length
        if self.pinned:
            keys, values = self._buffers
            if indices.shape[0] != keys.shape[1]:  # fewer rows: new buffers of that width, pinned there
                self._buffers = [keys.new_empty(keys.shape[0], indices.shape[0], *keys.shape[2:]) for _ in range(2)]
            for old, new in zip((keys, values), self._buffers, strict=True):
                new[:length] = old[:length].index_select(1, indices)
            self._publish()
            return
        keys, values, spare_keys, spare_values = self._buffers
        if indices.shape[0] <= keys.shape[1] and reorder.possible(keys, indices):
            reorder.rows_([keys, values], length, indices)  # only rows whose parent is another row move
            if indices.shape[0] < keys.shape[1]:  # fewer rows (inputs left): the first ones, in the same memory
                self._buffers = [buffer[:, : indices.shape[0]] for buffer in self._buffers]
                self._publish()
            return
        if indices.shape[0] != keys.shape[1]:  # fewer rows: new spares of that width
            spare_keys = keys.new_empty(keys.shape[0], indices.shape[0], *keys.shape[2:])
            spare_values = values.new_empty(spare_keys.shape)
        torch.index_select(keys[:length], 1, indices, out=spare_keys[:length])
        torch.index_select(values[:length], 1, indices, out=spare_values[:length])
        self._buffers = [spare_keys, spare_values, keys, values]
        if indices.shape[0] != keys.shape[1]:
            self._buffers[2:] = [spare_keys.new_empty(spare_keys.shape), spare_values.new_empty(spare_keys.shape)]
        self._publish()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx.to(self._buffers[0].device))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self._select_rows(indices.to(self._buffers[0].device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._adopt(self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0), 32)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # upstream's checks; its slice of our views sets the new length
        if self.is_initialized:
            self._length = self.keys.shape[-2]
            self._publish()

    def plain(self) -> DynamicLayer:
        """An ordinary ``DynamicLayer`` holding contiguous copies of the K/V."""
        layer = DynamicLayer()
        layer.__dict__.update({k: v for k, v in self.__dict__.items() if not k.startswith("_")})
        layer.keys, layer.values = self.keys.contiguous(), self.values.contiguous()
        return layer


def grow_in_place(cache: DynamicCache) -> None:
    """Swap ``cache``'s filled plain ``DynamicLayer``s for :class:`GrowingLayer`s."""
    cache.layers = [
        GrowingLayer(layer) if type(layer) is DynamicLayer and layer.is_initialized else layer for layer in cache.layers
    ]


def plain_layers(cache: DynamicCache) -> None:
    """Put ordinary ``DynamicLayer``s back (contiguous K/V, upstream's layout) where :func:`grow_in_place` swapped."""
    cache.layers = [layer.plain() if isinstance(layer, GrowingLayer) else layer for layer in cache.layers]
