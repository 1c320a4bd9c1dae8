"""Where a decode step's time goes: ``torch.profiler`` over one ``generate`` call, upstream and fastgen.

    python -m benchmarks.step_profile --scenario bart-large --device cuda --dtype fp16 --batch 32

For each variant it reports the wall time per new token, the device time of the kernels grouped by
name and by kind (matrix products, attention, softmax, top-k, copies, elementwise, ...), the share
of the wall time the device was busy (a step that is mostly idle device is bound by launches on the
host, not by the kernels), kernel launches per new token, and the three largest costs by kind. On a
CPU the same report groups the host-side operators (``aten::...``) instead of kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import fastgen
from benchmarks.measure import environment, synchronize
from benchmarks.run import DTYPES, RESULTS
from benchmarks.scenarios import SCENARIOS

#: kernel / operator name patterns -> kind, first match wins (lower-case names)
KINDS = (
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention|_ragged"),
    ("matmul", r"gemm|cutlass|cublas|nvjet|xmma|ampere_|hopper|wgmma|aten::(mm|bmm|addmm|linear|matmul|baddbmm)"),
    ("softmax", r"softmax"),
    ("top-k / sort", r"topk|sort|radix|select|gather_topk|bitonic|beam_topk"),
    ("n-gram blocking", r"ngram|no_repeat"),
    ("layer norm", r"layer_norm|layernorm|rms"),
    ("copy / index", r"copy|index|gather|scatter|cat|catarray|memcpy|memset|fill|where|masked"),
    ("reduction", r"reduce|sum|max|min|argmax|any|all"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton_|add|mul|div|gelu|relu|exp|log|neg|sub"),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lowered):
            return kind
    return "other"


def _device_us(event: Any) -> float:
    for attribute in ("device_time", "cuda_time"):
        value = getattr(event, attribute, None)
        if value:
            return float(value)
    return float(event.time_range.elapsed_us())


def profile_call(call, device: str) -> dict[str, Any]:
    """Runs ``call`` once under the profiler; device kernels (CUDA) or host operators (CPU) grouped."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        call()
        synchronize(device)
    wall_us = (time.perf_counter() - start) * 1e6
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    if device == "cuda":
        for event in prof.events():
            if str(getattr(event, "device_type", "")).endswith("CUDA"):
                entry = by_name[event.name]
                entry[0] += _device_us(event)
                entry[1] += 1
    else:
        for event in prof.key_averages():
            if event.key.startswith("aten::"):
                entry = by_name[event.key]
                entry[0] += float(event.self_cpu_time_total)
                entry[1] += int(event.count)
    busy_us = sum(us for us, _ in by_name.values())
    kinds: dict[str, float] = collections.defaultdict(float)
    for name, (us, _) in by_name.items():
        kinds[kind_of(name)] += us
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:15]
    return {
        "profiled_wall_ms": wall_us / 1e3,
        "busy_ms": busy_us / 1e3,
        "busy_share_of_wall": busy_us / wall_us,
        "launches": sum(count for _, count in by_name.values()),
        "by_kind_ms": {k: v / 1e3 for k, v in sorted(kinds.items(), key=lambda item: -item[1])},
        "top": [{"name": name[:160], "ms": us / 1e3, "count": count} for name, (us, count) in top],
    }


def timed(call, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="bart-large")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--input-len", type=int)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per variant (median), outside the profiler")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA device is available")

    scenario = SCENARIOS[args.scenario]
    settings = scenario.settings(args.device) | {"new_tokens": args.new_tokens}
    settings |= {k: v for k, v in (("batch", args.batch), ("input_len", args.input_len)) if v}
    model, inputs, kwargs = scenario.build(args.device, DTYPES[args.dtype], settings)
    encoder = model.get_encoder() if model.config.is_encoder_decoder else None

    def generate():
        with torch.inference_mode():
            return model.generate(**inputs, **kwargs)

    def encode():
        with torch.inference_mode():
            return encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])

    report: dict[str, Any] = {}
    for variant, scope in (("upstream", fastgen.unpatched), ("fastgen", fastgen.patched)):
        with scope():
            generate()  # warm-up: kernels compiled, allocator grown
            seconds = timed(generate, args.device, args.repeats)
            encoder_seconds = timed(encode, args.device, args.repeats) if encoder is not None else 0.0
            entry = profile_call(generate, args.device)
        steps = settings["new_tokens"]
        entry |= {
            "generate_s": seconds,
            "encoder_s": encoder_seconds,
            "per_new_token_ms": (seconds - encoder_seconds) / steps * 1e3,
            "launches_per_new_token": entry["launches"] / steps,
            "three_largest": list(entry["by_kind_ms"])[:3],
        }
        report[variant] = entry
        print(
            f"{variant}: {seconds:.3f}s per call, {entry['per_new_token_ms']:.2f} ms per new token, "
            f"device busy {entry['busy_share_of_wall']:.0%}, {entry['launches_per_new_token']:.0f} launches per token; "
            f"largest: " + ", ".join(f"{k} {entry['by_kind_ms'][k]:.1f} ms" for k in entry["three_largest"]),
            flush=True,
        )
    result = {
        "benchmark": "step_profile",
        "command": "python -m benchmarks.step_profile " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(args.device),
        "settings": settings | {"scenario": args.scenario, "dtype": args.dtype, "generate": scenario.generate},
        "profiles": report,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"step_profile-{args.scenario}-{args.device}-{args.dtype}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
