"""``generate_many`` on a call continuous batching does not serve: per input, what ``generate`` returns for it alone.

The exact way is ``generate`` on each input alone (:func:`alone`). Padded static batches are faster, but their
rows are an input's result only where padding changes nothing but the width:

- an encoder-decoder model pads the *encoder* input; a decoder-side setting (beam search, lengths, repetition
  penalty on the generated tokens, bad words, ...) never reads it, and a row that ended at its EOS is only
  followed by fill (pad) tokens up to the batch's longest row, which :func:`static_batches` cuts off;
- a decoder-only model's left pads are part of what it generates from: a ``max_length`` or ``min_length``
  counts them, ``no_repeat_ngram_size`` and repetition penalties read them, so those calls run alone;
- sampling draws a batch's rows from one stream (alone, each input has its own), ``return_dict_in_generate``
  returns per-step outputs of the padded width, and callbacks (``logits_processor``, ``prefix_allowed_tokens_fn``
  with its batch index, ``stopping_criteria``) see the batch: alone too.

:func:`batch_invariant` decides by allow-list (DESIGN §8), as :func:`~fastgen.continuous.settings.resolve` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers import GenerationConfig

from fastgen.continuous import settings as served

#: generation settings that act on the decoder's tokens only (an encoder-decoder model's padded encoder input
#: never reaches them), beyond the ones continuous batching serves
_DECODER_SIDE = served.SUPPORTED_FIELDS | {
    "repetition_penalty",
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "sequence_bias",
    "num_beam_groups",
    "diversity_penalty",
}


def batch_invariant(model: Any, kwargs: dict[str, Any]) -> bool:
    """Whether padded static batches give each input what ``generate`` gives it alone (once cut to its width)."""
    if not getattr(model.config, "is_encoder_decoder", False) or model.training:
        return False
    kwargs = dict(kwargs)
    # private (listed in the contract's inventory): generate's merge of model config, kwargs and defaults
    gen, model_kwargs = model._prepare_generation_config(kwargs.pop("generation_config", None), **kwargs)
    if any(value is not None for value in model_kwargs.values()) or gen.do_sample or gen.return_dict_in_generate:
        return False
    defaults = GenerationConfig()
    defaults.update(**GenerationConfig._get_default_generation_params())
    defaults = defaults.to_dict()
    ignored = served._IGNORED_FIELDS | served._SAMPLING_FIELDS  # bookkeeping; warpers act only when sampling
    for key, value in gen.to_dict().items():
        if key in _DECODER_SIDE or key in ignored or key.startswith("_"):
            continue
        if key in defaults and not served._is_default(key, value, defaults[key]):
            return False
    return True


def alone(
    model: Any,
    rows: Iterator[torch.Tensor],
    seeds: Iterator[int] | None,
    return_scores: bool,
    kwargs: dict[str, Any],
) -> Iterator[Any]:
    """``generate`` on each input alone; with ``seeds`` (sampling), each under its own seed, the caller's
    generator state kept."""
    call = _call(kwargs, return_scores)
    devices = [model.device] if model.device.type == "cuda" else []
    for index, ids in enumerate(rows):
        ids = ids.to(model.device)[None]
        if seeds is None:
            out = _generate(model, ids, torch.ones_like(ids), call)
        else:
            seed = next(seeds, None)
            if seed is None:
                raise ValueError(f"input {index}: no seed left (give one seed per input)")
            with torch.random.fork_rng(devices=devices):  # computed, not yielded, inside: the caller's state is kept
                torch.manual_seed(seed)
                out = _generate(model, ids, torch.ones_like(ids), call)
        yield _result(out, return_scores)


def static_batches(
    model: Any, rows: Iterator[torch.Tensor], batch_rows: int, return_scores: bool, kwargs: dict[str, Any]
) -> Iterator[Any]:
    """``generate`` on right-padded batches of ``batch_rows // num_beams`` inputs, each input's rows cut to
    the width ``generate`` gives it alone (only for calls :func:`batch_invariant` admits)."""
    gen, _ = model._prepare_generation_config(kwargs.get("generation_config"), **_without_config(kwargs))
    beams, returns = gen.num_beams or 1, gen.num_return_sequences or 1
    eos = torch.tensor(served._ids(gen.eos_token_id), dtype=torch.long, device=model.device)
    pad = gen.pad_token_id if gen.pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    chunk: list[torch.Tensor] = []
    for ids in rows:
        chunk.append(ids)
        if len(chunk) == max(1, batch_rows // beams):
            yield from _batch(model, chunk, pad, eos, returns, return_scores, kwargs)
            chunk = []
    if chunk:
        yield from _batch(model, chunk, pad, eos, returns, return_scores, kwargs)


def _batch(model, chunk, pad, eos, returns, return_scores, kwargs) -> Iterator[Any]:
    width = max(len(ids) for ids in chunk)
    batch = torch.full((len(chunk), width), pad, dtype=torch.long, device=model.device)
    mask = torch.zeros_like(batch)
    for row, ids in enumerate(chunk):
        batch[row, : len(ids)], mask[row, : len(ids)] = ids.to(model.device), 1
    out = _generate(model, batch, mask, _call(kwargs, return_scores))
    sequences = out.sequences if return_scores else out
    scores = getattr(out, "sequences_scores", None) if return_scores else None
    for row, ids in enumerate(chunk):
        span = slice(row * returns, (row + 1) * returns)
        own = _cut(sequences[span], eos, pad)
        if own is None:  # not only fill after the cut: this input alone, not a guess
            yield from alone(model, iter([ids]), None, return_scores, kwargs)
            continue
        yield (own, scores[span] if scores is not None else None) if return_scores else own


def _cut(rows: torch.Tensor, eos: torch.Tensor, pad: int) -> torch.Tensor | None:
    """An input's rows (decoder start first) cut after its longest row's first EOS: each row of ``generate``'s
    output stops at its first EOS (or runs to the batch's end, the length limit), then holds fill. None when
    the columns cut hold anything but fill."""
    width = rows.shape[1]
    if len(eos) == 0:
        return rows
    ended = torch.isin(rows[:, 1:], eos)
    ends = torch.where(ended.any(1), ended.int().argmax(1) + 2, width)
    own = int(ends.max())
    tail = rows[:, own:]
    if not bool((tail == pad).logical_or(torch.isin(tail, eos)).all()):
        return None
    return rows[:, :own]


def _call(kwargs: dict[str, Any], return_scores: bool) -> dict[str, Any]:
    call = dict(kwargs)
    if return_scores:
        call.update(return_dict_in_generate=True, output_scores=True)
    return call


def _without_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k != "generation_config"}


def _result(out: Any, return_scores: bool) -> Any:
    return (out.sequences, getattr(out, "sequences_scores", None)) if return_scores else out


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, call: dict[str, Any]) -> Any:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **call)
