"""What a request may ask for, checked before it reaches the engine: one clear 4xx message per mistake.

The generation parameters are an allow-list of ``generate``'s arguments that continuous batching serves
(:data:`PARAMETERS`), each checked for type and range here, so a request never fails deep inside the loop
(where it could take other requests with it). Inputs are texts (tokenized with the model's tokenizer) or
token ids; their lengths are checked against the server's limits and the model's positions.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from fastgen.continuous.settings import Settings, resolve

#: accepted generation parameters: name -> (kind, minimum, maximum); kinds: int, float, bool, early
PARAMETERS: dict[str, tuple[str, float | None, float | None]] = {
    "num_beams": ("int", 1, None),
    "num_return_sequences": ("int", 1, None),
    "max_new_tokens": ("int", 1, None),
    "min_new_tokens": ("int", 0, None),
    "do_sample": ("bool", None, None),
    "temperature": ("float", 1e-6, None),
    "top_k": ("int", 0, None),
    "top_p": ("float", 1e-6, 1.0),
    "min_p": ("float", 0.0, 1.0),
    "no_repeat_ngram_size": ("int", 0, None),
    "length_penalty": ("float", None, None),
    "early_stopping": ("early", None, None),
    "seed": ("int", 0, 2**63 - 1),
}


class RequestError(Exception):
    """A request the server will not run: an HTTP status and one message (OpenAI's error body)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.kind = message, status, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class Limits:
    """The server's limits (command-line options) and the model's."""

    max_input_tokens: int
    max_new_tokens: int
    max_rows: int  # rows of one input (beams x returned sequences) at most: the engine's batch_rows
    max_inputs: int = 64  # inputs per request


def check_parameters(params: Any, limits: Limits) -> tuple[dict[str, Any], int | None]:
    """``generate`` keyword arguments and the seed from a request's parameters object."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RequestError(f"parameters must be an object, got {type(params).__name__}", param="parameters")
    kwargs: dict[str, Any] = {}
    for name, value in params.items():
        if name not in PARAMETERS:
            raise RequestError(f"unknown parameter {name!r} (accepted: {', '.join(PARAMETERS)})", param=name)
        if value is None:
            continue
        kind, low, high = PARAMETERS[name]
        kwargs[name] = _checked(name, value, kind, low, high)
    seed = kwargs.pop("seed", None)
    if kwargs.get("max_new_tokens", 0) > limits.max_new_tokens:
        raise RequestError(
            f"max_new_tokens={kwargs['max_new_tokens']} is over this server's limit of {limits.max_new_tokens}",
            param="max_new_tokens",
        )
    if kwargs.get("min_new_tokens", 0) > kwargs.get("max_new_tokens", limits.max_new_tokens):
        raise RequestError("min_new_tokens is larger than max_new_tokens", param="min_new_tokens")
    return kwargs, seed


def _checked(name: str, value: Any, kind: str, low: float | None, high: float | None) -> Any:
    if kind == "bool":
        if not isinstance(value, bool):
            raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
        return value
    if kind == "early":
        if isinstance(value, bool) or value == "never":
            return value
        raise RequestError(f'early_stopping must be true, false or "never", got {value!r}', param=name)
    if kind == "int":
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if not ok and isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
        if not ok:
            raise RequestError(f"{name} must be an integer, got {value!r}", param=name)
        value = int(value)
    else:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RequestError(f"{name} must be a number, got {value!r}", param=name)
        value = float(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}" if low is not None else f"<= {high}"
        raise RequestError(f"{name} must be {bounds}, got {value!r}", param=name)
    return value


def token_ids(value: Any, index: int, vocab: int) -> torch.Tensor:
    """One input's token ids, checked: a non-empty list of integers in the vocabulary."""
    if not isinstance(value, list) or not value:
        raise RequestError(f"input {index}: token ids must be a non-empty list of integers", param="input_ids")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise RequestError(f"input {index}: token ids must be integers", param="input_ids")
    low, high = min(value), max(value)
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise RequestError(
            f"input {index}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param="input_ids"
        )
    return torch.tensor(value, dtype=torch.long)


def tokenize(tokenizer: Any, text: Any, index: int) -> list[int]:
    if tokenizer is None:
        raise RequestError("this model has no tokenizer: send token ids (input_ids) instead of texts", param="inputs")
    if not isinstance(text, str) or not text:
        raise RequestError(f"input {index}: expected a non-empty string, got {text!r}", param="inputs")
    return list(tokenizer(text)["input_ids"])


def settings_for(model: Any, kwargs: dict[str, Any], served: bool) -> Settings | None:
    """The resolved settings (None: the model runs ``generate`` alone per input), or a 400 for a combination
    continuous batching does not serve."""
    if kwargs.get("do_sample") and kwargs.get("num_beams", 1) > 1:
        raise RequestError("do_sample with num_beams > 1 (beam sampling) is not served", param="num_beams")
    if not served:
        return None
    try:
        settings, reason = resolve(model, kwargs)
    except ValueError as exc:  # generate's own validation of the settings
        raise RequestError(str(exc).strip("`")) from exc
    if settings is None:
        raise RequestError(f"not served: {reason}")
    return settings


def check_lengths(
    model: Any, settings: Settings | None, kwargs: dict[str, Any], ids: torch.Tensor, index: int, limits: Limits
) -> None:
    """Input and output lengths within the server's limits and the model's positions."""
    length = len(ids)
    if length > limits.max_input_tokens:
        raise RequestError(
            f"input {index} has {length} tokens; this server takes at most {limits.max_input_tokens}", param="inputs"
        )
    if settings is None:
        return
    rows = settings.rows_per_input
    if rows > limits.max_rows:
        raise RequestError(
            f"{rows} rows per input (beams or returned sequences) is over this server's {limits.max_rows}",
            param="num_beams",
        )
    positions = getattr(model.config, "max_position_embeddings", None)
    if model.config.is_encoder_decoder:
        total, new = settings.max_length, settings.max_length - 1
    else:
        total = settings.length_limit(length)
        new = total - length
        if new <= 0:
            raise RequestError(
                f"input {index}: its {length} tokens reach the length limit {total}; set max_new_tokens",
                param="max_new_tokens",
            )
    if new > limits.max_new_tokens:
        raise RequestError(
            f"up to {new} new tokens is over this server's limit of {limits.max_new_tokens}; set max_new_tokens",
            param="max_new_tokens",
        )
    if positions is not None and total > positions:
        raise RequestError(
            f"input {index}: {total} tokens in all is over the model's {positions} positions", param="max_new_tokens"
        )
