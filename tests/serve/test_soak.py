"""Soak: no growth of memory or threads over 10,000 requests.

The app runs in-process (httpx's ASGI transport, the lifespan started as uvicorn starts it), so the test
measures fastgen-serve's own code (routes, engine thread, scheduler loops) rather than a server in front of
it. A tiny GPT-2 serves a rotating mix of small requests, 32 in flight at a time: greedy, beam search and
seeded sampling on ``/v1/generate``, and streamed greedy ``/v1/completions`` (each setting a batch group of
its own).

After the first tenth of the requests (the warm-up: allocator pools, caches, every group and code path
run once) and after the last, with the engine idle and after a full garbage collection, the test takes
the process's threads, its resident memory and the Python heap's allocated blocks
(``sys.getallocatedblocks``: every live Python object, tracked by the collector or not). Between those two
points:

- threads: none more in Python (a thread per request or per group that never ends would show at once), and at
  most one more native thread: a thread's first parallel operation with more than one thread starts its OpenMP
  team once, later than the warm-up if its first large operation comes late (seen twice in CI runs of the whole
  suite, 23 -> 24 threads, Python threads unchanged; never when this test runs alone). A leak of native threads
  per request or per group would add many;
- Python blocks: fewer than 1,000 more. What is still referenced when the count is taken (the last
  requests' tasks, a kernel choice cached for a new batch shape) moves it by a few hundred either way;
  an object kept per request adds at least one block per request (1,800 in the CI size, 9,000 in the full
  size), and a kept job or response adds dozens;
- resident memory: less than 4 MiB plus 512 bytes per request more. Allocator pools and caches still
  settle after the warm-up (about 2 MiB, then flat); a tensor or response body kept per request holds
  more than 512 bytes.

Every request must be answered 200 with its result (the right number of tokens). The full 10,000 take
30–45 s on one core and are marked slow; 2,000 requests (about 8 s) run in CI.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import sys
import threading
import time

import httpx
import pytest

from fastgen.serve import create_app
from tests import harness
from tests.serve.conftest import word_tokenizer

NEW_TOKENS = 2
IN_FLIGHT = 32
PROMPTS = [[3 + (n * 7 + k) % (harness.VOCAB - 3) for k in range(2 + n % 5)] for n in range(64)]
SETTINGS = [
    {"max_new_tokens": NEW_TOKENS},
    {"max_new_tokens": NEW_TOKENS, "num_beams": 2},
    {"max_new_tokens": NEW_TOKENS, "do_sample": True, "top_k": 20, "seed": 5},
]


def _thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return names


def proc_status(field: str) -> int:
    """A number from /proc/self/status (``Threads``; ``VmRSS`` in KiB)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


async def one(client: httpx.AsyncClient, number: int) -> None:
    """Request ``number`` of the mix; asserts it was answered with its result."""
    prompt = PROMPTS[number % len(PROMPTS)]
    kind = number % (len(SETTINGS) + 1)
    if kind == len(SETTINGS):
        body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS, "temperature": 0, "stream": True}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
        assert sum(len(chunk.get("token_ids") or []) for chunk in chunks) == NEW_TOKENS, chunks
        assert chunks[-1]["finish_reason"] == "length"
        return
    params = {**SETTINGS[kind], "min_new_tokens": NEW_TOKENS}
    response = await client.post("/v1/generate", json={"input_ids": prompt, "parameters": params})
    assert response.status_code == 200, response.text
    (sequence,) = response.json()["results"][0]["sequences"]
    assert sequence["token_ids"][: len(prompt)] == prompt
    assert len(sequence["token_ids"]) == len(prompt) + NEW_TOKENS


async def send(client: httpx.AsyncClient, numbers: range) -> None:
    """The requests ``numbers``, ``IN_FLIGHT`` at a time (workers: the driver holds no queue of its own)."""
    todo = iter(numbers)

    async def worker() -> None:
        for number in todo:
            await one(client, number)

    await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))


async def measure(engine) -> dict[str, int]:
    """Threads, Python blocks and resident memory once all is idle: the engine's groups dropped, the
    transport's tasks ended."""
    deadline = time.monotonic() + 10
    while engine._groups or engine.queue_depth or len(asyncio.all_tasks()) > 1:
        assert time.monotonic() < deadline, "the engine did not go idle"
        await asyncio.sleep(0.01)
    gc.collect()
    return {
        "threads": proc_status("Threads"),
        "thread_names": sorted(_thread_names()),  # which native threads, for a failure's message
        "python_threads": threading.active_count(),
        "blocks": sys.getallocatedblocks(),
        "rss_kib": proc_status("VmRSS"),
    }


async def soak(count: int) -> tuple[dict[str, int], dict[str, int], object]:
    app = create_app(harness.tiny_hf_model("gpt2"), word_tokenizer(False), name="tiny", batch_rows=32)
    engine = app.state.served.engine
    warm_up = count // 10
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://soak", timeout=60) as client,
    ):
        await send(client, range(warm_up))
        warm = await measure(engine)
        await send(client, range(warm_up, count))
        end = await measure(engine)
    return warm, end, engine.stats


@pytest.mark.parametrize("count", [2_000, pytest.param(10_000, marks=pytest.mark.slow)])
def test_no_growth_of_memory_or_threads(count: int) -> None:
    if sys.platform != "linux":
        pytest.skip("reads /proc/self/status")
    warm, end, stats = asyncio.run(soak(count))
    after_warm_up = count - count // 10
    print(f"\n{count} requests: after warm-up {warm}, at the end {end}")
    assert stats.finished == count  # one input per request
    assert stats.failed == stats.cancelled == 0
    assert end["threads"] <= warm["threads"] + 1, (warm["thread_names"], end["thread_names"])
    assert end["python_threads"] <= warm["python_threads"]
    assert end["blocks"] - warm["blocks"] < 1_000
    assert end["rss_kib"] - warm["rss_kib"] < 4 * 1024 + after_warm_up / 2
