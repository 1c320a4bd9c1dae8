"""``fastgen-generate-hf`` on continuous batching (``--continuous-batching``; the default where it is expected to be
faster) and with ``--no-continuous-batching`` (static batches)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastgen
from fastgen.cli import journal
from fastgen.cli.generate_hf import load_model, load_tokenizer, main
from fastgen.cli.hf_inputs import read_lines
from scripts import make_tiny_model
from tests.cli.test_generate_hf import _KILLER
from tests.cli.tiny_files import bart_and_inputs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cbatch")
    return {**bart_and_inputs(root, sentences=30, max_words=16), "gpt2": make_tiny_model.make(root / "gpt2", "gpt2")}


def run_cli(args: list[str], capsys: pytest.CaptureFixture) -> int:
    capsys.readouterr()
    code = main([*args, "--no-progress-bar"])
    capsys.readouterr()
    return code


def alone_outputs(model_dir: Path, inputs: Path, seed: int | None = None, **kwargs) -> list[str]:
    """Upstream generate on each line alone, decoded as the CLI decodes (line k seeded with ``seed + k``;
    a decoder-only model's prompt cut off)."""
    causal = "gpt2" in model_dir.name
    tokenizer = load_tokenizer(model_dir, causal)
    model = load_model(model_dir, "cpu", "float32")
    texts = []
    for k, line in enumerate(read_lines(inputs)):
        ids = torch.tensor([tokenizer(line.text)["input_ids"]])
        if seed is not None:
            torch.manual_seed(seed + k)
        with fastgen.unpatched(), torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        if causal:
            out = out[:, ids.shape[1] :]
        texts.append(tokenizer.batch_decode(out, skip_special_tokens=True)[0].replace("\n", "\\n"))
    return texts


def test_continuous_equals_generate_alone_and_static_batches(files, tmp_path, capsys, caplog):
    out, static = tmp_path / "out.txt", tmp_path / "static.txt"
    args = [str(files["bart"]), "--input", str(files["inputs"]), "--batch-size", "3", "--sort-window", "9"]
    args += ["--num-beams", "3", "--no-repeat-ngram-size", "2", "--max-new-tokens", "10", "--postprocess-workers", "0"]
    with caplog.at_level(logging.INFO, logger="fastgen.cli.generate_hf"):
        assert run_cli([*args, "--output", str(out), "--continuous-batching"], capsys) == 0  # (a tiny model: static
        # by default, tests/cli/test_continuous_choice.py)
    assert "continuous batching: 9 decoder rows" in caplog.text
    expected = alone_outputs(files["bart"], files["inputs"], num_beams=3, no_repeat_ngram_size=2, max_new_tokens=10)
    assert out.read_text().split("\n")[:-1] == expected
    assert len(set(expected)) > 10, "outputs are degenerate; the comparison would be weak"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastgen.cli.generate_hf"):
        assert run_cli([*args, "--output", str(static), "--no-continuous-batching"], capsys) == 0
    assert "continuous batching" not in caplog.text
    assert static.read_text() == out.read_text()  # on this tiny model padding flips no token


@pytest.mark.parametrize("mode", [["--gen", "do_sample=false"], ["--num-beams", "2", "--no-repeat-ngram-size", "2"]])
def test_decoder_only_equals_generate_alone(files, tmp_path, capsys, caplog, mode):
    """A decoder-only model through the continuous stream: the prompt is cut off, as in static batches."""
    out = tmp_path / "out.txt"
    args = [str(files["gpt2"]), "--input", str(files["inputs"]), "--output", str(out), "--max-new-tokens", "8"]
    args += ["--batch-size", "3", "--sort-window", "9", "--postprocess-workers", "0", "--continuous-batching", *mode]
    with caplog.at_level(logging.INFO, logger="fastgen.cli.generate_hf"):
        assert run_cli(args, capsys) == 0
    assert "continuous batching:" in caplog.text
    kwargs = dict(do_sample=False) if "do_sample=false" in mode else dict(num_beams=2, no_repeat_ngram_size=2)
    expected = alone_outputs(files["gpt2"], files["inputs"], max_new_tokens=8, **kwargs)
    assert out.read_text().split("\n")[:-1] == expected
    assert len(set(expected)) > 10, "outputs are degenerate; the comparison would be weak"


def test_sampling_seeds_each_line(files, tmp_path, capsys, caplog):
    """With --seed S, line k is sampled from seed S + k: equal to generate on that line alone so seeded."""
    out = tmp_path / "out.txt"
    args = [str(files["bart"]), "--input", str(files["inputs"]), "--output", str(out), "--max-new-tokens", "8"]
    args += ["--gen", "do_sample=true", "--gen", "top_p=0.9", "--seed", "3", "--batch-size", "3"]
    args += ["--sort-window", "9", "--postprocess-workers", "0", "--continuous-batching"]
    with caplog.at_level(logging.INFO, logger="fastgen.cli.generate_hf"):
        assert run_cli(args, capsys) == 0
    assert "continuous batching: 3 decoder rows (3 inputs x 1 samples)" in caplog.text
    expected = alone_outputs(files["bart"], files["inputs"], seed=3, do_sample=True, top_p=0.9, max_new_tokens=8)
    assert out.read_text().split("\n")[:-1] == expected
    greedy = alone_outputs(files["bart"], files["inputs"], max_new_tokens=8)
    assert sum(a != b for a, b in zip(expected, greedy, strict=True)) > 10, "sampling should differ from greedy"


def test_beam_sampling_keeps_static_batches_with_their_seeds(files, tmp_path, capsys, caplog):
    out = tmp_path / "out.txt"
    args = [str(files["bart"]), "--input", str(files["inputs"]), "--output", str(out), "--max-new-tokens", "5"]
    args += ["--gen", "do_sample=true", "--num-beams", "2", "--seed", "3", "--postprocess-workers", "0"]
    with caplog.at_level(logging.INFO, logger="fastgen.cli.generate_hf"):
        assert run_cli(args, capsys) == 0
    assert "static batches: continuous batching does not serve this run (do_sample=True with num_beams > 1" in (
        caplog.text
    )


@pytest.mark.parametrize("kill_at", [1, 3])
def test_resume_after_kill_equals_uninterrupted_run(files, tmp_path, capsys, kill_at):
    full, resumed = tmp_path / "full.txt", tmp_path / "resumed.txt"
    args = [str(files["bart"]), "--input", str(files["inputs"]), "--batch-size", "3", "--sort-window", "6"]
    args += ["--max-new-tokens", "8", "--num-beams", "2", "--postprocess-workers", "0", "--no-progress-bar"]
    assert run_cli([*args, "--output", str(full)], capsys) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    killed = subprocess.run(
        [sys.executable, "-c", _KILLER, str(kill_at), "1", *args, "--output", str(resumed)],
        env=env,
        capture_output=True,
    )
    assert killed.returncode == 9, killed.stderr.decode()[-2000:]
    assert not resumed.exists()  # the output appears only once the run is complete
    partial = Path(f"{resumed}.partial")  # absent when killed before the first window was written
    assert not partial.exists() or len(partial.read_bytes()) < len(full.read_bytes())
    assert run_cli([*args, "--output", str(resumed), "--resume"], capsys) == 0
    assert resumed.read_text() == full.read_text()


def test_journal_records_continuous_batching_only_where_seeding_differs(files, tmp_path, capsys):
    """Greedy/beam journals are the same either way (so they resume either way); sampling ones are not."""
    base = [str(files["bart"]), "--input", str(files["inputs"]), "--max-new-tokens", "4", "--batch-size", "3"]
    base += ["--postprocess-workers", "0"]
    headers = {}
    for name, extra in {
        "beam": ["--num-beams", "2"],
        "beam-static": ["--num-beams", "2", "--no-continuous-batching"],
        "sample": ["--gen", "do_sample=true", "--seed", "1"],
        "sample-static": ["--gen", "do_sample=true", "--seed", "1", "--no-continuous-batching"],
    }.items():
        out = tmp_path / f"{name}.txt"
        assert run_cli([*base, *extra, "--output", str(out)], capsys) == 0
        headers[name] = journal.read_index(journal.index_path(out))[0]
    assert headers["beam"] == headers["beam-static"] and "continuous_batching" not in headers["beam"]
    assert headers["sample"] == {**headers["sample-static"], "continuous_batching": True}
