"""Continuous batching against static batches on the small BART trained here, in each CPU mode, one process.

    OMP_NUM_THREADS=1 python -m benchmarks.continuous_trained [--modes exact,fast,int8] [--beams 4] [--batch-size 8]

The test sentences (natural lengths: the model ends each output with EOS) in the length-sorted order the CLI
plans: static batches of ``--batch-size`` through ``model.generate`` (fastgen's beam loop, finished inputs
leaving the batch) against one :func:`fastgen.generate_many` stream of ``batch size x beams`` rows, the two
alternating for ``--rounds`` after a warm-up of each. Reported per mode: medians, the ratio, and how many outputs
are equal (they must all be: greedy and beam search give each input what it gets alone, up to padding).
What the CLI's default choice rests on (``fastgen.cli.continuous_hf.prefers_static``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers

import fastgen
from benchmarks import train_small_model as trained
from benchmarks.measure import environment, load_average, result_header, write_result

RESULTS = Path(__file__).parent / "results"


def _tokens(row: Any, pad: int) -> list[int]:
    return [int(v) for v in torch.as_tensor(row).reshape(-1) if int(v) != pad]


def measure(model: Any, sources: list[list[int]], mode: str, beams: int, batch: int, rounds: int) -> dict[str, Any]:
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    batches = [trained.source_batch([sources[i] for i in order[b : b + batch]]) for b in range(0, len(order), batch)]
    feed = [torch.tensor(sources[i]) for i in order]
    settings = dict(num_beams=beams, **trained.GENERATE)

    def static() -> list[Any]:
        with fastgen.mode(mode), torch.inference_mode():
            return [row for b in batches for row in model.generate(**b, **settings)]

    def continuous() -> list[Any]:
        with fastgen.mode(mode), torch.inference_mode():
            return list(fastgen.generate_many(model, feed, batch_rows=batch * beams, **settings))

    runs = {"static": static, "continuous": continuous}
    outputs = {name: run() for name, run in runs.items()}  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds):
        for name in list(runs) if round_ % 2 == 0 else list(runs)[::-1]:
            started = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - started)
    pad = model.config.pad_token_id
    pairs = zip(outputs["static"], outputs["continuous"], strict=True)
    equal = sum(_tokens(a, pad) == _tokens(b, pad) for a, b in pairs)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "seconds": seconds,
        "median_s": medians,
        "continuous_speed_vs_static": medians["static"] / medians["continuous"],
        "equal_outputs": f"{equal}/{len(feed)}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=trained.DEFAULT_OUT)
    parser.add_argument("--modes", default="exact,fast,int8")
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="inputs per static batch (continuous: x beams rows)")
    parser.add_argument("--sentences", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = transformers.BartForConditionalGeneration.from_pretrained(args.model_dir / "hf").eval()
    sources = [row["source_ids"] for row in trained.load_test(args.model_dir)[: args.sentences]]
    result = result_header("continuous_trained", argv) | {"environment": environment("cpu")}
    result["settings"] = {k: v for k, v in vars(args).items() if k not in ("model_dir", "out")}
    result["load_average"] = {"start": load_average()}
    for mode in args.modes.split(","):
        result[mode] = measure(model, sources, mode, args.beams, args.batch_size, args.rounds)
        row = result[mode]
        print(
            f"{mode:6s} static {row['median_s']['static']:.3f} s, continuous {row['median_s']['continuous']:.3f} s: "
            f"continuous {row['continuous_speed_vs_static']:.2f}x static, equal outputs {row['equal_outputs']}",
            flush=True,
        )
    result["load_average"]["end"] = load_average()
    search = "greedy" if args.beams == 1 else f"beam{args.beams}"
    out = args.out or RESULTS / f"continuous_trained-{search}-b{args.batch_size}-{args.threads}t.json"
    write_result(out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
