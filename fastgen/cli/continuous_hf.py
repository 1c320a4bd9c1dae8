"""``fastgen-generate-hf`` on continuous batching (the default where it serves the run; ``--no-continuous-batching``
gives static batches).

The plan (windows, length-sorted batches, journal units, data-parallel split) is unchanged: this
module only replaces *how* a batch's outputs are computed. All of this rank's remaining inputs are fed,
batch after batch, into one :func:`fastgen.continuous.generate_many` stream of ``batch_size x
num_beams`` decoder rows, so the batch never drains between batches or windows; results come back
in feed order and are handed to the pipeline as the plan's batches (padded like ``generate``'s
output), so the journal, ``--resume``, the output order and the progress bar see what they saw before.

Decoder-only results start with their prompt, which is cut off here (the pipeline takes new tokens).
Runs that continuous batching does not serve (beam sampling, other families or
arguments: see :func:`fastgen.continuous.settings.resolve`) keep the static batches, with one log line
saying why. Sampling is seeded per input line, not per batch (a line's batch neighbours change as
others finish): with ``--seed S`` line ``k`` (0-based in the input file) is sampled from seed ``S + k``,
so its output equals ``generate`` on that line alone after ``torch.manual_seed(S + k)``, in every
batch size, rank and resumed run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from fastgen.cli.common import rejected
from fastgen.cli.hf_inputs import Batch, InputLine
from fastgen.continuous import generate_many
from fastgen.continuous.settings import Settings, resolve

logger = logging.getLogger("fastgen.cli.generate_hf")


class ContinuousBatches:
    """The outputs of the planned batches, computed by one continuous-batching stream."""

    def __init__(
        self,
        model: Any,
        lines: Sequence[InputLine],
        batches: Sequence[Batch],
        kwargs: dict,
        rows: int,
        seed: int | None = None,
    ):
        self._lines = lines
        #: decoder-only results start with their prompt; the pipeline takes only the new tokens
        self._strip_prompt = not model.config.is_encoder_decoder
        feed = (lines[i].ids for batch in batches for i in batch.indices)
        seeds = None if seed is None else (seed + i for batch in batches for i in batch.indices)
        self._kwargs = kwargs
        try:
            self._results = generate_many(model, feed, batch_rows=rows, seed=seeds, **kwargs)
        except (ValueError, TypeError) as exc:
            raise rejected(kwargs, exc) from exc

    def next_batch(self, batch: Batch, pad: int) -> torch.Tensor | None:
        """The next batch of the plan (batches must be asked for in the order given): ``(B, L)`` tokens."""
        if not batch.indices:
            return None
        try:  # a value generate rejects (temperature=0, ...) is found when the first step runs, as in generate
            rows = [next(self._results)[0] for _ in batch.indices]
        except (ValueError, TypeError) as exc:
            raise rejected(self._kwargs, exc) from exc
        if self._strip_prompt:
            rows = [row[len(self._lines[i].ids) :] for row, i in zip(rows, batch.indices, strict=True)]
        out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long, device=rows[0].device)
        for index, row in enumerate(rows):
            out[index, : len(row)] = row
        return out


def serves(model: Any, kwargs: dict) -> Settings | None:
    """The run's settings when continuous batching serves it, else None (logged: static batches, and why)."""
    try:
        settings, reason = resolve(model, kwargs)
    except (ValueError, TypeError) as exc:  # as generate validates its config (early_stopping='maybe', ...)
        raise rejected(kwargs, exc) from exc
    if reason is not None:
        logger.info("static batches: continuous batching does not serve this run (%s)", reason)
    return settings


def start(
    model: Any,
    lines: Sequence[InputLine],
    batches: Sequence[Batch],
    kwargs: dict,
    batch_size: int,
    settings: Settings,
    seed: int | None = None,
) -> ContinuousBatches:
    """A continuous stream for these batches (``settings``: from :func:`serves`)."""
    per_input = settings.rows_per_input
    rows = batch_size * per_input
    what = "samples" if settings.do_sample else "beams"
    logger.info("continuous batching: %d decoder rows (%d inputs x %d %s)", rows, batch_size, per_input, what)
    return ContinuousBatches(model, lines, batches, kwargs, rows, seed)
