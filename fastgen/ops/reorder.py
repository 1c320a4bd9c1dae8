"""Beam search's reorder of a CPU K/V cache in place (``fastgen_cpu::reorder_rows_``, ``csrc/cpu/reorder_rows.cpp``).

Why: each beam step gives every hypothesis row its parent's history, and about two thirds of the rows keep their
own parent from one step to the next. Gathering every row into a spare buffer moves all of them; the op moves
only the others, in place, with the gather's bytes. The lean step's time-major cache
(:mod:`fastgen.models.growing_cache`) and continuous batching's row-major slots (:mod:`fastgen.continuous.cache`)
both use it where :func:`possible` says so, and gather otherwise.
"""

from __future__ import annotations

import torch


def possible(buffer: torch.Tensor, parents: torch.Tensor) -> bool:
    """Whether the op can reorder ``buffer``'s rows by ``parents``: a CPU buffer, int64 parents, and fastgen's CPU
    kernels already loaded (never built for this)."""
    if buffer.device.type != "cpu" or parents.dtype != torch.int64:
        return False
    from fastgen.ops import cpu_kernels  # imported here: the caches load before the kernels are wanted

    return cpu_kernels.loaded() and hasattr(torch.ops.fastgen_cpu, "reorder_rows_")


def rows_(buffers: list[torch.Tensor], length: int, parents: torch.Tensor) -> None:
    """Row ``r < len(parents)`` of every buffer ``(T, rows, ...)`` takes row ``parents[r]``'s contents over
    positions ``[0, length)``; each row must be one contiguous block (dims from 2 on dense)."""
    torch.ops.fastgen_cpu.reorder_rows_(buffers, length, parents)
