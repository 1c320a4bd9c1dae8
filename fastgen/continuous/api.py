"""``fastgen.generate_many``: many inputs through one model, results streamed in input order.

Named after ``generate`` (it takes the same keyword arguments) with ``batch_rows`` for the one knob
``generate`` does not have: how many decoder rows (inputs x beams) run per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fastgen.continuous import settings as switches
from fastgen.continuous.decoder_only import run_decoder_only
from fastgen.continuous.scheduler import FEATURE, run_continuous
from fastgen.continuous.search import Finished
from fastgen.continuous.settings import resolve
from fastgen.optimizer.registry import fallback

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

    Served: encoder-decoder models of :data:`fastgen.continuous.settings.FAMILIES` and decoder-only models
    of :data:`~fastgen.continuous.settings.DECODER_ONLY_FAMILIES`, greedy and beam
    search with length penalty, early stopping, ``num_return_sequences``, ``no_repeat_ngram_size``,
    min/max (new) tokens and forced BOS/EOS; and sampling (``do_sample=True``, one beam) with
    ``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``num_return_sequences`` samples per input.
    Any other argument or model (beam sampling, ``typical_p``, ...) falls back, with one warning naming
    it, to plain ``generate`` over consecutive static batches of ``batch_rows // num_beams`` inputs
    (right-padded); each result is then that input's rows of its batch's output.

    Sampling draws every input from its own random stream, so an input's samples do not depend on which
    inputs share its steps. ``seed=S`` gives input ``i`` (0-based position in ``inputs``) the stream of
    seed ``S + i``: its result equals ``torch.manual_seed(S + i); model.generate(input_ids=ids[None],
    do_sample=True, **generate_kwargs)``. ``seed`` may also be an iterable of one seed per input (the CLI
    seeds by line number). A call that falls back with a seed runs each input alone under its seed
    (global generator state restored), keeping that promise. Without ``seed``, as ``generate`` the call
    takes its randomness from torch's global generator: ``S`` is drawn from it once, when
    ``generate_many`` is called, so ``torch.manual_seed(k)`` before the call makes the run reproducible
    (and a call that falls back samples its static batches from the global generator, as ``generate``).
    ``seed`` is ignored when not sampling.
    """
    if not isinstance(batch_rows, int) or batch_rows < 1:
        raise ValueError(f"batch_rows must be a positive integer, got {batch_rows!r}")
    if not switches.switched_on():  # feature "continuous" off (enable(features=...), FASTGEN_FEATURES, unpatched())
        return _each_alone(model, inputs, seed, return_scores, generate_kwargs)
    settings, reason = resolve(model, generate_kwargs)
    if reason is not None:
        if seed is not None and _samples(model, generate_kwargs):
            fallback(FEATURE, f"{reason}: plain generate per input, each under its seed")
            return _seeded_alone(model, inputs, _seeds(seed), return_scores, generate_kwargs)
        fallback(FEATURE, f"{reason}: plain generate per static batch")
        return _static_batches(model, inputs, batch_rows, return_scores, generate_kwargs)
    seeds = _seeds(seed) if settings.do_sample else None
    if not model.config.is_encoder_decoder:
        run = run_decoder_only(model, inputs, settings, batch_rows, generate_kwargs, seeds=seeds)
        return _results(run, return_scores)
    return _results(run_continuous(model, inputs, settings, batch_rows, seeds=seeds), return_scores)


def _each_alone(
    model: Any, inputs: Iterable[Any], seed: Any, return_scores: bool, kwargs: dict[str, Any]
) -> Iterator[Any]:
    """Continuous batching switched off: ``generate`` on each input alone (each sampled input under its seed),
    which is what continuous batching returns for it."""
    if _samples(model, kwargs):
        return _seeded_alone(model, inputs, _seeds(seed), return_scores, kwargs)
    return _static_batches(model, inputs, 1, return_scores, kwargs)  # batches of one input


def _seeds(seed: int | Iterable[int] | None) -> Iterator[int]:
    """Each input's seed: ``S + i``, the given ones, or ``S`` drawn once from torch's global generator."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    if isinstance(seed, int):
        return itertools.count(seed)
    return iter(seed)


def _samples(model: Any, kwargs: dict[str, Any]) -> bool:
    config = kwargs.get("generation_config") or model.generation_config
    return bool(kwargs.get("do_sample", config.do_sample))


def _results(finished: Iterator[Finished], return_scores: bool) -> Iterator[Any]:
    for item in finished:
        yield (item.sequences, item.scores) if return_scores else item.sequences


def _seeded_alone(
    model: Any, inputs: Iterable[Any], seeds: Iterator[int], return_scores: bool, kwargs: dict[str, Any]
) -> Iterator[Any]:
    """The fallback with a seed: ``generate`` on each input alone after seeding, as the docstring promises."""
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    returns = int(kwargs.get("num_return_sequences") or model.generation_config.num_return_sequences or 1)
    devices = [model.device] if model.device.type == "cuda" else []
    for index, value in enumerate(inputs):
        ids = torch.as_tensor(value).reshape(-1)
        if ids.numel() == 0:
            raise ValueError(f"input {index}: empty")
        seed = next(seeds, None)
        if seed is None:
            raise ValueError(f"input {index}: no seed left (give one seed per input)")
        with torch.random.fork_rng(devices=devices):  # computed, not yielded, inside: the caller's state is kept
            torch.manual_seed(int(seed))
            results = list(_generate_chunk(model, [ids], pad, False, returns, return_scores, kwargs))
        yield from results


def _static_batches(
    model: Any, inputs: Iterable[Any], batch_rows: int, return_scores: bool, kwargs: dict[str, Any]
) -> Iterator[Any]:
    """The fallback: ``generate`` on consecutive chunks, padded as a tokenizer pads for the model."""
    beams = max(int(kwargs.get("num_beams") or model.generation_config.num_beams or 1), 1)
    size = max(1, batch_rows // beams)
    returns = int(kwargs.get("num_return_sequences") or model.generation_config.num_return_sequences or 1)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    left = not model.config.is_encoder_decoder
    chunk: list[torch.Tensor] = []
    for index, value in enumerate(inputs):
        ids = torch.as_tensor(value).reshape(-1)
        if ids.numel() == 0:
            raise ValueError(f"input {index}: empty")
        chunk.append(ids)
        if len(chunk) == size:
            yield from _generate_chunk(model, chunk, pad, left, returns, return_scores, kwargs)
            chunk = []
    if chunk:
        yield from _generate_chunk(model, chunk, pad, left, returns, return_scores, kwargs)


def _generate_chunk(model, chunk, pad, left, returns, return_scores, kwargs) -> Iterator[Any]:
    width = max(len(ids) for ids in chunk)
    batch = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros((len(chunk), width), dtype=torch.long)
    for row, ids in enumerate(chunk):
        span = slice(width - len(ids), width) if left else slice(0, len(ids))
        batch[row, span], mask[row, span] = ids, 1
    call = dict(kwargs)
    if return_scores:
        call.update(return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        out = model.generate(input_ids=batch.to(model.device), attention_mask=mask.to(model.device), **call)
    sequences = out.sequences if return_scores else out
    scores = getattr(out, "sequences_scores", None) if return_scores else None
    for row in range(len(chunk)):
        rows = slice(row * returns, (row + 1) * returns)
        seq = sequences[rows]
        yield (seq, scores[rows] if scores is not None else None) if return_scores else seq
