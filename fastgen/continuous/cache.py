"""The decoder cache of continuous batching: rows at different steps, each row's entries at its own positions.

Rows of a continuously refilled batch are at different decoding steps. fastgen's batched speculative
decoder (:mod:`fastgen.models.ragged_cache`) right-aligns such rows; here they are *left*-aligned:
row ``r``'s self-attention entry for position ``p`` lives in slot ``p``, and this step's new entry
is written into slot ``positions[r]`` (not appended at a common end). The slots past a row's length
are padding that the 2-D attention mask hides.

Why left: an input's decoder rows should do the arithmetic of the same input decoded alone. With
left alignment a row's valid keys sit at the slots they have in the single-input run, and padding
only ever follows them, so softmax sums and the probability-weighted sum over values meet the real
entries in the same order and then add exact zeros (``exp(-inf)``). Right alignment shifts every
real entry by the padding width (and the single-input run has no padding at all), which changes the
order of the vectorised reductions and with it the last bits of the scores (measured in the tests).

The cross-attention cache holds each input's projected encoder K/V, right-padded to the widest input
in the batch (the encoder mask hides the padding), one row per input when the beams can share it
(fastgen's grouped attention, feature ``dedup``), else one row per hypothesis.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache

#: slots added at a time when a row outgrows the buffer
SLOT_CHUNK = 16


class SlotLayer(DynamicLayer):
    """A self-attention layer whose ``update`` writes each row's new K/V at that row's own slot.

    The scheduler sets :attr:`positions` (one int64 per row) and :attr:`width` (``max(positions) + 1``,
    known on the host) before each forward; ``update`` returns the first ``width`` slots.
    """

    def __init__(self) -> None:
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.width = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        rows, heads, _, dim = key_states.shape
        self.keys = key_states.new_zeros((rows, heads, 0, dim))
        self.values = value_states.new_zeros((rows, value_states.shape[1], 0, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[-2] != 1:
            raise ValueError("continuous batching writes one token per row and step")
        self.reserve(self.width)
        rows = torch.arange(key_states.shape[0], device=key_states.device)
        self.keys[rows, :, self.positions] = key_states[:, :, 0]
        self.values[rows, :, self.positions] = value_states[:, :, 0]
        return self.keys[:, :, : self.width], self.values[:, :, : self.width]

    def reserve(self, width: int) -> None:
        """Grow the slot buffers to at least ``width`` slots, in chunks of :data:`SLOT_CHUNK` (a copy every
        chunk of steps; the beam reorder copies the whole buffer every step, so it stays tight)."""
        capacity = self.keys.shape[-2]
        if capacity >= width:
            return
        grow = -(-width // SLOT_CHUNK) * SLOT_CHUNK - capacity
        self.keys = torch.cat([self.keys, self.keys.new_zeros((*self.keys.shape[:2], grow, self.keys.shape[-1]))], 2)
        self.values = torch.cat(
            [self.values, self.values.new_zeros((*self.values.shape[:2], grow, self.values.shape[-1]))], 2
        )

    def get_seq_length(self) -> int:
        return max(self.width - 1, 0)  # "past" length: the mask then spans ``width`` slots

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys.index_select(0, rows), self.values.index_select(0, rows)

    def append_rows(self, count: int) -> None:
        """``count`` new empty rows at the end (their slots are written as they decode)."""
        if self.is_initialized and count:
            shape = (count, *self.keys.shape[1:])
            self.keys = torch.cat([self.keys, self.keys.new_zeros(shape)], 0)
            self.values = torch.cat([self.values, self.values.new_zeros((count, *self.values.shape[1:]))], 0)


class SlotCache:
    """Self-attention :class:`SlotLayer` s plus per-input cross K/V, in an ``EncoderDecoderCache`` the model reads."""

    def __init__(self, num_layers: int) -> None:
        self.self_layers = [SlotLayer() for _ in range(num_layers)]
        self_cache = DynamicCache()
        self_cache.layers = list(self.self_layers)
        cross = DynamicCache()
        cross.layers = [DynamicLayer() for _ in range(num_layers)]
        self.cache = EncoderDecoderCache(self_cache, cross)
        self.cross_width = 0

    def set_positions(self, positions: torch.Tensor, width: int) -> None:
        for layer in self.self_layers:
            layer.positions, layer.width = positions, width

    def select(self, hyp_rows: torch.Tensor, cross_rows: torch.Tensor) -> None:
        """Keep (and reorder) hypothesis rows of the self-attention cache and rows of the cross cache."""
        for layer in self.self_layers:
            layer.select_rows(hyp_rows)
        for layer in self.cache.cross_attention_cache.layers:
            if layer.is_initialized:
                layer.keys, layer.values = (
                    layer.keys.index_select(0, cross_rows),
                    layer.values.index_select(0, cross_rows),
                )

    def reorder(self, hyp_rows: torch.Tensor) -> None:
        """Beam reorder: only the self-attention rows move (the cross rows are the same for an input's beams)."""
        for layer in self.self_layers:
            layer.select_rows(hyp_rows)

    def add(self, new_hyp_rows: int, cross_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append newcomers: empty self-attention rows and their cross K/V (one entry per layer, ``(R, H, S, D)``)."""
        for layer in self.self_layers:
            layer.append_rows(new_hyp_rows)
        width = max(self.cross_width, cross_kv[0][0].shape[-2])
        for index, (layer, (keys, values)) in enumerate(
            zip(self.cache.cross_attention_cache.layers, cross_kv, strict=True)
        ):
            keys, values = _pad_slots(keys, width), _pad_slots(values, width)
            if layer.is_initialized:
                keys = torch.cat([_pad_slots(layer.keys, width), keys], 0)
                values = torch.cat([_pad_slots(layer.values, width), values], 0)
            else:
                layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            self.cache.is_updated[index] = True
        self.cross_width = width

    def narrow_cross(self, width: int) -> None:
        """Drop cross K/V slots past ``width`` (after the widest input left: less attention work per step)."""
        if width >= self.cross_width:
            return
        for layer in self.cache.cross_attention_cache.layers:
            if layer.is_initialized:
                layer.keys = layer.keys[:, :, :width].contiguous()
                layer.values = layer.values[:, :, :width].contiguous()
        self.cross_width = width


def _pad_slots(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad dim 2 (slots) with zeros to ``width``."""
    missing = width - tensor.shape[-2]
    if missing <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((*tensor.shape[:2], missing, tensor.shape[-1]))], 2)
