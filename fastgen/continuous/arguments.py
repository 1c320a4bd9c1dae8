"""What ``generate_many`` accepts, checked where the user made the mistake, with a message that says what to pass.

Without these checks a wrong argument failed far from its cause ("got multiple values for keyword argument"
from the fallback, "new(): invalid data type 'str'", "object is not iterable"), or worse, was taken silently:
a 2-D padded tensor read row by row with its pads as tokens, ``num_beams=0`` run as greedy search,
``batch_rows=True`` as one row. Inputs and seeds are checked as they are consumed (both may be lazy
iterables); the arguments, when ``generate_many`` is called.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

#: keyword arguments that would describe the inputs a second time (generate_many builds each input's own)
_INPUT_KWARGS = ("input_ids", "attention_mask")
#: generate arguments that must be positive integers (upstream divides by num_beams: 0 ran as greedy here)
_POSITIVE = ("num_beams", "num_return_sequences", "num_beam_groups")
#: generate arguments that are numbers (upstream fails deep in the loop on a string, or not at all)
_NUMBERS = ("length_penalty",)


def integer(value: Any) -> int | None:
    """``value`` as an int when it is one: a Python or NumPy integer, or a 0-d integer tensor or array
    (``torch.tensor(5)``); bools are not integers here."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim == 0:
        dtype = torch.as_tensor(value).dtype
        is_int = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        return int(value.item()) if is_int else None
    return None


def check_batch_rows(batch_rows: Any) -> int:
    rows = integer(batch_rows)
    if rows is None or rows < 1:
        raise ValueError(f"batch_rows must be a positive integer (decoder rows per step), got {batch_rows!r}")
    return rows


def check_generate_kwargs(kwargs: dict[str, Any], return_scores: bool) -> None:
    """The keyword arguments ``generate`` would reject late or misread, rejected now."""
    for key in _INPUT_KWARGS:
        if key in kwargs:
            raise TypeError(
                f"generate_many() got {key}=: it takes unpadded 1-D inputs and builds each input's {key} itself "
                "(a tokenizer's padded output is accepted as inputs: generate_many(model, tokenizer(texts, "
                "padding=True, return_tensors='pt'), ...))"
            )
    for key in _POSITIVE:
        value = kwargs.get(key)
        if value is not None and (integer(value) is None or integer(value) < 1):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    for key in _NUMBERS:
        value = kwargs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"{key} must be a number, got {type(value).__name__} {value!r}")
    if return_scores and kwargs.get("return_dict_in_generate"):
        raise ValueError(
            "return_scores=True with return_dict_in_generate=True: choose one (each result is then generate's "
            "output for that input, whose sequences_scores are the scores)"
        )


def seed_stream(seed: Any) -> Iterator[int] | None:
    """``seed`` as one seed per input: ``S, S + 1, ...`` for an integer ``S``, or the given iterable's
    integers (each checked as it is taken); None for None."""
    if seed is None:
        return None
    start = integer(seed)
    if start is not None:
        return itertools.count(start)
    zero_d = isinstance(seed, torch.Tensor | np.ndarray) and seed.ndim == 0
    if zero_d or isinstance(seed, str | bytes | Mapping) or not isinstance(seed, Iterable):
        raise TypeError(
            f"seed must be an integer or an iterable of one integer per input, got {type(seed).__name__} {seed!r}"
        )
    return _checked_seeds(iter(seed))


def _checked_seeds(seeds: Iterator[Any]) -> Iterator[int]:
    for index, value in enumerate(seeds):
        number = integer(value)
        if number is None:
            raise TypeError(f"seed of input {index}: must be an integer, got {type(value).__name__} {value!r}")
        yield number


def pad_id(model: Any) -> int | None:
    pad = model.generation_config.pad_token_id
    return model.config.pad_token_id if pad is None else pad


