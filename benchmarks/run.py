"""Side-by-side generation benchmark: upstream (``fastgen.unpatched()``) vs fastgen, one process.

    python -m benchmarks.run --scenario bart-base --device cpu

Both variants run after a warm-up, alternating ABBA so drift hits both alike; the result
(medians, ratio, samples/s, tokens/s, peak memory, KV-cache bytes, whether the outputs were
identical) is printed and written to ``benchmarks/results/<scenario>-<device>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

import fastgen
from benchmarks.measure import alternate, environment, timed, write_result
from benchmarks.scenarios import SCENARIOS, FairseqScenario, Scenario

RESULTS = Path(__file__).parent / "results"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def run_scenario(
    scenario: Scenario,
    device: str,
    dtype: str,
    rounds: int,
    overrides: dict[str, Any],
    features: list[str] | None = None,
) -> dict:
    """Time one scenario; ``features`` restricts fastgen to those features (None: all of them)."""
    settings = scenario.settings(device) | {k: v for k, v in overrides.items() if v is not None}
    call = scenario.prepare(device, DTYPES[dtype], settings)
    n = settings["new_tokens"]

    def generate(variant: str) -> tuple[Any, float, int]:
        scope = fastgen.unpatched() if variant == "baseline" else fastgen.patched(features)
        with scope, torch.inference_mode():
            return timed(call, device)

    # warm-up (allocator, kernels, lazy patches), then baseline/fastgen, fastgen/baseline, ... rounds
    measured = alternate(generate, ["baseline", "fastgen"], rounds)
    outputs = measured.outputs
    samples = {variant: measured.column(variant, 0) for variant in outputs}
    peaks = {variant: measured.column(variant, 1) for variant in outputs}

    batch = settings["batch"]
    result: dict[str, Any] = {
        "scenario": scenario.name,
        "note": scenario.note,
        "features": features or "all",
        "settings": settings
        | {
            "dtype": dtype,
            "rounds": rounds,
            "generate": scenario.generate,
            "equal_work": "min_new_tokens == max_new_tokens",
        },
        "identical_outputs": bool(torch.equal(outputs["baseline"].sequences, outputs["fastgen"].sequences)),
        "identical_rows": _identical_rows(outputs["baseline"].sequences, outputs["fastgen"].sequences),
        "load_average": measured.load_average,
    }
    ngram = scenario.generate.get("no_repeat_ngram_size")
    if ngram:  # the property n-gram blocking promises, checked on each variant's generated tokens
        result["rows_with_repeated_ngrams"] = {
            v: rows_with_repeated_ngrams(outputs[v].sequences[:, -n:], ngram) for v in outputs
        }
    difference = scenario.known_output_difference(device)
    if difference is not None:
        result["outputs_note"] = difference
    for variant in ("baseline", "fastgen"):
        median = statistics.median(samples[variant])
        result[variant] = {
            "seconds": samples[variant],
            "median_s": median,
            "samples_per_s": batch / median,
            "new_tokens_per_s": batch * n / median,
            "peak_memory_bytes": max(peaks[variant]),
            "kv_cache_bytes": outputs[variant].kv_cache_bytes,
        }
        if outputs[variant].fold_seconds is not None:  # included in the timed call; here alone
            result[variant]["returned_cache_fold_s"] = outputs[variant].fold_seconds
    result["speedup"] = result["baseline"]["median_s"] / result["fastgen"]["median_s"]
    for part in ("self_attention", "cross_attention"):
        base_bytes = result["baseline"]["kv_cache_bytes"].get(part)
        if base_bytes:
            result[f"{part}_cache_ratio"] = result["fastgen"]["kv_cache_bytes"][part] / base_bytes
    result["sample_output"] = {v: outputs[v].sequences[0, -min(n, 12) :].tolist() for v in outputs}
    return result


def rows_with_repeated_ngrams(sequences: torch.Tensor, n: int) -> int:
    """How many rows contain some n-gram twice."""
    count = 0
    for row in sequences.tolist():
        grams = [tuple(row[i : i + n]) for i in range(len(row) - n + 1)]
        count += len(grams) != len(set(grams))
    return count


def _identical_rows(baseline: torch.Tensor, candidate: torch.Tensor) -> str:
    """How many output rows are token-identical, as "k/n" (half precision may flip a near-tie)."""
    if baseline.shape != candidate.shape:
        return f"shapes differ: {tuple(baseline.shape)} vs {tuple(candidate.shape)}"
    return f"{int((baseline == candidate).all(-1).sum())}/{baseline.shape[0]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", choices=[*SCENARIOS, "all"], required=True)
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: fp32 on CPU, fp16 on CUDA")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--input-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument(
        "--features",
        help="comma-separated fastgen features to time (default: all); saved as <scenario>-<device>-<features>.json",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON results")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA device is available")
    dtype = args.dtype or ("fp16" if device == "cuda" else "fp32")
    names = list(SCENARIOS) if "all" in args.scenario else args.scenario
    overrides = {"batch": args.batch, "input_len": args.input_len, "new_tokens": args.new_tokens}
    command = "python -m benchmarks.run " + shlex.join(argv if argv is not None else sys.argv[1:])
    for name in names:
        scenario = SCENARIOS[name]
        if scenario.gpu_only and device != "cuda":
            print(f"{name}: skipped (GPU-only scenario)")
            continue
        if isinstance(scenario, FairseqScenario) and importlib.util.find_spec("fairseq") is None:
            print(f"{name}: skipped (fairseq is not installed)")
            continue
        features = [f.strip() for f in args.features.split(",") if f.strip()] if args.features else None
        result = run_scenario(scenario, device, dtype, args.rounds, overrides, features)
        result["command"] = command
        result["environment"] = environment(device)
        _print(result)
        if not args.no_save:
            args.out.mkdir(parents=True, exist_ok=True)
            suffix = "" if features is None else "-" + "-".join(features)
            # on a GPU both precisions are measured: the file name says which
            precision = f"-{dtype}" if device == "cuda" else ""
            path = args.out / f"{name}-{device}{precision}{suffix}.json"
            write_result(path, result)
            print(f"  wrote {path}")
    return 0


def _print(r: dict) -> None:
    b, f = r["baseline"], r["fastgen"]
    s = r["settings"]
    print(
        f"{r['scenario']} on {r['environment']['device']} — batch {s['batch']}, input {s['input_len']}, "
        f"{s['new_tokens']} new tokens, {s['dtype']}, {r['note']}; fastgen features: {r['features']}"
    )
    print(
        f"  upstream : median {b['median_s']:.3f}s  {b['samples_per_s']:.2f} samples/s  "
        f"{b['new_tokens_per_s']:.1f} tokens/s  peak +{b['peak_memory_bytes'] / 2**20:.0f} MiB  "
        f"KV cache {_mib(b['kv_cache_bytes'])}"
    )
    print(
        f"  fastgen  : median {f['median_s']:.3f}s  {f['samples_per_s']:.2f} samples/s  "
        f"{f['new_tokens_per_s']:.1f} tokens/s  peak +{f['peak_memory_bytes'] / 2**20:.0f} MiB  "
        f"KV cache {_mib(f['kv_cache_bytes'])}"
    )
    if "returned_cache_fold_s" in f:
        print(f"  fastgen's returned cache folded to upstream's layout in {f['returned_cache_fold_s'] * 1e3:.1f} ms")
    rows = r.get("identical_rows")
    print(f"  speedup {r['speedup']:.2f}x, identical outputs: {r['identical_outputs']} (rows {rows})")
    if "rows_with_repeated_ngrams" in r:
        rep = r["rows_with_repeated_ngrams"]
        print(f"  rows repeating an n-gram: upstream {rep['baseline']}, fastgen {rep['fastgen']} (of {s['batch']})")
    if "outputs_note" in r:
        print(f"  note: {r['outputs_note']}")
    print(f"  first row, last tokens: upstream {r['sample_output']['baseline']}")
    print(f"                          fastgen  {r['sample_output']['fastgen']}")


def _mib(cache: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in cache.items()) or "n/a"


if __name__ == "__main__":
    raise SystemExit(main())
