"""fastgen-generate writes what fairseq-generate writes, on a real (tiny) fairseq setup.

The module fixture builds the setup with fairseq's own tools and runs upstream fairseq-generate
once per configuration (tests/cli/fairseq_setup.py); fastgen-generate runs in this process, with
fastgen's patches on, and its stdout must equal upstream's result lines byte for byte.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli import fairseq_setup
from tests.conftest import HAS_FAIRSEQ

pytestmark = pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")


@pytest.fixture(scope="module")
def setup(fairseq_paths: dict[str, Path]) -> dict[str, Path]:
    return fairseq_paths  # tests/cli/conftest.py: built once, shared with test_generate_fairseq_errors.py


def fastgen_generate(argv: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> str:
    from fastgen.cli.generate import main

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    capsys.readouterr()
    # The upstream outputs come from subprocesses with one thread (fairseq_setup.env()): the printed
    # scores carry every digit, and a different intra-op thread count rounds GEMMs differently.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*argv, "--no-progress-bar"]) == 0
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


def upstream(setup: dict[str, Path], name: str) -> str:
    text = fairseq_setup.results_only(setup[f"upstream-{name}"].read_text())
    assert text.count("\nH-") >= 20, "upstream produced too little to compare"
    return text


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("beam", ["--postprocess-workers", "1", "--num-workers", "1"]),  # a worker process, a data-loader worker
        ("beam", ["--no-pipeline"]),  # the synchronous path
        ("beam_nbest", ["--postprocess-workers", "0"]),  # post-processing in the background thread
        ("sampling", ["--postprocess-workers", "0"]),
        ("sacrebleu", ["--postprocess-workers", "0"]),
    ],
)
def test_same_output_as_fairseq_generate(setup, name, mode, capsys, monkeypatch):
    expected = upstream(setup, name)
    hypotheses = {line.split("\t")[-1] for line in expected.splitlines() if line.startswith("H-")}
    assert len(hypotheses) > 3, "the tiny model's outputs are degenerate; the comparison would be weak"
    assert re.search(r"^Generate test with beam=\d+: ", expected, re.M)
    out = fastgen_generate(fairseq_setup.base_args(setup) + fairseq_setup.CONFIGS[name] + mode, capsys, monkeypatch)
    assert out == expected
    assert multiprocessing.active_children() == []  # no data-loader or post-processing worker outlives the call


def _has_repeated_bigram(line: str) -> bool:
    words = line.split("\t")[-1].split()
    bigrams = list(itertools.pairwise(words))
    return len(bigrams) != len(set(bigrams))


def test_no_repeat_ngram_matches_cuda_semantics(setup, capsys, monkeypatch):
    """Oracle: fairseq_cli.generate in a process that imported fastgen (fairseq's CUDA-kernel
    semantics); plain upstream on CPU bans nothing, so it must differ here."""
    expected = upstream(setup, "with-fastgen-ngram")
    out = fastgen_generate(fairseq_setup.base_args(setup) + fairseq_setup.CONFIGS["ngram"], capsys, monkeypatch)
    assert out == expected
    hypos = [line for line in out.splitlines() if line.startswith("H-")]
    assert not any(_has_repeated_bigram(h) for h in hypos)
    plain = [line for line in upstream(setup, "ngram").splitlines() if line.startswith("H-")]
    assert any(_has_repeated_bigram(h) for h in plain), "upstream's CPU blocker should not be in play here"


# Runs fastgen-generate and dies (os._exit, like SIGKILL: no flush, no cleanup) during the commit
# of unit KILL_AT, after writing only part of its text when TORN is set.
_KILLER = """
import os, sys
import fastgen.cli.journal as journal
kill_at, torn = int(sys.argv[1]), sys.argv[2] == "1"
original = journal.Journal.commit
count = 0
def commit(self, unit, text, **extra):
    global count
    count += 1
    if count == kill_at:
        if torn:
            self._open_fresh()  # the journal creates its files at the first commit
            self._out.write(text.encode()[: len(text) // 2])
            self._out.flush()
        os._exit(9)
    original(self, unit, text, **extra)
journal.Journal.commit = commit
from fastgen.cli.generate import main
sys.exit(main(sys.argv[3:]))
"""


def test_resume_after_kill_equals_uninterrupted_run(setup, tmp_path, capsys, monkeypatch):
    """Sampling, so resuming must also restore the random state of the killed run."""
    rng = random.Random()
    kill_at, torn = rng.randint(1, 3), rng.choice([True, False])
    results = tmp_path / "out"
    argv = fairseq_setup.base_args(setup) + fairseq_setup.CONFIGS["sampling"]
    argv += ["--results-path", str(results), "--no-progress-bar", "--postprocess-workers", "0"]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLER, str(kill_at), "1" if torn else "0", *argv],
        env=fairseq_setup.env(),
        capture_output=True,
    )
    assert killed.returncode == 9, killed.stderr.decode()[-2000:]
    output = results / "generate-test.txt"
    assert not output.exists(), "a killed run must not create (or touch) the output"
    partial_file = Path(f"{output}.partial")  # absent when killed before the first unit was written
    partial = partial_file.read_text() if partial_file.exists() else ""
    assert "Generate test" not in partial
    fastgen_generate([*argv, "--resume"], capsys, monkeypatch)
    expected = upstream(setup, "sampling")
    assert output.read_text() == expected, f"kill_at={kill_at} torn={torn}"
    # resuming a finished output changes nothing
    fastgen_generate([*argv, "--resume"], capsys, monkeypatch)
    assert output.read_text() == expected


@pytest.mark.slow  # the journal's own test covers the check; this one adds a whole generation run
def test_resume_refuses_other_arguments(setup, tmp_path, capsys, monkeypatch):
    results = tmp_path / "out"
    argv = [
        *fairseq_setup.base_args(setup),
        "--beam",
        "2",
        "--results-path",
        str(results),
        "--postprocess-workers",
        "0",
    ]
    fastgen_generate(argv, capsys, monkeypatch)
    from fastgen.cli.generate import main

    argv[argv.index("--beam") + 1] = "3"
    assert main([*argv, "--resume", "--no-progress-bar"]) == 1
    assert "different settings" in capsys.readouterr().err


@pytest.mark.slow
def test_two_gloo_processes_equal_one(setup, tmp_path, capsys, monkeypatch):
    argv = [*fairseq_setup.base_args(setup), "--beam", "4", "--batch-size", "4", "--postprocess-workers", "0"]
    fastgen_generate([*argv, "--results-path", str(tmp_path / "one")], capsys, monkeypatch)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*torchrun, "-m", "fastgen.cli.generate", *argv, "--results-path", str(tmp_path / "two"), "--no-progress-bar"],
        env={**fairseq_setup.env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    one = (tmp_path / "one" / "generate-test.txt").read_text()
    assert (tmp_path / "two" / "generate-test.txt").read_text() == one
    assert one.count("\nH-") >= 20


def _without_weights_only_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        monkeypatch.setenv(name, "0")  # recorded, so the test's changes are undone afterwards
        monkeypatch.delenv(name)


def test_loads_fairseq_checkpoints_on_current_torch_by_itself(setup, capsys, monkeypatch, caplog):
    from fastgen.cli.generate import main

    _without_weights_only_env(monkeypatch)
    caplog.set_level(logging.INFO, logger="fastgen.cli")
    assert (
        main([*fairseq_setup.base_args(setup), "--beam", "2", "--postprocess-workers", "0", "--no-progress-bar"]) == 0
    )
    assert "weights_only=False" in caplog.text
    assert capsys.readouterr().out.count("\nH-") >= 20


def test_weights_only_loading_gives_a_clear_error(setup, capsys, monkeypatch):
    from fastgen.cli.generate import main

    _without_weights_only_env(monkeypatch)
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    assert main([*fairseq_setup.base_args(setup), "--beam", "2", "--postprocess-workers", "0"]) == 1
    err = capsys.readouterr().err
    assert "cannot load the checkpoint" in err
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" in err
