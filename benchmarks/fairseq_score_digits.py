"""How far fastgen's fairseq scores are from upstream's when beams share cross-attention (``dedup``).

fairseq's beamable attention (which ``dedup`` switches on) multiplies the ``M`` beam queries of an
input with its keys in one GEMM (``einsum``), where upstream multiplies each beam's query with its own
copy of the keys (``bmm``, a GEMV per beam): the sums round differently in the last bits. Tokens stay
identical; this measures the score differences (fp32, CPU) on random fairseq transformers.

    python -m benchmarks.fairseq_score_digits
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

import fastgen
from benchmarks.measure import environment
from tests import harness

RESULTS = Path(__file__).parent / "results" / "fairseq_score_digits-cpu.json"
SHAPES = {"tiny (32-dim, 4 heads, 2+2 layers)": 1.0, "medium (512-dim, 8 heads, 2+2 layers)": 16.0}


def _model(width: float) -> tuple[Any, Any]:
    if width == 1.0:
        return harness.tiny_fairseq_transformer()
    import argparse

    from fairseq.models.transformer import TransformerModel, base_architecture

    _, dictionary = harness.tiny_fairseq_transformer(vocab=512)
    args = argparse.Namespace(encoder_embed_dim=512, decoder_embed_dim=512, encoder_ffn_embed_dim=1024,
                              decoder_ffn_embed_dim=1024, encoder_layers=2, decoder_layers=2,
                              encoder_attention_heads=8, decoder_attention_heads=8, dropout=0.0,
                              share_all_embeddings=True, max_source_positions=256,
                              max_target_positions=256)  # fmt: skip
    base_architecture(args)

    class _Task:
        source_dictionary = target_dictionary = dictionary

    torch.manual_seed(0)
    return TransformerModel.build_model(args, _Task()).eval(), dictionary


def compare(model: Any, dictionary: Any, batch: int, length: int, beam: int) -> dict[str, Any]:
    sample = harness.tiny_fairseq_sample(dictionary, batch=batch, length=length)
    kwargs = dict(beam_size=beam, max_len_b=12)
    with fastgen.unpatched():
        reference = harness.fairseq_generate(model, dictionary, sample, **kwargs)
    result: dict[str, Any] = {"batch": batch, "source_length": length, "beam": beam}
    for label, features in (
        ("all features", None),
        ("without dedup", [f for f in fastgen.known_features() if f != "dedup"]),
    ):
        with fastgen.patched(features):
            candidate = harness.fairseq_generate(model, dictionary, sample, **kwargs)
        pairs = [(r, c) for rs, cs in zip(reference, candidate, strict=True) for r, c in zip(rs, cs, strict=True)]
        assert all(torch.equal(r["tokens"], c["tokens"]) for r, c in pairs), "tokens differ"
        diffs = [(r["positional_scores"] - c["positional_scores"]).abs().max().item() for r, c in pairs]
        result[label] = {
            "hypotheses": len(pairs),
            "hypotheses_with_a_differing_score": sum(d > 0 for d in diffs),
            "max_abs_positional_score_diff": max(diffs),
            "max_abs_score_diff": max(abs(float(r["score"]) - float(c["score"])) for r, c in pairs),
        }
    return result


def main() -> None:
    started = time.perf_counter()
    rows = []
    for name, width in SHAPES.items():
        model, dictionary = _model(width)
        for batch, length, beam in ((3, 10, 4), (8, 20, 4), (8, 30, 5)):
            row = {"model": name, **compare(model, dictionary, batch, length, beam)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "command": "python -m benchmarks.fairseq_score_digits",
        "environment": environment("cpu"),
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
