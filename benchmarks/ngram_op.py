"""Micro-benchmark of n-gram blocking: fastgen's op vs HF's processor vs fairseq's CPU fallback.

    python -m benchmarks.ngram_op --device cpu [--repeats 30] [--out benchmarks/results/ngram_op-cpu.json]

Shapes are the seeds' (CNN/DM with BART: batch 128 x beam 4 = 512 hypotheses, 140 steps, vocab
50265, no-repeat 3) and a long-row case (64 hypotheses, 1024 tokens). Rows are random ids with each
row's final (n-1)-gram copied to a few earlier places, so every row bans something (random ids
alone almost never repeat a trigram). The implementations run round-robin in one process after a
warm-up, and the medians are reported.

fairseq is timed the way SequenceGenerator calls it: ``NGramRepeatBlock(n)(tokens, lprobs, bsz,
beam, step)`` with its whole pad-filled ``max_len + 2`` buffer. On CPU (or without its CUDA
extension) that runs a Python loop which, handed that buffer, bans nothing (fairseq #4709/#5206);
the loop on the valid tokens only (``tokens[:, :step+1]``, what it was meant to see) is timed too.

The encoder variant (HF's EncoderNoRepeatNGramLogitsProcessor) runs at 128 inputs of 1024 tokens x
beam 4, every hypothesis ending on a bigram of its input.

Importing fastgen patches HF's processors and fairseq's blocker (feature "ngram"), so upstream is
timed inside ``fastgen.unpatched()``; ``fastgen_processor`` / ``fastgen_fairseq_patched`` time the
patched entry points as users get them (argument checks and, for HF, the copy of the scores).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import fastgen
from benchmarks.measure import result_header, write_result
from fastgen.ops.ngram import available_backends, ban_encoder_ngrams, ban_repeated_ngrams

SHAPES = [
    {"rows": 512, "length": 140, "vocab": 50265, "n": 3, "beam": 4},
    {"rows": 64, "length": 1024, "vocab": 50265, "n": 3, "beam": 4},
]
PAD = 1  # fairseq's pad id for BART dictionaries
REPEATS_PER_ROW = 3


def make_tokens(rows: int, length: int, vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab, (rows, length), generator=gen)
    starts = torch.randint(0, length - 2 * n + 2, (rows, REPEATS_PER_ROW), generator=gen)
    for r in range(rows):
        for i in starts[r].tolist():
            tokens[r, i : i + n - 1] = tokens[r, length - n + 1 :]
    return tokens


def upstream(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run as upstream code: fastgen's patches of HF and fairseq step aside for the call."""

    def call() -> object:
        with fastgen.unpatched():
            return fn()

    return call


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(fns: dict[str, Callable[[], object]], device: torch.device, repeats: dict[str, int]):
    """Median seconds per implementation; one call of each per round, so drift hits all alike.

    The order is shuffled every round: whatever runs right after HF's 100 MB sweep finds cold
    caches, and that should not always be the same implementation.
    """
    for fn in fns.values():  # warm-up (allocator, Triton/JIT compiles, lazy imports)
        for _ in range(3):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = random.Random(0)
    for round_ in range(max(repeats.values())):
        names = list(fns)
        order.shuffle(names)
        for name in names:
            fn = fns[name]
            if round_ >= repeats[name]:
                continue
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def summarise(times: dict[str, list[float]]) -> dict:
    """Median (the figure reported), the 10th/90th percentiles (the noise) in ms, and the call counts."""

    def ms(ts: list[float], q: float) -> float:
        ordered = sorted(ts)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 4)

    return {
        "median_ms": {name: round(statistics.median(ts) * 1e3, 4) for name, ts in times.items()},
        "p10_ms": {name: ms(ts, 0.1) for name, ts in times.items()},
        "p90_ms": {name: ms(ts, 0.9) for name, ts in times.items()},
        "timed_calls": {name: len(ts) for name, ts in times.items()},
    }


