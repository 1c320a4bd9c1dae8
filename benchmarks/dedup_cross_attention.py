"""Beam-shared cross-attention ("dedup") vs upstream on a random encoder-decoder model.

Alternates upstream (``fastgen.unpatched()``) and fastgen runs in one process after a warm-up,
forcing equal work (``min_new_tokens == max_new_tokens``), and reports median wall time and the
K/V cache bytes at the end of generation (self- and cross-attention separately).

    python -m benchmarks.dedup_cross_attention --shape bart-base --batch 2 --src-len 256 --beams 4 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers

import fastgen
from fastgen.models.encoder_decoder import cache_nbytes

SHAPES: dict[str, dict[str, Any]] = {
    "bart-base": dict(
        vocab_size=50265,
        d_model=768,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=12,
        decoder_attention_heads=12,
        encoder_ffn_dim=3072,
        decoder_ffn_dim=3072,
        max_position_embeddings=1024,
    ),
    "bart-large": dict(
        vocab_size=50265,
        d_model=1024,
        encoder_layers=12,
        decoder_layers=12,
        encoder_attention_heads=16,
        decoder_attention_heads=16,
        encoder_ffn_dim=4096,
        decoder_ffn_dim=4096,
        max_position_embeddings=1024,
    ),
}


def _run(
    model: transformers.PreTrainedModel, inputs: dict[str, torch.Tensor], kwargs: dict[str, Any]
) -> tuple[float, float, Any]:
    """Wall seconds, process CPU seconds (less sensitive to other tenants of a shared machine), output."""
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(**inputs, **kwargs)
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bart-base")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--src-len", type=int, default=256)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = transformers.BartConfig(**SHAPES[args.shape], dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).eval()
    model.set_attn_implementation(args.attn)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(4, config.vocab_size, (args.batch, args.src_len), generator=generator)
    mask = torch.ones_like(ids)
    mask[1:, args.src_len - args.src_len // 8 :] = 0  # pad the tail of rows > 0
    inputs = {"input_ids": ids.masked_fill(mask == 0, config.pad_token_id), "attention_mask": mask}
    kwargs = dict(
        num_beams=args.beams,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        no_repeat_ngram_size=3,
        return_dict_in_generate=True,
        output_scores=True,
    )

    with fastgen.patched(["dedup"]):
        _run(model, inputs, {**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
    times: dict[str, list[float]] = {"upstream": [], "fastgen": []}
    cpu_times: dict[str, list[float]] = {"upstream": [], "fastgen": []}
    outputs: dict[str, Any] = {}
    for _ in range(args.repeats):
        for name, context in (("upstream", fastgen.unpatched), ("fastgen", lambda: fastgen.patched(["dedup"]))):
            with context():
                wall, cpu, outputs[name] = _run(model, inputs, kwargs)
            times[name].append(wall)
            cpu_times[name].append(cpu)

    same = torch.equal(outputs["upstream"].sequences, outputs["fastgen"].sequences)
    score_diff = (outputs["upstream"].sequences_scores - outputs["fastgen"].sequences_scores).abs().max().item()
    up_self, up_cross = cache_nbytes(outputs["upstream"].past_key_values)
    fg_self, fg_cross = cache_nbytes(outputs["fastgen"].past_key_values)
    median = {k: statistics.median(v) for k, v in times.items()}
    median_cpu = {k: statistics.median(v) for k, v in cpu_times.items()}
    tokens = args.batch * args.new_tokens
    result = {
        "scenario": "dedup_cross_attention",
        "command": "python -m benchmarks.dedup_cross_attention "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None),
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "fastgen": fastgen.__version__,
        },
        "settings": {**vars(args), "out": None, "no_repeat_ngram_size": 3, "equal_work": "min=max_new_tokens"},
        "same_sequences": same,
        "max_sequence_score_diff": score_diff,
        "seconds": times,
        "median_seconds": median,
        "speedup": median["upstream"] / median["fastgen"],
        "cpu_seconds": cpu_times,
        "median_cpu_seconds": median_cpu,
        "speedup_cpu_time": median_cpu["upstream"] / median_cpu["fastgen"],
        "tokens_per_s": {k: tokens / v for k, v in median.items()},
        "cache_bytes": {
            "upstream": {"self": up_self, "cross": up_cross},
            "fastgen": {"self": fg_self, "cross": fg_cross},
            "cross_ratio": fg_cross / up_cross,
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
