"""Where the host's time goes in one warm ``generate`` call: cProfile over fastgen's call (or upstream's).

    python -m benchmarks.host_profile --scenario gpt2 --device cuda --dtype fp16 [--upstream]

A step bound by the host (the GPU idle between launches) is explained by the Python functions that run
each step, not by the kernels (``benchmarks.step_profile`` groups those). The call is warmed at its shape
first; the profiled call's top functions by cumulative and by own time are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path
from typing import Any

import torch

import fastgen
from benchmarks.measure import environment, result_header, synchronize, write_result
from benchmarks.run import DTYPES, RESULTS
from benchmarks.scenarios import SCENARIOS


def _top(stats: pstats.Stats, key: str, count: int) -> list[dict[str, Any]]:
    stats.sort_stats(key)
    rows = []
    for function in stats.fcn_list[:count]:  # type: ignore[attr-defined]
        calls, _, own, cumulative, _ = stats.stats[function]  # type: ignore[attr-defined]
        filename, line, name = function
        where = f"{Path(filename).name}:{line}({name})"
        rows.append({"function": where, "calls": calls, "own_s": own, "cumulative_s": cumulative})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="gpt2")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--input-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--upstream", action="store_true", help="profile upstream's call instead of fastgen's")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    scenario = SCENARIOS[args.scenario]
    overrides = {"batch": args.batch, "input_len": args.input_len, "new_tokens": args.new_tokens}
    settings = scenario.settings(args.device) | {k: v for k, v in overrides.items() if v is not None}
    call = scenario.prepare(args.device, DTYPES[args.dtype], settings)
    scope = fastgen.unpatched if args.upstream else fastgen.patched
    with scope(), torch.inference_mode():
        call()  # warm at the shape
        synchronize(args.device)
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        call()
        synchronize(args.device)
        profiler.disable()
        wall = time.perf_counter() - started
    stats = pstats.Stats(profiler)
    variant = "upstream" if args.upstream else "fastgen"
    result = result_header("host_profile", argv) | {"environment": environment(args.device)}
    result |= {"scenario": args.scenario, "dtype": args.dtype, "settings": settings, "variant": variant}
    result |= {"profiled_wall_s": wall, "by_cumulative": _top(stats, "cumulative", args.top)}
    result["by_own_time"] = _top(stats, "tottime", args.top)
    print(f"{variant}: profiled call {wall:.3f} s ({settings['new_tokens']} new tokens)")
    for title in ("by_cumulative", "by_own_time"):
        print(title)
        for row in result[title]:
            print(f"  {row['cumulative_s']:8.3f} {row['own_s']:8.3f} {row['calls']:7d}  {row['function']}")
    write_result(args.out / f"host_profile-{args.scenario}-{args.device}-{args.dtype}-{variant}.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
