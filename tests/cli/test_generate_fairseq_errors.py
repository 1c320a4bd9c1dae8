"""fastgen-generate's own checks: one line, exit status 2, nothing written, an existing output kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli import fairseq_setup
from tests.conftest import HAS_FAIRSEQ

pytestmark = pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")

PRECIOUS = "an earlier run's output\n"


@pytest.fixture(scope="module")
def setup(fairseq_paths: dict[str, Path]) -> dict[str, Path]:
    """The setup test_generate_fairseq.py compares on (tests/cli/conftest.py), not a second build (~10 s)."""
    return fairseq_paths


def run(argv: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    from fastgen.cli.generate import main

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    capsys.readouterr()
    try:
        code = main([*argv, "--no-progress-bar"])
    except SystemExit as exc:  # argparse
        code = exc.code
    return code, capsys.readouterr().err


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _cases(setup: dict[str, Path], tmp: Path) -> dict[str, tuple[list[str], str]]:
    data, ckpt, common = str(setup["data"]), str(setup["ckpt"]), fairseq_setup.COMMON
    results = ["--results-path", str(tmp / "out")]
    return {
        "missing checkpoint": ([data, "--path", str(tmp / "nope.pt"), *common], "nope.pt: no such file"),
        "checkpoint is a directory": ([data, "--path", str(tmp), *common], "not a regular file"),
        "results path is a file": (
            [data, "--path", ckpt, *common, "--results-path", str(tmp / "file")],
            "is not a directory",
        ),
        "output is a directory": (
            [data, "--path", ckpt, *common, "--results-path", str(tmp / "taken")],
            "is a directory",
        ),
        "resume without results path": ([data, "--path", ckpt, *common, "--resume"], "need --results-path"),
        "sampling nbest": ([data, "--path", ckpt, *common, *results, "--sampling", "--beam", "2"], "--nbest"),
        "negative workers": ([data, "--path", ckpt, *common, "--postprocess-workers", "-1"], "must be 0 or more"),
        "missing data": ([str(tmp / "bin"), "--path", ckpt, *common], "bin: no such file or directory"),
        "zero beams": ([data, "--path", ckpt, *common, *results, "--beam", "0"], "--beam must be a positive integer"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing checkpoint",
        "checkpoint is a directory",
        "results path is a file",
        "output is a directory",
        "resume without results path",
        "sampling nbest",
        "negative workers",
        "zero beams",
        "missing data",
    ],
)
def test_fastgen_checks_are_one_line_with_status_2(setup, tmp_path, capsys, monkeypatch, case):
    (tmp_path / "file").write_text(PRECIOUS)
    (tmp_path / "taken" / "generate-test.txt").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "generate-test.txt").write_text(PRECIOUS)
    before = files(tmp_path)
    argv, message = _cases(setup, tmp_path)[case]
    code, err = run(argv, capsys, monkeypatch)
    assert code == 2, err
    assert message in err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err
    assert files(tmp_path) == before


def test_exact_scores_turns_off_dedup_only(setup, capsys, monkeypatch):
    """--exact-scores: fastgen-generate without beam-shared cross-attention, whose H-/D-/P- digits can differ
    from fairseq-generate's (benchmarks/fairseq_score_digits.py); the other features keep running."""
    import fastgen
    from fastgen.optimizer.registry import feature_enabled

    argv = [*fairseq_setup.base_args(setup), "--beam", "4", "--postprocess-workers", "0"]
    with fastgen.patched(), fastgen.report() as plain:
        assert run(argv, capsys, monkeypatch)[0] == 0
    with fastgen.patched(), fastgen.report() as exact:
        assert run([*argv, "--exact-scores"], capsys, monkeypatch)[0] == 0
        assert feature_enabled("dedup")  # the run's choice was confined to its own block
    assert plain.fast_path("dedup")
    assert "dedup" not in exact.ran
    assert exact.fast_path("beam")
