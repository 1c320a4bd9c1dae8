"""``fastgen_cpu::reorder_rows_``: beam search's cache reorder in place, the gather's bytes.

What is asserted: for any parents (identity, cycles, one parent for many rows, rows dropped), on several
buffers at once and over a prefix shorter than the buffer, the op leaves exactly what ``index_select`` over
the prefix gives and touches nothing past it; any torch thread count gives the same bytes;
bad parents and buffers are refused with a clear error.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen.ops import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=str(cpu_kernels.unavailable_reason()))


def _buffers(capacity: int, rows: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(capacity, rows, 2, 8, generator=generator)
    values = torch.randn(capacity, rows, 2, 8, generator=generator)
    return [keys, values]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 12),
    length=st.integers(0, 9),
    spare=st.integers(0, 3),
    data=st.data(),
)
def test_the_op_leaves_what_the_gather_gives(rows, length, spare, data):
    parents = torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), min_size=rows, max_size=rows)))
    buffers = _buffers(length + spare, rows, seed=rows * 100 + length)
    want = [b.clone() for b in buffers]
    for w in want:
        w[:length] = w[:length].index_select(1, parents)
    torch.ops.fastgen_cpu.reorder_rows_(buffers, length, parents)
    for got, expected in zip(buffers, want, strict=True):
        assert torch.equal(got, expected)


def test_fewer_parents_than_rows_fill_the_first_rows_of_strided_row_blocks():
    """A row-major slot buffer (rows, slots, features) viewed as (1, rows, slots in use, features): rows past the
    parents' count are left as they were (the caller drops them)."""
    generator = torch.Generator().manual_seed(3)
    buffer = torch.randn(6, 10, 4, generator=generator)
    parents = torch.tensor([4, 0, 0, 3])
    want = buffer.clone()
    want[:4, :7] = buffer[:6, :7].index_select(0, parents)
    torch.ops.fastgen_cpu.reorder_rows_([buffer[:, :7].unsqueeze(0)], 1, parents)
    assert torch.equal(buffer, want)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_move_the_same_bytes(threads):
    parents = torch.tensor([3, 3, 0, 1, 7, 5, 5, 2])
    buffers = _buffers(300, 8, seed=1)
    want = [b.clone() for b in buffers]
    for w in want:
        w[:257] = w[:257].index_select(1, parents)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.ops.fastgen_cpu.reorder_rows_(buffers, 257, parents)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(got, expected) for got, expected in zip(buffers, want, strict=True))


def test_bad_arguments_are_refused():
    buffers = _buffers(4, 3, seed=2)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.fastgen_cpu.reorder_rows_(buffers, 2, torch.tensor([0, 3, 1]))
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.fastgen_cpu.reorder_rows_(buffers, 2, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.fastgen_cpu.reorder_rows_([buffers[0].transpose(2, 3)], 2, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="4 parents for 3 rows"):
        torch.ops.fastgen_cpu.reorder_rows_(buffers, 2, torch.tensor([0, 1, 2, 2]))
    with pytest.raises(RuntimeError, match="length"):
        torch.ops.fastgen_cpu.reorder_rows_(buffers, 5, torch.tensor([0, 1, 2]))
