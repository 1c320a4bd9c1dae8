"""Upstream vs fastgen without its ``beam`` loop vs fastgen with it (the default), one process.

    python -m benchmarks.beam_loop --scenario bart-base [--rounds 4] [--out FILE.json]
    python -m benchmarks.beam_loop --scenario bart-base-varlen [--rounds 3]
    python -m benchmarks.beam_loop --scenario bart-base --no-dedup [--no-repeat 0]   # the loop alone

``--no-dedup`` compares upstream with the loop where ``dedup`` is unavailable (as when a release
switched it off): ``beam`` alone and ``beam`` + ``ngram``. ``--no-repeat N`` overrides the scenario's
``no_repeat_ngram_size`` (0: none).

The three variants run in a rotating order each round after a warm-up. Wall time and this thread's
CPU time are both recorded: on a shared, loaded machine the wall clock mostly measures waiting for
a core, the thread CPU time what the code costs. The fixed-length scenarios (benchmarks.scenarios)
force the length (min_new_tokens == max_new_tokens) and return dicts, so no input leaves the batch:
they time the fused step, the in-place bans and the prefix-only gathers. ``bart-base-varlen``
(benchmarks.varlen) stops naturally at input-dependent steps and returns plain tensors, so finished
inputs leave the batch under ``beam``; it also counts the decoder rows each variant runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import types
from pathlib import Path

import torch

import fastgen
from benchmarks import varlen
from benchmarks.measure import alternate, environment, result_header, write_result
from benchmarks.scenarios import SCENARIOS

VARLEN = "bart-base-varlen"
VARLEN_SETTINGS = {"batch": 8, "input_len": 256, "new_tokens": 48}

VARIANTS: dict[str, list[str] | None] = {
    "upstream": None,
    # names from when the loop was opt-in (kept: the committed results use them): "default" is every
    # default feature but the loop, "default+beam" every default feature
    "default": sorted(set(fastgen.known_features()) - fastgen.optimizer.registry.OPT_IN_FEATURES - {"beam"}),
    "default+beam": sorted(set(fastgen.known_features()) - fastgen.optimizer.registry.OPT_IN_FEATURES | {"beam"}),
}

#: the loop without dedup: never slower than upstream (issue 16, item 6)
NO_DEDUP_VARIANTS: dict[str, list[str] | None] = {"upstream": None, "beam": ["beam"], "beam+ngram": ["beam", "ngram"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    choices = [n for n in SCENARIOS if n != "fairseq-transformer"] + [VARLEN]
    parser.add_argument("--scenario", default="bart-base", choices=choices)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-dedup", action="store_true", help="variants without dedup: beam, beam+ngram")
    parser.add_argument("--no-repeat", type=int, default=None, help="override no_repeat_ngram_size (0: none)")
    args = parser.parse_args(argv)
    variants = NO_DEDUP_VARIANTS if args.no_dedup else VARIANTS
    torch.set_num_threads(1)
    selection, count_rows = None, None
    if args.scenario == VARLEN:
        settings = dict(VARLEN_SETTINGS)
        generate = _generate_settings(SCENARIOS["bart-base"].generate, args.no_repeat)
        model, inputs, kwargs, selection = varlen.prepare(**settings, generate=generate)
        settings["generate"] = generate

        def call():
            return types.SimpleNamespace(sequences=model.generate(**inputs, **kwargs))

        def count_rows(variant: str) -> int:
            """Decoder rows (hypotheses x steps) one call runs."""
            rows = [0]

            def record(module, args, kwargs):
                ids = kwargs.get("input_ids", args[0] if args else None)
                rows[0] += ids.shape[0]

            handle = model.model.decoder.register_forward_pre_hook(record, with_kwargs=True)
            try:
                run(variant)
            finally:
                handle.remove()
            return rows[0]
    else:
        scenario = SCENARIOS[args.scenario]
        scenario = dataclasses.replace(scenario, generate=_generate_settings(scenario.generate, args.no_repeat))
        settings = scenario.settings("cpu") | {"generate": scenario.generate}
        call = scenario.prepare("cpu", torch.float32, settings)

    def run(variant: str):
        features = variants[variant]
        scope = fastgen.unpatched() if features is None else fastgen.patched(features)
        with scope, torch.inference_mode():
            start, start_cpu = time.perf_counter(), time.thread_time()
            out = call()
            return out, time.perf_counter() - start, time.thread_time() - start_cpu

    names = list(variants)
    rounds = alternate(run, names, args.rounds)
    outputs, load = rounds.outputs, rounds.load_average
    wall = {name: rounds.column(name, 0) for name in names}
    cpu = {name: rounds.column(name, 1) for name in names}
    medians = {name: statistics.median(wall[name]) for name in names}
    cpu_medians = {name: statistics.median(cpu[name]) for name in names}
    report = result_header("beam_loop", argv) | {
        "scenario": args.scenario,
        "settings": settings,
        "variants": variants,
        "environment": environment("cpu"),
        "load_average": load,
        "identical_outputs": all(torch.equal(outputs["upstream"].sequences, outputs[n].sequences) for n in names),
        "wall_seconds": wall,
        "thread_cpu_seconds": cpu,
        "speedup_wall": {n: medians["upstream"] / medians[n] for n in names[1:]},
        "speedup_thread_cpu": {n: cpu_medians["upstream"] / cpu_medians[n] for n in names[1:]},
    }
    if selection is not None:
        lengths = varlen.natural_lengths(outputs["upstream"].sequences, pad=1)
        rows = {name: count_rows(name) for name in names}
        report["variable_length"] = {
            "how": varlen.__doc__,
            "natural_lengths_upstream": lengths,
            "target_lengths": [round(t, 1) for t in selection["targets"]],
            "pool_lengths_upstream": selection["pool_lengths"],
            "decoder_rows": rows,
            "decoder_rows_skipped_vs_upstream": {n: 1 - rows[n] / rows["upstream"] for n in names[1:]},
        }
        sys.stdout.write(f"natural lengths {lengths}; decoder rows {rows}\n")
    suffix = ("-nodedup" if args.no_dedup else "") + (
        f"-norepeat{args.no_repeat}" if args.no_repeat is not None else ""
    )
    out = args.out or Path(__file__).resolve().parent / "results" / f"beam_loop-{args.scenario}{suffix}-cpu.json"
    write_result(out, report)
    for name in names:
        sys.stdout.write(
            f"{name:>13}: wall median {medians[name]:.3f} s, thread CPU median {cpu_medians[name]:.3f} s\n"
        )
    sys.stdout.write(
        f"speedup wall {report['speedup_wall']}, thread CPU {report['speedup_thread_cpu']}; "
        f"identical outputs: {report['identical_outputs']}; load {load['start']} -> {load['end']}\n"
    )


def _generate_settings(generate: dict, no_repeat: int | None) -> dict:
    settings = dict(generate)
    if no_repeat is not None:
        settings.pop("no_repeat_ngram_size", None)
        if no_repeat:
            settings["no_repeat_ngram_size"] = no_repeat
    return settings


if __name__ == "__main__":
    main()
