"""fastgen-generate-hf on what a user gets wrong: one line, exit status 2, and an existing output untouched."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest

import fastgen
from fastgen.cli import generate_hf, journal
from fastgen.cli.generate_hf import main
from fastgen.cli.hf_inputs import read_lines
from scripts import make_tiny_model
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


#: --gen values that generate rejects (issue 24): on the continuous path (the default) they printed a traceback
REJECTED_GEN = {
    "temperature=0": (["--gen", "do_sample=true", "--gen", "temperature=0"], "temperature"),
    "top_k=-3": (["--gen", "do_sample=true", "--gen", "top_k=-3"], "top_k"),
    "min_p=5": (["--gen", "do_sample=true", "--gen", "min_p=5"], "min_p"),
    "length_penalty=abc": (["--num-beams", "2", "--gen", "length_penalty=abc"], "length_penalty"),
    "early_stopping=maybe": (["--num-beams", "2", "--gen", "early_stopping=maybe"], "early_stopping"),
    "gpt2 max_length=2": (["--gen", "max_length=2"], "max_length"),
    "attention_mask": (["--gen", "attention_mask=[1]"], "attention_mask"),
}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model.make(tmp_path_factory.mktemp("hf-errors-gpt2") / "gpt2", "gpt2")


@pytest.mark.parametrize("mode", ["--continuous-batching", "--no-continuous-batching"])
@pytest.mark.parametrize("case", list(REJECTED_GEN))
def test_generate_arguments_generate_rejects_are_one_line_on_both_paths(setup, gpt2, tmp_path, capsys, case, mode):
    out = tmp_path / "out.txt"
    out.write_text(PRECIOUS)
    extra, name = REJECTED_GEN[case]
    model = gpt2 if case.startswith("gpt2") else setup["bart"]
    capsys.readouterr()
    args = [str(model), "--input", str(setup["inputs"]), "--output", str(out), *extra, mode]
    try:  # no --max-new-tokens here: it would override max_length
        code = main([*args, "--no-progress-bar", "--postprocess-workers", "0"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and name in err
    assert len(error_lines(err)) == 1, err
    assert files(tmp_path) == {"out.txt": PRECIOUS.encode()}, "nothing may be written, the old output kept"


@pytest.mark.parametrize("mode", ["--continuous-batching", "--no-continuous-batching"])
def test_max_input_tokens_above_the_models_positions_is_one_line(setup, tmp_path, capsys, mode):
    """A 64-position model, ``--max-input-tokens 500`` and a 300-token line: was an IndexError traceback."""
    long_input = tmp_path / "long.txt"
    long_input.write_text(setup["inputs"].read_text() + " ".join(["red cat"] * 150) + "\n")
    out = tmp_path / "out.txt"
    out.write_text(PRECIOUS)
    before = files(tmp_path)
    args = [str(setup["bart"]), "--input", str(long_input), "--output", str(out), mode]
    code, err = run([*args, "--max-input-tokens", "500"], capsys)
    assert code == 2, err
    assert "--max-input-tokens 500: the model takes at most 64 input tokens" in err and "Traceback" not in err
    assert len(error_lines(err)) == 1, err
    assert files(tmp_path) == before
    code, err = run([*args, "--max-input-tokens", "64"], capsys)  # within the limit: the long line is invalid
    assert code == 1 and "has 300 tokens; the limit is 64" in err and "Traceback" not in err
