"""``fastgen.generate_many``: many inputs through one model, results streamed in input order.

Named after ``generate`` (it takes the same keyword arguments) with ``batch_rows`` for the one knob
``generate`` does not have: how many decoder rows (inputs x beams) run per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fastgen.continuous import fallback
from fastgen.continuous import settings as switches
from fastgen.continuous.arguments import check_batch_rows, check_generate_kwargs, seed_stream, token_rows
from fastgen.continuous.decoder_only import run_decoder_only
from fastgen.continuous.scheduler import FEATURE, run_continuous
from fastgen.continuous.search import Finished
from fastgen.continuous.settings import resolve
from fastgen.optimizer.registry import fallback as warn_fallback

DEFAULT_BATCH_ROWS = 64


def generate_many(
    model: Any,
    inputs: Iterable[Any],
    *,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    return_scores: bool = False,
    seed: int | Iterable[int] | None = None,
    **generate_kwargs: Any,
) -> Iterator[Any]:
    """Generate for every input (a 1-D sequence of token ids each), yielding results in input order.

    Each result is what ``model.generate(input_ids=ids[None], **generate_kwargs)`` returns for that
    input alone: a ``(num_return_sequences, length)`` tensor of token ids (with ``return_scores=True``
    a pair ``(sequences, sequences_scores)``; scores are None for greedy search). Rows are refilled as
    inputs finish (continuous batching), so the batch stays at ``batch_rows`` decoder rows while there
    are inputs left.

    For a decoder-only model, as ``generate``, each result starts with the input's prompt.

    ``inputs``: an iterable of unpadded 1-D token-id sequences (lists, tensors, arrays), or a tokenizer's
    output (``input_ids`` and ``attention_mask``: each row's tokens under its mask are one input). A 2-D
    tensor holding the pad token id is refused (its padding cannot be told from tokens), as is
    ``attention_mask=`` (each input's mask is built here): see :mod:`fastgen.continuous.arguments`.

    Served: encoder-decoder models of :data:`fastgen.continuous.settings.FAMILIES` and decoder-only models
    of :data:`~fastgen.continuous.settings.DECODER_ONLY_FAMILIES`, greedy and beam
    search with length penalty, early stopping, ``num_return_sequences``, ``no_repeat_ngram_size``,
    min/max (new) tokens and forced BOS/EOS; and sampling (``do_sample=True``, one beam) with
    ``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``num_return_sequences`` samples per input.
    Any other argument or model (beam sampling, ``typical_p``, ``return_dict_in_generate``, ...) falls
    back, with one warning naming it, to plain ``generate``, and each result is still what ``generate``
    returns for that input alone (with ``return_dict_in_generate=True``, its output object): on padded
    static batches of ``batch_rows // num_beams`` inputs cut to each input's width where padding cannot
    change a result (an encoder-decoder model, greedy or beam search, decoder-side settings), else on
    each input alone (see :mod:`fastgen.continuous.fallback`).

    Sampling draws every input from its own random stream, so an input's samples do not depend on which
    inputs share its steps. ``seed=S`` (an integer: Python, NumPy or a 0-d tensor) gives input ``i``
    (0-based position in ``inputs``) the stream of seed ``S + i``: its result equals
    ``torch.manual_seed(S + i); model.generate(input_ids=ids[None], do_sample=True, **generate_kwargs)``.
    ``seed`` may also be an iterable of one seed per input (the CLI seeds by line number). Without
    ``seed``, as ``generate`` the call takes its randomness from torch's global generator: ``S`` is drawn
    from it once, when ``generate_many`` is called, so ``torch.manual_seed(k)`` before the call makes the
    run reproducible. A call that falls back keeps this promise (each input alone under its seed, the
    global generator state restored). ``seed`` is ignored when not sampling.
    """
    check_batch_rows(batch_rows)
    check_generate_kwargs(generate_kwargs, return_scores)
    seeds = seed_stream(seed)
    rows = token_rows(model, inputs)
    if not switches.switched_on():  # feature "continuous" off (enable(features=...), FASTGEN_FEATURES, unpatched())
        seeds = _drawn(seeds) if _samples(model, generate_kwargs) else None
        return fallback.alone(model, rows, seeds, return_scores, generate_kwargs)
    settings, reason = resolve(model, generate_kwargs)
    sampling = settings.do_sample if settings is not None else _samples(model, generate_kwargs)
    seeds = _drawn(seeds) if sampling else None
    if reason is not None:
        if fallback.batch_invariant(model, generate_kwargs):
            warn_fallback(FEATURE, f"{reason}: plain generate per static batch, each input's rows cut to its width")
            return fallback.static_batches(model, rows, int(batch_rows), return_scores, generate_kwargs)
        warn_fallback(FEATURE, f"{reason}: plain generate on each input alone")
        return fallback.alone(model, rows, seeds, return_scores, generate_kwargs)
    if not model.config.is_encoder_decoder:
        run = run_decoder_only(model, rows, settings, int(batch_rows), generate_kwargs, seeds=seeds)
        return _results(run, return_scores)
    return _results(run_continuous(model, rows, settings, int(batch_rows), seeds=seeds), return_scores)


def _drawn(seeds: Iterator[int] | None) -> Iterator[int]:
    """The given seeds, or, as ``generate``, from torch's global generator: S drawn once, input i gets S + i."""
    return seeds if seeds is not None else itertools.count(int(torch.randint(0, 2**62, ()).item()))


def _samples(model: Any, kwargs: dict[str, Any]) -> bool:
    config = kwargs.get("generation_config") or model.generation_config
    return bool(kwargs.get("do_sample", config.do_sample))


def _results(finished: Iterator[Finished], return_scores: bool) -> Iterator[Any]:
    for item in finished:
        yield (item.sequences, item.scores) if return_scores else item.sequences
