"""What int8's asymmetric activation grid costs: bart-base-shaped int8 ``generate``, symmetric vs asymmetric.

    OMP_NUM_THREADS=1 python -m benchmarks.int8_grid_cost [--threads 1] [--rounds 4] [--out FILE.json]

The bart-base scenario of ``benchmarks.scenarios`` (random weights, batch 4, 256 input tokens, beam 4,
32 new tokens forced: equal work) with fastgen's default features + ``int8``, the two activation grids of
:mod:`fastgen.ops.int8_linear` alternating in one process (``int8_linear.GRID`` switched between calls;
:func:`benchmarks.measure.alternate`: a warm-up call each, then rounds in rotating order). Median wall
seconds, the ratio, and the load average before and after are recorded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import fastgen
from benchmarks.measure import alternate, environment, result_header, write_result
from benchmarks.scenarios import SCENARIOS
from fastgen.ops import cpu_kernels, int8_linear

GRIDS = ("symmetric", "asymmetric")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    scenario = SCENARIOS["bart-base"]
    settings = scenario.settings("cpu")
    model, inputs, kwargs = scenario.build("cpu", torch.float32, settings)
    features = [*sorted(set(fastgen.known_features()) - fastgen.optimizer.registry.OPT_IN_FEATURES), "int8"]

    def run(grid: str) -> tuple[Any, float]:
        int8_linear.GRID = grid
        start = time.perf_counter()
        with fastgen.patched(features), torch.inference_mode():
            out = model.generate(**inputs, **kwargs).sequences
        return out, time.perf_counter() - start

    rounds = alternate(run, list(GRIDS), args.rounds)
    int8_linear.GRID = "asymmetric"
    medians = {grid: statistics.median(rounds.column(grid)) for grid in GRIDS}
    env = environment("cpu")
    report = {
        **result_header("int8_grid_cost", argv),
        "scenario": "bart-base",
        "settings": settings,
        "threads": args.threads,
        "cpu_kernels": cpu_kernels.available(),
        "int8_backend": int8_linear.backend(),
        "wall_seconds": {grid: rounds.column(grid) for grid in GRIDS},
        "median_wall_seconds": medians,
        "asymmetric_over_symmetric": medians["asymmetric"] / medians["symmetric"],
        "same_tokens": bool(torch.equal(rounds.outputs["symmetric"], rounds.outputs["asymmetric"])),
        "load_average": rounds.load_average,
        "environment": env,
    }
    sys.stdout.write(f"{medians} ratio {report['asymmetric_over_symmetric']:.3f} load {rounds.load_average}\n")
    out = args.out or Path(__file__).resolve().parent / "results" / f"int8_grid_cost-{env['cpu_kind']}-1t.json"
    write_result(out, report)
    return report


if __name__ == "__main__":
    main()