def bench_shape(shape: dict, device: torch.device, repeats: int, slow_repeats: int) -> dict:
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    rows, length, vocab, n, beam = shape["rows"], shape["length"], shape["vocab"], shape["n"], shape["beam"]
    tokens = make_tokens(rows, length, vocab, n).to(device)
    scores = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)).to(device)
    hf = NoRepeatNGramLogitsProcessor(n)

    # fairseq's buffer: (bsz*beam, max_len + 2), pad-filled past the current step; step = length - 1.
    step = length - 1
    buffer = torch.full((rows, length + 8), PAD, dtype=torch.long, device=device)
    buffer[:, :length] = tokens

    expected = upstream(lambda: hf(tokens, scores.clone()))()
    got = ban_repeated_ngrams(tokens, scores.clone(), n)
    assert torch.equal(got, expected), "fastgen and HF disagree: fix the op before timing it"
    assert torch.equal(hf(tokens, scores), expected), "the patched processor disagrees with upstream"
    assert torch.equal(ban_repeated_ngrams(buffer, scores.clone(), n, step + 1), expected)
    banned = int(expected.isinf().sum())

    work = scores.clone()
    fns: dict[str, Callable[[], object]] = {
        "fastgen": lambda: ban_repeated_ngrams(tokens, work, n),
        "fastgen_fairseq_buffer": lambda: ban_repeated_ngrams(buffer, work, n, step + 1),
        "fastgen_plus_clone": lambda: ban_repeated_ngrams(tokens, scores.clone(), n),
        "fastgen_processor": lambda: hf(tokens, scores),
        "hf_processor": upstream(lambda: hf(tokens, scores)),
    }
    if device.type == "cuda":  # each backend on its own, besides the automatic choice above
        for backend, reason in available_backends(device).items():
            if reason is None:
                fns[f"fastgen_{backend}"] = lambda backend=backend: ban_repeated_ngrams(
                    tokens, work, n, backend=backend
                )
    repeats_of = {name: repeats for name in fns}
    fairseq_note = None
    try:
        from fairseq.ngram_repeat_block import NGramRepeatBlock
    except Exception as exc:  # fairseq is optional
        fairseq_note = f"fairseq not importable: {type(exc).__name__}: {exc}"
    else:
        block = NGramRepeatBlock(n)
        fairseq_note = f"NGramRepeatBlock.use_extension={block.use_extension}"
        bsz = rows // beam
        fairseq_bans = int(upstream(lambda: block(buffer, scores.clone(), bsz, beam, step))().isinf().sum())
        fairseq_note += f"; bans on its padded buffer: {fairseq_bans} (fastgen/HF: {banned})"
        assert torch.equal(block(buffer, scores.clone(), bsz, beam, step), expected)
        fns["fairseq_as_called"] = upstream(lambda: block(buffer, work, bsz, beam, step))
        fns["fastgen_fairseq_patched"] = lambda: block(buffer, work, bsz, beam, step)
        fns["fairseq_loop_on_valid_tokens"] = lambda: block._no_repeat_ngram(
            buffer[:, : step + 1], work, bsz, beam, step
        )
        repeats_of["fairseq_as_called"] = repeats_of["fairseq_loop_on_valid_tokens"] = slow_repeats
        repeats_of["fastgen_fairseq_patched"] = repeats

    stats = summarise(time_round_robin(fns, device, repeats_of))
    medians = stats["median_ms"]
    result = {
        "variant": "decoder",
        **shape,
        "banned_entries": banned,
        **stats,
        "speedup_vs_hf": round(medians["hf_processor"] / medians["fastgen"], 1),
        "speedup_vs_hf_with_clone": round(medians["hf_processor"] / medians["fastgen_plus_clone"], 1),
        "speedup_of_patched_processor": round(medians["hf_processor"] / medians["fastgen_processor"], 1),
        "fairseq": fairseq_note,
    }
    if "fairseq_as_called" in medians:
        result["speedup_vs_fairseq_as_called"] = round(
            medians["fairseq_as_called"] / medians["fastgen_fairseq_buffer"], 1
        )
    return result


