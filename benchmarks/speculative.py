"""Batched speculative decoding on a real draft/target pair (trained by :mod:`benchmarks.spec_pair`).

    python -m benchmarks.speculative --device cpu            # batch 1 2 4 8 16, writes results/speculative-cpu.json

Variants per batch size, alternating in one process after a warm-up (medians over ``--rounds``):

- ``regular``: the target's regular batched greedy decoding, upstream (``fastgen.unpatched()``);
- ``fastgen``: ``generate(assistant_model=draft)`` on the whole batch with fastgen (batch 1: upstream's
  assisted decoding, which fastgen leaves alone);
- ``hf_looped``: upstream's batch-1 assisted decoding, once per row (unpadded prompt);
- ``fastgen_lookup``: ``generate(prompt_lookup_num_tokens=...)`` on the whole batch with fastgen.

Prompts are cut from held-out standard-library files (16-48 tokens, left-padded); greedy, EOS on,
``--new-tokens`` per row at most. Per-token latency of a sequence = time until it is finished / its
new tokens: for batched upstream calls a row is finished at the step it stops (a stopping-criteria
hook records it), for fastgen's loop when it leaves the batch, for the looped baseline when its own
call returns. The JSON also holds acceptance rates, the pair's facts and whether outputs are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import fastgen
from benchmarks import spec_pair
from benchmarks.measure import environment
from fastgen.optimizer.transformers import speculative
from fastgen.optimizer.transformers.contract import CACHE

RESULTS = Path(__file__).parent / "results"


class _FinishClock(StoppingCriteria):
    """Records when each row of an upstream batched call stops (EOS or length); never stops anything."""

    def __init__(self, prompt_width: int, max_new: int, eos: int) -> None:
        self.prompt_width, self.max_new, self.eos = prompt_width, max_new, eos
        self.start = time.perf_counter()
        self.finished: list[float | None] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        now = time.perf_counter() - self.start
        if not self.finished:
            self.finished = [None] * input_ids.shape[0]
        new = input_ids[:, self.prompt_width :]
        for row in range(input_ids.shape[0]):
            if self.finished[row] is None and (new.shape[1] >= self.max_new or bool((new[row] == self.eos).any())):
                self.finished[row] = now
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _batch(prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), spec_pair.PAD)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _new_tokens(row: torch.Tensor, prompt_width: int) -> list[int]:
    """A row's generated tokens up to and including EOS (padding after it removed)."""
    out = []
    for token in row[prompt_width:].tolist():
        out.append(token)
        if token == spec_pair.EOS:
            break
    return out


def _latency(finished: list[float], tokens: list[int]) -> dict[str, float]:
    per_token = [f / max(n, 1) for f, n in zip(finished, tokens, strict=True)]
    first, last = (
        min(range(len(finished)), key=finished.__getitem__),
        max(range(len(finished)), key=finished.__getitem__),
    )
    return {
        "first_ms": 1e3 * per_token[first],
        "last_ms": 1e3 * per_token[last],
        "average_ms": 1e3 * statistics.mean(per_token),
    }


