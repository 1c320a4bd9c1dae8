"""Continuous batching (issue 19) against static length-sorted batches, fastgen and upstream, on one file.

    python -m benchmarks.continuous_batching --shape bart-base --inputs 200 --beams 4 --batch-size 16

A "file" of ``--inputs`` random inputs (token counts uniform in ``[--min-input, --max-input]``) is
generated three ways, alternating in one process (round-robin, medians):

- ``continuous``: :func:`fastgen.generate_many` with ``batch_size x beams`` decoder rows, fed in the
  length-sorted order the CLI plans;
- ``static-fastgen``: ``model.generate`` (fastgen on: shared cross K/V, its beam loop with finished
  inputs leaving the batch) on consecutive length-sorted batches of ``batch_size`` inputs;
- ``static-upstream``: the same batches under ``fastgen.unpatched()``.

Outputs end at naturally different lengths: the LM head's EOS row is scaled by ``--eos-gain``, so the
EOS logit follows the decoder state, which depends on the input (nothing forces the length; the
histogram of output lengths is in the JSON). Reported per variant: seconds, samples/s, generated
tokens/s (tokens after the decoder start, up to and including EOS), decoder steps and the average
rows per decoder step (a forward pre-hook on the decoder counts them), and how many outputs equal
the continuous ones.

On a shared machine the wall-clock figures move with the other processes' load (recorded); the
process CPU time (``time.process_time``, one torch thread) moves much less, so both are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

import fastgen
from benchmarks.measure import (
    environment,
    length_summary,
    rotating_order,
    run_heading,
    synchronize,
)
from benchmarks.scenarios import SCENARIOS
from fastgen.cli import heap

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("continuous", "static-fastgen", "static-upstream")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

#: the scenarios' bart-base shape, dropout off (the model is built in eval mode anyway) and an untied
#: LM head, so the EOS gain in :func:`build` scales only the output row
_BART_BASE = dict(
    SCENARIOS["bart-base"].config, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, tie_word_embeddings=False
)
SHAPES: dict[str, dict[str, Any]] = {
    "bart-base": _BART_BASE,
    # bart-base's width and vocabulary with half the layers (for a shared CPU)
    "bart-base-3l": dict(_BART_BASE, encoder_layers=3, decoder_layers=3),
    # a small BART (d=384, 3+3 layers, bart's vocabulary): a step's fixed cost is a larger share (issue 24)
    "bart-small": dict(
        _BART_BASE,
        d_model=384,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
        encoder_layers=3,
        decoder_layers=3,
    ),
}


def build(shape: str, eos_gain: float, seed: int, device: str = "cpu", dtype: str = "fp32") -> Any:
    torch.manual_seed(seed)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(**SHAPES[shape])).eval()
    with torch.no_grad():
        model.lm_head.weight[2] *= eos_gain
    model.generation_config.pad_token_id = 1
    return model.to(device=device, dtype=DTYPES[dtype])


def make_inputs(count: int, low: int, high: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, 50000, (n,), generator=generator) for n in lengths]


class RowCounter:
    """Decoder forwards and the rows they carry (a forward pre-hook on the decoder)."""

    def __init__(self, model: Any) -> None:
        self.steps = self.rows = 0
        self._handle = model.get_decoder().register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, args: Any, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.steps += 1
            self.rows += ids.shape[0]

    def close(self) -> None:
        self._handle.remove()


def generated_tokens(sequence: torch.Tensor, pad: int, eos: int) -> int:
    """Tokens after the decoder start, up to and including the first EOS (padding excluded)."""
    row = sequence[1:].tolist()
    if eos in row:
        return row.index(eos) + 1
    while row and row[-1] == pad:
        row.pop()
    return len(row)


def run_variant(name: str, model: Any, ordered: list[torch.Tensor], args: argparse.Namespace) -> list[torch.Tensor]:
    kwargs = dict(num_beams=args.beams, max_new_tokens=args.max_new_tokens)
    if args.no_repeat_ngram_size:
        kwargs["no_repeat_ngram_size"] = args.no_repeat_ngram_size
    if name == "continuous":
        return [r[0] for r in fastgen.generate_many(model, ordered, batch_rows=args.batch_size * args.beams, **kwargs)]
    outputs: list[torch.Tensor] = []
    for start in range(0, len(ordered), args.batch_size):
        chunk = ordered[start : start + args.batch_size]
        width = max(len(ids) for ids in chunk)
        batch = torch.full((len(chunk), width), 1, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for row, ids in enumerate(chunk):
            batch[row, : len(ids)], mask[row, : len(ids)] = ids, 1
        batch, mask = batch.to(model.device), mask.to(model.device)
        with torch.inference_mode():
            if name == "static-upstream":
                with fastgen.unpatched():
                    out = model.generate(input_ids=batch, attention_mask=mask, **kwargs)
            else:
                out = model.generate(input_ids=batch, attention_mask=mask, **kwargs)
        outputs.extend(out)
    return outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="bart-base")
    parser.add_argument("--inputs", type=int, default=200)
    parser.add_argument("--min-input", type=int, default=8)
    parser.add_argument("--max-input", type=int, default=64)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="inputs per static batch (continuous: x beams rows)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-repeat-ngram-size", type=int, default=0)
    parser.add_argument("--eos-gain", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument(
        "--heap",
        choices=("cli", "default"),
        default="cli",
        help="cli: malloc thresholds as fastgen-generate-hf sets them (fastgen.cli.heap); default: glibc's",
    )
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--table", type=Path, nargs="+", default=None, help="print the README table of these results")
    args = parser.parse_args(argv)
    if args.table:
        print(readme_table(args.table))
        return 0

    heap_set = args.heap == "cli" and heap.keep_freed_memory()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA device is available")
    model = build(args.shape, args.eos_gain, args.seed, args.device, args.dtype)
    inputs = make_inputs(args.inputs, args.min_input, args.max_input, args.seed + 1)
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))  # the CLI's plan: longest first, stable
    ordered = [inputs[i] for i in order]
    names = [v for v in args.variants.split(",") if v]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    outputs: dict[str, list[torch.Tensor]] = {}
    load = [os.getloadavg()[0]]
    # warm-up: a few inputs through every variant
    for name in names:
        run_variant(name, model, ordered[: args.batch_size], args)
    for name in rotating_order(names, args.rounds):
        counter = RowCounter(model)
        start, cpu_start = time.perf_counter(), time.process_time()
        result = run_variant(name, model, ordered, args)
        synchronize(args.device)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        counter.close()
        tokens = sum(generated_tokens(seq, 1, 2) for seq in result)
        runs[name].append(
            dict(
                seconds=seconds,
                cpu_seconds=cpu_seconds,
                samples_per_s=len(result) / seconds,
                tokens_per_s=tokens / seconds,
                samples_per_cpu_s=len(result) / cpu_seconds,
                tokens_per_cpu_s=tokens / cpu_seconds,
                tokens=tokens,
                decoder_steps=counter.steps,
                avg_rows_per_step=counter.rows / max(counter.steps, 1),
            )
        )
        load.append(os.getloadavg()[0])
        outputs[name] = result
        print(name, json.dumps(runs[name][-1]), f"load {load[-1]:.2f}", flush=True)

    summary: dict[str, Any] = {}
    for name in names:
        summary[name] = {key: statistics.median(r[key] for r in runs[name]) for key in runs[name][0]}
        if args.rounds > 1:  # the first pass meets every shape first (kernel compilations); the last is warm
            summary[name]["last_round_seconds"] = runs[name][-1]["seconds"]
    reference = outputs.get("continuous")
    if reference is not None:
        for name in names:
            same = sum(
                torch.equal(a[: generated_tokens(a, 1, 2) + 1], b[: generated_tokens(b, 1, 2) + 1])
                for a, b in zip(reference, outputs[name], strict=True)
            )
            summary[name]["outputs_equal_to_continuous"] = same
    if "continuous" in summary:
        for name in names:
            if name != "continuous":
                summary[f"speedup_vs_{name}"] = summary[name]["seconds"] / summary["continuous"]["seconds"]
                summary[f"cpu_speedup_vs_{name}"] = summary[name]["cpu_seconds"] / summary["continuous"]["cpu_seconds"]
    lengths = [generated_tokens(seq, 1, 2) for seq in outputs[names[0]]]
    result = {
        "benchmark": "continuous_batching",
        "command": "python -m benchmarks.continuous_batching " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(args.device),
        "config": vars(args) | {"output": str(args.output) if args.output else None, "heap_thresholds_set": heap_set},
        "load_1min": load,
        "output_lengths": length_summary(lengths),
        "input_lengths": {"min": min(map(len, inputs)), "max": max(map(len, inputs))},
        "runs": runs,
        "median": summary,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


def readme_table(paths: list[Path]) -> str:
    """The README's table from result files (``python -m benchmarks.continuous_batching --table A.json ...``)."""
    lines = []
    for path in paths:
        data = json.loads(path.read_text())
        config, median = data["config"], data["median"]
        lines.append(run_heading(data, "output lengths"))
        lines.append(
            "| variant | wall s | samples/s | tokens/s | CPU s | tokens/CPU s | steps | rows/step | equal outputs |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for name in VARIANTS:
            if name not in median:
                continue
            r = median[name]
            lines.append(
                f"| {name} | {r['seconds']:.0f} | {r['samples_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                f"{r.get('cpu_seconds', float('nan')):.0f} | {r.get('tokens_per_cpu_s', float('nan')):.1f} | "
                f"{r['decoder_steps']:.0f} | {r['avg_rows_per_step']:.1f} | "
                f"{r.get('outputs_equal_to_continuous', '-')}/{config['inputs']} |"
            )
        ratios = [
            f"{key.replace('_', ' ')}: {value:.2f}x"
            for key, value in median.items()
            if key.startswith(("speedup", "cpu_"))
        ]
        lines.append("\n" + "; ".join(ratios) + "\n")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
