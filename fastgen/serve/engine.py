"""The serving engine: one thread owns the model and steps continuous batching's loops over requests as they arrive.

Why one thread: a model's forward is not re-entrant under fastgen's per-call scopes, and a CPU runs one
batched step faster than several small ones side by side. The thread runs the scheduler of
``generate_many`` (:func:`~fastgen.continuous.scheduler.run_continuous`, or
:func:`~fastgen.continuous.decoder_only.run_decoder_only`) in its online form
(:mod:`fastgen.continuous.online`): a request's inputs join at the next step boundary and leave when they
finish, so each result is what ``generate`` returns for that input alone (the scheduler's promise).

The scheduler runs one set of generation settings per loop, so requests are grouped by their resolved
:class:`~fastgen.continuous.settings.Settings`; each group is one online loop, and the thread steps the
groups with work in turn, one step each. A group whose loop raises is closed; the inputs that were in it are
run again each in a group of its own, so an input that raises fails alone and the others are served
(their results do not depend on the company they keep, sampling included: each input has its own seed).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fastgen.continuous import fallback
from fastgen.continuous.decoder_only import run_decoder_only
from fastgen.continuous.online import WAIT, Online
from fastgen.continuous.scheduler import held_linear_scope, run_continuous
from fastgen.continuous.search import Finished
from fastgen.continuous.settings import Settings

log = logging.getLogger("fastgen")


class QueueFull(Exception):
    """The engine's queue holds its maximum of waiting inputs."""

    def __init__(self, retry_after: float) -> None:
        super().__init__("the server's queue is full; retry later")
        self.retry_after = retry_after


class Closed(Exception):
    """The engine is shutting down and takes no new requests."""


@dataclass(eq=False)
class Job:
    """One input of a request: its token ids, settings and where its events go.

    ``sink`` is called from the engine thread with ``("tokens", position, [token per row])`` after each step
    (streamed jobs only: the token each row wrote at that sequence position), ``("done", Finished)`` or
    ``("error", exception)``.
    """

    ids: torch.Tensor
    settings: Settings | None  # None: the model or call is not served by continuous batching (generate alone)
    kwargs: dict[str, Any]
    sink: Callable[[tuple[str, Any]], None]
    seed: int | None = None
    stream: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    joined: float | None = None
    first_step: float | None = None
    finished: float | None = None
    cancelled: bool = False
    retried: bool = False


@dataclass
class EngineStats:
    """Counters the metrics read (updated by the engine thread)."""

    steps: int = 0
    rows: int = 0  # rows summed over steps
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    generated_tokens: int = 0
    busy_seconds: float = 0.0  # wall time in the loops' steps (a step's mean duration: busy_seconds / steps)