def run_batch(
    target, draft, prompts: list[list[int]], new_tokens: int, lookup: int, limits: list[int] = (), sample: bool = False
) -> dict[str, dict]:
    """One timed run of every variant on one batch: {variant: {seconds, sequences, finished, stats}}."""
    inputs = {k: v.to(target.device) for k, v in _batch(prompts).items()}
    width = inputs["input_ids"].shape[1]
    greedy = dict(do_sample=sample, max_new_tokens=new_tokens, eos_token_id=spec_pair.EOS, pad_token_id=spec_pair.PAD)
    if sample:
        greedy |= dict(top_k=None, top_p=None, temperature=1.0)
    results: dict[str, dict] = {}

    def timed(name: str, fn) -> None:
        start = time.perf_counter()
        out = fn()
        results[name] = {"seconds": time.perf_counter() - start, **out}

    def regular() -> dict:
        clock = _FinishClock(width, new_tokens, spec_pair.EOS)
        with fastgen.unpatched():
            seq = target.generate(**inputs, **greedy, stopping_criteria=StoppingCriteriaList([clock]))
        return {"rows": [_new_tokens(r, width) for r in seq], "finished": clock.finished}

    def batched(config_attributes: dict | None = None, **extra: Any) -> dict:
        start = time.perf_counter()
        speculative.last_stats.clear()
        saved = {k: getattr(target.generation_config, k, None) for k in config_attributes or {}}
        for k, v in (config_attributes or {}).items():
            setattr(target.generation_config, k, v)
        try:
            seq = target.generate(**inputs, **greedy, **extra)
        finally:
            for k, v in saved.items():
                setattr(target.generation_config, k, v)
        stats = dict(speculative.last_stats)
        finished = stats.pop("row_finished_s", None)
        if finished is None:  # batch 1: upstream's loop ran; the row is finished when the call returns
            finished = [time.perf_counter() - start] * len(prompts)
        else:  # the loop's clock starts after generate's preparation: shift by that
            finished = [f + (time.perf_counter() - start) - max(finished) for f in finished]
        return {"rows": [_new_tokens(r, width) for r in seq], "finished": finished, "stats": stats}

    def looped() -> dict:
        start, rows, finished = time.perf_counter(), [], []
        with fastgen.unpatched():
            for p in prompts:
                ids = torch.tensor([p], device=target.device)
                seq = target.generate(input_ids=ids, assistant_model=draft, **greedy)
                rows.append(_new_tokens(seq[0], len(p)))
                finished.append(time.perf_counter() - start)
        return {"rows": rows, "finished": finished}

    order = [
        ("regular", regular),
        ("fastgen", lambda: batched(assistant_model=draft)),
        ("fastgen_lookup", lambda: batched(prompt_lookup_num_tokens=lookup)),
        ("hf_looped", looped),
    ]
    for limit in limits:  # BASS with a smaller l_limit: verification is not free on a CPU
        order.append(
            (
                f"fastgen_l_limit_{limit}",
                lambda limit=limit: batched({"fastgen_draft_limit": limit}, assistant_model=draft),
            )
        )
    for name, fn in order:
        with torch.inference_mode():
            timed(name, fn)
    return results


