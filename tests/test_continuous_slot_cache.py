"""``SlotLayer`` (the continuous-batching self-attention cache) against a plain per-row model of it.

The reference keeps, per running row, the list of K/V entries at slots ``0..len-1``. After any mix of
steps (each row writing at its own position), beam reorders, retirements, plain and prefilled
newcomers and capacity growth, the layer's view must hold each row's entries at its slots and exact
zeros in every slot past the row's length (the slots the mask hides: never a retired row's values).
"""

from __future__ import annotations

import random

import torch

from fastgen.continuous.cache import SLOT_CHUNK, SlotLayer

HEADS, DIM = 3, 4


def _check(layer: SlotLayer, rows: list[list[torch.Tensor]], width: int) -> None:
    keys, values = layer.keys, layer.values
    assert keys.shape == (len(rows), HEADS, width, DIM) and values.shape == keys.shape
    for index, entries in enumerate(rows):
        for slot in range(width):
            expected = entries[slot] if slot < len(entries) else torch.zeros(HEADS, DIM)
            assert torch.equal(keys[index, :, slot], expected), (index, slot)
            assert torch.equal(values[index, :, slot], -expected), (index, slot)


def test_slot_layer_matches_a_per_row_reference():
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