class _Group:
    """One online loop of the scheduler over the jobs of one settings key."""

    def __init__(self, engine: Engine, settings: Settings | None, kwargs: dict[str, Any], rows: int) -> None:
        self.engine = engine
        self.settings = settings
        self.pending: collections.deque[Job] = collections.deque()
        self.jobs: dict[int, Job] = {}  # scheduler index -> job (joined, not finished)
        self.next_index = 0
        self.seeds: collections.deque[int] = collections.deque()
        self.online = Online(on_step=self._on_step)
        model = engine.model
        if settings is None:
            self.loop = _alone_loop(model, self._source(), kwargs, self.seeds)
        elif model.config.is_encoder_decoder:
            seeds = _popping(self.seeds) if settings.do_sample else None
            self.loop = run_continuous(model, self._source(), settings, rows, seeds=seeds, online=self.online)
        else:
            seeds = _popping(self.seeds) if settings.do_sample else None
            self.loop = run_decoder_only(model, self._source(), settings, rows, kwargs, seeds=seeds, online=self.online)

    def has_work(self) -> bool:
        return bool(self.pending or self.jobs)

    def rows_in_flight(self) -> int:
        per_input = 1 if self.settings is None else self.settings.rows_per_input
        return len(self.jobs) * per_input

    def _source(self) -> Iterator[Any]:
        while True:
            while self.pending:
                job = self.pending.popleft()
                self.engine._left_queue()
                if job.cancelled:
                    self.engine._count_cancelled(job)
                    continue
                index, self.next_index = self.next_index, self.next_index + 1
                self.jobs[index] = job
                job.joined = time.perf_counter()
                if job.seed is not None:
                    self.seeds.append(job.seed)
                yield job.ids
            yield WAIT

    def step(self) -> None:
        """One step of the loop; finished jobs are delivered. Raises what the loop raised."""
        for item in self.loop:
            if item is None:
                return
            self.online.cancelled.discard(item.index)  # it finished before its cancellation reached the loop
            job = self.jobs.pop(item.index, None)
            if job is not None:
                self.engine._deliver(job, item)

    def cancel(self, job: Job) -> None:
        for index, joined in self.jobs.items():
            if joined is job:
                del self.jobs[index]
                self.online.cancelled.add(index)
                self.engine._count_cancelled(job)
                return

    def close(self) -> None:
        self.loop.close()

    def _on_step(self, state: Any) -> None:
        now = time.perf_counter()
        stats = self.engine.stats
        stats.steps += 1
        stats.rows += len(state) * state.beams
        streamed = []
        for position, index in enumerate(state.indices):
            job = self.jobs.get(index)
            if job is None:
                continue
            if job.first_step is None:
                job.first_step = now
            if job.stream and not state.beam_search:
                streamed.append((position, job))
        if not streamed:
            return
        beams = state.beams
        rows = [position * beams + row for position, _ in streamed for row in range(beams)]
        columns = [state.host_lengths[position] - 1 for position, _ in streamed for _ in range(beams)]
        device = state.tokens.device
        tokens = state.tokens[torch.tensor(rows, device=device), torch.tensor(columns, device=device)].tolist()
        for number, (position, job) in enumerate(streamed):
            job.sink(("tokens", state.host_lengths[position] - 1, tokens[number * beams : (number + 1) * beams]))


def _popping(values: collections.deque[int]) -> Iterator[int]:
    while True:
        yield values.popleft()


def _alone_loop(model: Any, source: Iterator[Any], kwargs: dict[str, Any], seeds: collections.deque[int]):
    """The online protocol over ``generate`` on each input alone (a model or call continuous batching does
    not serve): one input per step."""
    index = 0
    for item in source:
        if item is WAIT:
            yield None
            continue
        seed_iter = iter([seeds.popleft()]) if seeds else None
        sequences, scores = next(fallback.alone(model, iter([item]), seed_iter, True, kwargs))
        yield Finished(index, sequences, scores)
        yield None
        index += 1


