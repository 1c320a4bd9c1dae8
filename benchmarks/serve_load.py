"""Load test: fastgen-serve against a micro-batching server, Poisson arrivals from an async httpx driver.

Both servers run in their own process on 127.0.0.1 with 1 torch thread, serving the same random-weight
model (built from a config and a seed: no download). The baseline is the usual hand-written server: it
collects the requests that arrive within a short wait window (up to ``--max-batch`` inputs), runs upstream
``generate`` (under ``fastgen.unpatched()``) on the padded batch, answers, and only then collects the next
batch. fastgen-serve batches continuously (``fastgen.serve``). Every request asks for the same work
(``min_new_tokens == max_new_tokens``, so no request ends early on an EOS of the random model).

For each model and each arrival rate, the driver sends ``rate x --seconds`` requests (at least 20, at most
``--max-requests``) at exponential gaps (seeded: both servers get the same inputs at the same offsets),
alternating the two servers rate by rate, and records throughput, latency percentiles and the server
process's CPU time per answered request (steadier than throughput on a shared machine: it counts the work,
not the wait for a core). A server's sustainable rate is the highest rate at which its p95 latency stays
<= 2 s with no failure, below the first rate where it does not: a rate past a server's capacity can pass that
test when its window is short (the queue has not grown enough yet; at 38 req/s the 480-request cap gives 12.6
s), hence windows of up to 480 requests, and a rate held after a miss does not count.

    python -m benchmarks.serve_load --out benchmarks/results/serve_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: the models (random weights): a small BART (beam 4) and a small gpt2 (greedy)
MODELS: dict[str, dict[str, Any]] = {
    "bart-d256": dict(
        config=dict(
            vocab_size=16384,
            d_model=256,
            encoder_layers=3,
            decoder_layers=3,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=1024,
            decoder_ffn_dim=1024,
            max_position_embeddings=512,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=2,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        ),
        params={"num_beams": 4, "max_new_tokens": 24, "min_new_tokens": 24},
    ),
    "gpt2-d256": dict(
        config=dict(
            vocab_size=16384,
            n_embd=256,
            n_layer=4,
            n_head=4,
            n_positions=512,
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=1,
        ),
        params={"max_new_tokens": 32, "min_new_tokens": 32},
    ),
}
P95_TARGET_S = 2.0
#: requests per second of the warm-up (``--warmup`` requests, the same for both servers)
WARMUP_RATE = 32.0


def build(name: str) -> Any:
    import torch
    import transformers

    spec = MODELS[name]
    torch.manual_seed(0)
    if name.startswith("bart"):
        model = transformers.BartForConditionalGeneration(transformers.BartConfig(**spec["config"]))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**spec["config"]))
    model.generation_config.pad_token_id = 1
    return model.eval()


def padded(model: Any, inputs: list[list[int]]) -> tuple[Any, Any]:
    """``input_ids`` and ``attention_mask`` of a static batch as ``generate`` takes it (decoder-only: left-padded)."""
    import torch

    width, left = max(len(tokens) for tokens in inputs), not model.config.is_encoder_decoder
    ids = torch.full((len(inputs), width), model.generation_config.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(inputs):
        span = slice(width - len(tokens), width) if left else slice(0, len(tokens))
        ids[row, span], mask[row, span] = torch.tensor(tokens), 1
    return ids, mask


# -- the baseline server --------------------------------------------------------------------------------
def baseline_app(model: Any, max_batch: int, wait_s: float) -> Any:
    """Static micro-batching: the requests of one wait window, one upstream ``generate`` on their padded batch."""
    import torch
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    import fastgen

    pending: asyncio.Queue = asyncio.Queue()
    left = not model.config.is_encoder_decoder  # decoder-only models are padded on the left for generate

    def run(batch: list[tuple[list[int], dict]]) -> list[list[int]]:
        ids, mask = padded(model, [tokens for tokens, _ in batch])
        width = ids.shape[1]
        with fastgen.unpatched(), torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **batch[0][1])
        rows = out.tolist()
        # fastgen-serve's layout: a decoder-only row is the prompt and its continuation, without the padding
        return [row[width - len(tokens) :] if left else row for row, (tokens, _) in zip(rows, batch, strict=True)]

    async def batcher() -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await pending.get()
            batch, deadline = [first], loop.time() + wait_s
            while len(batch) < max_batch:
                try:
                    batch.append(await asyncio.wait_for(pending.get(), max(0.0, deadline - loop.time())))
                except TimeoutError:
                    break
            groups: dict[str, list] = {}
            for item in batch:  # one generate per distinct settings
                groups.setdefault(json.dumps(item[1], sort_keys=True), []).append(item)
            for items in groups.values():
                try:
                    rows = await loop.run_in_executor(None, run, [(ids, params) for ids, params, _ in items])
                    for (_, _, future), row in zip(items, rows, strict=True):
                        future.set_result(row)
                except Exception as exc:
                    for _, _, future in items:
                        future.set_exception(exc)

    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        future = asyncio.get_running_loop().create_future()
        await pending.put((body["input_ids"], body.get("parameters", {}), future))
        row = await future
        return JSONResponse({"results": [{"sequences": [{"token_ids": row}]}]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(batcher())
        yield
        task.cancel()

    routes = [Route("/v1/generate", generate, methods=["POST"]), Route("/health", health)]
    return Starlette(routes=routes, lifespan=lifespan)


def serve(kind: str, name: str, port: int, max_batch: int, wait_s: float, rows: int | None = None) -> None:
    """Server process: ``kind`` fastgen or baseline; ``rows``: fastgen-serve's decoder rows per step (default: the
    baseline's largest batch, ``max_batch`` inputs x beams)."""
    import torch
    import uvicorn

    torch.set_num_threads(1)
    model = build(name)
    if kind == "fastgen":
        from fastgen.serve import create_app

        rows = rows or max_batch * MODELS[name]["params"].get("num_beams", 1)
        app = create_app(model, name=name, batch_rows=rows, max_queue=4096, max_new_tokens=512)
    else:
        app = baseline_app(model, max_batch, wait_s)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# -- capacity: each server's model work alone ------------------------------------------------------------
