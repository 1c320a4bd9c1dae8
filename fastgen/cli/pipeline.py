"""FastSeq's asynchronous generation pipeline (§4.3): the device never waits for post-processing.

    caller's thread          offload thread               worker pool            writer thread
    generate(batch k+1) ->   device -> host, plain data -> detokenize / format -> commit in key order

The caller generates and ``submit``s each batch; one background thread moves the finished batch
off the device into plain Python data (one transfer per batch instead of a sync per hypothesis);
a pool post-processes batches in parallel; the writer waits on the results *in submission order*,
so output order never depends on which worker finishes first. Queues are bounded, so generation
runs at most ``max_in_flight`` batches ahead. The first failure anywhere (a worker process that
died included: ``BrokenProcessPool``) stops the pipeline and is raised to the caller by the next
``submit`` or by ``close``; nothing is dropped silently.

Workers are processes by default. Detokenizers (Moses, BPE decoders, ``Dictionary.string``, slow
HF tokenizers) are pure Python, so threads would serialize on the GIL and also compete with the
Python-heavy decoding loop; the objects they need are plain picklable data (fairseq dictionaries,
BPE/tokenizer objects, or a tokenizer directory that each worker loads once), and fairseq's
``encode_line(add_if_not_exist=True)``, which mutates the dictionary, is never called in a worker.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

logger = logging.getLogger("fastgen")

_STOP = object()


class PipelineError(RuntimeError):
    """A pipeline stage failed; the run stops instead of writing an incomplete output."""


def make_executor(
    workers: int,
    kind: str = "process",
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
) -> Executor | None:
    """A pool for post-processing, or None for "post-process in the writer thread" (``workers == 0``).

    Processes are started with ``spawn``: the caller already runs threads (and torch's thread
    pools), and forking a multi-threaded process can deadlock the child.
    """
    if workers <= 0:
        return None
    if kind == "thread":
        return ThreadPoolExecutor(
            workers, thread_name_prefix="fastgen-post", initializer=initializer, initargs=initargs
        )
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=initializer, initargs=initargs)
    # Start every worker now, so their imports overlap with model loading instead of the first batch.
    for _ in range(workers):
        pool.submit(_ready)
    return pool


def _ready() -> bool:
    return True


class AsyncPipeline:
    """Offload -> post-process -> ordered commit, behind the caller's generation loop.

    ``offload(device_output) -> payload`` runs in the offload thread (tensor work only; the
    payload must be picklable for a process pool), ``postprocess(payload) -> result`` in a worker,
    ``commit(key, result)`` in the writer thread in submission order. ``serial=True`` runs the
    three inline in ``submit`` (the synchronous path, for comparison and debugging).
    """

    def __init__(
        self,
        offload: Callable[[Any], Any],
        postprocess: Callable[[Any], Any],
        commit: Callable[[int, Any], None],
        executor: Executor | None = None,
        serial: bool = False,
        max_in_flight: int = 4,
    ) -> None:
        self._offload = offload
        self._postprocess = postprocess
        self._commit = commit
        self._executor = executor
        self._serial = serial
        self._failure: BaseException | None = None
        self._failed = threading.Event()
        self._last_key: int | None = None
        self._to_offload: queue.Queue = queue.Queue(max(1, max_in_flight))
        self._to_write: queue.Queue = queue.Queue(max(1, 2 * max_in_flight))
        self._threads: list[threading.Thread] = []
        self._closed = False
        if not serial:
            for target, name in ((self._offload_loop, "fastgen-offload"), (self._write_loop, "fastgen-writer")):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    # -- caller side ---------------------------------------------------------------------------
    def submit(self, key: int, device_output: Any) -> None:
        """Queue one finished batch; raises PipelineError if any stage has failed."""
        if self._last_key is not None and key <= self._last_key:
            raise ValueError(f"keys must increase: {key} after {self._last_key}")
        self._last_key = key
        self._raise_if_failed()
        if self._serial:
            self._commit(key, self._postprocess(self._offload(device_output)))
            return
        self._put(self._to_offload, (key, device_output))

    def close(self) -> None:
        """Wait until every submitted batch is committed; raise the first failure."""
        if self._closed:
            return
        self._closed = True
        if not self._serial:
            try:
                if not self._failed.is_set():
                    self._put(self._to_offload, _STOP)
            except PipelineError:
                pass
            for thread in self._threads:
                thread.join()
        self._shutdown_executor(cancel=self._failed.is_set())
        self._raise_if_failed()

    def abort(self) -> None:
        """Stop after an error in the caller: drop queued work, stop the workers."""
        self._fail(PipelineError("aborted by the caller"))
        self._closed = True
        for thread in self._threads:
            thread.join()
        self._shutdown_executor(cancel=True)

    def __enter__(self) -> AsyncPipeline:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- stages --------------------------------------------------------------------------------
    def _offload_loop(self) -> None:
        try:
            while (item := self._next(self._to_offload)) is not _STOP:
                key, device_output = item
                payload = self._offload(device_output)
                if self._executor is None:
                    future: Future = Future()
                    future.set_result(payload)
                    self._put(self._to_write, (key, future, True))
                else:
                    self._put(self._to_write, (key, self._executor.submit(self._postprocess, payload), False))
            if not self._failed.is_set():
                self._put(self._to_write, _STOP)
        except BaseException as exc:
            self._fail(exc)

    def _write_loop(self) -> None:
        try:
            while (item := self._next(self._to_write)) is not _STOP:
                key, future, inline = item
                result = future.result()
                self._commit(key, self._postprocess(result) if inline else result)
        except BaseException as exc:
            self._fail(exc)

    # -- plumbing ------------------------------------------------------------------------------
    def _next(self, source: queue.Queue) -> Any:
        """The next item, or _STOP once the pipeline has failed (stages then exit)."""
        while not self._failed.is_set():
            try:
                return source.get(timeout=0.05)
            except queue.Empty:
                continue
        return _STOP

    def _put(self, target: queue.Queue, item: Any) -> None:
        while True:
            self._raise_if_failed()
            try:
                target.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._failed.set()

    def _raise_if_failed(self) -> None:
        failure = self._failure
        if failure is None:
            return
        if isinstance(failure, PipelineError):
            raise failure
        what = "a post-processing worker died" if isinstance(failure, BrokenProcessPool) else "a pipeline stage failed"
        raise PipelineError(f"{what}: {type(failure).__name__}: {failure}") from failure

    def _shutdown_executor(self, cancel: bool) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=cancel)
            self._executor = None


class Progress:
    """A tqdm bar counting samples, with generated tokens per second beside it."""

    def __init__(self, total: int | None, enabled: bool = True, desc: str = "generate", initial: int = 0) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total, initial=initial, unit="sample", desc=desc, disable=not enabled, dynamic_ncols=True
        )
        self._start = time.perf_counter()
        self.samples = 0
        self.tokens = 0

    def update(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{self.tokens / elapsed:.1f} tok/s", refresh=False)
        self._bar.update(samples)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def close(self) -> None:
        self._bar.close()
