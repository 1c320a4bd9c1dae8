"""Never lose a request silently: a full queue is 429 with Retry-After, a client that disconnects frees its
rows, an input that raises fails alone (the others are served, equal to ``generate``), SIGTERM drains."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from tests.serve.conftest import bart, free_port, gpt2, serving, word_tokenizer
from tests.serve.test_server import oracle

#: token ids that make the tiny model's encoder raise (test_failing_input_fails_alone)
POISON = [90, 91, 92, 93]


def slow_steps(model, seconds: float):
    """Every forward through the LM head sleeps ``seconds`` (the tiny models are too fast to catch mid-run)."""
    return model.get_output_embeddings().register_forward_hook(lambda *_: time.sleep(seconds))


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_full_queue_is_429_with_retry_after():
    model = bart()
    slow_steps(model, 0.02)
    with serving(model, batch_rows=4, max_queue=3) as running:

        async def burst():
            async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
                body = {"input_ids": [5, 6, 7], "parameters": {"max_new_tokens": 20}}
                return await asyncio.gather(*[client.post("/v1/generate", json=body) for _ in range(16)])

        responses = asyncio.run(burst())
    codes = sorted(response.status_code for response in responses)
    assert set(codes) == {200, 429}, codes
    refused = [response for response in responses if response.status_code == 429]
    assert all(int(response.headers["Retry-After"]) >= 1 for response in refused)
    assert "queue is full" in refused[0].json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_cancels_and_frees_rows(stream):
    model = gpt2()
    slow_steps(model, 0.01)
    with serving(model, word_tokenizer(False), batch_rows=8) as running:
        engine = running.engine
        body = {"prompt": [5, 6, 7], "max_tokens": 100, "stream": stream}
        with httpx.Client(base_url=running.url, timeout=httpx.Timeout(60, read=0.2 if not stream else 60)) as client:
            if stream:
                with client.stream("POST", "/v1/completions", json=body) as response:
                    lines = response.iter_lines()
                    assert next(line for line in lines if line).startswith("data: ")  # a token came: mid-stream
            else:
                with pytest.raises(httpx.ReadTimeout):
                    client.post("/v1/completions", json=body)
        wait_until(lambda: engine.stats.cancelled == 1 and engine.rows_in_flight == 0)
        assert engine.stats.finished == 0
        # the server goes on serving
        with httpx.Client(base_url=running.url, timeout=60) as client:
            assert client.post("/v1/completions", json={"prompt": [5], "max_tokens": 3}).status_code == 200


def test_failing_input_fails_alone():
    model = bart()

    def poison(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] >= 4 and bool((ids[:, :4] == torch.tensor(POISON)).all(1).any()):
            raise RuntimeError("poisoned input")

    model.get_encoder().register_forward_pre_hook(poison, with_kwargs=True)
    params = {"num_beams": 2, "max_new_tokens": 8}
    inputs = [[5, 6, 7, 8], [*POISON, 9], [11, 12], [13, 14, 15], [16]]
    with serving(model, batch_rows=16) as running:

        async def together():
            async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
                calls = [client.post("/v1/generate", json={"input_ids": ids, "parameters": params}) for ids in inputs]
                return await asyncio.gather(*calls)

        responses = asyncio.run(together())
        assert running.engine.alive
    for ids, response in zip(inputs, responses, strict=True):
        if ids[:4] == POISON:
            assert response.status_code == 500 and "poisoned input" in response.json()["error"]["message"]
        else:
            assert response.status_code == 200, response.text
            expected, _ = oracle(model, ids, params, None)
            assert response.json()["results"][0]["sequences"][0]["token_ids"] == expected[0]


def test_sigterm_drains_requests_in_flight(tmp_path):
    model = bart()
    model.save_pretrained(tmp_path)
    word_tokenizer(True).save_pretrained(tmp_path)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "fastgen.serve",
        str(tmp_path),
        "--port",
        str(port),
        "--threads",
        "1",
        "--log-level",
        "warning",
        "--batch-rows",
        "16",
    ]
    server = subprocess.Popen(command, env=env, cwd=os.getcwd(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # imports alone take 15 s on a loaded 2-core machine
        while True:
            assert server.poll() is None, server.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)

        async def load_then_term():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                body = {"input_ids": [5, 6, 7, 8], "parameters": {"num_beams": 4, "max_new_tokens": 60}}
                calls = [asyncio.ensure_future(client.post("/v1/generate", json=body)) for _ in range(8)]
                while True:  # every request admitted (none waits in the queue), then SIGTERM
                    metrics = (await client.get("/metrics")).text
                    if "fastgen_queue_depth 0.0" in metrics and "fastgen_rows_in_flight 0.0" not in metrics:
                        break
                    await asyncio.sleep(0.01)
                server.send_signal(signal.SIGTERM)
                return await asyncio.gather(*calls)

        responses = asyncio.run(load_then_term())
        started = time.monotonic()
        # uvicorn answers the requests in flight, stops, then re-raises the signal (exit status -SIGTERM)
        assert server.wait(120) in (0, -signal.SIGTERM)
        drain = time.monotonic() - started
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert [response.status_code for response in responses] == [200] * 8, drain
    rows = [response.json()["results"][0]["sequences"][0]["token_ids"] for response in responses]
    assert rows == [rows[0]] * 8 and len(rows[0]) > 1
