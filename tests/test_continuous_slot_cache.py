"""``SlotLayer`` (the continuous-batching self-attention cache) against a plain per-row model of it.

The reference keeps, per running row, the list of K/V entries at slots ``0..len-1``. After any mix of
steps (each row writing at its own position), beam reorders, retirements, plain and prefilled
newcomers and capacity growth, the layer's view must hold each row's entries at its slots and exact
zeros in every slot past the row's length (the slots the mask hides: never a retired row's values).
"""

from __future__ import annotations

import random

import pytest
import torch

from fastgen.continuous.cache import SLOT_CHUNK, SlotLayer
from tests import harness

HEADS, DIM = 3, 4


def _check(layer: SlotLayer, rows: list[list[torch.Tensor]], width: int) -> None:
    keys, values = layer.keys, layer.values
    assert keys.shape == (len(rows), HEADS, width, DIM) and values.shape == keys.shape
    for index, entries in enumerate(rows):
        for slot in range(width):
            expected = entries[slot] if slot < len(entries) else torch.zeros(HEADS, DIM)
            assert torch.equal(keys[index, :, slot], expected), (index, slot)
            assert torch.equal(values[index, :, slot], -expected), (index, slot)


@pytest.mark.parametrize("in_place", [True, False], ids=["reorder-in-place", "reorder-gather"])
def test_slot_layer_matches_a_per_row_reference(in_place, monkeypatch):
    decided = harness.force_in_place_reorder(monkeypatch, in_place)
    rng = random.Random(0)
    torch.manual_seed(0)
    layer, rows = SlotLayer(), []  # rows: each running row's entries (values are the keys negated)
    layer.append_rows(2)
    rows += [[], []]
    grew = reordered = retired = prefilled = 0
    for step in range(60):
        # one step: every row writes its next slot
        positions = torch.tensor([len(entries) for entries in rows])
        new = torch.randn(len(rows), HEADS, 1, DIM)
        layer.positions, layer.width = positions, int(positions.max()) + 1
        capacity = 0 if layer._buffers is None else layer._buffers[0].shape[1]
        layer.update(new, -new)
        grew += layer._buffers[0].shape[1] > capacity and capacity > 0
        for index, entries in enumerate(rows):
            entries.append(new[index, :, 0])
        _check(layer, rows, layer.width)
        # membership changes between steps
        action = rng.choice(["reorder", "retire", "append", "prefill", "none"])
        if action == "reorder":
            order = [rng.randrange(len(rows)) for _ in rows]
            layer.select_rows(torch.tensor(order))
            rows = [list(rows[i]) for i in order]
            reordered += 1
        elif action == "retire" and len(rows) > 1:
            keep = sorted(rng.sample(range(len(rows)), len(rows) - 1))
            layer.select_rows(torch.tensor(keep))
            rows = [rows[i] for i in keep]
            retired += 1
        elif action == "append":
            count = rng.randint(1, 3)
            layer.append_rows(count)
            rows += [[] for _ in range(count)]
        elif action == "prefill":
            length = rng.randint(1, 2 * SLOT_CHUNK)
            prompt = torch.randn(2, HEADS, length, DIM)
            layer.append_prefilled(prompt, -prompt)
            rows += [[prompt[r, :, s] for s in range(length)] for r in range(2)]
            prefilled += 1
        rows_width = max(len(entries) for entries in rows) if rows else 0
        if rows_width <= layer._clean:  # every running row reads zeros (or its own entries) below clean
            layer.width = max(rows_width, 1)
            view = layer._buffers[0][: len(rows), : layer._clean].unflatten(-1, (HEADS, DIM))
            for index, entries in enumerate(rows):
                assert torch.count_nonzero(view[index, len(entries) :]) == 0, (step, index)
    assert grew and reordered and retired and prefilled, (grew, reordered, retired, prefilled)
    assert set(decided) == {in_place}  # every reorder and retirement in place, or every one gathered


def test_cross_slots_match_a_per_input_reference():
    """The cross K/V after joins (strided views, of several widths), retirements (the last inputs moved into
    the holes) and narrowing: each running input reads its own K/V at its slots, and zeros past what its
    encoder call wrote (never another input's values), through views of the buffers the joins wrote into."""
    from fastgen.continuous.cache import SlotCache
    from fastgen.continuous.scheduler import _rows, compaction

    rng = random.Random(1)
    torch.manual_seed(1)
    layers, per_input = 2, 2  # cross rows per input (beams that do not share their K/V)
    cache = SlotCache(layers)
    running: list[tuple[list[torch.Tensor], int]] = []  # per input: its K per layer (V = -K), its length
    buffers_seen, joins, moved, shrunk, peak = set(), 0, 0, False, 0
    for _ in range(80):
        action = rng.choice(["join", "join", "leave"])
        if action == "join" or not running:
            count = rng.randint(1, 3)
            lengths = [rng.randint(1, 3 * SLOT_CHUNK if rng.random() < 0.2 else SLOT_CHUNK) for _ in range(count)]
            width = max(lengths)
            encoded = [torch.randn(count * per_input + 2, HEADS, width + 5, DIM) for _ in range(layers)]
            views = [
                (k[1 : 1 + count * per_input, :, :width], -k[1 : 1 + count * per_input, :, :width]) for k in encoded
            ]
            cache.add(count * per_input, views)
            joins += 1
            for i, length in enumerate(lengths):
                rows = slice(1 + i * per_input, 1 + (i + 1) * per_input)
                running.append(([k[rows, :, :width].clone() for k in encoded], length))
        else:
            keep = sorted(rng.sample(range(len(running)), rng.randint(0, len(running) - 1)))
            order, holes, movers = compaction(keep)
            moved += len(holes)
            cache.move_cross(_rows(holes, per_input), _rows(movers, per_input), len(keep) * per_input)
            running = [running[i] for i in order]
            slots = cache._cross[0][0].shape[2]
            cache.narrow_cross(max((length for _, length in running), default=0))
            shrunk |= cache._cross[0][0].shape[2] < slots
        assert cache.cross_width == max(length for _, length in running) if running else True
        peak = max(peak, len(running) * per_input)
        assert cache._cross[0][0].shape[0] <= 2 * peak  # rows grow by doubling, and only when they must
        if not running:
            continue
        buffers_seen.add(cache.cache.cross_attention_cache.layers[0].keys.untyped_storage().data_ptr())
        for layer_index, layer in enumerate(cache.cache.cross_attention_cache.layers):
            assert layer.keys.shape == (len(running) * per_input, HEADS, cache.cross_width, DIM)
            for i, (keys, length) in enumerate(running):
                mine = slice(i * per_input, (i + 1) * per_input)
                expected = keys[layer_index]
                got_k, got_v = layer.keys[mine], layer.values[mine]
                assert torch.equal(got_k[:, :, :length], expected[:, :, :length])
                assert torch.equal(got_v[:, :, :length], -expected[:, :, :length])
                for slot in range(length, cache.cross_width):  # padding: its own encoder call's, or zeros
                    own = expected[:, :, slot] if slot < expected.shape[2] else torch.zeros_like(got_k[:, :, 0])
                    for got, sign in ((got_k, 1), (got_v, -1)):
                        value = got[:, :, slot]
                        assert torch.equal(value, sign * own) or torch.count_nonzero(value) == 0, (i, slot)
    assert moved and shrunk, (moved, shrunk)
    assert len(buffers_seen) < joins / 2, (len(buffers_seen), joins)  # most joins write into the buffers in place
