"""fastgen-generate-hf: files in, files out, equal to upstream ``model.generate`` on the same inputs."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastgen
from fastgen.cli.generate_hf import main
from fastgen.cli.hf_inputs import plan, read_lines
from scripts import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    inputs = root / "inputs.txt"
    inputs.write_text("\n".join(make_tiny_model.sentences(40, seed=3, max_words=16)) + "\n")
    return {
        "bart": make_tiny_model.make(root / "bart", "bart"),
        "gpt2": make_tiny_model.make(root / "gpt2", "gpt2"),
        "inputs": inputs,
    }


def cli(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*args, "--no-progress-bar"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def reference(model_dir: Path, inputs: Path, batch_size: int, window: int, **kwargs) -> list[str]:
    """Upstream (``fastgen.unpatched()``) generate + batch_decode on the batches the CLI plans."""
    from fastgen.cli.generate_hf import load_model, load_tokenizer

    causal = "gpt2" in model_dir.name
    tokenizer = load_tokenizer(model_dir, causal)
    model = load_model(model_dir, "cpu", "float32")
    lines = read_lines(inputs)
    for line in lines:
        line.ids = tokenizer(line.text)["input_ids"]
    outputs = [""] * len(lines)
    for batch in plan(lines, batch_size, window):
        texts = [lines[i].text for i in batch.indices]
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        with fastgen.unpatched():
            out = model.generate(**enc, **kwargs)
        if causal:
            out = out[:, enc["input_ids"].shape[1] :]
        for i, text in zip(batch.indices, tokenizer.batch_decode(out, skip_special_tokens=True), strict=True):
            outputs[i] = text
    return outputs


CASES = {
    "bart-beam-ngram": (
        "bart",
        ["--num-beams", "3", "--no-repeat-ngram-size", "2"],
        {"num_beams": 3, "no_repeat_ngram_size": 2},
    ),
    "gpt2-greedy": ("gpt2", ["--gen", "do_sample=false"], {"do_sample": False}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_output_equals_upstream_generate(models, case, tmp_path, capsys):
    family, flags, kwargs = CASES[case]
    out = tmp_path / "out.txt"
    args = [str(models[family]), "--input", str(models["inputs"]), "--output", str(out), "--batch-size", "4"]
    args += ["--max-new-tokens", "10", "--sort-window", "12", "--postprocess-workers", "0", *flags]
    assert cli(args, capsys)[0] == 0
    expected = reference(models[family], models["inputs"], 4, 12, max_new_tokens=10, **kwargs)
    got = out.read_text().split("\n")[:-1]
    assert got == expected
    assert len(set(expected)) > 10, "outputs are degenerate; the comparison would be weak"


def test_worker_processes_and_reference_scores(models, tmp_path, capsys):
    out = tmp_path / "out.txt"
    args = [str(models["bart"]), "--input", str(models["inputs"]), "--output", str(out), "--batch-size", "8"]
    args += ["--max-new-tokens", "8", "--postprocess-workers", "1", "--reference", str(models["inputs"])]
    code, stdout, _ = cli(args, capsys)
    assert code == 0
    assert stdout.startswith("BLEU = ")
    expected = reference(models["bart"], models["inputs"], 8, 128, max_new_tokens=8)
    assert out.read_text().split("\n")[:-1] == expected


def test_invalid_lines_are_named_or_skipped_and_counted(models, tmp_path, capsys, caplog):
    good = models["inputs"].read_bytes().split(b"\n")[:6]
    bad = tmp_path / "bad.txt"
    long_line = b" ".join([b"cat"] * 80)
    bad.write_bytes(b"\n".join([good[0], b"\xff\xfe broken", good[1], b"   ", good[2], long_line, good[3]]) + b"\n")
    out = tmp_path / "out.txt"
    args = [str(models["bart"]), "--input", str(bad), "--output", str(out), "--max-new-tokens", "6"]
    args += ["--postprocess-workers", "0"]
    code, _, err = cli(args, capsys)
    assert code == 1
    assert f"{bad}:2 is not valid UTF-8" in err
    assert f"{bad}:4 is empty" in err
    assert f"{bad}:6 has 80 tokens; the limit is 64" in err
    assert not out.exists()

    code, _, err = cli([*args, "--skip-invalid"], capsys)
    assert code == 0
    assert "skipped 3 invalid input line(s): 2, 4, 6" in caplog.text
    lines = out.read_text().split("\n")[:-1]
    assert len(lines) == 7
    assert [lines[1], lines[3], lines[5]] == ["", "", ""]
    assert all(lines[i] for i in (0, 2, 4, 6))


# Dies (like SIGKILL) while committing window KILL_AT, after writing part of it when TORN.
_KILLER = """
import os, sys
import fastgen.cli.journal as journal
kill_at, torn = int(sys.argv[1]), sys.argv[2] == "1"
original, count = journal.Journal.commit, 0
def commit(self, unit, text, **extra):
    global count
    count += 1
    if count == kill_at:
        if torn:
            self._open_fresh()  # the journal creates its files at the first commit
            self._out.write(text.encode()[: len(text) // 2]); self._out.flush()
        os._exit(9)
    original(self, unit, text, **extra)
journal.Journal.commit = commit
from fastgen.cli.generate_hf import main
sys.exit(main(sys.argv[3:]))
"""


def test_resume_after_kill_equals_uninterrupted_run(models, tmp_path, capsys):
    """Sampling with --seed: the resumed batches must be the same batches with the same seeds."""
    rng = random.Random()
    kill_at, torn = rng.randint(1, 4), rng.choice([True, False])
    full, resumed = tmp_path / "full.txt", tmp_path / "resumed.txt"
    args = [str(models["bart"]), "--input", str(models["inputs"]), "--batch-size", "3", "--sort-window", "6"]
    args += ["--max-new-tokens", "8", "--gen", "do_sample=true", "--gen", "top_k=20", "--seed", "11"]
    args += ["--postprocess-workers", "0", "--no-progress-bar"]
    assert cli([*args, "--output", str(full)], capsys)[0] == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    killed = subprocess.run(
        [sys.executable, "-c", _KILLER, str(kill_at), "1" if torn else "0", *args, "--output", str(resumed)],
        env=env,
        capture_output=True,
    )
    assert killed.returncode == 9, killed.stderr.decode()[-2000:]
    assert not resumed.exists(), "a killed run must not create (or touch) the output"
    partial = Path(f"{resumed}.partial")  # absent when killed before the first window was written
    assert not partial.exists() or len(partial.read_bytes()) < len(full.read_bytes())
    assert cli([*args, "--output", str(resumed), "--resume"], capsys)[0] == 0
    assert resumed.read_text() == full.read_text(), f"kill_at={kill_at} torn={torn}"


def test_two_gloo_processes_equal_one(models, tmp_path, capsys):
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    args = [str(models["gpt2"]), "--input", str(models["inputs"]), "--batch-size", "4", "--sort-window", "8"]
    args += ["--max-new-tokens", "6", "--num-beams", "2", "--postprocess-workers", "0", "--no-progress-bar"]
    assert cli([*args, "--output", str(one)], capsys)[0] == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*torchrun, "-m", "fastgen.cli.generate_hf", *args, "--output", str(two)], env=env, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert two.read_text() == one.read_text()
    assert not list(tmp_path.glob("two.txt.part-*")), "the parts should be merged and removed"


def test_windows_and_batches_do_not_depend_on_the_world():
    """The plan is the same whatever the number of ranks: each rank takes whole windows of it."""
    lines = read_lines(Path(__file__))  # any text file
    for line in lines:
        line.ids = list(range(len(line.text or "")))
    batches = plan(lines, 4, 8)
    assert sorted(i for b in batches for i in b.indices) == [i for i, line in enumerate(lines) if line.text]
    assert [b.key for b in batches] == list(range(len(batches)))
    assert torch.tensor([b.window for b in batches]).diff().ge(0).all()