def capacity(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Inputs per second of each server's model work alone, in this process, the three alternating round by
    round (no HTTP, no arrivals: every input waiting from the start): upstream ``generate`` on padded batches of
    ``--max-batch`` inputs (the baseline's work at saturation), fastgen's ``generate`` on the same batches, and
    ``generate_many`` at fastgen-serve's rows per step (its engine's work). The ceiling of each server's
    sustainable rate, steadier than through the servers on a shared machine."""
    import torch

    import fastgen
    from fastgen.continuous.api import generate_many

    torch.set_num_threads(1)
    model, params = build(name), MODELS[name]["params"]
    inputs = workload(name, args.capacity_inputs, seed=7)
    batches = [padded(model, inputs[i : i + args.max_batch]) for i in range(0, len(inputs), args.max_batch)]
    rows = args.rows_per_step or args.max_batch * params.get("num_beams", 1)

    def static(patched: bool) -> None:
        with contextlib.nullcontext() if patched else fastgen.unpatched(), torch.no_grad():
            for ids, mask in batches:
                model.generate(input_ids=ids, attention_mask=mask, **params)

    def continuous() -> None:
        with torch.no_grad():
            for _ in generate_many(model, [torch.tensor(tokens) for tokens in inputs], batch_rows=rows, **params):
                pass

    runs = {"upstream_static": lambda: static(False), "fastgen_static": lambda: static(True)}
    runs["fastgen_continuous"] = continuous
    rates: dict[str, list[float]] = {kind: [] for kind in runs}
    for run in runs.values():  # warm-up: calibrations, kernels
        run()
    for round_ in range(args.capacity_rounds):
        for kind in runs if round_ % 2 == 0 else reversed(runs):
            start = time.perf_counter()
            runs[kind]()
            rates[kind].append(round(len(inputs) / (time.perf_counter() - start), 2))
        print(f"{name} capacity round {round_}: {json.dumps(rates)}", flush=True)
    median = {kind: sorted(values)[len(values) // 2] for kind, values in rates.items()}
    base = median["upstream_static"]
    return {
        "inputs": len(inputs),
        "rows_per_step": rows,
        "inputs_per_s": rates,
        "median_inputs_per_s": median,
        "ratio_to_upstream": {kind: round(value / base, 3) for kind, value in median.items()},
        "load_average": load_average(),
    }


# -- the driver -----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, kind: str, name: str, args: argparse.Namespace) -> None:
        self.kind, self.port = kind, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "benchmarks.serve_load",
            "--serve",
            kind,
            "--model",
            name,
            "--port",
            str(self.port),
            "--max-batch",
            str(args.max_batch),
            "--wait-ms",
            str(args.wait_ms),
            "--rows-per-step",
            str(args.rows_per_step or 0),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.process = subprocess.Popen(command, env=env)

    def wait_ready(self, timeout: float = 120) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"{self.kind} server exited"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"{self.kind} server did not start")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.process.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def cpu_seconds(self) -> float:
        """CPU time of the server process so far (user + system, every thread)."""
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/task"))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def workload(name: str, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = MODELS[name]["config"]["vocab_size"]
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 49))] for _ in range(count)]


async def drive(url: str, inputs: list[list[int]], params: dict, rate: float, seed: int) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` per second; latency of each request (send to answer)."""
    import httpx

    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in inputs:
        offsets.append(t)
        t += rng.expovariate(rate)
    latencies: list[float | None] = [None] * len(inputs)
    outputs: list[Any] = [None] * len(inputs)
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        start = time.perf_counter()

        async def one(index: int) -> None:
            await asyncio.sleep(max(0.0, start + offsets[index] - time.perf_counter()))
            sent = time.perf_counter()
            try:
                response = await client.post("/v1/generate", json={"input_ids": inputs[index], "parameters": params})
                if response.status_code == 200:
                    latencies[index] = time.perf_counter() - sent
                    outputs[index] = response.json()["results"][0]["sequences"][0]["token_ids"]
            except httpx.HTTPError:
                pass

        await asyncio.gather(*[one(i) for i in range(len(inputs))])
        elapsed = time.perf_counter() - start
    done = sorted(v for v in latencies if v is not None)

    def pct(q: float) -> float | None:
        return None if not done else round(done[min(len(done) - 1, int(q * len(done)))], 4)

    return {
        "rate": rate,
        "requests": len(inputs),
        "failed": len(inputs) - len(done),
        "throughput_rps": round(len(done) / elapsed, 3),
        "p50_s": pct(0.50),
        "p95_s": pct(0.95),
        "p99_s": pct(0.99),
        "outputs": outputs,
    }


async def drive_streamed(url: str, inputs: list[list[int]], max_tokens: int, rate: float, seed: int) -> dict[str, Any]:
    """Poisson arrivals of streamed greedy ``/v1/completions`` requests: the time to the first token's event
    (send to the first ``data:`` line) and to the end of the stream, with the server's own counters over the run
    (``/metrics``): its mean queue wait (received to joined) and first step, and its mean decoder step."""
    import httpx

    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in inputs:
        offsets.append(t)
        t += rng.expovariate(rate)
    first: list[float | None] = [None] * len(inputs)
    whole: list[float | None] = [None] * len(inputs)
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        before = _metric_sums((await client.get("/metrics")).text)
        start = time.perf_counter()

        async def one(index: int) -> None:
            await asyncio.sleep(max(0.0, start + offsets[index] - time.perf_counter()))
            sent = time.perf_counter()
            body = {"prompt": inputs[index], "max_tokens": max_tokens, "temperature": 0, "stream": True}
            try:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        return
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and first[index] is None:
                            first[index] = time.perf_counter() - sent
                    whole[index] = time.perf_counter() - sent
            except httpx.HTTPError:
                pass

        await asyncio.gather(*[one(i) for i in range(len(inputs))])
        elapsed = time.perf_counter() - start
        after = _metric_sums((await client.get("/metrics")).text)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}

    def pct(values: list[float | None], q: float) -> float | None:
        done = sorted(v for v in values if v is not None)
        return None if not done else round(done[min(len(done) - 1, int(q * len(done)))], 4)

    def mean(total: str, count: str) -> float | None:
        return round(delta[total] / delta[count], 4) if delta.get(count) else None

    return {
        "rate": rate,
        "requests": len(inputs),
        "failed": sum(v is None for v in whole),
        "throughput_rps": round(sum(v is not None for v in whole) / elapsed, 3),
        "first_token_p50_s": pct(first, 0.50),
        "first_token_p95_s": pct(first, 0.95),
        "first_token_p99_s": pct(first, 0.99),
        "latency_p50_s": pct(whole, 0.50),
        "latency_p95_s": pct(whole, 0.95),
        "server_queue_wait_mean_s": mean("fastgen_queue_wait_seconds_sum", "fastgen_queue_wait_seconds_count"),
        "server_first_token_mean_s": mean(
            "fastgen_time_to_first_token_seconds_sum", "fastgen_time_to_first_token_seconds_count"
        ),
        "server_step_mean_s": mean("fastgen_busy_seconds_total", "fastgen_steps_total"),
    }


