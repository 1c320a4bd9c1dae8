"""A tiny fairseq translation setup built with fairseq's own tools, and upstream's outputs on it.

Generated parallel data (a word-reversal task), ``fairseq-preprocess``, three ``fairseq-train``
updates of a 1+1-layer transformer on CPU (a barely trained model still produces varied
hypotheses of different lengths, with repeated n-grams), then ``fairseq-generate`` — the
unmodified fairseq code, in a process that never imports fastgen — for every configuration
the tests compare against.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()

COMMON = ["--batch-size", "8", "--required-batch-size-multiple", "1", "--cpu", "--max-len-b", "12"]

# name -> fairseq-generate arguments (after DATA --path CKPT and COMMON)
CONFIGS: dict[str, list[str]] = {
    "beam": ["--beam", "4"],
    "beam_nbest": ["--beam", "3", "--nbest", "2", "--post-process", "subword_nmt"],
    "sampling": ["--sampling", "--beam", "3", "--nbest", "3", "--seed", "7", "--sampling-topk", "10"],
    "sacrebleu": ["--beam", "2", "--scoring", "sacrebleu"],
    "ngram": ["--beam", "4", "--no-repeat-ngram-size", "2"],
}
# Upstream's CPU n-gram blocker bans nothing (fairseq #4709); fastgen's patch gives the semantics of
# fairseq's CUDA kernel. For these configurations the oracle is fairseq_cli.generate itself run in
# a process that imported fastgen first (same blocker as fastgen-generate; only the CLI differs).
WITH_FASTGEN_ORACLE = {"ngram"}

# Runs upstream fairseq-generate once per configuration in one interpreter (one import).
_UPSTREAM_DRIVER = """
import contextlib, io, sys, json
runs = json.loads(sys.argv[1])
if sys.argv[2] == "fastgen":
    import fastgen
from fairseq_cli.generate import cli_main
for name, argv, out in runs:
    sys.argv = ["fairseq-generate", *argv]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        cli_main()
    open(out, "w").write(buffer.getvalue())
"""


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", "FASTGEN_DISABLE": "1"}


def _write_split(root: Path, split: str, n: int, rng: random.Random) -> None:
    src, tgt = [], []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 9))]
        src.append(" ".join(words))
        tgt.append(" ".join(w.upper() for w in reversed(words)))
    (root / f"{split}.src").write_text("\n".join(src) + "\n")
    (root / f"{split}.tgt").write_text("\n".join(tgt) + "\n")


def _tool(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def build(root: Path) -> dict[str, Path]:
    """Data, checkpoint and upstream outputs under ``root``; returns their paths."""
    rng = random.Random(0)
    for split, n in (("train", 200), ("valid", 20), ("test", 30)):
        _write_split(root, split, n, rng)
    run = {"env": env(), "cwd": root, "check": True, "capture_output": True, "text": True}
    subprocess.run(
        [_tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt", "--trainpref", "train"]
        + ["--validpref", "valid", "--testpref", "test", "--destdir", "bin", "--workers", "1"],
        **run,
    )
    arch = ["--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1"]
    arch += ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32"]
    arch += ["--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
    subprocess.run(
        [_tool("fairseq-train"), "bin", *arch, "--optimizer", "adam", "--lr", "0.0005", "--max-tokens", "2000"]
        + ["--max-update", "3", "--cpu", "--save-dir", "ckpt", "--no-epoch-checkpoints", "--disable-validation"]
        + ["--seed", "1", "--log-format", "simple", "--num-workers", "0"],
        **run,
    )
    paths = {"root": root, "data": root / "bin", "ckpt": root / "ckpt" / "checkpoint_last.pt"}
    plain, with_fastgen = [], []
    for name, extra in CONFIGS.items():
        out = root / f"upstream-{name}.txt"
        plain.append([name, base_args(paths) + extra, str(out)])
        paths[f"upstream-{name}"] = out
        if name in WITH_FASTGEN_ORACLE:
            out = root / f"upstream-with-fastgen-{name}.txt"
            with_fastgen.append([name, base_args(paths) + extra, str(out)])
            paths[f"upstream-with-fastgen-{name}"] = out
    subprocess.run([sys.executable, "-c", _UPSTREAM_DRIVER, json.dumps(plain), "plain"], **run)
    fastgen_env = {k: v for k, v in env().items() if k != "FASTGEN_DISABLE"}
    subprocess.run(
        [sys.executable, "-c", _UPSTREAM_DRIVER, json.dumps(with_fastgen), "fastgen"], **{**run, "env": fastgen_env}
    )
    return paths


def base_args(paths: dict[str, Path]) -> list[str]:
    return [str(paths["data"]), "--path", str(paths["ckpt"]), *COMMON]


def results_only(text: str) -> str:
    """fairseq-generate's output without log lines (they carry timestamps and timings)."""
    import re

    log = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| |INFO:|WARNING:)")
    return "".join(line for line in text.splitlines(keepends=True) if not log.match(line))
