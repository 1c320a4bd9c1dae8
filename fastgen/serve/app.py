"""The HTTP app: routes, request checking and the bridge between asyncio handlers and the engine thread.

Endpoints: ``POST /v1/generate`` (fastgen's own: texts or token ids, ``generate``'s settings, results
with token ids, texts, scores and timings), ``POST /v1/completions`` (OpenAI-compatible, ``stream: true``
as server-sent events; :mod:`fastgen.serve.openai_api`), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text).

Every refusal is an OpenAI-style error body ``{"error": {"message", "type", "param", "code"}}`` with a
4xx status; a full queue is 429 with ``Retry-After``; an input that raised in the model is 500 for its
request only. A client that disconnects before its answer cancels its inputs (their rows leave the
batch at the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fastgen.continuous.search import Finished
from fastgen.continuous.settings import Settings, resolve
from fastgen.serve.engine import Closed, Engine, Job, QueueFull, random_seed
from fastgen.serve.metrics import Metrics
from fastgen.serve.protocol import (
    Limits,
    RequestError,
    check_lengths,
    check_parameters,
    settings_for,
    token_ids,
    tokenize,
)

log = logging.getLogger("fastgen")

#: distinct request parameters whose resolved settings are kept (then the memory starts afresh)
MAX_RESOLVED = 256


@dataclass
class Served:
    """Everything the handlers share: the model, its tokenizer, the engine, limits and metrics."""

    model: Any
    tokenizer: Any
    name: str
    engine: Engine
    limits: Limits
    served: bool  # continuous batching serves the model (else generate runs alone per input)
    metrics: Metrics
    created: int
    resolved: dict[str, Settings | None] = field(default_factory=dict)  # settings per distinct parameters

    @property
    def vocab(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def prompt_in_output(self) -> bool:
        return not self.model.config.is_encoder_decoder

    def new_tokens(self, sequence: list[int], prompt_length: int) -> list[int]:
        """The generated part of a result row (no prompt, no decoder start token)."""
        return sequence[prompt_length:] if self.prompt_in_output else sequence[1:]

    def decode(self, tokens: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            return set()
        return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}

    def sampling(self, kwargs: dict[str, Any]) -> bool:
        return bool(kwargs.get("do_sample", self.model.generation_config.do_sample))

    def settings(self, kwargs: dict[str, Any]) -> Settings | None:
        """:func:`settings_for`, once per distinct parameters: resolving walks the model's modules and copies
        its generation config (about 0.7 ms of the event loop's time, and of the GIL the engine's steps need,
        per request); the model and its generation config do not change while it is served."""
        key = json.dumps(kwargs, sort_keys=True)
        if key not in self.resolved:
            if len(self.resolved) >= MAX_RESOLVED:
                self.resolved.clear()
            self.resolved[key] = settings_for(self.model, kwargs, self.served)
        return self.resolved[key]

    def make_jobs(
        self, inputs: list[Any], kwargs: dict[str, Any], seed: int | None, stream: bool, sinks: list[Any]
    ) -> tuple[list[Job], int | None]:
        settings = self.settings(kwargs)
        sampling = settings.do_sample if settings is not None else self.sampling(kwargs)
        if sampling and seed is None:
            seed = random_seed() >> 16  # room for seed + i
        jobs = []
        for index, ids in enumerate(inputs):
            check_lengths(self.model, settings, kwargs, ids, index, self.limits)
            jobs.append(
                Job(
                    ids=ids.to(self.model.device),
                    settings=settings,
                    kwargs=kwargs,
                    sink=sinks[index],
                    seed=seed + index if sampling else None,
                    stream=stream,
                )
            )
        return jobs, seed if sampling else None


class Outcome:
    """The events of one request's jobs, delivered on the event loop."""

    def __init__(self, count: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sinks = [self._sink(index) for index in range(count)]

    def _sink(self, index: int):
        def sink(event: tuple) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed (server stopped)
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

        return sink


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_jobs(served: Served, request: Request, jobs: list[Job], outcome: Outcome) -> list[Finished]:
    """Submit and await every job; cancels them when the client disconnects (raises ``ClientGone``)."""
    submit(served, jobs)
    results: dict[int, Finished] = {}
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        while len(results) < len(jobs):
            getter = asyncio.ensure_future(outcome.queue.get())
            done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                served.engine.cancel(jobs)
                raise ClientGone()
            index, event = getter.result()
            if event[0] == "done":
                results[index] = event[1]
            elif event[0] == "error":
                served.engine.cancel(jobs)
                raise RequestError(f"generation failed for input {index}: {event[1]!r}", 500, kind="server_error")
    finally:
        gone.cancel()
    observe(served, jobs)
    return [results[i] for i in range(len(jobs))]


def submit(served: Served, jobs: list[Job]) -> None:
    try:
        served.engine.submit(jobs)
    except QueueFull as full:
        raise RequestError(str(full), 429, kind="rate_limit_error") from full
    except Closed as closed:
        raise RequestError(str(closed), 503, kind="server_error") from closed


def observe(served: Served, jobs: list[Job]) -> None:
    for job in jobs:
        if job.joined is not None:
            served.metrics.queue_wait.observe(job.joined - job.submitted)
        if job.first_step is not None:
            served.metrics.first_token.observe(job.first_step - job.submitted)


class ClientGone(Exception):
    """The client disconnected before its answer."""


def error_response(error: RequestError, retry_after: float | None = None) -> JSONResponse:
    headers = {}
    if error.status == 429:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after or 1)))
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def endpoint(name: str):
    """Wraps a handler: errors as responses, metrics per endpoint."""

    def wrap(handler):
        async def route(request: Request) -> Response:
            served: Served = request.app.state.served
            start = time.perf_counter()
            try:
                response = await handler(served, request)
            except RequestError as error:
                retry = served.engine._retry_after() if error.status == 429 else None
                response = error_response(error, retry)
            except ClientGone:
                response = Response(status_code=499)
            except Exception as exc:  # a bug: the server keeps serving
                log.exception("fastgen-serve: %s failed", name)
                response = error_response(RequestError(f"internal error: {exc!r}", 500, kind="server_error"))
            served.metrics.requests.labels(name, str(response.status_code)).inc()
            if response.status_code < 400:
                served.metrics.latency.labels(name).observe(time.perf_counter() - start)
            return response

        return route

    return wrap


