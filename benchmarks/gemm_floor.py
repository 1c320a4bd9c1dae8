"""The GEMM floor of a bart-base decode step vs fastgen's measured step (issue 18, item 4), CPU.

    OMP_NUM_THREADS=1 python -m benchmarks.gemm_floor [--rounds 5] [--out FILE.json]

Floor: the decode step's linears at their row count (batch x beams hypotheses, one token each):
per decoder layer self-attention q/k/v/o and cross-attention q/o (768 x 768, bias), fc1 (3072 x 768)
and fc2 (768 x 3072), then the vocabulary projection (50265 x 768, no bias); cross-attention K/V are
computed once per call, not per step. Each shape is timed as a pass over as many distinct weights
as the step has (so caches hold what they would hold in the step), in three forms: ``F.linear``
(upstream), fastgen's calibrated exact form (``gemm``) and the packed oneDNN form (``fast_gemm``);
the floor is the sum over the shapes.

Step: ``generate`` of the bart-base scenario at two forced lengths; (long - short) / (extra steps),
in this thread's CPU time, for fastgen's default features and with ``fast_gemm``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fastgen
from benchmarks.measure import environment, result_header, write_result
from benchmarks.scenarios import SCENARIOS
from fastgen.ops import fast_linear, linear

DEFAULT = sorted(set(fastgen.known_features()) - fastgen.optimizer.registry.OPT_IN_FEATURES)


def step_linears(config: object) -> list[tuple[int, int, bool, int]]:
    """(out_features, in_features, bias, count per step) of one decode step of a BART decoder."""
    d, ffn, layers = config.d_model, config.decoder_ffn_dim, config.decoder_layers
    return [(d, d, True, 6 * layers), (ffn, d, True, layers), (d, ffn, True, layers), (config.vocab_size, d, False, 1)]


def time_shapes(rows: int, config: object, rounds: int) -> dict[str, dict[str, float]]:
    """Median milliseconds per step for each shape and form: one pass over ``count`` distinct weights
    (as many as the step has, so that caches hold what they would hold in the real step)."""
    out: dict[str, dict[str, float]] = {}
    for n, k, bias, count in step_linears(config):
        modules = [torch.nn.Linear(k, n, bias=bias) for _ in range(count)]
        x = torch.randn(rows, 1, k)
        with torch.no_grad():
            for module in modules:
                linear.exact_linear(x, module.weight, module.bias)  # calibrates once (first module)
                fast_linear.prepack(module)
            forms = {
                "f_linear": lambda m, x=x: F.linear(x, m.weight, m.bias),
                "exact": lambda m, x=x: linear.exact_linear(x, m.weight, m.bias),
                "packed": lambda m, x=x: fast_linear.packed_linear(m, x),
            }
            times: dict[str, list[float]] = {name: [] for name in forms}
            for _ in range(rounds):
                for name, run in forms.items():
                    start = time.thread_time()
                    for module in modules:
                        run(module)
                    times[name].append((time.thread_time() - start) * 1e3)
        choice = linear.choice_for(x, modules[0].weight, modules[0].bias)
        out[f"{n}x{k}{'+bias' if bias else ''}"] = {
            "count_per_step": count,
            **{name: statistics.median(values) for name, values in times.items()},
            "exact_form": choice.form if choice else "linear (below the blocking threshold)",
        }
        fast_linear.forget_packed()
    return out


def step_ms(features: list[str], rounds: int) -> float:
    """Thread-CPU milliseconds of one decode step of the bart-base scenario under ``features``."""
    scenario = SCENARIOS["bart-base"]
    settings = scenario.settings("cpu")
    model, inputs, kwargs = scenario.build("cpu", torch.float32, settings)
    kwargs["return_dict_in_generate"] = False
    lengths = (4, settings["new_tokens"])
    samples: dict[int, list[float]] = {n: [] for n in lengths}
    with fastgen.patched(features), torch.inference_mode():
        for n in lengths:  # warm-up (calibration, packing)
            model.generate(**inputs, **(kwargs | {"max_new_tokens": n, "min_new_tokens": n}))
        for _ in range(rounds):
            for n in lengths:
                start = time.thread_time()
                model.generate(**inputs, **(kwargs | {"max_new_tokens": n, "min_new_tokens": n}))
                samples[n].append(time.thread_time() - start)
    short, long = (statistics.median(samples[n]) for n in lengths)
    return (long - short) / (lengths[1] - lengths[0]) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    scenario = SCENARIOS["bart-base"]
    config = scenario.build("cpu", torch.float32, scenario.settings("cpu") | {"batch": 1, "input_len": 4})[0].config
    rows = scenario.settings("cpu")["batch"] * scenario.generate["num_beams"]
    load = [round(os.getloadavg()[0], 2)]
    shapes = time_shapes(rows, config, args.rounds)
    floors = {form: sum(entry[form] for entry in shapes.values()) for form in ("f_linear", "exact", "packed")}
    steps = {"fastgen": step_ms(DEFAULT, args.rounds), "fastgen_fast": step_ms([*DEFAULT, "fast_gemm"], args.rounds)}
    load.append(round(os.getloadavg()[0], 2))
    report = result_header("gemm_floor", argv) | {
        "rows": rows,
        "environment": environment("cpu"),
        "load_average_1min": load,
        "shapes_ms": shapes,
        "floor_ms_per_step": floors,
        "step_ms": steps,
        "step_over_floor": {
            "fastgen (exact)": steps["fastgen"] / floors["exact"],
            "fastgen_fast": steps["fastgen_fast"] / floors["packed"],
        },
    }
    out = args.out or Path(__file__).resolve().parent / "results" / "gemm_floor-bart-base-cpu.json"
    write_result(out, report)
    sys.stdout.write(json.dumps({k: report[k] for k in ("floor_ms_per_step", "step_ms", "step_over_floor")}) + "\n")
    sys.stdout.write(f"load {load}\n")


if __name__ == "__main__":
    main()
