"""The CUDA-graph decode step against the eager one and upstream, one process, one GPU.

    python -m benchmarks.graph_step --scenario bart-large --dtype fp16 --rounds 2

Three variants of one scenario: upstream (``fastgen.unpatched()``), fastgen with its decode step eager
(``FASTGEN_CUDA_GRAPHS=0``) and fastgen with CUDA graphs. Each variant's first call at the shape is timed
apart (cold: allocator growth, graph capture), then the variants alternate for ``--rounds`` warm rounds.
Reported: medians, ratios to upstream, peak memory, whether rows are token-identical to upstream, and the
captures the graph variant made (``--dtype fp32`` at a small shape is the exactness check on a GPU).
On ``--device cpu`` (a smoke test of the harness) the graph variant runs the eager step: graphs need CUDA.
``--no-cudnn-attention`` runs every variant without SDPA's cuDNN backend (which builds a plan per new shape: a
suspect for the cost of a first call).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

import fastgen
from benchmarks.measure import environment, load_average, result_header, rotating_order, timed, write_result
from benchmarks.run import DTYPES, _identical_rows
from benchmarks.scenarios import SCENARIOS
from fastgen.models.graph_step import GRAPHS_ENV

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("upstream", "fastgen-eager", "fastgen-graphs")


def _attention_backends(no_cudnn: bool) -> Any:
    """Every variant's SDPA backends: torch's default order, or without cuDNN's (whose plans are built per shape)."""
    if not no_cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _runner(call: Any, device: str, no_cudnn: bool = False) -> Any:
    def run(variant: str) -> tuple[Any, float, int, list[str]]:
        os.environ[GRAPHS_ENV] = "1" if variant == "fastgen-graphs" else "0"
        scope = fastgen.unpatched() if variant == "upstream" else fastgen.patched()
        with scope, _attention_backends(no_cudnn), fastgen.report() as report, torch.inference_mode():
            out, seconds, peak = timed(call, device)
        return out, seconds, peak, [note for notes in report.ran.values() for note in notes if "decode step" in note]

    return run


def _upstream_halves(scenario: Any, device: str, dtype: str, settings: dict[str, Any]) -> str:
    """Rows of upstream's whole batch identical to upstream's two half batches (the same rows, the same model):
    how far upstream's half precision moves from itself under a change it treats as harmless."""
    model, inputs, kwargs = scenario.build(device, DTYPES[dtype], settings)
    half = settings["batch"] // 2
    with fastgen.unpatched(), torch.inference_mode():
        whole = model.generate(**inputs, **kwargs).sequences
        parts = [model.generate(**{k: v[rows] for k, v in inputs.items()}, **kwargs).sequences
                 for rows in (slice(0, half), slice(half, None))]  # fmt: skip
    width = max(part.shape[-1] for part in parts)
    pad = model.generation_config.pad_token_id or 0
    halves = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=pad) for p in parts])
    del model
    return _identical_rows(whole, halves)


def measure(
    scenario_name: str, device: str, dtype: str, rounds: int, overrides: dict[str, Any], no_cudnn: bool = False,
    upstream_halves: bool = False,
) -> dict[str, Any]:  # fmt: skip
    scenario = SCENARIOS[scenario_name]
    settings = scenario.settings(device) | {k: v for k, v in overrides.items() if v is not None}
    call = scenario.prepare(device, DTYPES[dtype], settings)
    run = _runner(call, device, no_cudnn)
    cold, outputs, notes = {}, {}, {}
    for variant in VARIANTS:
        outputs[variant], cold[variant], _, notes[variant] = run(variant)
    warm: dict[str, list[float]] = {v: [] for v in VARIANTS}
    peaks: dict[str, list[int]] = {v: [] for v in VARIANTS}
    start = load_average()
    for variant in rotating_order(list(VARIANTS), rounds):
        outputs[variant], seconds, peak, notes[variant] = run(variant)
        warm[variant].append(seconds)
        peaks[variant].append(peak)
    batch, new_tokens = settings["batch"], settings["new_tokens"]
    settings = settings | {"generate": scenario.generate}
    result: dict[str, Any] = {"scenario": scenario_name, "dtype": dtype, "settings": settings, "rounds": rounds}
    result["attention_backends"] = "flash, efficient, math (no cuDNN)" if no_cudnn else "torch's default"
    base = statistics.median(warm["upstream"])
    for variant in VARIANTS:
        median = statistics.median(warm[variant])
        result[variant] = {
            "cold_s": cold[variant],
            "warm_s": warm[variant],
            "median_s": median,
            "cold_over_warm": cold[variant] / median,
            "speedup_vs_upstream": base / median,
            "samples_per_s": batch / median,
            "ms_per_new_token": 1000 * median / new_tokens,
            "peak_memory_bytes": max(peaks[variant]),
            "identical_rows_vs_upstream": _identical_rows(outputs["upstream"].sequences, outputs[variant].sequences),
            "lean_step_notes": notes[variant],
        }
    result["graphs_over_eager"] = result["fastgen-eager"]["median_s"] / result["fastgen-graphs"]["median_s"]
    if upstream_halves:
        result["upstream_vs_own_halves"] = _upstream_halves(scenario, device, dtype, settings)
    result["load_average"] = {"start": start, "end": load_average()}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="bart-large")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--input-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--no-cudnn-attention", action="store_true", help="SDPA without cuDNN, all variants")
    parser.add_argument(
        "--upstream-halves", action="store_true", help="also: upstream's whole batch against its two halves"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("graph_step: needs a CUDA device", file=sys.stderr)
        return 2
    overrides = {"batch": args.batch, "input_len": args.input_len, "new_tokens": args.new_tokens}
    result = result_header("graph_step", argv) | {"environment": environment(args.device)}
    result |= measure(
        args.scenario, args.device, args.dtype, args.rounds, overrides, args.no_cudnn_attention, args.upstream_halves
    )
    for variant in VARIANTS:
        row = result[variant]
        print(
            f"{variant:15s} warm {row['median_s']:.3f} s ({row['speedup_vs_upstream']:.2f}x upstream), "
            f"cold {row['cold_s']:.3f} s ({row['cold_over_warm']:.2f}x warm), "
            f"peak {row['peak_memory_bytes'] / 2**30:.2f} GiB, rows {row['identical_rows_vs_upstream']}, "
            f"{row['lean_step_notes']}"
        )
    print(f"graphs over eager: {result['graphs_over_eager']:.2f}x")
    if "upstream_vs_own_halves" in result:
        print(f"upstream's whole batch against its two halves: {result['upstream_vs_own_halves']} rows identical")
    suffix = "-no-cudnn" if args.no_cudnn_attention else ""
    name = f"graph_step-{args.scenario}-b{result['settings']['batch']}-{args.device}-{args.dtype}{suffix}.json"
    write_result(args.out / name, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
