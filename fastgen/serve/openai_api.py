"""``POST /v1/completions``, OpenAI-compatible: plain JSON or, with ``stream: true``, server-sent events.

Mapping onto ``generate``: ``max_tokens`` -> ``max_new_tokens`` (default 16, as OpenAI's), ``temperature``
0 -> greedy search, > 0 -> sampling at that temperature (absent: the model's ``generation_config``
decides), ``top_p``, ``n`` -> ``num_return_sequences``, ``seed`` (prompt ``i`` gets ``seed + i``). fastgen's
extensions: ``num_beams``, ``top_k``, ``min_p``, ``min_tokens``, ``no_repeat_ngram_size``,
``length_penalty``, ``early_stopping``. Not served (a 400 when set to anything but its neutral value):
``stop``, ``logprobs``, ``echo``, ``suffix``, ``best_of``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias``.

A choice's text is its generated tokens up to the first EOS (``finish_reason`` ``stop``; ``length`` when it
ran to the limit), decoded without special tokens; each choice also carries ``token_ids`` (an extension).
Streaming sends each token's text as the step that made it ends (greedy search and sampling); beam
search's hypotheses change until the end, so its text comes in one chunk when the input finishes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from fastgen.serve.app import Outcome, RequestError, Served, endpoint, observe, read_json, run_jobs, submit
from fastgen.serve.protocol import check_parameters, token_ids, tokenize

#: OpenAI fields served only at their neutral value
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stop": (None, [], ""),
    "logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}
_EXTENSIONS = {
    "num_beams": "num_beams",
    "top_k": "top_k",
    "min_p": "min_p",
    "min_tokens": "min_new_tokens",
    "no_repeat_ngram_size": "no_repeat_ngram_size",
    "length_penalty": "length_penalty",
    "early_stopping": "early_stopping",
}
_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "seed", "user"}
_FIELDS |= set(_NEUTRAL) | set(_EXTENSIONS)
DEFAULT_MAX_TOKENS = 16


def parse(served: Served, body: dict[str, Any]) -> tuple[list[Any], dict[str, Any], int | None, int]:
    """The prompts' token ids, ``generate`` kwargs, seed and ``n``."""
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}", param=unknown[0])
    for key, neutral in _NEUTRAL.items():
        if body.get(key) not in neutral:
            raise RequestError(f"{key} is not supported by fastgen-serve", param=key)
    model = body.get("model")
    if model is not None and model != served.name:
        raise RequestError(
            f"model {model!r} is not served here (served: {served.name!r})", 404, "model", "not_found_error"
        )
    params: dict[str, Any] = {key: body[name] for name, key in _EXTENSIONS.items() if body.get(name) is not None}
    params["max_new_tokens"] = body.get("max_tokens") if body.get("max_tokens") is not None else DEFAULT_MAX_TOKENS
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
            raise RequestError(f"temperature must be a number >= 0, got {temperature!r}", param="temperature")
        params["do_sample"] = temperature > 0
        if temperature > 0:
            params["temperature"] = temperature
    if body.get("top_p") is not None:
        params["top_p"] = body["top_p"]
    if body.get("seed") is not None:
        params["seed"] = body["seed"]
    n = body.get("n") if body.get("n") is not None else 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RequestError(f"n must be a positive integer, got {n!r}", param="n")
    if n > 1:
        params["num_return_sequences"] = n
        if not served.sampling(params) and params.get("num_beams", 1) < n:
            raise RequestError("n > 1 needs sampling (temperature > 0) or num_beams >= n", param="n")
    kwargs, seed = check_parameters(params, served.limits)
    return prompts(served, body.get("prompt")), kwargs, seed, n


def prompts(served: Served, prompt: Any) -> list[Any]:
    """``prompt``: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(prompt, str):
        rows = [tokenize(served.tokenizer, prompt, 0)]
    elif isinstance(prompt, list) and prompt and all(isinstance(v, int) for v in prompt):
        rows = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(v, str) for v in prompt):
        rows = [tokenize(served.tokenizer, text, i) for i, text in enumerate(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(v, list) for v in prompt):
        rows = prompt
    else:
        raise RequestError(
            "prompt must be a string, a list of strings or token ids (a list, or a list of lists)", param="prompt"
        )
    if len(rows) > served.limits.max_inputs:
        raise RequestError(f"{len(rows)} prompts in one request; this server takes at most {served.limits.max_inputs}")
    return [token_ids(row, i, served.vocab) for i, row in enumerate(rows)]


def completion_tokens(served: Served, row: list[int], prompt_length: int) -> tuple[list[int], str]:
    """A result row's generated tokens up to its first EOS, and why it stopped."""
    tokens = served.new_tokens(row, prompt_length)
    eos = served.eos_ids()
    for position, token in enumerate(tokens):
        if token in eos:
            return tokens[:position], "stop"
    return tokens, "length"


