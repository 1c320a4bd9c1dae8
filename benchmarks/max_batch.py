"""The largest batch that fits a memory budget, upstream vs fastgen, and samples/s at each (GPU).

    python -m benchmarks.max_batch --scenario bart-large --budget-gib 40 --dtype fp16

FastSeq's headline gains come partly from memory: with the cross-attention K/V (and encoder states)
kept once per input instead of once per beam, the same memory holds more inputs, and a larger batch
uses the GPU better. This benchmark measures exactly that, at the scenario's CUDA shape (bart-large:
CNN/DM-like 1024 input tokens, 140 new tokens, beam 4, no-repeat 3; length forced so every call does
the same work):

1. the budget is enforced by the CUDA caching allocator (``torch.cuda.set_per_process_memory_fraction``):
   an allocation past it raises ``OutOfMemoryError``, which this script catches;
2. for each variant, the largest batch whose ``generate`` call succeeds: doubling from ``--start``,
   then bisection down to ``--granularity`` (:func:`largest_fitting`);
3. samples/s, alternating in one process: upstream and fastgen at upstream's largest batch (same
   work: the speed-up at equal batch, outputs compared), and fastgen at its own largest batch;
   the headline is fastgen at its batch over upstream at its batch, and the max-batch ratio.

CUDA only: on CPU there is no allocator limit to enforce (the resident set is not a budget).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fastgen
from benchmarks.measure import environment, result_header, rotating_order, synchronize, write_result
from benchmarks.run import DTYPES, RESULTS
from benchmarks.scenarios import SCENARIOS, Scenario

VARIANTS = ("upstream", "fastgen")


def largest_fitting(fits: Callable[[int], bool], start: int = 8, limit: int = 4096, granularity: int = 1) -> int:
    """The largest batch ``b <= limit`` with ``fits(b)``, assuming ``fits`` is monotone (0: not even 1).

    Doubles from ``start`` until a batch fails (or ``limit``), then bisects between the last batch that
    fitted and the first that did not until they are ``granularity`` apart: few probes, each a full call.
    """
    if start < 1 or granularity < 1 or limit < 1:
        raise ValueError("start, limit and granularity must be positive")
    low, high = 0, None  # low fits (0: vacuously), high does not
    batch = min(start, limit)
    while high is None:
        if fits(batch):
            low = batch
            if batch == limit:
                return limit
            batch = min(2 * batch, limit)
        else:
            high = batch
    while high - low > (granularity if low else 1):  # below the first fit, down to batch 1
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def _scope(variant: str):
    return fastgen.unpatched() if variant == "upstream" else fastgen.patched()


class Runner:
    """Builds the scenario's model once and runs its ``generate`` call at any batch, under the budget."""

    def __init__(self, scenario: Scenario, dtype: torch.dtype, budget_bytes: int, sequences_only: bool = False) -> None:
        self.scenario, self.settings = scenario, scenario.settings("cuda")
        self.model, _, self.kwargs = scenario.build("cuda", dtype, self.settings | {"batch": 1})
        if sequences_only:  # the common call: no output object, so no returned cache in upstream's layout
            self.kwargs["return_dict_in_generate"] = False
        total = torch.cuda.get_device_properties(0).total_memory
        if budget_bytes > total:
            raise SystemExit(f"max_batch: the budget ({budget_bytes / 2**30:.1f} GiB) exceeds the GPU's memory")
        self.budget_bytes, self.total_bytes = budget_bytes, total
        self.probes: dict[str, dict[int, bool]] = {variant: {} for variant in VARIANTS}

    def call(self, variant: str, batch: int) -> tuple[torch.Tensor, float, int]:
        inputs = self.scenario.inputs(self.model, batch, self.settings["input_len"])
        inputs = {key: value.to("cuda") for key, value in inputs.items()}
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with _scope(variant), torch.inference_mode():
            synchronize("cuda")
            start = time.perf_counter()
            out = self.model.generate(**inputs, **self.kwargs)
            synchronize("cuda")
            seconds = time.perf_counter() - start
        sequences = out.sequences if self.kwargs.get("return_dict_in_generate") else out
        return sequences, seconds, torch.cuda.max_memory_allocated()

    def fits(self, variant: str, batch: int) -> bool:
        try:
            self.call(variant, batch)
            fitted = True
        except torch.cuda.OutOfMemoryError:
            fitted = False
        torch.cuda.empty_cache()
        self.probes[variant][batch] = fitted
        return fitted

    def __enter__(self) -> Runner:
        torch.cuda.set_per_process_memory_fraction(self.budget_bytes / self.total_bytes)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_per_process_memory_fraction(1.0)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    scenario = SCENARIOS[args.scenario]
    budget = int(args.budget_gib * 2**30)
    with Runner(scenario, DTYPES[args.dtype], budget, args.sequences_only) as runner:
        runner.call("upstream", 1)  # warm-up (kernels, lazy patches) before any probe
        runner.call("fastgen", 1)
        largest = {
            variant: largest_fitting(lambda b, v=variant: runner.fits(v, b), args.start, args.limit, args.granularity)
            for variant in VARIANTS
        }
        if not largest["upstream"]:
            raise SystemExit(f"max_batch: not even batch 1 fits {args.budget_gib} GiB upstream")
        runs = {
            "upstream@upstream": ("upstream", largest["upstream"]),
            "fastgen@upstream": ("fastgen", largest["upstream"]),
        }
        runs["fastgen@fastgen"] = ("fastgen", largest["fastgen"])
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        peaks: dict[str, int] = {}
        outputs: dict[str, torch.Tensor] = {}
        for name in rotating_order(list(runs), args.rounds):
            torch.cuda.empty_cache()  # each timed call starts from the same empty allocator, as the probes did
            outputs[name], spent, peaks[name] = runner.call(*runs[name])
            seconds[name].append(spent)
    new_tokens = runner.settings["new_tokens"]
    timing = {
        name: {
            "batch": runs[name][1],
            "seconds": seconds[name],
            "median_s": statistics.median(seconds[name]),
            "samples_per_s": runs[name][1] / statistics.median(seconds[name]),
            "new_tokens_per_s": runs[name][1] * new_tokens / statistics.median(seconds[name]),
            "peak_memory_bytes": peaks[name],
        }
        for name in runs
    }
    return result_header("max_batch", None) | {
        "scenario": scenario.name,
        "note": scenario.note,
        "settings": runner.settings
        | {
            "dtype": args.dtype,
            "generate": scenario.generate,
            "budget_gib": args.budget_gib,
            "return_dict_in_generate": not args.sequences_only,
        },
        "environment": environment("cuda"),
        "largest_batch": largest,
        "max_batch_ratio": largest["fastgen"] / largest["upstream"],
        "probes": {variant: {str(b): ok for b, ok in sorted(runner.probes[variant].items())} for variant in VARIANTS},
        "timing": timing,
        "identical_outputs_at_upstream_batch": bool(
            torch.equal(outputs["upstream@upstream"], outputs["fastgen@upstream"])
        ),
        "speedup_same_batch": timing["upstream@upstream"]["median_s"] / timing["fastgen@upstream"]["median_s"],
        "throughput_ratio_at_largest_batches": timing["fastgen@fastgen"]["samples_per_s"]
        / timing["upstream@upstream"]["samples_per_s"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario", default="bart-large", choices=[n for n in SCENARIOS if n != "fairseq-transformer"]
    )
    parser.add_argument("--budget-gib", type=float, default=40.0)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    parser.add_argument("--start", type=int, default=16, help="first batch probed (doubling from there)")
    parser.add_argument("--limit", type=int, default=1024)
    parser.add_argument("--granularity", type=int, default=8, help="stop bisecting when this close")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--sequences-only",
        action="store_true",
        help="generate returns the sequences alone (return_dict_in_generate=False): with an output object, "
        "fastgen hands back the cache in upstream's per-beam layout, which costs upstream's cross K/V at the end",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("max_batch: needs a CUDA device (the budget is the CUDA allocator's limit)")
    result = measure(args)
    out = args.out or RESULTS / f"max_batch-{args.scenario}-{args.dtype}-cuda.json"
    write_result(out, result)
    sys.stdout.write(
        f"largest batch in {args.budget_gib} GiB: {result['largest_batch']} (x{result['max_batch_ratio']:.2f}); "
        f"same batch {result['speedup_same_batch']:.2f}x; at the largest batches "
        f"{result['throughput_ratio_at_largest_batches']:.2f}x samples/s; identical at upstream's batch: "
        f"{result['identical_outputs_at_upstream_batch']}; wrote {out}\n"
    )


if __name__ == "__main__":
    main()
