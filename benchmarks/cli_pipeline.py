"""End-to-end files-in/files-out throughput: the CLIs' pipeline vs a serial path, same model and data.

    OMP_NUM_THREADS=1 python -m benchmarks.cli_pipeline [--sentences 400] [--reps 3]

fairseq: upstream ``fairseq_cli.generate.main`` (unpatched), the same with fastgen's kernels
(patched), ``fastgen-generate --no-pipeline`` (fastgen's code, synchronous), and the pipeline with
post-processing in the background thread or in a worker process. HF: a plain loop over
``generate`` + ``batch_decode`` (unpatched, patched) and ``fastgen-generate-hf`` in the same three
modes. Each variant is timed from the call to the written output (model loading included, the
interpreter's imports not), variants alternate, medians are reported. Writes
``benchmarks/results/cli-pipeline-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _results(text: str) -> str:
    from tests.cli.fairseq_setup import results_only

    return "".join(
        line for line in results_only(text).splitlines(keepends=True) if line[:2] in {"S-", "T-", "H-", "D-", "P-"}
    )


def fairseq_variants(root: Path, sentences: int, batch: int) -> tuple[dict, dict]:
    import fastgen
    from fastgen.cli.generate import main as fastgen_main
    from tests.cli import fairseq_setup

    setup = fairseq_setup.build(root, test_size=sentences, configs={})
    base = [*fairseq_setup.base_args(setup), "--beam", "4", "--batch-size", str(batch), "--no-progress-bar"]
    base += ["--num-workers", "0"]  # fairseq's DataLoader process start-up is noise here
    base[base.index("--max-len-b") + 1] = "24"

    def upstream(out: Path, patched: bool) -> None:
        from fairseq import options
        from fairseq_cli.generate import main

        parser = options.get_generation_parser()
        parser.add_argument("--arch", "-a", default="wav2vec2")
        args = options.parse_args_and_arch(parser, [*base, "--results-path", str(out)])
        if patched:
            main(args)
        else:
            with fastgen.unpatched():
                main(args)

    variants = {
        "fairseq-generate (upstream)": lambda out: upstream(out, False),
        "fairseq-generate + fastgen kernels": lambda out: upstream(out, True),
        "fastgen-generate --no-pipeline": lambda out: fastgen_main(
            [*base, "--results-path", str(out), "--no-pipeline"]
        ),
        "fastgen-generate, pipeline, post-process in a thread": lambda out: fastgen_main(
            [*base, "--results-path", str(out), "--postprocess-workers", "0"]
        ),
        "fastgen-generate, pipeline, 1 worker process": lambda out: fastgen_main(
            [*base, "--results-path", str(out), "--postprocess-workers", "1"]
        ),
    }
    return variants, {
        "sentences": sentences,
        "batch_size": batch,
        "beam": 4,
        "max_len_b": 24,
        "model": "fairseq transformer 1+1 layers, d=16 (3 updates)",
    }


def hf_variants(root: Path, sentences: int, batch: int) -> tuple[dict, dict]:
    import fastgen
    from fastgen.cli.generate_hf import main as hf_main
    from scripts import make_tiny_model

    model_dir = make_tiny_model.make(root / "bart", "bart")
    inputs = root / "inputs.txt"
    inputs.write_text("\n".join(make_tiny_model.sentences(sentences, seed=5, max_words=16)) + "\n")
    kwargs = {"num_beams": 4, "max_new_tokens": 16}

    def plain_loop(out: Path, patched: bool) -> None:
        from fastgen.cli.generate_hf import load_model, load_tokenizer

        tokenizer = load_tokenizer(model_dir, False)
        model = load_model(model_dir, "cpu", "float32")
        lines = inputs.read_text().splitlines()
        with open(out, "w") as handle:
            for start in range(0, len(lines), batch):
                enc = tokenizer(lines[start : start + batch], return_tensors="pt", padding=True)
                if patched:
                    ids = model.generate(**enc, **kwargs)
                else:
                    with fastgen.unpatched():
                        ids = model.generate(**enc, **kwargs)
                handle.writelines(t + "\n" for t in tokenizer.batch_decode(ids, skip_special_tokens=True))

    cli = [str(model_dir), "--input", str(inputs), "--batch-size", str(batch), "--num-beams", "4"]
    cli += ["--max-new-tokens", "16", "--no-progress-bar"]
    variants = {
        "plain generate+batch_decode loop (upstream)": lambda out: plain_loop(out, False),
        "plain loop + fastgen kernels": lambda out: plain_loop(out, True),
        "fastgen-generate-hf --no-pipeline": lambda out: hf_main([*cli, "--output", str(out), "--no-pipeline"]),
        "fastgen-generate-hf, pipeline, post-process in a thread": lambda out: hf_main(
            [*cli, "--output", str(out), "--postprocess-workers", "0"]
        ),
        "fastgen-generate-hf, pipeline, 1 worker process": lambda out: hf_main(
            [*cli, "--output", str(out), "--postprocess-workers", "1"]
        ),
    }
    return variants, {
        "sentences": sentences,
        "batch_size": batch,
        **kwargs,
        "model": "tiny random BART 2+2 layers, d=32",
    }


def measure(variants: dict, reps: int, root: Path, sentences: int, hf: bool) -> dict:
    times: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict[str, str] = {}
    for rep in range(reps + 1):  # rep 0 warms up
        for i, (name, run) in enumerate(variants.items()):
            out = root / f"out-{i}-{rep}"
            start = time.perf_counter()
            run(out)
            elapsed = time.perf_counter() - start
            if rep:
                times[name].append(elapsed)
            outputs[name] = out.read_text() if hf else _results((out / "generate-test.txt").read_text())
    first = next(iter(outputs.values()))
    rows = {}
    for name, values in times.items():
        median = statistics.median(values)
        rows[name] = {"seconds": values, "median_s": median, "samples_per_s": sentences / median}
    base = next(iter(rows.values()))["median_s"]
    for row in rows.values():
        row["speedup_vs_first"] = base / row["median_s"]
    return {"variants": rows, "identical_outputs": all(text == first for text in outputs.values())}


def readme_table(result: dict) -> str:
    """The CLI benchmark table of the docs (docs/benchmarks/cli-pipeline.md), from the JSON."""
    env = result["environment"]
    rows = ["| framework | variant | median s | samples/s | vs first row | runs (s) |", "|---|---|---|---|---|---|"]
    for framework in ("fairseq", "hf"):
        for name, v in result[framework]["variants"].items():
            runs = ", ".join(f"{x:.2f}" for x in v["seconds"])
            rows.append(
                f"| {framework} | {name} | {v['median_s']:.2f} | {v['samples_per_s']:.1f} | "
                f"{v['speedup_vs_first']:.2f}× | {runs} |"
            )
    return (
        f"`{result['command']}` ({env['device']}, {env['cpu_count']} cores, {env['torch_threads']} torch thread, "
        f"load average {' '.join(env['loadavg_before'])} before, {' '.join(env['loadavg_after'])} after; commit "
        f"{env['git_commit']}; identical outputs across variants: fairseq {result['fairseq']['identical_outputs']}, "
        f"HF {result['hf']['identical_outputs']}):\n\n" + "\n".join(rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sentences", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--table", action="store_true", help="only print the docs' table of the committed JSON")
    args = parser.parse_args()
    path = ROOT / "benchmarks" / "results" / "cli-pipeline-cpu.json"
    if args.table:  # the docs build renders it (benchmarks.report, docs/benchmarks/cli-pipeline.md)
        print(readme_table(json.loads(path.read_text())))
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = {
        "benchmark": "cli-pipeline",
        "command": " ".join(
            [
                "OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "?"),
                "python -m benchmarks.cli_pipeline",
                *sys.argv[1:],
            ]
        ),
        "environment": {
            "device": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
            "git_commit": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
            ).stdout.strip(),
        },
        "note": "shared 2-core machine loaded by other jobs; timings include model loading and output writing, "
        "not imports. HF outputs are compared line by line (both in input order; the plain loop batches in input "
        "order, the CLI by length, so padding differs).",
    }
    with tempfile.TemporaryDirectory() as tmp:
        variants, settings = fairseq_variants(Path(tmp) / "fairseq", args.sentences, args.batch_size)
        result["fairseq"] = {
            "settings": settings,
            **measure(variants, args.reps, Path(tmp) / "fairseq", args.sentences, hf=False),
        }
        variants, settings = hf_variants(Path(tmp) / "hf", args.sentences, args.batch_size)
        result["hf"] = {"settings": settings, **measure(variants, args.reps, Path(tmp) / "hf", args.sentences, hf=True)}
    result["environment"]["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
