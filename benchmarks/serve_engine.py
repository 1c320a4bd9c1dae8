"""fastgen-serve's engine work under churn, without HTTP: inputs join and leave the running batch every few steps.

``serve_load`` measures the whole server; its figures mix the engine's work with the event loop's, the
arrivals' randomness in wall-clock time and the machine's other load. This drives the engine's loop
(:func:`~fastgen.continuous.scheduler.run_continuous` in its online form, the GEMM scopes held as the engine
holds them) on one thread, with arrivals counted in steps: before each step a Poisson number of new inputs
(mean ``--per-step``) joins the queue, from a seeded generator, so every run sees the same joins and
retirements at the same steps. Reported: CPU seconds of the thread per input (``time.thread_time``), steps,
rows per step, and a hash of every result's tokens (runs that differ in code must agree on it).

    OMP_NUM_THREADS=1 python -m benchmarks.serve_engine --rows 128 --per-step 1.2 --inputs 400 --rounds 3

``--source DIR`` imports fastgen from ``DIR`` instead (a checkout of another commit, for before/after pairs).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import random
import sys
import time
from typing import Any


def timed_parts() -> dict[str, float]:
    """Wrap the scheduler's membership changes (retirements, joins, newcomers cut from their encoder call) with
    timers; returns the dict of seconds they fill."""
    from fastgen.continuous import scheduler

    spent: dict[str, float] = {}

    def timed(name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.thread_time() - start

        return wrapper

    scheduler._retire = timed("retire", scheduler._retire)
    scheduler.SlotCache.add = timed("join", scheduler.SlotCache.add)
    scheduler._Encoded.take = timed("take", scheduler._Encoded.take)
    return spent


def churn(
    model: Any, inputs: list[list[int]], params: dict, rows: int, per_step: float, seed: int, parts: dict | None = None
) -> dict:
    """One run: ``inputs`` arrive ``Poisson(per_step)`` per step boundary; returns timings and a result hash."""
    import torch

    from fastgen.continuous.online import WAIT, Online
    from fastgen.continuous.scheduler import held_linear_scope, run_continuous
    from fastgen.continuous.settings import resolve

    settings, reason = resolve(model, dict(params))
    if settings is None:
        raise SystemExit(f"continuous batching does not serve this: {reason}")
    rng = random.Random(seed)
    arrived: collections.deque = collections.deque()
    left = collections.deque(torch.tensor(ids) for ids in inputs)

    def arrive() -> None:
        # Poisson(per_step) by counting exponential gaps within one unit of time
        t = rng.expovariate(per_step)
        while t < 1.0 and left:
            arrived.append(left.popleft())
            t += rng.expovariate(per_step)

    def source():
        while True:
            while arrived:
                yield arrived.popleft()
            yield WAIT

    stats: dict[str, int] = {}
    if parts is not None:
        parts.clear()
    results: dict[int, Any] = {}
    loop = run_continuous(model, source(), settings, rows, stats=stats, online=Online())
    start_cpu, start = time.thread_time(), time.perf_counter()
    with torch.no_grad(), held_linear_scope(model):
        arrive()
        for item in loop:
            if item is None:
                if len(results) == len(inputs):
                    break
                arrive()
                continue
            results[item.index] = item.sequences
    cpu, wall = time.thread_time() - start_cpu, time.perf_counter() - start
    loop.close()
    digest = hashlib.sha256()
    for index in sorted(results):
        digest.update(json.dumps(results[index].tolist()).encode())
    return {
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "cpu_ms_per_input": round(cpu * 1e3 / len(inputs), 2),
        "steps": stats["steps"],
        "rows_per_step": round(stats["rows"] / max(1, stats["steps"]), 1),
        "tokens_sha256": digest.hexdigest()[:16],
        **(
            {}
            if parts is None
            else {f"{name}_ms_per_input": round(v * 1e3 / len(inputs), 3) for name, v in parts.items()}
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bart-d256")
    parser.add_argument("--rows", type=int, default=128, help="decoder rows per step (fastgen-serve's --batch-rows)")
    parser.add_argument("--per-step", type=float, default=1.2, help="mean arrivals per step boundary")
    parser.add_argument("--inputs", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=200, help="inputs of the warm-up run (same arrivals)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--source", help="import fastgen from this directory")
    parser.add_argument("--label", default="")
    parser.add_argument("--parts", action="store_true", help="also time retirements, joins and takes (thread CPU)")
    args = parser.parse_args(argv)
    if args.source:
        sys.path.insert(0, args.source)
    import torch

    import fastgen
    from benchmarks.serve_load import MODELS, build, load_average, workload

    torch.set_num_threads(1)
    model, params = build(args.model), MODELS[args.model]["params"]
    parts = timed_parts() if args.parts else None
    inputs = workload(args.model, args.inputs, seed=3)
    churn(model, workload(args.model, args.warmup, seed=4), params, args.rows, args.per_step, seed=5, parts=parts)
    runs = []
    for _ in range(args.rounds):
        runs.append(churn(model, inputs, params, args.rows, args.per_step, seed=6, parts=parts))
    cpu = sorted(run["cpu_ms_per_input"] for run in runs)
    print(
        json.dumps(
            {
                "label": args.label,
                "fastgen": fastgen.__file__,
                "rows": args.rows,
                "per_step": args.per_step,
                "median_cpu_ms_per_input": cpu[len(cpu) // 2],
                "runs": runs,
                "load_average": load_average(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
