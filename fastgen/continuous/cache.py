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

The cross-attention cache holds each input's projected encoder K/V, read up to the widest running input
(the encoder mask hides the padding), one row per input when the beams can share it (fastgen's grouped
attention, feature ``dedup``), else one row per hypothesis; its rows live in preallocated buffers that
joins write into and leaves move the last inputs' rows within (:class:`SlotCache`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache

from fastgen.ops import reorder

#: slots added at a time when a row outgrows the buffer
SLOT_CHUNK = 16


class SlotLayer(DynamicLayer):
    """A self-attention layer whose ``update`` writes each row's new K/V at that row's own slot.

    The scheduler sets :attr:`positions` (one int64 per row) and :attr:`width` (``max(positions) + 1``,
    known on the host) before each forward; ``update`` returns the first ``width`` slots of every row.

    Storage is row-major, ``(rows, slots, heads * head_dim)`` (the attention reads a strided
    ``(rows, heads, width, head_dim)`` view of it). A beam reorder or a retirement moves, in place, only
    the rows whose parent is another row, their slots in use (:mod:`fastgen.ops.reorder`); elsewhere it copies the
    slots in use of every row into a spare buffer with one ``index_select`` and swaps the two.
    Why: the reorder runs every beam step over every row, and rows of a continuous batch are of mixed
    ages, so it is the largest cost of the step outside the model (a head-major buffer copied whole
    cost about a sixth of a 64-row bart-base step). Row-major, each row's slots are one contiguous
    block, and only the slots in use are copied.

    Invariant: slots ``[length, clean)`` of every running row are zero, so the masked slots that a row's
    attention reads hold zeros, as in a single-input run's (absent) padding, never a retired row's values.
    """

    def __init__(self) -> None:
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.width = 0
        self.rows = 0  # running rows: the first ``rows`` of the buffers
        self._clean = 0  # slots below this are written or zero in every running row
        self._used = 0  # slots below this may hold entries (what a reorder copies)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # (keys, values)
        self._spares: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_heads, self.value_heads = key_states.shape[1], value_states.shape[1]
        self._features = (self.key_heads * key_states.shape[-1], self.value_heads * value_states.shape[-1])
        self.is_initialized = True
        self._ensure(max(self.rows, 1), SLOT_CHUNK)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[-2] != 1:
            raise ValueError("continuous batching writes one token per row and step")
        rows = key_states.shape[0]
        if rows != self.rows:
            raise ValueError(f"{rows} rows in the forward, {self.rows} in the cache")
        self._ensure(rows, self.width)
        index = torch.arange(rows, device=key_states.device)
        keys, values = self._buffers
        keys[index, self.positions] = key_states[:, :, 0].reshape(rows, -1)
        values[index, self.positions] = value_states[:, :, 0].reshape(rows, -1)
        self._used = self.width  # every running row's length is at most the width
        self.keys = _heads_view(keys, rows, self.width, self.key_heads)
        self.values = _heads_view(values, rows, self.width, self.value_heads)
        return self.keys, self.values

    def prepare(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`update` does besides the write, for a step that writes the K/V itself (the C++ step,
        :mod:`fastgen.continuous.lean`): room and zeros up to :attr:`width`; returns the row-major buffers."""
        if rows != self.rows:
            raise ValueError(f"{rows} rows in the step, {self.rows} in the cache")
        self._ensure(rows, self.width)
        self._used = self.width
        return self._buffers

    def _ensure(self, rows: int, width: int) -> None:
        """Capacity for ``rows`` rows of ``width`` slots (grown in chunks, old contents kept), and zeros in
        slots ``[clean, width)`` of the running rows."""
        capacity = (0, 0) if self._buffers is None else self._buffers[0].shape[:2]
        if rows > capacity[0] or width > capacity[1]:
            shape = (max(rows, capacity[0]), max(-(-width // SLOT_CHUNK) * SLOT_CHUNK, capacity[1]))
            old = self._buffers
            self._buffers = tuple(
                torch.zeros((*shape, f), dtype=self.dtype, device=self.device) for f in self._features
            )
            self._spares = tuple(torch.zeros((*shape, f), dtype=self.dtype, device=self.device) for f in self._features)
            if old is not None:
                for new, kept in zip(self._buffers, old, strict=True):
                    new[: self.rows, : self._clean] = kept[: self.rows, : self._clean]
        if width > self._clean:
            for buffer in self._buffers:
                buffer[: self.rows, self._clean : width] = 0
            self._clean = width

    def _zeros(self, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.zeros((*shape, f), dtype=self.dtype, device=self.device) for f in self._features)

    def get_seq_length(self) -> int:
        return max(self.width - 1, 0)  # "past" length: the mask then spans ``width`` slots

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (and reorder) running rows: ``rows`` index the running rows (one copy, into the spare)."""
        if not self.is_initialized:
            self.rows = len(rows)
            return
        count, used = len(rows), self._used
        if count <= self.rows and reorder.possible(self._buffers[0], rows):  # only rows whose parent is another move
            reorder.rows_([buffer[: self.rows, :used].unsqueeze(0) for buffer in self._buffers], 1, rows)
            self.rows = count  # (slots past ``used`` of a moved row are its own zeros: ``_clean`` holds)
            return
        for buffer, spare in zip(self._buffers, self._spares, strict=True):
            torch.index_select(buffer[: self.rows, :used], 0, rows, out=spare[:count, :used])
        self._buffers, self._spares = self._spares, self._buffers
        self.rows = count
        self._clean = used  # the spare's slots past ``used`` may hold older entries: zeroed as the width grows

    def append_rows(self, count: int) -> None:
        """``count`` new empty (zero) rows at the end (their slots are written as they decode)."""
        if count and self.is_initialized:
            self._ensure(self.rows + count, self._clean)
            for buffer in self._buffers:
                buffer[self.rows : self.rows + count, : self._clean] = 0
        self.rows += count

    def append_prefilled(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New rows that arrive with K/V ``(R, H, L, D)`` at slots ``0..L-1`` (a prompt prefilled elsewhere)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        count, length = keys.shape[0], keys.shape[-2]
        start = self.rows
        self.append_rows(count)
        self._ensure(self.rows, length)
        self._used = max(self._used, length)
        for buffer, states in zip(self._buffers, (keys, values), strict=True):
            buffer[start : self.rows, :length] = states.transpose(1, 2).reshape(count, length, -1)


def _heads_view(buffer: torch.Tensor, rows: int, width: int, heads: int) -> torch.Tensor:
    """``(rows, heads, width, head_dim)`` view of a row-major ``(capacity, slots, heads * head_dim)`` buffer."""
    return buffer[:rows, :width].unflatten(-1, (heads, -1)).transpose(1, 2)


class SlotCache:
    """Self-attention :class:`SlotLayer` s plus per-input cross K/V, in an ``EncoderDecoderCache`` the model reads.

    The cross K/V live in preallocated buffers per layer, ``(capacity rows, heads, slots, head_dim)``; the
    running inputs' cross rows are the first :attr:`cross_count` rows, and the model reads the strided view
    of them up to :attr:`cross_width` slots (the widest running input). Why: with a server's arrivals inputs
    join and leave nearly every step, and a cross cache rebuilt on each change (a concatenation for every
    join, a compacting copy and a narrowing copy for every leave) cost O(cache) per change; here a join
    writes the newcomers' rows in place and a leave moves the last running inputs' rows into the holes
    (:meth:`move_cross`), O(newcomers) and O(leavers). The attention reads each (row, head) block's slots
    with the same layout as before (slots ``head_dim`` apart), so its arithmetic, and the bits, are unchanged.

    Invariant: every slot of a running cross row past what its input's encoder call wrote is zero (written
    so on join, moved whole on leave, zero where the slots grow), so a masked slot never holds a retired
    input's values.
    """

    def __init__(self, num_layers: int) -> None:
        self.self_layers = [SlotLayer() for _ in range(num_layers)]
        self_cache = DynamicCache()
        self_cache.layers = list(self.self_layers)
        cross = DynamicCache()
        cross.layers = [DynamicLayer() for _ in range(num_layers)]
        self.cache = EncoderDecoderCache(self_cache, cross)
        self.cross_width = 0
        self.cross_count = 0  # running cross rows: the first ``cross_count`` rows of the buffers
        self._cross: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (keys, values) buffers

    def set_positions(self, positions: torch.Tensor, width: int) -> None:
        for layer in self.self_layers:
            layer.positions, layer.width = positions, width

    def reorder(self, hyp_rows: torch.Tensor) -> None:
        """Beam reorder, or retirements folded into it: only the self-attention rows move (``hyp_rows`` index
        the running hypothesis rows; the cross rows are the same for an input's beams and move in
        :meth:`move_cross`)."""
        for layer in self.self_layers:
            layer.select_rows(hyp_rows)

    def add(self, new_hyp_rows: int, cross_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append newcomers: empty self-attention rows and their cross K/V (one entry per layer, ``(R, H, S, D)``,
        views taken as they are), written in place after the running cross rows."""
        for layer in self.self_layers:
            layer.append_rows(new_hyp_rows)
        count, width = cross_kv[0][0].shape[0], cross_kv[0][0].shape[-2]
        start, stop = self.cross_count, self.cross_count + count
        self._reserve(cross_kv, stop, width)
        for (key_buffer, value_buffer), (keys, values) in zip(self._cross, cross_kv, strict=True):
            for buffer, states in ((key_buffer, keys), (value_buffer, values)):
                buffer[start:stop, :, :width] = states
                buffer[start:stop, :, width:] = 0
        self.cross_count = stop
        self.cross_width = max(self.cross_width, width)
        self._expose()

    def move_cross(self, holes: list[int], movers: list[int], count: int) -> None:
        """Keep the first ``count`` cross rows, rows ``movers`` (past ``count``) moved into rows ``holes`` (before
        it) in that order: one copy of the moved rows, whole (their zero slots included)."""
        if holes:
            device = self._cross[0][0].device
            to, source = (torch.tensor(rows, dtype=torch.long, device=device) for rows in (holes, movers))
            for buffers in self._cross:
                for buffer in buffers:
                    buffer.index_copy_(0, to, buffer.index_select(0, source))
        self.cross_count = count
        if self._cross:
            self._expose()

    def narrow_cross(self, width: int) -> None:
        """Read only the first ``width`` cross slots (after the widest input left: less attention work per step);
        the buffers shrink only when their slots are over twice what the running inputs read (a long input has
        left them), not when every input left (the next ones are likely as wide)."""
        if width >= self.cross_width:
            return
        self.cross_width = width
        if not self._cross:
            return
        slots = self._cross[0][0].shape[2]
        if self.cross_count and slots > 2 * _round_up(max(width, 1)):
            keep = _round_up(max(width, 1))
            self._cross = [tuple(buffer[:, :, :keep].clone() for buffer in buffers) for buffers in self._cross]
        self._expose()

    def _reserve(self, cross_kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int, width: int) -> None:
        """Buffers of at least ``rows`` rows and ``width`` slots (grown by doubling rows and whole chunks of
        slots; the running rows kept, new slots zero)."""
        if self._cross:
            capacity, slots = self._cross[0][0].shape[0], self._cross[0][0].shape[2]
            if rows <= capacity and width <= slots:
                return
        else:
            capacity, slots = 0, 0
        shape_rows = capacity if rows <= capacity else max(rows, 2 * capacity)
        shape_slots = max(slots, _round_up(width))
        grown = []
        for index, (keys, values) in enumerate(cross_kv):
            old = self._cross[index] if self._cross else None
            pair = []
            for which, states in enumerate((keys, values)):
                buffer = states.new_zeros((shape_rows, states.shape[1], shape_slots, states.shape[3]))
                if old is not None:
                    buffer[: self.cross_count, :, : old[which].shape[2]] = old[which][: self.cross_count]
                pair.append(buffer)
            grown.append(tuple(pair))
        self._cross = grown

    def _expose(self) -> None:
        """Point the cross layers the model reads at the running rows' first :attr:`cross_width` slots."""
        count, width = self.cross_count, self.cross_width
        for index, (layer, (keys, values)) in enumerate(
            zip(self.cache.cross_attention_cache.layers, self._cross, strict=True)
        ):
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys[:count, :, :width], values[:count, :, :width]
            self.cache.is_updated[index] = True


def _round_up(width: int) -> int:
    return -(-width // SLOT_CHUNK) * SLOT_CHUNK
