"""fastgen-generate-hf on what a user gets wrong: one line, exit status 2, and an existing output untouched."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest

import fastgen
from fastgen.cli import generate_hf, journal
from fastgen.cli.generate_hf import main
from fastgen.cli.hf_inputs import read_lines
from tests.cli.tiny_files import bart_and_inputs
from tests.harness import tiny_hf_model, tiny_inputs

PRECIOUS = "an earlier run's output\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return bart_and_inputs(tmp_path_factory.mktemp("hf-errors"), sentences=12, max_words=12)


def run(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main([*args, "--no-progress-bar", "--postprocess-workers", "0", "--max-new-tokens", "6"])
    except SystemExit as exc:  # argparse
        code = exc.code
    return code, capsys.readouterr().err


def error_lines(err: str) -> list[str]:
    """stderr without Transformers' weight-loading progress bar."""
    return [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "Loading weights" not in line]


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_bad_generate_argument_leaves_the_existing_output_alone(setup, tmp_path, capsys):
    out = tmp_path / "out.txt"
    out.write_text(PRECIOUS)
    code, err = run(
        [str(setup["bart"]), "--input", str(setup["inputs"]), "--output", str(out), "--gen", "foo=3"], capsys
    )
    assert code == 2
    assert "foo" in err and "Traceback" not in err
    assert len(error_lines(err)) == 1, err
    assert files(tmp_path) == {"out.txt": PRECIOUS.encode()}, "nothing may be written, the old output kept"


def test_interrupted_run_keeps_the_old_output_and_resumes(setup, tmp_path, capsys, monkeypatch):
    out, full = tmp_path / "out.txt", tmp_path / "full.txt"
    args = [
        str(setup["bart"]),
        "--input",
        str(setup["inputs"]),
        "--batch-size",
        "2",
        "--sort-window",
        "4",
        "--no-pipeline",
        "--no-continuous-batching",  # the interruption is planted in the static batches' generate call
    ]
    assert run([*args, "--output", str(full)], capsys)[0] == 0
    out.write_text(PRECIOUS)
    calls = 0
    original = generate_hf._generate

    def interrupted(*args, **kwargs):  # Ctrl-C during the third batch, after the first window was written
        # (--no-pipeline: each window is committed before the next batch starts)
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(generate_hf, "_generate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run([*args, "--output", str(out)], capsys)
    monkeypatch.setattr(generate_hf, "_generate", original)
    assert journal.partial_path(out).stat().st_size > 0
    assert out.read_text() == PRECIOUS
    assert journal.partial_path(out).exists()
    assert run([*args, "--output", str(out), "--resume"], capsys)[0] == 0
    assert out.read_text() == full.read_text()
    assert not journal.partial_path(out).exists()


def _bad_paths(setup: dict[str, Path], tmp: Path) -> dict[str, tuple[list[str], str]]:
    model, inputs, out = str(setup["bart"]), str(setup["inputs"]), str(tmp / "out.txt")
    return {
        "missing model": ([str(tmp / "nope"), "--input", inputs, "--output", out], "nope: no such directory"),
        "model without config": ([str(tmp), "--input", inputs, "--output", out], "has no config.json"),
        "missing input": ([model, "--input", str(tmp / "in.txt"), "--output", out], "in.txt: no such file"),
        "input is a directory": ([model, "--input", str(tmp), "--output", out], "not a regular file"),
        "output is a directory": ([model, "--input", inputs, "--output", str(tmp)], "is a directory"),
        "output under a file": ([model, "--input", inputs, "--output", str(tmp / "out.txt" / "x")], "not a directory"),
        "missing reference": (
            [model, "--input", inputs, "--output", out, "--reference", str(tmp / "r")],
            "no such file",
        ),
        "zero beams": (
            [model, "--input", inputs, "--output", out, "--num-beams", "0"],
            "--num-beams: must be a positive",
        ),
        "zero batch": (
            [model, "--input", inputs, "--output", out, "--batch-size", "0"],
            "--batch-size: must be a positive",
        ),
        "bad --gen": ([model, "--input", inputs, "--output", out, "--gen", "beams"], "--gen takes KEY=VALUE"),
        "zero beams in --gen": (
            [model, "--input", inputs, "--output", out, "--gen", "num_beams=0"],
            "must be a positive",
        ),
        "unknown device": (
            [model, "--input", inputs, "--output", out, "--device", "gpu7"],
            "--device gpu7: not a device",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing model",
        "model without config",
        "missing input",
        "input is a directory",
        "output is a directory",
        "output under a file",
        "missing reference",
        "zero beams",
        "zero batch",
        "bad --gen",
        "zero beams in --gen",
        "unknown device",
    ],
)
def test_bad_paths_and_values_are_one_line_with_status_2(setup, tmp_path, capsys, case):
    (tmp_path / "out.txt").write_text(PRECIOUS)
    before = files(tmp_path)
    args, message = _bad_paths(setup, tmp_path)[case]
    code, err = run(args, capsys)
    assert code == 2
    assert message in err
    assert len(error_lines(err)) == 1, err
    assert files(tmp_path) == before


def test_a_byte_order_mark_does_not_change_the_first_line(setup, tmp_path, capsys):
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    marked.write_bytes(codecs.BOM_UTF8 + setup["inputs"].read_bytes())
    assert [line.text for line in read_lines(marked)] == [line.text for line in read_lines(setup["inputs"])]
    args = [str(setup["bart"]), "--batch-size", "4"]
    assert run([*args, "--input", str(setup["inputs"]), "--output", str(plain)], capsys)[0] == 0
    assert run([*args, "--input", str(marked), "--output", str(tmp_path / "m.txt")], capsys)[0] == 0
    assert (tmp_path / "m.txt").read_text() == plain.read_text()
    assert len(set(plain.read_text().splitlines())) > 3, "outputs are degenerate; the comparison would be weak"


def test_help_says_how_inputs_are_decoded(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "utf-8-sig" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_zero_beams_through_the_api_fail_as_upstream_does(family):
    model = tiny_hf_model(family)
    inputs = tiny_inputs(model)
    errors = []
    for context in (fastgen.unpatched, fastgen.patched):
        with context(), pytest.raises(Exception) as caught:  # the type is upstream's, compared below
            model.generate(**inputs, num_beams=0, max_new_tokens=4)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]
