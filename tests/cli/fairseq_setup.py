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

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
]

# No data-loader worker process (fairseq's default is one): a finished run's loader is shut down only when its
# iterator is collected, in the next run of the same process, and waits 5 s there for the forked worker to
# join. The batches are the same either way; test_same_output_as_fairseq_generate[beam-mode0] runs with one.
COMMON = ["--batch-size", "8", "--required-batch-size-multiple", "1", "--cpu", "--max-len-b", "12"]
COMMON += ["--num-workers", "0"]

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

# One interpreter (one `import fairseq`) runs fairseq's own CLIs: preprocess, train, then
# fairseq-generate once per configuration, then imports fastgen and runs the configurations
# whose oracle has fastgen's n-gram blocker.
_DRIVER = """
import contextlib, io, json, sys
steps = json.loads(sys.argv[1])
from fairseq_cli import generate, preprocess, train
tools = {"preprocess": preprocess.cli_main, "train": train.cli_main, "generate": generate.cli_main}
for tool, argv, out in steps:
    if tool == "import fastgen":
        import fastgen
        continue
    sys.argv = ["fairseq-" + tool, *argv]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        tools[tool]()
    if out:
        open(out, "w").write(buffer.getvalue())
"""


def env() -> dict[str, str]:
    """For subprocesses: one thread, fairseq checkpoints loadable on torch>=2.6."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


def _write_split(root: Path, split: str, n: int, rng: random.Random) -> None:
    src, tgt = [], []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 9))]
        src.append(" ".join(words))
        tgt.append(" ".join(w.upper() for w in reversed(words)))
    (root / f"{split}.src").write_text("\n".join(src) + "\n")
    (root / f"{split}.tgt").write_text("\n".join(tgt) + "\n")


def build(root: Path, test_size: int = 30, configs: dict[str, list[str]] | None = None) -> dict[str, Path]:
    """Data, checkpoint and upstream outputs under ``root``; returns their paths."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for split, n in (("train", 200), ("valid", 20), ("test", test_size)):
        _write_split(root, split, n, rng)
    paths = {"root": root, "data": root / "bin", "ckpt": root / "ckpt" / "checkpoint_last.pt"}
    arch = ["--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1"]
    arch += ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32"]
    arch += ["--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
    steps: list[list] = [
        [
            "preprocess",
            [
                "--source-lang",
                "src",
                "--target-lang",
                "tgt",
                "--trainpref",
                "train",
                "--validpref",
                "valid",
                "--testpref",
                "test",
                "--destdir",
                "bin",
                "--workers",
                "1",
            ],
            None,
        ],
        [
            "train",
            [
                "bin",
                *arch,
                "--optimizer",
                "adam",
                "--lr",
                "0.0005",
                "--max-tokens",
                "2000",
                "--max-update",
                "3",
                "--cpu",
                "--save-dir",
                "ckpt",
                "--no-epoch-checkpoints",
                "--disable-validation",
                "--seed",
                "1",
                "--log-format",
                "simple",
                "--num-workers",
                "0",
            ],
            None,
        ],
    ]
    later = []
    for name, extra in (CONFIGS if configs is None else configs).items():
        paths[f"upstream-{name}"] = root / f"upstream-{name}.txt"
        steps.append(["generate", base_args(paths) + extra, str(paths[f"upstream-{name}"])])
        if name in WITH_FASTGEN_ORACLE:
            paths[f"upstream-with-fastgen-{name}"] = root / f"upstream-with-fastgen-{name}.txt"
            later.append(["generate", base_args(paths) + extra, str(paths[f"upstream-with-fastgen-{name}"])])
    steps += [["import fastgen", [], None], *later]
    subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(steps)], env=env(), cwd=root, check=True, capture_output=True
    )
    return paths


def base_args(paths: dict[str, Path]) -> list[str]:
    return [str(paths["data"]), "--path", str(paths["ckpt"]), *COMMON]


def results_only(text: str) -> str:
    """fairseq-generate's output without log lines (they carry timestamps and timings)."""
    import re

    log = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| |INFO:|WARNING:)")
    return "".join(line for line in text.splitlines(keepends=True) if not log.match(line))
