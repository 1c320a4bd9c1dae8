"""``fastgen-generate-hf`` on continuous batching (the default where it serves the run and is expected to be
faster, :func:`prefers_static`; ``--continuous-batching`` asks for it wherever it serves the run,
``--no-continuous-batching`` gives static batches).

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


#: Rows per step (``batch_size x num_beams``) above which an encoder-decoder beam search runs static batches
#: (see :func:`prefers_static`).
STATIC_BEAM_ROWS = 32

#: Encoder-decoder models with fewer parameters than this run static batches on a CPU (see :func:`prefers_static`).
SMALL_MODEL_PARAMETERS = 50_000_000


def prefers_static(model: Any, settings: Settings, batch_size: int) -> str | None:
    """Why static batches are expected to be at least as fast for this run (None: continuous batching).

    On a CPU, an encoder-decoder model's static batches run its decode step from C++ (and, in beam search, the
    compiled beam step), where a continuous batch runs every row at its own position through the continuous
    scheduler in Python; in the fast modes (``int8``, ``fast``) the continuous step itself stays in Python (the
    fast attention kernel takes no self-attention mask). Measured on a 7.9M-parameter BART trained here (one
    AMD EPYC core, in one process, ``benchmarks/continuous_trained.py``), continuous batching lost in every
    mode and size tried, greedy and beam search (0.5-0.85x); on bart-base (140M parameters, output lengths
    7-48) it won at 16 rows in the exact mode (1.29x). So on a CPU: static batches in the fast modes and for
    models under :data:`SMALL_MODEL_PARAMETERS`.

    For beam search above :data:`STATIC_BEAM_ROWS` rows, anywhere: fastgen's beam loop drops finished inputs
    from a static batch, so both ways compute the same row-steps and refilling saves only steps, a step's
    fixed cost, worth about 16-20 rows (at 64 rows on one thread 0.94-1.04x in different runs, at two threads
    0.91x). Greedy static batches keep finished rows (refilling saves rows too), and decoder-only models were
    not measured: continuous there.

    Only greedy/beam runs are ever switched: their results are the same either way. Sampling seeds per
    line under continuous batching and per batch in static batches, so its mode is never changed here.
    """
    if settings.do_sample or not model.config.is_encoder_decoder:
        return None
    beam = settings.num_beams > 1
    if beam and not _beam_loop_drops_finished():
        return None  # upstream's beam loop keeps finished inputs' rows in a static batch
    if getattr(model, "device", torch.device("cpu")).type == "cpu":
        from fastgen.optimizer.registry import current_mode

        mode = current_mode(model)
        if mode in ("fast", "int8"):
            return f"the {mode} mode on a CPU: static batches run the decode step in C++, a continuous batch in Python"
        parameters = sum(p.numel() for p in model.parameters())
        if parameters < SMALL_MODEL_PARAMETERS:
            return (
                f"a model of {parameters / 1e6:.1f}M parameters on a CPU: a continuous step's fixed cost outweighs "
                "what refilling saves"
            )
    rows, threads = batch_size * settings.num_beams, torch.get_num_threads()
    if not beam or rows <= STATIC_BEAM_ROWS:
        return None
    return (
        f"beam search over {rows} rows per step (> {STATIC_BEAM_ROWS}) on {threads} thread(s): fastgen's beam loop "
        "drops finished inputs from static batches, so refilling would save only steps, which are not slower there"
    )


def _beam_loop_drops_finished() -> bool:
    """Whether static batches run fastgen's own beam loop (feature ``beam``), which drops finished inputs."""
    from fastgen.continuous.scheduler import _feature_applied

    return _feature_applied("beam")


def serves(model: Any, kwargs: dict, batch_size: int = 1, chosen: bool = True) -> Settings | None:
    """The run's settings when continuous batching serves it and (``chosen``: the CLI's default, not asked for)
    is expected to be faster, else None (logged: static batches, and why)."""
    try:
        settings, reason = resolve(model, kwargs)
    except (ValueError, TypeError) as exc:  # as generate validates its config (early_stopping='maybe', ...)
        raise rejected(kwargs, exc) from exc
    if reason is not None:
        logger.info("static batches: continuous batching does not serve this run (%s)", reason)
        return None
    slower = prefers_static(model, settings, batch_size) if chosen else None
    if slower is not None:
        logger.info("static batches: %s (--continuous-batching forces continuous batching)", slower)
        return None
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