def summarise(runs: list[dict[str, dict]], sample: bool = False) -> dict[str, Any]:
    variants = list(runs[0])
    reference = runs[0]["regular"]["rows"]
    out: dict[str, Any] = {}
    for name in variants:
        seconds = [r[name]["seconds"] for r in runs]
        median_run = sorted(runs, key=lambda r: r[name]["seconds"])[len(runs) // 2][name]
        tokens = sum(len(row) for row in median_run["rows"])
        entry = {
            "seconds_median": statistics.median(seconds),
            "seconds_all": seconds,
            "tokens_per_s": tokens / statistics.median(seconds),
            "new_tokens": tokens,
            "per_token_latency": _latency(median_run["finished"], [len(row) for row in median_run["rows"]]),
            # Sampling: outputs are equal in distribution only (tests/optimizer/test_speculative_sampling.py).
            "identical_to_regular_greedy": None if sample else all(r[name]["rows"] == reference for r in runs),
        }
        stats = median_run.get("stats")
        if stats:
            entry["acceptance_rate"] = stats["accepted"] / max(stats["drafted"], 1)
            entry["accepted_per_row_step"] = stats["accepted"] / max(stats["row_steps"], 1)
            entry["speculative_steps"] = stats["steps"]
            entry["draft_forwards"] = stats["draft_forwards"]
        out[name] = entry
    regular = out["regular"]["seconds_median"]
    for name in variants:
        out[name]["speedup_vs_regular"] = regular / out[name]["seconds_median"]
    return out


def verification_cost(target, draft, batches=(1, 8, 16), new=(1, 2, 4, 8), past=64, reps=30) -> dict:
    """Median ms of one forward of ``m`` new tokens per row after a ``past``-token cache (target), and of
    one draft step: how the cost of verifying ``k + 1`` tokens grows with ``k`` on this device."""
    from transformers import DynamicCache

    def one(model, batch: int, m: int) -> float:
        times = []
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for _ in range(reps):
                cache = DynamicCache(config=model.config)
                model(
                    input_ids=torch.randint(4, spec_pair.VOCAB, (batch, past), generator=generator),
                    **{CACHE: cache},
                )
                step = torch.randint(4, spec_pair.VOCAB, (batch, m), generator=generator)
                start = time.perf_counter()
                model(input_ids=step, **{CACHE: cache})
                times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    return {
        str(b): {"target_ms_by_new_tokens": {str(m): one(target, b, m) for m in new}, "draft_step_ms": one(draft, b, 1)}
        for b in batches
    }


def markdown_table(path: Path) -> str:
    """The docs table of one result file: tokens/s, ratio to regular decoding, latency, acceptance."""
    report = json.loads(path.read_text())
    lines = [
        "| batch | variant | tok/s | × regular | ms/token first / last / avg | acceptance | = greedy |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch, variants in report["results_by_batch"].items():
        for name, r in variants.items():
            lat = r["per_token_latency"]
            accept = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "—"
            lines.append(
                f"| {batch} | {name} | {r['tokens_per_s']:.0f} | {r['speedup_vs_regular']:.2f} | "
                f"{lat['first_ms']:.2f} / {lat['last_ms']:.2f} / {lat['average_ms']:.2f} | {accept} | "
                f"{ {True: 'yes', False: 'NO', None: 'n/a (sampling)'}[r['identical_to_regular_greedy']] } |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lookup", type=int, default=4, help="prompt_lookup_num_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft", choices=["distilled", "independent"], default="distilled")
    parser.add_argument("--limits", type=int, nargs="*", default=[8], help="extra fastgen variants with this l_limit")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--sample", action="store_true", help="multinomial sampling (temperature 1) instead of greedy")
    parser.add_argument("--verify-cost", action="store_true", help="only measure forward cost vs new tokens")
    parser.add_argument("--table", type=Path, help="print the markdown table of a result file and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(args.table))
        return 0
    command = "python -m benchmarks.speculative " + shlex.join(argv if argv is not None else sys.argv[1:])

    target, draft, facts = spec_pair.load(args.draft)
    target, draft = target.to(args.device), draft.to(args.device)
    if args.verify_cost:
        load_before = os.getloadavg()
        report = {
            "command": command,
            "what": "median ms of one target forward of m new tokens per row after a 64-token cache; one draft step",
            "cost": verification_cost(target, draft),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "environment": environment(args.device),
        }
        print(json.dumps(report["cost"], indent=1))
        if not args.no_save:
            (args.out / f"speculative-verify-cost-{args.device}.json").write_text(json.dumps(report, indent=2) + "\n")
        return 0
    prompts = spec_pair.prompts(max(args.batches), 16, 48)
    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    run_batch(target, draft, prompts[:2], 8, args.lookup, args.limits, args.sample)  # warm-up
    for batch in args.batches:
        runs = [
            run_batch(target, draft, prompts[:batch], args.new_tokens, args.lookup, args.limits, args.sample)
            for _ in range(args.rounds)
        ]
        results[str(batch)] = summarise(runs, args.sample)
        row = results[str(batch)]
        print(
            f"batch {batch:>2}: "
            + "  ".join(
                f"{name} {r['tokens_per_s']:.0f} tok/s ({r['speedup_vs_regular']:.2f}x"
                + (f", accept {r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "")
                + ("" if r["identical_to_regular_greedy"] in (True, None) else ", OUTPUT DIFFERS")
                + ")"
                for name, r in row.items()
            ),
            flush=True,
        )
    report = {
        "scenario": "speculative",
        "command": command,
        "settings": {
            "new_tokens": args.new_tokens,
            "prompt_tokens": [16, 48],
            "greedy": not args.sample,
            "sampling": "multinomial, temperature 1, no top-k/top-p" if args.sample else None,
            "eos": "on (id 2)",
            "rounds": args.rounds,
            "prompt_lookup_num_tokens": args.lookup,
            "draft_schedule": "bass (fastgen default: l0=7, l_incre=2, l_mod=10, l_limit=32); "
            "fastgen_l_limit_N: the same with l_limit=N",
            "draft": args.draft,
        },
        "pair": facts,
        "results_by_batch": results,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "environment": environment(args.device),
    }
    if not args.no_save:
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = ("" if args.draft == "distilled" else "-independent-draft") + ("-sample" if args.sample else "")
        path = args.out / f"speculative-{args.device}{suffix}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
