"""Micro-benchmark of one beam-search step after the forward: HF's code vs :func:`fastgen.ops.beam_topk`.

    python -m benchmarks.beam_topk_op --device cpu [--repeats 50] [--out benchmarks/results/beam_topk_op-cpu.json]

bart-base shape (V = 50265, M = 4, k = 2·M as with one EOS id) at B = 4 and 32 inputs. Timed:

- ``hf_step``: HF 5.23 ``_beam_search`` steps b–c as written there — the float32 copy of the last
  logits, ``log_softmax``, ``+ running_beam_scores[:, :, None]``, reshape to B×(M·V), ``topk``, ``//``, ``%``.
- ``fastgen_op``: ``beam_topk(logits, scores, k)`` (CPU: the torch reference — the same ops in place
  on one buffer, so bit-identical results; asserted before timing).
- ``*_ngram3``: the same with ``no_repeat_ngram_size=3`` over 64-token hypotheses with planted
  repeats: HF's ``NoRepeatNGramLogitsProcessor`` (upstream, unpatched) between the log-softmax and
  the add, vs fastgen's loop-side pipeline (log-softmax into its own buffer, the n-gram op in place
  on it, :func:`~fastgen.ops.beam_topk.log_probs_top_k`).
- with ``--device cuda``: every available backend (CUDA extension, Triton, torch) separately.

Implementations alternate round-robin in a shuffled order after a warm-up (benchmarks.ngram_op's
round-robin idea, plus thread CPU time, which leaves out waiting for a core); medians reported with the
load average, which on a shared machine matters.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import fastgen
from benchmarks.ngram_op import device_facts, make_tokens, summarise, upstream, write_report
from fastgen.ops.beam_topk import BeamTopK, available_backends, beam_topk, log_probs_top_k
from fastgen.ops.ngram import ban_repeated_ngrams

VOCAB = 50265  # bart-base
BEAMS = 4
BATCHES = (4, 32)
NGRAM, HYP_LENGTH = 3, 64


def hf_step(model_logits: torch.Tensor, running_beam_scores: torch.Tensor, k: int, processor=None, ids=None):
    """HF 5.23 ``_beam_search`` b–c, line for line (``_get_top_k_continuations`` without the gathers)."""
    batch_size, num_beams = running_beam_scores.shape
    logits = model_logits[:, -1, :].to(copy=True, dtype=torch.float32)
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
    if processor is not None:
        log_probs = processor(ids, log_probs)
    log_probs = torch.reshape(log_probs, [batch_size, num_beams, *log_probs.shape[1:]])
    log_probs = log_probs + running_beam_scores[:, :, None]
    log_probs = torch.reshape(log_probs, (batch_size, -1))
    topk_log_probs, topk_indices = torch.topk(log_probs, k=k)
    vocab_size = log_probs.shape[-1] // num_beams
    return BeamTopK(topk_log_probs, topk_indices // vocab_size, topk_indices % vocab_size)


def fastgen_ngram_step(model_logits: torch.Tensor, scores: torch.Tensor, k: int, ids: torch.Tensor) -> BeamTopK:
    """The loop's CPU pipeline: one N×V buffer, bans written in place, scores added in place."""
    log_probs = torch.log_softmax(model_logits[:, -1, :].to(torch.float32), dim=-1)
    ban_repeated_ngrams(ids, log_probs, NGRAM)
    return log_probs_top_k(log_probs, scores, k)


def time_round_robin(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int):
    """Wall and thread-CPU seconds per call, implementations interleaved in a shuffled order.

    The thread-CPU time leaves out the time this process waited for a core, which on a loaded
    shared machine dominates wall-clock medians; both are reported.
    """
    for fn in fns.values():
        for _ in range(3):
            fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    order = random.Random(0)
    for _ in range(repeats):
        names = list(fns)
        order.shuffle(names)
        for name in names:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start, start_cpu = time.perf_counter(), time.thread_time()
            fns[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - start_cpu)
    return wall, cpu


def assert_identical(got: BeamTopK, want: BeamTopK, what: str) -> None:
    same = torch.equal(got.scores, want.scores) and torch.equal(got.beams, want.beams)
    assert same and torch.equal(got.tokens, want.tokens), f"{what}: fastgen and HF disagree; fix before timing"


