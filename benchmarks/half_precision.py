"""How close fastgen stays to upstream in bf16/fp16, next to how close upstream stays to itself.

fastgen promises identical tokens in fp32 only: in half precision a different (equally valid)
summation order flips near-ties. The yardstick is upstream against itself under changes it treats as
harmless: the same rows generated one at a time instead of batched, and eager attention instead of
sdpa (sdpa instead of eager where eager is the default; skipped where the model has no sdpa). For
each family and dtype this prints and saves, per comparison, the share of rows whose generated
tokens are identical and the mean share of each row's tokens before its first difference.

    python -m benchmarks.half_precision [--families bart,llama] [--dtypes bfloat16,float16,float32]

Models are random (tiny test configs, plus wider "medium" ones), beam search with 4 beams and
``min_new_tokens == max_new_tokens`` so every run does the same work.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import transformers

import fastgen
from benchmarks.measure import environment
from tests import harness

RESULTS = Path(__file__).parent / "results" / "half_precision-cpu.json"
#: Wider random models: more heads and features, so rounding is not dominated by a 32-wide toy.
MEDIUM = {
    "bart-medium": ("bart", dict(d_model=256, encoder_attention_heads=8, decoder_attention_heads=8,
                                 encoder_ffn_dim=1024, decoder_ffn_dim=1024, encoder_layers=3, decoder_layers=3,
                                 init_std=0.02)),
    "llama-medium": ("llama", dict(hidden_size=256, intermediate_size=1024, num_attention_heads=8,
                                   num_key_value_heads=4, num_hidden_layers=3, initializer_range=0.05)),
}  # fmt: skip


def _agreement(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, float]:
    """Share of identical rows, and mean share of each row's tokens before its first difference."""
    identical, prefix = 0, 0.0
    for ref, cand in zip(reference, candidate, strict=True):
        identical += ref == cand
        common = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=False)) if a != b), min(len(ref), len(cand)))
        prefix += common / max(len(ref), len(cand), 1)
    return {"rows_identical": identical / len(reference), "prefix_agreement": round(prefix / len(reference), 4)}


def _generate(model: Any, inputs: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> list[list[int]]:
    """The generated tokens of each row (the prompt of a decoder-only model removed, padding kept)."""
    with torch.no_grad():
        out = model.generate(**inputs, **kwargs)
    if not model.config.is_encoder_decoder:
        out = out[:, inputs["input_ids"].shape[1] :]
    return out.tolist()


def _one_by_one(model: Any, inputs: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> list[list[int]]:
    """Each row alone (its padding removed): upstream's batch-1 answer."""
    rows = []
    for row in range(next(iter(inputs.values())).shape[0]):
        single = {k: v[row : row + 1] for k, v in inputs.items()}
        if "attention_mask" in single:
            keep = single["attention_mask"][0].bool()
            single = {k: v[:, keep] for k, v in single.items()}
        rows.extend(_generate(model, single, kwargs))
    return rows


def measure(name: str, family: str, overrides: dict[str, Any], dtype: torch.dtype, new: int) -> dict[str, Any]:
    model = harness.tiny_hf_model(family, **overrides).to(dtype)
    inputs = harness.tiny_inputs(model, batch=4, length=16)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    kwargs = dict(num_beams=4, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with fastgen.unpatched():
        upstream = _generate(model, inputs, kwargs)
        alone = _one_by_one(model, inputs, kwargs)
        implementation = model.config._attn_implementation
        other = "eager" if implementation != "eager" else "sdpa"
        try:
            model.set_attn_implementation(other)
            switched = _generate(model, inputs, kwargs)
        except ValueError:  # e.g. Gemma 2 has no sdpa
            switched = None
        model.set_attn_implementation(implementation)
    with fastgen.report() as report:
        fast = _generate(model, inputs, kwargs)
    return {
        "model": name,
        "dtype": str(dtype).removeprefix("torch."),
        "fastgen_features_ran": sorted(report.ran),
        "fastgen_vs_upstream": _agreement(upstream, fast),
        "upstream_batch1_vs_batched": _agreement(upstream, alone),
        "attention": implementation,
        "upstream_other_attention": {"with": other, **_agreement(upstream, switched)} if switched else None,
        "distinct_generated_tokens": len({t for row in upstream for t in row}),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(harness.ENCODER_DECODER + harness.DECODER_ONLY + tuple(MEDIUM)))
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    rows = []
    started = time.perf_counter()
    for name in args.families.split(","):
        family, overrides = MEDIUM.get(name, (name, {}))
        for dtype in args.dtypes.split(","):
            row = measure(name, family, overrides, getattr(torch, dtype), args.new_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "command": "python -m benchmarks.half_precision " + " ".join(argv or []),
        "environment": environment("cpu"),
        "seconds": round(time.perf_counter() - started, 1),
        "settings": {"batch": 4, "num_beams": 4, "new_tokens": args.new_tokens, "input_length": 16},
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