def bench_encoder(device: torch.device, repeats: int) -> dict:
    """HF's EncoderNoRepeatNGramLogitsProcessor (its n-gram dicts built once, as generate() does) vs ours."""
    from transformers.generation.logits_process import EncoderNoRepeatNGramLogitsProcessor

    batch, beam, source, length, vocab, n = 128, 4, 1024, 140, 50265, 3
    gen = torch.Generator().manual_seed(2)
    inputs = torch.randint(4, vocab, (batch, source), generator=gen)
    tokens = torch.randint(4, vocab, (batch * beam, length), generator=gen)
    for r in range(batch * beam):  # each hypothesis ends on a bigram its input contains
        i = int(torch.randint(0, source - n + 1, (1,), generator=gen))
        tokens[r, length - n + 1 :] = inputs[r // beam, i : i + n - 1]
    inputs, tokens = inputs.to(device), tokens.to(device)
    scores = torch.randn(batch * beam, vocab, generator=gen).to(device)
    hf = EncoderNoRepeatNGramLogitsProcessor(n, inputs)  # built patched: it keeps the prompt for the op
    expected = upstream(lambda: hf(tokens, scores))()
    assert torch.equal(ban_encoder_ngrams(inputs, tokens, scores.clone(), n), expected)
    assert torch.equal(hf(tokens, scores), expected), "the patched processor disagrees with upstream"
    work = scores.clone()
    fns = {
        "fastgen": lambda: ban_encoder_ngrams(inputs, tokens, work, n),
        "fastgen_plus_clone": lambda: ban_encoder_ngrams(inputs, tokens, scores.clone(), n),
        "fastgen_processor": lambda: hf(tokens, scores),
        "hf_processor": upstream(lambda: hf(tokens, scores)),
    }
    stats = summarise(time_round_robin(fns, device, dict.fromkeys(fns, repeats)))
    medians = stats["median_ms"]
    return {
        "variant": "encoder",
        "rows": batch * beam,
        "source_length": source,
        "length": length,
        "vocab": vocab,
        "n": n,
        "banned_entries": int(expected.isinf().sum()),
        **stats,
        "speedup_vs_hf": round(medians["hf_processor"] / medians["fastgen"], 1),
        "speedup_vs_hf_with_clone": round(medians["hf_processor"] / medians["fastgen_plus_clone"], 1),
        "speedup_of_patched_processor": round(medians["hf_processor"] / medians["fastgen_processor"], 1),
    }


def device_facts(device: torch.device) -> dict:
    facts = {"device": str(device), "torch_default_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
        facts["cuda"] = torch.version.cuda
    try:
        with open("/proc/cpuinfo") as info:
            facts["cpu"] = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        facts["cpu"] = platform.processor() or platform.machine()
    facts["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    return facts


def write_report(benchmark: str, argv: list[str] | None, facts: dict, method: str, results: list, out: Path) -> None:
    """The JSON every op micro-benchmark writes: command, date, machine, versions, method, results."""
    report = result_header(benchmark, argv) | {
        "machine": facts,
        "versions": versions(),
        "method": method,
        "results": results,
    }
    write_result(out, report)


def versions() -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("fairseq", "triton"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls of the fast implementations")
    parser.add_argument("--slow-repeats", type=int, default=7, help="timed calls of fairseq's Python loop")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/ngram_op-<device>.json")
    parser.add_argument(
        "--threads",
        default=f"1,{torch.get_num_threads()}",
        help="comma-separated torch intra-op thread counts to run with (default: 1 and torch's default). "
        "On a shared machine one busy core stalls every 2-thread parallel region: 1 thread is the robust figure",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    out = args.out or Path(__file__).resolve().parent / "results" / f"ngram_op-{device.type}.json"

    facts = device_facts(device)
    results = []
    with fastgen.patched(["ngram"]):  # whatever FASTGEN_* says: the patched entry points are timed too
        for threads in dict.fromkeys(int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for shape in SHAPES:
                results.append({"threads": threads, **bench_shape(shape, device, args.repeats, args.slow_repeats)})
            results.append({"threads": threads, **bench_encoder(device, args.repeats)})
    facts["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    method = (
        "median wall time per call after 3 warm-up calls, implementations interleaved round-robin "
        "in a shuffled order; "
        f"tokens random with each row's final (n-1)-gram planted {REPEATS_PER_ROW}x earlier; "
        "fastgen works in place (fastgen_plus_clone adds the copy HF's out-of-place contract implies); "
        "fastgen_processor / fastgen_fairseq_patched: the patched HF processor / fairseq blocker as users call "
        "them; hf_processor and fairseq_as_called run inside fastgen.unpatched(); "
        "fairseq_as_called passes its pad-filled buffer, as SequenceGenerator does"
    )
    write_report("ngram_op", argv, facts, method, results, out)
    for r in results:
        line = ", ".join(f"{k} {v:.3f} ms" for k, v in r["median_ms"].items())
        shape = f"{r['variant']} threads={r['threads']} N={r['rows']} L={r['length']} V={r['vocab']} n={r['n']}"
        sys.stdout.write(f"{shape}: {line}\n")
        sys.stdout.write(
            f"  fastgen vs HF: op {r['speedup_vs_hf']}x, op + clone {r['speedup_vs_hf_with_clone']}x, "
            f"patched processor {r['speedup_of_patched_processor']}x\n"
        )
    sys.stdout.write(f"wrote {out}\n")


if __name__ == "__main__":
    main()