@endpoint("completions")
async def completions(served: Served, request: Request) -> Response:
    body = await read_json(request)
    inputs, kwargs, seed, n = parse(served, body)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", param="stream")
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
    outcome = Outcome(len(inputs))
    jobs, _ = served.make_jobs(inputs, kwargs, seed, stream, outcome.sinks)
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if stream:
        submit(served, jobs)  # a full queue is a 429 before the stream starts
        events = _stream(served, jobs, outcome, n, ident, created, include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    results = await run_jobs(served, request, jobs, outcome)
    choices, generated = [], 0
    for number, (job, result) in enumerate(zip(jobs, results, strict=True)):
        for row_number, row in enumerate(result.sequences.tolist()):
            tokens, reason = completion_tokens(served, row, len(job.ids))
            generated += len(tokens)
            choices.append(_choice(served, number * n + row_number, tokens, reason))
    prompt_tokens = sum(len(job.ids) for job in jobs)
    return JSONResponse(
        {
            "id": ident,
            "object": "text_completion",
            "created": created,
            "model": served.name,
            "choices": choices,
            "usage": _usage(prompt_tokens, generated),
        }
    )


def _choice(served: Served, index: int, tokens: list[int], reason: str | None, text: str | None = None) -> dict:
    if text is None:
        text = served.decode(tokens) or ""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": reason, "token_ids": tokens}


def _usage(prompt_tokens: int, generated: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}


class _Row:
    """One streamed choice: its tokens so far and the text sent (incremental detokenization that holds back
    an incomplete character, as the decoded text of a prefix can change when a token is added)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.prefix = self.read = 0
        self.sent = ""
        self.ended = False
        self.next_position = 0

    def delta(self, tokenizer: Any) -> str:
        if tokenizer is None:
            return ""
        before = tokenizer.decode(self.tokens[self.prefix : self.read], skip_special_tokens=True)
        now = tokenizer.decode(self.tokens[self.prefix :], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        text = now[len(before) :]
        self.sent += text
        return text


async def _stream(
    served: Served, jobs: list, outcome: Outcome, n: int, ident: str, created: int, include_usage: bool
) -> AsyncIterator[str]:
    def event(choice: dict) -> str:
        chunk = {
            "id": ident,
            "object": "text_completion",
            "created": created,
            "model": served.name,
            "choices": [choice],
        }
        return f"data: {json.dumps(chunk)}\n\n"

    rows = [[_Row() for _ in range(n)] for _ in jobs]
    eos, remaining, generated, finished = served.eos_ids(), len(jobs), 0, False
    try:
        while remaining:
            index, message = await outcome.queue.get()
            if message[0] == "tokens":
                _, position, tokens = message
                for number, token in enumerate(tokens):
                    row = rows[index][number]
                    if row.ended or position < row.next_position:  # ended, or sent already (a rerun)
                        continue
                    row.next_position = position + 1
                    if token in eos:
                        row.ended = True
                        continue
                    row.tokens.append(token)
                    text = row.delta(served.tokenizer)
                    yield event(_choice(served, index * n + number, [token], None, text))
            elif message[0] == "done":
                remaining -= 1
                job = jobs[index]
                for number, sequence in enumerate(message[1].sequences.tolist()):
                    tokens, reason = completion_tokens(served, sequence, len(job.ids))
                    generated += len(tokens)
                    row = rows[index][number]
                    full = served.decode(tokens) or ""
                    rest = full[len(row.sent) :] if full.startswith(row.sent) else ""
                    unsent = tokens[len(row.tokens) :]
                    yield event(_choice(served, index * n + number, unsent, reason, rest))
            else:
                error = RequestError(f"generation failed for input {index}: {message[1]!r}", 500, kind="server_error")
                yield f"data: {json.dumps(error.body())}\n\n"
                return
        observe(served, jobs)
        if include_usage:
            usage = _usage(sum(len(job.ids) for job in jobs), generated)
            chunk = {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": served.name,
                "choices": [],
                "usage": usage,
            }
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client went away (or an input failed): free the rows of the others
            served.engine.cancel(jobs)
