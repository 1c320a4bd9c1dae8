"""Micro-benchmark of one decode attention call: shared K/V per input vs K/V expanded per beam.

    python -m benchmarks.attention_op --device cuda            # B=32 G=4 H=16 S=1024 D=64 fp16
    python -m benchmarks.attention_op --device cpu --threads 1  # smaller, fp32, torch paths only

Upstream beam search keeps ``B*G`` copies of each input's keys/values and runs SDPA per beam
(``per_beam_sdpa``, the baseline: the copies already sit in the cache, so expanding them is not
timed). The shared variants read each input's K/V once: ``shared_triton`` (the Triton kernel,
CUDA only), ``shared_torch`` (the torch reference, which also returns the lse) and
``grouped_sdpa`` (beam queries grouped as extra rows and stock SDPA, no lse: what fastgen's
dedup path runs today). Variants alternate after a warm-up; each sample times ``--inner`` calls.
Writes ``benchmarks/results/attention_op-<device>.json`` with device, versions and the command.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.measure import environment, synchronize, write_result
from fastgen.ops.attention import (
    group_beam_queries,
    layout_for_groups,
    shared_kv_attention,
    shared_kv_attention_backend,
    shared_kv_attention_reference,
    ungroup_beam_rows,
)

RESULTS = Path(__file__).parent / "results"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULTS = {  # decode step of beam search over a 1024-token source (GPU) / a smaller one (CPU)
    "cuda": dict(batch=32, group=4, heads=16, kv_heads=16, q_len=1, kv_len=1024, dim=64, dtype="fp16"),
    "cpu": dict(batch=8, group=4, heads=8, kv_heads=8, q_len=1, kv_len=512, dim=64, dtype="fp32"),
}


def make_inputs(shape: dict[str, Any], device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Queries per beam, K/V per input, a per-input padding mask; plus the per-beam copies upstream keeps."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[shape["dtype"]]
    batch, group, kv_len = shape["batch"], shape["group"], shape["kv_len"]

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    query = randn(batch * group, shape["heads"], shape["q_len"], shape["dim"])
    key = randn(batch, shape["kv_heads"], kv_len, shape["dim"])
    value = randn(batch, shape["kv_heads"], kv_len, shape["dim"])
    lengths = torch.randint(kv_len // 2, kv_len + 1, (batch,), generator=gen, device=device)
    lengths[0] = kv_len
    mask = (torch.arange(kv_len, device=device) >= kv_len - lengths[:, None]).view(batch, 1, 1, kv_len)  # left pad
    return {
        "query": query,
        "key": key,
        "value": value,
        "mask": mask,
        "key_per_beam": key.repeat_interleave(group, 0),
        "value_per_beam": value.repeat_interleave(group, 0),
        "mask_per_beam": mask.repeat_interleave(group, 0),
    }


def variants(inputs: dict[str, torch.Tensor], group: int, device: str) -> dict[str, Callable[[], torch.Tensor]]:
    q, k, v, mask = inputs["query"], inputs["key"], inputs["value"], inputs["mask"]
    gqa = q.shape[1] != k.shape[1]
    grouped_mask = layout_for_groups(mask, k.shape[0], group, q.shape[2])
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "per_beam_sdpa": lambda: F.scaled_dot_product_attention(
            q, inputs["key_per_beam"], inputs["value_per_beam"], attn_mask=inputs["mask_per_beam"], enable_gqa=gqa
        ),
        "grouped_sdpa": lambda: ungroup_beam_rows(
            F.scaled_dot_product_attention(group_beam_queries(q, group), k, v, attn_mask=grouped_mask, enable_gqa=gqa),
            group,
        ),
        "shared_torch": lambda: shared_kv_attention_reference(q, k, v, mask)[0],
    }
    if device == "cuda" and shared_kv_attention_backend(q, k, v, mask, backend=None) == "triton":
        calls["shared_triton"] = lambda: shared_kv_attention(q, k, v, mask, backend="triton")[0]
    return calls


def _sample(fn: Callable[[], torch.Tensor], device: str, inner: int) -> float:
    """Seconds per call, averaged over ``inner`` back-to-back calls (launch overhead included)."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / inner


