"""Continuous batching of a decoder-only model (issue 19) against static batches and Transformers' own.

    python -m benchmarks.continuous_decoder_only --shape gpt2 --inputs 200 --batch-size 16

A "file" of ``--inputs`` random prompts (token counts uniform in ``[--min-input, --max-input]``) is
generated four ways (greedy; ``--do-sample``: sampling, each variant from its own random streams,
so "equal outputs" means nothing there), alternating in one process (round-robin, medians):

- ``continuous``: :func:`fastgen.generate_many` with ``batch_size`` rows, fed longest prompt first;
- ``static-fastgen``: ``model.generate`` (fastgen on) on consecutive length-sorted, left-padded batches
  of ``batch_size`` prompts;
- ``static-upstream``: the same batches under ``fastgen.unpatched()``;
- ``hf-generate-batch``: Transformers 5.24's own continuous batching, ``model.generate_batch(...)``
  (paged attention cache, its own scheduler and batch sizing; unpatched). It runs on CPU: without
  ``psutil`` it logs that it cannot size its cache from free memory and uses its defaults, and its
  manager start-up (cache allocation, warm-up) is inside the timed call, as a user pays it.

Outputs end at naturally different lengths: the LM head's EOS row is scaled by ``--eos-gain`` (the
EOS logit then follows the hidden state, which depends on the prompt; nothing forces the length).
Reported per variant: seconds (wall and process CPU), samples/s, new tokens/s (up to and including
EOS), forwards, the average rows per decode step (forwards of one query token per row) and, for the
packed ``generate_batch`` steps, the average query tokens per forward; how many outputs (new tokens up
to EOS) equal the continuous ones (static batches left-pad, so their last bits, and rarely a token,
may differ from the single-prompt run that continuous batching reproduces).

The model is built in fp32 with random weights from the scenarios' shapes; ``gpt2-3l``/``llama-2l``
keep the width and vocabulary with fewer layers, for a shared CPU.
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
from benchmarks.measure import environment, length_summary, rotating_order, run_heading
from benchmarks.scenarios import SCENARIOS
from fastgen.cli import heap

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("continuous", "static-fastgen", "static-upstream", "hf-generate-batch")

#: the scenarios' GPT-2 small and Llama shapes, untied LM heads (the EOS gain then scales only the output row)
_GPT2 = dict(SCENARIOS["gpt2"].config, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
_LLAMA = dict(SCENARIOS["llama"].config, tie_word_embeddings=False)
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", _GPT2),
    "gpt2-3l": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT2, n_layer=3)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA),
    "llama-2l": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA, num_hidden_layers=2)),
}


def build(shape: str, eos_gain: float, seed: int) -> Any:
    config_name, model_name, config = SHAPES[shape]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**config)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight[model.config.eos_token_id] *= eos_gain
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    return model


def make_inputs(count: int, low: int, high: int, vocab: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab - 1, (n,), generator=generator) for n in lengths]


class ForwardCounter:
    """Model forwards, the rows of decode steps (one query token per row) and all query tokens."""

    def __init__(self, model: Any) -> None:
        self.forwards = self.decode_steps = self.decode_rows = self.query_tokens = 0
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, args: Any, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        self.forwards += 1
        self.query_tokens += ids.numel()
        if ids.shape[1] == 1:
            self.decode_steps += 1
            self.decode_rows += ids.shape[0]

    def close(self) -> None:
        self._handle.remove()


def new_tokens(sequence: list[int], eos: int) -> list[int]:
    """Generated tokens up to and including the first EOS (padding after it excluded)."""
    return sequence[: sequence.index(eos) + 1] if eos in sequence else sequence


def run_variant(name: str, model: Any, ordered: list[torch.Tensor], args: argparse.Namespace) -> list[list[int]]:
    """Each prompt's new tokens (up to EOS)."""
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    kwargs = dict(num_beams=1, do_sample=args.do_sample, max_new_tokens=args.max_new_tokens)
    torch.manual_seed(args.seed)  # sampling: each variant draws from its own streams (outputs not comparable)
    if name == "continuous":
        results = fastgen.generate_many(model, ordered, batch_rows=args.batch_size, seed=args.seed, **kwargs)
        return [new_tokens(r[0, len(ids) :].tolist(), eos) for ids, r in zip(ordered, results, strict=True)]
    if name == "hf-generate-batch":
        config = transformers.GenerationConfig(
            max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, eos_token_id=eos, pad_token_id=pad
        )
        with fastgen.unpatched(), torch.inference_mode():
            out = model.generate_batch(inputs=[ids.tolist() for ids in ordered], generation_config=config)
        return [new_tokens(list(out[f"req_{i}"].generated_tokens), eos) for i in range(len(ordered))]
    outputs: list[list[int]] = []
    for start in range(0, len(ordered), args.batch_size):
        chunk = ordered[start : start + args.batch_size]
        width = max(len(ids) for ids in chunk)
        batch = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for row, ids in enumerate(chunk):
            batch[row, width - len(ids) :], mask[row, width - len(ids) :] = ids, 1
        with torch.inference_mode():
            if name == "static-upstream":
                with fastgen.unpatched():
                    out = model.generate(input_ids=batch, attention_mask=mask, **kwargs)
            else:
                out = model.generate(input_ids=batch, attention_mask=mask, **kwargs)
        outputs.extend(new_tokens(row[width:].tolist(), eos) for row in out)
    return outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="gpt2")
    parser.add_argument("--inputs", type=int, default=200)
    parser.add_argument("--min-input", type=int, default=8)
    parser.add_argument("--max-input", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per static batch = continuous rows")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--eos-gain", type=float, default=7.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--do-sample", action="store_true", help="sample (upstream's default top_k=50) instead of greedy search"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
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
    model = build(args.shape, args.eos_gain, args.seed)
    inputs = make_inputs(args.inputs, args.min_input, args.max_input, model.config.vocab_size, args.seed + 1)
    ordered = sorted(inputs, key=lambda ids: -len(ids))  # longest first, stable
    names = [v for v in args.variants.split(",") if v]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    outputs: dict[str, list[list[int]]] = {}
    load = [os.getloadavg()[0]]
    for name in names:  # warm-up: one batch through every variant
        run_variant(name, model, ordered[: args.batch_size], args)
    for name in rotating_order(names, args.rounds):
        counter = ForwardCounter(model)
        start, cpu_start = time.perf_counter(), time.process_time()
        result = run_variant(name, model, ordered, args)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        counter.close()
        tokens = sum(len(r) for r in result)
        runs[name].append(
            dict(
                seconds=seconds,
                cpu_seconds=cpu_seconds,
                samples_per_s=len(result) / seconds,
                tokens_per_s=tokens / seconds,
                tokens_per_cpu_s=tokens / cpu_seconds,
                tokens=tokens,
                forwards=counter.forwards,
                avg_rows_per_decode_step=counter.decode_rows / max(counter.decode_steps, 1),
                avg_query_tokens_per_forward=counter.query_tokens / max(counter.forwards, 1),
            )
        )
        load.append(os.getloadavg()[0])
        outputs[name] = result
        print(name, json.dumps(runs[name][-1]), f"load {load[-1]:.2f}", flush=True)

    summary: dict[str, Any] = {}
    for name in names:
        summary[name] = {key: statistics.median(r[key] for r in runs[name]) for key in runs[name][0]}
    reference = outputs.get("continuous")
    if reference is not None:
        for name in names:
            summary[name]["outputs_equal_to_continuous"] = sum(
                a == b for a, b in zip(reference, outputs[name], strict=True)
            )
            if name != "continuous":
                summary[f"speedup_vs_{name}"] = summary[name]["seconds"] / summary["continuous"]["seconds"]
    lengths = [len(r) for r in outputs[names[0]]]
    result = {
        "benchmark": "continuous_decoder_only",
        "command": "python -m benchmarks.continuous_decoder_only "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment("cpu"),
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
    """The README's table from result files (``python -m benchmarks.continuous_decoder_only --table A.json ...``)."""
    lines = []
    for path in paths:
        data = json.loads(path.read_text())
        median = data["median"]
        lines.append(run_heading(data, "new tokens"))
        lines.append(
            "| variant | wall s | samples/s | tokens/s | CPU s | forwards | rows/decode step | equal outputs |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for name in VARIANTS:
            if name not in median:
                continue
            r = median[name]
            rows = f"{r['avg_rows_per_decode_step']:.1f}" if r["avg_rows_per_decode_step"] else "packed"
            lines.append(
                f"| {name} | {r['seconds']:.0f} | {r['samples_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                f"{r['cpu_seconds']:.0f} | {r['forwards']} | {rows} | "
                f"{r.get('outputs_equal_to_continuous', '-')}/{data['config']['inputs']} |"
            )
        speedups = [
            f"{key[len('speedup_vs_') :]}: {value:.2f}x"
            for key, value in median.items()
            if key.startswith("speedup_vs_")
        ]
        lines.append("\ncontinuous speedup vs " + "; ".join(speedups) + "\n")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