class Engine:
    """Owns the model on one thread; :meth:`submit` jobs from any thread.

    ``batch_rows``: decoder rows per step of one group (inputs x beams); ``max_queue``: inputs waiting to
    join before :meth:`submit` raises :class:`QueueFull`.
    """

    def __init__(self, model: Any, batch_rows: int = 64, max_queue: int = 256) -> None:
        self.model = model
        self.batch_rows = int(batch_rows)
        self.max_queue = int(max_queue)
        self.stats = EngineStats()
        self._groups: dict[Any, _Group] = {}
        self._inbox: collections.deque[Job] = collections.deque()
        self._cancels: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._waiting = 0  # jobs submitted, not yet joined a loop
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._recent: collections.deque[float] = collections.deque(maxlen=64)  # finish times, for Retry-After
        self._rows = 0
        self._threads = torch.get_num_threads()  # the caller's setting (--threads): a new thread may not inherit it

    # -- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fastgen-serve-engine", daemon=True)
            self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's jobs (all or none)."""
        with self._cv:
            if self._stopping:
                raise Closed("the server is shutting down")
            if self._waiting + len(jobs) > self.max_queue:
                raise QueueFull(self._retry_after())
            self._waiting += len(jobs)
            self._inbox.extend(jobs)
            self._cv.notify()

    def cancel(self, jobs: list[Job]) -> None:
        """Drop the jobs (a client went away): their rows leave at the next step boundary."""
        with self._cv:
            for job in jobs:
                if job.finished is None and not job.cancelled:
                    job.cancelled = True
                    self._cancels.append(job)
            self._cv.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Take no new jobs, finish the ones submitted, then end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return self._waiting

    @property
    def rows_in_flight(self) -> int:
        return self._rows

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _retry_after(self) -> float:
        """Seconds until the queue has room, from the recent finish rate (at least 1)."""
        if len(self._recent) < 2 or self._recent[-1] <= self._recent[0]:
            return 1.0
        rate = (len(self._recent) - 1) / (self._recent[-1] - self._recent[0])
        return max(1.0, self._waiting / rate)

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        torch.set_num_threads(self._threads)
        # generate's GEMM scopes, entered once per busy spell instead of once per step (no one else runs the
        # model meanwhile); left when the engine has nothing to do, so an idle server's modules are the user's
        scope = contextlib.ExitStack()
        try:
            self._loop(scope)
        finally:
            scope.close()

    def _loop(self, scope: contextlib.ExitStack) -> None:
        held = False
        while True:
            self._intake()
            busy = [group for group in self._groups.values() if group.has_work()]
            if busy and not held:
                try:
                    scope.enter_context(held_linear_scope(self.model))
                except Exception:  # the loops enter it per step then, and fail alone if it raises there too
                    log.warning("fastgen-serve: entering the GEMM scopes raised", exc_info=True)
                held = True
            if not busy:
                if held:
                    scope.close()
                    held = False
                self._drop_idle()
                with self._cv:
                    if self._stopping and not self._inbox and not self._waiting:
                        return
                    if not self._inbox and not self._cancels:
                        self._cv.wait(timeout=0.5)
                continue
            started = time.perf_counter()
            for group in busy:
                try:
                    group.step()
                except Exception as exc:  # the loop is broken: its inputs run again, each alone
                    self._broken(group, exc)
            self.stats.busy_seconds += time.perf_counter() - started
            self._rows = sum(group.rows_in_flight() for group in self._groups.values())

    def _intake(self) -> None:
        with self._cv:
            jobs, self._inbox = list(self._inbox), collections.deque()
            cancels, self._cancels = list(self._cancels), collections.deque()
        for job in jobs:
            self._route(job)
        for job in cancels:
            for group in self._groups.values():
                group.cancel(job)

    def _route(self, job: Job, alone: bool = False) -> None:
        key: Any = ("alone", id(job)) if alone else (job.settings, job.settings is None)
        group = self._groups.get(key)
        if group is None:
            rows = self.batch_rows if not alone else max(1, 1 if job.settings is None else job.settings.rows_per_input)
            group = self._groups[key] = _Group(self, job.settings, job.kwargs, rows)
        group.pending.append(job)

    def _drop_idle(self) -> None:
        for key in [key for key, group in self._groups.items() if not group.has_work()]:
            self._groups.pop(key).close()
        self._rows = 0

    def _broken(self, group: _Group, exc: Exception) -> None:
        key = next(key for key, value in self._groups.items() if value is group)
        del self._groups[key]
        joined, pending = list(group.jobs.values()), list(group.pending)
        group.jobs.clear()
        group.pending.clear()
        try:
            group.close()
        except Exception:  # a loop that raised may raise again on close
            log.debug("closing a broken loop raised", exc_info=True)
        log.warning("fastgen-serve: a generation loop raised %r; its %d inputs run again, each alone", exc, len(joined))
        for job in joined:
            if job.cancelled:
                continue
            if job.retried or len(joined) == 1:
                self._fail(job, exc)
                continue
            job.retried = True
            with self._cv:
                self._waiting += 1
            self._route(job, alone=True)
        for job in pending:  # never reached the loop: back in line, with the others
            with self._cv:
                self._waiting += 1
            self._route(job)

    def _left_queue(self) -> None:
        with self._cv:
            self._waiting -= 1

    def _count_cancelled(self, job: Job) -> None:
        job.finished = time.perf_counter()
        self.stats.cancelled += 1

    def _deliver(self, job: Job, result: Finished) -> None:
        job.finished = time.perf_counter()
        if job.first_step is None:
            job.first_step = job.finished
        self._recent.append(job.finished)
        self.stats.finished += 1
        prompt = 0 if self.model.config.is_encoder_decoder else len(job.ids)
        self.stats.generated_tokens += int(result.sequences.shape[-1]) - max(prompt, 1)
        job.sink(("done", result))

    def _fail(self, job: Job, exc: Exception) -> None:
        job.finished = time.perf_counter()
        self.stats.failed += 1
        job.sink(("error", exc))


def random_seed() -> int:
    """A seed for a sampling request that gave none (returned to the client, so the result can be reproduced)."""
    return random.SystemRandom().randrange(0, 2**63 - 1)
