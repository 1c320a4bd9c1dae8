"""fast_gemm vs fastgen's exact default on a trained fairseq model: token agreement and BLEU.

    OMP_NUM_THREADS=1 python -m benchmarks.fast_gemm_agreement [--test-size 200] [--out FILE.json]

The model and data are those the CLI tests train (``tests/cli/fairseq_setup.py``: a word-reversal
task, a 1+1-layer transformer, d=16, three updates of ``fairseq-train``); ``fastgen.cli.generate``
decodes the test split with beam 4 twice in one process, with the default (exact) features and
with ``fast_gemm`` added, and the script compares the hypotheses line by line and the BLEU lines.
A barely trained, narrow model: the reductions are 16–32 long, so this is weak evidence of
agreement on large models (the random-weight bart-base / marian figures are in docs/benchmarks/ctranslate2.md).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

import fastgen
from benchmarks.measure import environment, result_header, write_result

DEFAULT = sorted(set(fastgen.known_features()) - fastgen.optimizer.registry.OPT_IN_FEATURES)


def _decode(setup: dict[str, Path], features: list[str]) -> tuple[dict[str, str], str, dict[str, bool]]:
    from fastgen.cli.generate import main
    from tests.cli import fairseq_setup

    out = io.StringIO()
    with fastgen.patched(features), fastgen.report() as report, contextlib.redirect_stdout(out):
        argv = [*fairseq_setup.base_args(setup), "--beam", "4", "--no-progress-bar", "--scoring", "sacrebleu"]
        assert main(argv) == 0
    text = out.getvalue()
    hypotheses = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", text, flags=re.M))
    bleu = next((line for line in text.splitlines() if "BLEU" in line), "")
    return hypotheses, bleu, {f: report.fast_path(f) for f in ("gemm", "fast_gemm")}


def main(argv: list[str] | None = None) -> None:
    from tests.cli import fairseq_setup

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--test-size", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    root = Path(tempfile.mkdtemp(prefix="fastgen-fast-gemm-"))
    setup = fairseq_setup.build(root, test_size=args.test_size, configs={})
    exact, exact_bleu, exact_ran = _decode(setup, DEFAULT)
    fast, fast_bleu, fast_ran = _decode(setup, [*DEFAULT, "fast_gemm"])
    same = sum(exact[k] == fast.get(k) for k in exact)
    report = result_header("fast_gemm_agreement", argv) | {
        "model": "tests/cli/fairseq_setup.py: transformer 1+1 layers, d=16, 3 updates; beam 4, sacrebleu",
        "environment": environment("cpu"),
        "sentences": len(exact),
        "identical_hypotheses": same,
        "bleu_exact": exact_bleu,
        "bleu_fast_gemm": fast_bleu,
        "features_ran": {"exact": exact_ran, "fast": fast_ran},
    }
    out = args.out or Path(__file__).resolve().parent / "results" / "fast_gemm_agreement-fairseq-cli-cpu.json"
    write_result(out, report)
    sys.stdout.write(json.dumps({k: report[k] for k in list(report)[-5:]}) + "\n")


if __name__ == "__main__":
    main()
