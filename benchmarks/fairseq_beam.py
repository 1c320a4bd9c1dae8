"""fairseq ``SequenceGenerator``: what the beam step costs outside the model, upstream vs ``beam``.

    python -m benchmarks.fairseq_beam [--rounds 5] [--new-tokens 24] [--out FILE.json]

A fairseq transformer at bart-base width (6+6 layers, d=768, 12 heads, vocabulary 50265, random
weights), batch 8, beam 5, ``min_len == max_len`` so every variant runs the same steps. Variants run
in a rotating order each round after a warm-up, in one process, ``torch.set_num_threads(1)``:
upstream, ``dedup`` (the default fairseq feature that changes the loop's surroundings) and
``dedup`` + ``beam``. Thread CPU time is measured for the whole call and, by wrapping
``EnsembleModel.forward_encoder`` / ``forward_decoder``, for the model alone: the rest divided by the
number of steps is the step outside the model (normalisation is inside ``forward_decoder``, as in
fairseq). No n-gram blocking: upstream's CPU blocker bans nothing (fairseq #4709), so outputs would
differ on purpose; identical outputs are checked here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import fastgen
from benchmarks.measure import alternate, environment, result_header, write_result
from benchmarks.scenarios import FairseqScenario

BART_BASE_WIDTH = dict(
    vocab_size=50265,
    encoder_embed_dim=768,
    encoder_ffn_embed_dim=3072,
    encoder_layers=6,
    encoder_attention_heads=12,
    decoder_embed_dim=768,
    decoder_ffn_embed_dim=3072,
    decoder_layers=6,
    decoder_attention_heads=12,
    share_all_embeddings=True,
    dropout=0.0,
)
VARIANTS: dict[str, list[str] | None] = {"upstream": None, "dedup": ["dedup"], "dedup+beam": ["dedup", "beam"]}


class _ModelClock:
    """Thread CPU seconds spent in the ensemble's encoder and decoder calls (and how many decoder calls)."""

    def __init__(self) -> None:
        from fairseq.sequence_generator import EnsembleModel

        self.seconds, self.steps = 0.0, 0
        for name in ("forward_encoder", "forward_decoder"):
            original = getattr(EnsembleModel, name)
            setattr(EnsembleModel, name, self._timed(original, count=name == "forward_decoder"))

    def _timed(self, original, count: bool):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start
                self.steps += count

        return timed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    scenario = FairseqScenario(
        "fairseq-bart-base-width",
        "",
        "",
        BART_BASE_WIDTH,
        batch=args.batch,
        input_len=args.input_len,
        new_tokens=args.new_tokens,
        generate=dict(beam_size=args.beam),
    )
    settings = {"batch": args.batch, "input_len": args.input_len, "new_tokens": args.new_tokens}
    call = scenario.prepare("cpu", torch.float32, settings)
    clock = _ModelClock()

    def run(variant: str):
        features = VARIANTS[variant]
        scope = fastgen.unpatched() if features is None else fastgen.patched(features)
        clock.seconds, clock.steps = 0.0, 0
        with scope, fastgen.report() as report:
            start = time.thread_time()
            out = call()
            total = time.thread_time() - start
        assert ("beam" in (features or [])) == report.fast_path("beam"), report
        return out.sequences, total, clock.seconds, clock.steps

    names = list(VARIANTS)
    rounds = alternate(run, names, args.rounds)
    outputs, load = rounds.outputs, rounds.load_average
    total = {name: rounds.column(name, 0) for name in names}
    step_ms = {name: [1e3 * (t - model) / steps for t, model, steps in rounds.measured[name]] for name in names}
    med_total = {n: statistics.median(total[n]) for n in names}
    med_step = {n: statistics.median(step_ms[n]) for n in names}
    result = result_header("fairseq_beam", argv) | {
        "model": BART_BASE_WIDTH,
        "settings": settings | {"beam_size": args.beam, "min_len == max_len": True},
        "variants": VARIANTS,
        "environment": environment("cpu"),
        "load_average": load,
        "identical_outputs": all(torch.equal(outputs["upstream"], outputs[n]) for n in names),
        "thread_cpu_seconds": total,
        "step_outside_model_ms": step_ms,
        "median_step_outside_model_ms": med_step,
        "speedup_thread_cpu": {n: med_total["upstream"] / med_total[n] for n in names[1:]},
    }
    out = args.out or Path(__file__).resolve().parent / "results" / "fairseq_beam-cpu.json"
    write_result(out, result)
    for name in names:
        sys.stdout.write(
            f"{name:>11}: thread CPU median {med_total[name]:.3f} s; step outside the model {med_step[name]:.2f} ms\n"
        )
    sys.stdout.write(
        f"speedup (thread CPU) {result['speedup_thread_cpu']}; identical outputs: {result['identical_outputs']}; "
        f"load {load['start']} -> {load['end']}\n"
    )


if __name__ == "__main__":
    main()