def run(shape: dict[str, Any], device: str, rounds: int, inner: int) -> dict[str, Any]:
    inputs = make_inputs(shape, device)
    calls = variants(inputs, shape["group"], device)
    with torch.inference_mode():
        baseline = calls["per_beam_sdpa"]().float()
        errors = {name: (fn().float() - baseline).abs().max().item() for name, fn in calls.items()}
        for fn in calls.values():  # warm-up: Triton compile, allocator, caches
            _sample(fn, device, max(1, inner // 4))
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for r in range(rounds):
            order = list(calls) if r % 2 == 0 else list(reversed(calls))
            for name in order:
                samples[name].append(_sample(calls[name], device, inner))
    itemsize = DTYPES[shape["dtype"]].itemsize
    kv_bytes = 2 * shape["batch"] * shape["kv_heads"] * shape["kv_len"] * shape["dim"] * itemsize
    read = {name: kv_bytes * (shape["group"] if name == "per_beam_sdpa" else 1) for name in calls}
    result: dict[str, Any] = {"benchmark": "attention_op", "shape": shape, "rounds": rounds, "inner_calls": inner}
    base = statistics.median(samples["per_beam_sdpa"])
    result["variants"] = {
        name: {
            "median_us": statistics.median(times) * 1e6,
            "samples_us": [t * 1e6 for t in times],
            "speedup_vs_per_beam_sdpa": base / statistics.median(times),
            "kv_bytes_read": read[name],
            "kv_gb_per_s": read[name] / statistics.median(times) / 1e9,
            "max_abs_diff_vs_per_beam_sdpa": errors[name],
        }
        for name, times in samples.items()
    }
    if "shared_triton" not in calls:
        result["note"] = "shared_triton not run: the Triton kernel runs on CUDA only"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    for name in ("batch", "group", "heads", "kv_heads", "q_len", "kv_len", "dim"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help="default: see DEFAULTS")
    parser.add_argument("--dtype", choices=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--inner", type=int, default=None, help="calls per sample (default 100 CUDA, 10 CPU)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA device is available (GPU figures come only from a GPU)")
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = DEFAULTS[args.device] | {k: v for k, v in vars(args).items() if k in DEFAULTS["cpu"] and v is not None}
    result = run(shape, args.device, args.rounds, args.inner or (100 if args.device == "cuda" else 10))
    result["command"] = "python -m benchmarks.attention_op " + shlex.join(argv if argv is not None else sys.argv[1:])
    result["environment"] = environment(args.device)
    try:
        import triton

        result["environment"]["triton"] = triton.__version__
    except ImportError:
        result["environment"]["triton"] = None
    if args.device == "cpu":  # a shared machine's other work shows up in CPU timings: record it
        result["environment"]["load_average_1m"] = os.getloadavg()[0]
    _print(result)
    if not args.no_save:
        path = args.out / f"attention_op-{args.device}.json"
        write_result(path, result)
        print(f"wrote {path}")
    return 0


def _print(result: dict[str, Any]) -> None:
    s = result["shape"]
    print(
        f"attention_op on {result['environment']['device']}: B={s['batch']} G={s['group']} H={s['heads']} "
        f"Hkv={s['kv_heads']} q={s['q_len']} S={s['kv_len']} D={s['dim']} {s['dtype']}"
    )
    for name, v in result["variants"].items():
        print(
            f"  {name:14s} {v['median_us']:9.1f} us  {v['speedup_vs_per_beam_sdpa']:5.2f}x  "
            f"K/V {v['kv_bytes_read'] / 2**20:6.1f} MiB  {v['kv_gb_per_s']:7.1f} GB/s  "
            f"max|diff| {v['max_abs_diff_vs_per_beam_sdpa']:.2e}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