def bench(batch: int, device: torch.device, repeats: int) -> dict:
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    rows, k = batch * BEAMS, 2 * BEAMS
    gen = torch.Generator().manual_seed(batch)
    model_logits = (torch.randn(rows, 1, VOCAB, generator=gen) * 4).to(device)  # as the LM head returns them
    scores = (-torch.rand(batch, BEAMS, generator=gen) * 10).to(device)
    ids = make_tokens(rows, HYP_LENGTH, VOCAB, NGRAM).to(device)
    processor = NoRepeatNGramLogitsProcessor(NGRAM)

    hf_plain = upstream(lambda: hf_step(model_logits, scores, k))
    hf_ngram = upstream(lambda: hf_step(model_logits, scores, k, processor, ids))
    ours_plain = lambda: beam_topk(model_logits[:, -1, :], scores, k)  # noqa: E731
    ours_ngram = lambda: fastgen_ngram_step(model_logits, scores, k, ids)  # noqa: E731
    if device.type == "cpu":  # kernels order exact ties differently (documented); torch is exact
        assert_identical(ours_plain(), hf_plain(), "plain step")
        assert_identical(ours_ngram(), hf_ngram(), "n-gram step")
    fns: dict[str, Callable[[], object]] = {
        "hf_step": hf_plain,
        "fastgen_op": ours_plain,
        "hf_step_ngram3": hf_ngram,
        "fastgen_step_ngram3": ours_ngram,
    }
    if device.type == "cuda":
        for backend, reason in available_backends(device).items():
            if reason is None:
                fns[f"fastgen_op_{backend}"] = lambda backend=backend: beam_topk(
                    model_logits[:, -1, :], scores, k, backend=backend
                )
    wall, cpu = time_round_robin(fns, device, repeats)
    stats = summarise(wall)
    medians, cpu_medians = stats["median_ms"], summarise(cpu)["median_ms"]
    return {
        "batch": batch,
        "beams": BEAMS,
        "vocab": VOCAB,
        "k": k,
        **stats,
        "thread_cpu_median_ms": cpu_medians,
        "speedup_vs_hf": round(medians["hf_step"] / medians["fastgen_op"], 2),
        "speedup_vs_hf_ngram3": round(medians["hf_step_ngram3"] / medians["fastgen_step_ngram3"], 2),
        "cpu_time_speedup_vs_hf": round(cpu_medians["hf_step"] / cpu_medians["fastgen_op"], 2),
        "cpu_time_speedup_vs_hf_ngram3": round(cpu_medians["hf_step_ngram3"] / cpu_medians["fastgen_step_ngram3"], 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=50, help="timed calls of each implementation")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: robust on a shared box)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/beam_topk_op-<device>.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    out = args.out or Path(__file__).resolve().parent / "results" / f"beam_topk_op-{device.type}.json"
    torch.set_num_threads(args.threads)
    facts = device_facts(device)
    with fastgen.patched(["ngram"]):
        results = [{"threads": args.threads, **bench(batch, device, args.repeats)} for batch in BATCHES]
    facts["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    method = (
        "median wall time (and thread CPU time) per call after 3 warm-up calls, implementations interleaved "
        "round-robin in a shuffled order; hf_* run HF 5.23's _beam_search step code inside fastgen.unpatched(); "
        "results "
        "asserted bit-identical (scores, beams, tokens) on CPU before timing; logits N×1×V float32, "
        "running scores random, k = 2·M; n-gram variants: 64-token hypotheses with planted repeats"
    )
    write_report("beam_topk_op", argv, facts, method, results, out)
    for r in results:
        line = ", ".join(f"{name} {ms:.3f} ms" for name, ms in r["median_ms"].items())
        sys.stdout.write(f"B={r['batch']} M={r['beams']} V={r['vocab']}: {line}\n")
        sys.stdout.write(f"  speedup vs HF: plain {r['speedup_vs_hf']}x, with n-gram 3 {r['speedup_vs_hf_ngram3']}x\n")
        line = ", ".join(f"{name} {ms:.3f} ms" for name, ms in r["thread_cpu_median_ms"].items())
        sys.stdout.write(f"  thread CPU time: {line}\n")
        sys.stdout.write(
            f"  CPU-time speedup: plain {r['cpu_time_speedup_vs_hf']}x, "
            f"n-gram 3 {r['cpu_time_speedup_vs_hf_ngram3']}x\n"
        )
    sys.stdout.write(f"load average {facts['load_average_at_start']} -> {facts['load_average_at_end']}; wrote {out}\n")


if __name__ == "__main__":
    main()