def _metric_sums(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text page (name -> value)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    return values


def sustainable(rows: list[dict]) -> float | None:
    """The highest rate held below the first rate missed (rates in increasing order): a rate past a server's
    capacity can pass when the request cap shortens its window, so a rate held after a miss does not count."""
    held = None
    for row in sorted(rows, key=lambda row: row["rate"]):
        if row["failed"] or (row["p95_s"] or 1e9) > P95_TARGET_S:
            break
        held = row["rate"]
    return held


def load_average() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(v) for v in f.read().split()[:3]]


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    params = MODELS[name]["params"]
    rates = [float(r) for r in (args.bart_rates if name.startswith("bart") else args.gpt2_rates).split(",")]
    servers = {kind: Server(kind, name, args) for kind in ("baseline", "fastgen")}
    try:
        for server in servers.values():
            server.wait_ready()
        # warm-up: fastgen's exact linears settle their form per row count on first sight, and a server is a
        # long-lived process; both servers get the same requests
        warm = workload(name, args.warmup, seed=99)
        for server in servers.values():
            asyncio.run(drive(server.url, warm, params, rate=WARMUP_RATE, seed=1))
        rows: dict[str, list[dict]] = {kind: [] for kind in servers}
        memory: dict[str, list] = {kind: [] for kind in servers}
        saturated = set()
        for number, rate in enumerate(rates):
            count = max(20, min(args.max_requests, int(rate * args.seconds)))
            inputs = workload(name, count, seed=number)
            outputs = {}
            for kind, server in servers.items():
                if kind in saturated:
                    continue
                before, cpu = load_average(), server.cpu_seconds()
                row = asyncio.run(drive(server.url, inputs, params, rate, seed=number))
                outputs[kind] = row.pop("outputs")
                answered = row["requests"] - row["failed"]
                row["server_cpu_ms_per_request"] = round((server.cpu_seconds() - cpu) * 1e3 / max(1, answered), 1)
                row["load_average"] = {"before": before, "after": load_average()}
                rows[kind].append(row)
                memory[kind].append({"rate": rate, "rss_mb": round(server.rss_mb(), 1), "threads": server.threads()})
                print(f"{name} {kind:8s} rate {rate:6.2f}/s: {json.dumps(row)}", flush=True)
                if row["p95_s"] is None or row["p95_s"] > 4 * P95_TARGET_S:
                    saturated.add(kind)  # far past its limit: higher rates only queue more
            if len(outputs) == 2:
                same = sum(a == b for a, b in zip(outputs["baseline"], outputs["fastgen"], strict=True) if a and b)
                both = sum(1 for a, b in zip(outputs["baseline"], outputs["fastgen"], strict=True) if a and b)
                rows["fastgen"][-1]["same_tokens_as_baseline"] = f"{same}/{both}"
        streamed = []
        if not name.startswith("bart") and args.ttft_rates:  # greedy streams; beam search answers at the end
            for number, rate in enumerate(float(r) for r in args.ttft_rates.split(",")):
                count = max(20, min(args.max_requests, int(rate * args.seconds)))
                inputs = workload(name, count, seed=1000 + number)
                url, new_tokens = servers["fastgen"].url, params["max_new_tokens"]
                row = asyncio.run(drive_streamed(url, inputs, new_tokens, rate, seed=number))
                streamed.append(row)
                print(f"{name} fastgen streamed rate {rate:6.2f}/s: {json.dumps(row)}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    base, fast = sustainable(rows["baseline"]), sustainable(rows["fastgen"])
    return {
        "params": params,
        "config": MODELS[name]["config"],
        "rates": rates,
        "baseline": rows["baseline"],
        "fastgen": rows["fastgen"],
        "memory": memory,
        "streamed_first_token": streamed,
        "sustainable_rate": {"baseline": base, "fastgen": fast, "ratio": None if not base or not fast else fast / base},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", choices=["fastgen", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="bart-d256", choices=sorted(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--models", default="bart-d256,gpt2-d256")
    parser.add_argument("--bart-rates", default="1,2,4,6,8,12")
    parser.add_argument("--gpt2-rates", default="2,4,8,12,16,24")
    parser.add_argument("--seconds", type=float, default=20.0, help="arrival window per rate")
    parser.add_argument("--max-requests", type=int, default=480)
    parser.add_argument("--warmup", type=int, default=96, help="warm-up requests per server")
    parser.add_argument("--max-batch", type=int, default=16, help="inputs per batch (both servers)")
    parser.add_argument("--wait-ms", type=float, default=10.0, help="the baseline's batching window")
    parser.add_argument(
        "--rows-per-step",
        type=int,
        default=0,
        help="fastgen-serve's decoder rows per step (its --batch-rows; 0: --max-batch inputs x beams); also the "
        "rows of generate_many in --capacity-rounds",
    )
    parser.add_argument(
        "--ttft-rates", default="", help="gpt2: rates of streamed completions sent to fastgen-serve (first token)"
    )
    parser.add_argument("--capacity-rounds", type=int, default=0, help="capacity rounds per model (0: none)")
    parser.add_argument("--capacity-inputs", type=int, default=64)
    parser.add_argument("--no-load", action="store_true", help="capacity only: no servers, no arrivals")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.model, args.port, args.max_batch, args.wait_ms / 1000, args.rows_per_step or None)
        return
    from benchmarks.measure import environment, result_header

    result = result_header("serve_load", argv)
    result["environment"] = environment("cpu")
    result["threads"] = 1
    result["load_average_start"] = load_average()
    result["settings"] = {
        "max_batch": args.max_batch,
        "wait_ms": args.wait_ms,
        "fastgen_rows_per_step": args.rows_per_step or None,
        "seconds": args.seconds,
        "max_requests": args.max_requests,
        "warmup_requests": args.warmup,
        "p95_target_s": P95_TARGET_S,
    }
    names = args.models.split(",")
    if args.capacity_rounds:
        result["capacity"] = {name: capacity(name, args) for name in names}
    if not args.no_load:
        result["models"] = {name: run_model(name, args) for name in names}
    result["load_average_end"] = load_average()
    result["driver_max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, data in result.get("capacity", {}).items():
        print(name, "capacity", json.dumps(data["ratio_to_upstream"]))
    for name, data in result.get("models", {}).items():
        print(name, json.dumps(data["sustainable_rate"]))


if __name__ == "__main__":
    main()