_GENERATE_KEYS = ("inputs", "input_ids", "parameters")


@endpoint("generate")
async def generate(served: Served, request: Request) -> Response:
    body = await read_json(request)
    unknown = sorted(set(body) - set(_GENERATE_KEYS))
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} (accepted: {', '.join(_GENERATE_KEYS)})", param=unknown[0])
    inputs = parse_inputs(served, body)
    kwargs, seed = check_parameters(body.get("parameters"), served.limits)
    outcome = Outcome(len(inputs))
    jobs, seed = served.make_jobs(inputs, kwargs, seed, False, outcome.sinks)
    results = await run_jobs(served, request, jobs, outcome)
    answer = []
    for index, (job, result) in enumerate(zip(jobs, results, strict=True)):
        sequences = result.sequences.tolist()
        scores = result.scores.tolist() if result.scores is not None else [None] * len(sequences)
        prompt = len(job.ids)
        answer.append(
            {
                "sequences": [
                    {"token_ids": row, "text": served.decode(served.new_tokens(row, prompt)), "score": score}
                    for row, score in zip(sequences, scores, strict=True)
                ],
                "seed": None if seed is None else seed + index,
                "timings": timings(job),
            }
        )
    return JSONResponse({"model": served.name, "results": answer})


def timings(job: Job) -> dict[str, float | None]:
    def since(t: float | None) -> float | None:
        return None if t is None else round(t - job.submitted, 6)

    return {"queued_s": since(job.joined), "first_step_s": since(job.first_step), "total_s": since(job.finished)}


def parse_inputs(served: Served, body: dict[str, Any]) -> list[Any]:
    texts, ids = body.get("inputs"), body.get("input_ids")
    if (texts is None) == (ids is None):
        raise RequestError("give either inputs (texts) or input_ids (token ids)", param="inputs")
    if texts is not None:
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts:
            raise RequestError("inputs must be a string or a non-empty list of strings", param="inputs")
        rows = [tokenize(served.tokenizer, text, i) for i, text in enumerate(texts)]
    else:
        if isinstance(ids, list) and ids and all(isinstance(v, int) for v in ids):
            ids = [ids]
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a list of token ids or a list of such lists", param="input_ids")
        rows = ids
    if len(rows) > served.limits.max_inputs:
        raise RequestError(f"{len(rows)} inputs in one request; this server takes at most {served.limits.max_inputs}")
    return [token_ids(row, i, served.vocab) for i, row in enumerate(rows)]


async def health(request: Request) -> Response:
    served: Served = request.app.state.served
    ok = served.engine.alive
    body = {
        "status": "ok" if ok else "stopped",
        "queue_depth": served.engine.queue_depth,
        "rows_in_flight": served.engine.rows_in_flight,
    }
    return JSONResponse(body, status_code=200 if ok else 503)


async def models(request: Request) -> Response:
    served: Served = request.app.state.served
    card = {"id": served.name, "object": "model", "created": served.created, "owned_by": "fastgen"}
    return JSONResponse({"object": "list", "data": [card]})


async def metrics(request: Request) -> Response:
    served: Served = request.app.state.served
    return Response(served.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(
    model: Any,
    tokenizer: Any = None,
    *,
    name: str = "model",
    batch_rows: int = 64,
    max_queue: int = 256,
    max_input_tokens: int | None = None,
    max_new_tokens: int = 512,
    max_inputs: int = 64,
) -> Starlette:
    """The ASGI app serving ``model`` (in eval mode, on its device). The engine thread starts with the app's
    lifespan and, at shutdown (uvicorn's SIGTERM: after the requests in flight were answered), finishes what
    it holds and stops."""
    from fastgen.serve import openai_api

    model.eval()
    positions = getattr(model.config, "max_position_embeddings", None)
    limits = Limits(
        max_input_tokens=int(max_input_tokens or positions or 1024),
        max_new_tokens=int(max_new_tokens),
        max_rows=int(batch_rows),
        max_inputs=int(max_inputs),
    )
    _, reason = resolve(model, {})
    if reason is not None:
        log.warning(
            "fastgen-serve: continuous batching does not serve this model (%s): generate runs per input", reason
        )
    engine = Engine(model, batch_rows=batch_rows, max_queue=max_queue)
    served = Served(
        model=model,
        tokenizer=tokenizer,
        name=name,
        engine=engine,
        limits=limits,
        served=reason is None,
        metrics=Metrics(engine),
        created=int(time.time()),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # What exists at startup (the model, the imported libraries: ~400k objects with Transformers) lives as
        # long as the server: frozen, the garbage collector's full passes skip it (each took ~0.1 s on one core
        # and paused the engine) and scan only what requests create
        frozen_before = gc.get_freeze_count()
        gc.collect()
        gc.freeze()
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)
            if not frozen_before:  # someone else's freeze stays as it was
                gc.unfreeze()

    app = Starlette(
        routes=[
            Route("/v1/generate", generate, methods=["POST"]),
            Route("/v1/completions", openai_api.completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.served = served
    return app