def token_rows(model: Any, inputs: Any) -> Iterator[torch.Tensor]:
    """``inputs`` as one 1-D tensor of token ids per input, each checked as it is taken.

    Accepted: an iterable of 1-D sequences (lists, tensors, arrays; a ``(1, n)`` tensor is one input);
    a tokenizer's output (a mapping with ``input_ids`` and, when padded, ``attention_mask``: each row's
    tokens under its mask, which must be one run of ones, left or right padded); a 2-D tensor or array
    only when it holds no pad token id (nothing tells its padding from tokens: pass its mask with it).
    """
    if isinstance(inputs, str | bytes):
        raise TypeError("inputs is a string: generate_many takes token ids (tokenize first: tokenizer(texts))")
    if isinstance(inputs, Mapping):
        return _encoded_rows(model, inputs)
    if isinstance(inputs, torch.Tensor | np.ndarray):
        return _tensor_rows(model, torch.as_tensor(inputs))
    if not isinstance(inputs, Iterable):
        raise TypeError(f"inputs must be an iterable of token-id sequences, got {type(inputs).__name__}")
    return _checked_rows(model, inputs)


def _tensor_rows(model: Any, batch: torch.Tensor) -> Iterator[torch.Tensor]:
    if batch.dim() != 2:
        hint = " (one input: pass [ids])" if batch.dim() == 1 else ""
        raise ValueError(f"inputs is a tensor of shape {tuple(batch.shape)}: expected (inputs, tokens){hint}")
    pad = pad_id(model)
    if pad is not None and bool((batch == pad).any()):
        raise ValueError(
            f"inputs is a 2-D tensor holding the pad token id {pad}: generate_many would read the padding as "
            "tokens. Pass a list of unpadded 1-D inputs, or the tokenizer's output with its attention_mask"
        )
    return _checked_rows(model, batch)


def _encoded_rows(model: Any, encoding: Mapping) -> Iterator[torch.Tensor]:
    other = sorted(set(encoding) - {"input_ids", "attention_mask"})
    if "input_ids" not in encoding or other:
        raise ValueError(
            "inputs is a mapping: generate_many reads a tokenizer's output, with input_ids and attention_mask only"
            f" (got keys {sorted(encoding)})"
        )
    ids, mask = encoding["input_ids"], encoding.get("attention_mask")
    if mask is None:
        return token_rows(model, ids)
    return _checked_rows(model, _unpadded(ids, mask))


def _unpadded(ids: Iterable[Any], masks: Iterable[Any]) -> Iterator[torch.Tensor]:
    for index, (row, mask) in enumerate(itertools.zip_longest(ids, masks)):
        if row is None or mask is None:
            raise ValueError("inputs: input_ids and attention_mask have different numbers of rows")
        row, mask = torch.as_tensor(row), torch.as_tensor(mask)
        if row.shape != mask.shape or row.dim() != 1:
            raise ValueError(f"input {index}: input_ids {tuple(row.shape)} and attention_mask {tuple(mask.shape)}")
        kept = mask.nonzero().reshape(-1)
        if len(kept) and (int(kept[-1]) - int(kept[0]) + 1 != len(kept) or bool((mask[kept] != 1).any())):
            raise ValueError(f"input {index}: attention_mask is not one run of ones (left or right padding)")
        yield row[kept]


def _checked_rows(model: Any, inputs: Iterable[Any]) -> Iterator[torch.Tensor]:
    embeddings = model.get_input_embeddings()
    vocab = getattr(embeddings, "num_embeddings", None)
    for index, value in enumerate(inputs):
        yield _row(value, index, vocab)


def _row(value: Any, index: int, vocab: int | None) -> torch.Tensor:
    if isinstance(value, str | bytes):
        raise TypeError(f"input {index}: a string; generate_many takes token ids (tokenize first)")
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"input {index}: expected a 1-D sequence of token ids, got {type(value).__name__}") from exc
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input {index}: expected a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"input {index}: token ids must be integers, got {ids.dtype}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bound = f"0..{vocab - 1}" if vocab is not None else "ids are not negative"
        raise ValueError(f"input {index}: token id {low if low < 0 else high} is outside the vocabulary ({bound})")
    return ids.long()
