"""The CLI's choice between continuous batching and static batches for a run (issue 24): the rule, not timings."""

from __future__ import annotations

import logging

import pytest
import torch

import fastgen
from fastgen.cli import continuous_hf
from fastgen.cli.generate_hf import main
from fastgen.continuous.settings import resolve
from tests import harness
from tests.cli.tiny_files import bart_and_inputs


@pytest.fixture(scope="module")
def bart():
    return harness.tiny_hf_model("bart")


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def rows_rule(monkeypatch):
    """The rows rule alone: the tiny test model passes as a large one (the small-model rule has its own tests)."""
    monkeypatch.setattr(continuous_hf, "SMALL_MODEL_PARAMETERS", 0)


def settings(model, **kwargs):
    resolved, reason = resolve(model, kwargs)
    assert reason is None
    return resolved


@pytest.mark.parametrize(
    ("kwargs", "batch_size"),
    [
        (dict(num_beams=1, max_new_tokens=5), 64),  # greedy: static batches keep finished rows
        (dict(do_sample=True, max_new_tokens=5), 64),  # sampling: its seeding depends on the mode
        (dict(num_beams=4, max_new_tokens=5), 8),  # 32 rows: a step's fixed cost is a large share
    ],
)
def test_continuous_where_it_saves_more_than_steps(bart, two_threads, rows_rule, kwargs, batch_size):
    assert continuous_hf.prefers_static(bart, settings(bart, **kwargs), batch_size) is None


def test_static_for_wide_beam_search_on_several_threads(bart, two_threads, rows_rule):
    reason = continuous_hf.prefers_static(bart, settings(bart, num_beams=4, max_new_tokens=5), 16)
    assert reason is not None and "64 rows per step (> 32) on 2 thread(s)" in reason


def test_static_for_wide_beam_search_on_one_thread_too(bart, rows_rule):
    """At 64 rows on one thread continuous batching measured 0.94x-1.04x static batches: static is the default."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reason = continuous_hf.prefers_static(bart, settings(bart, num_beams=4, max_new_tokens=5), 16)
        assert reason is not None and "on 1 thread(s)" in reason
        assert continuous_hf.prefers_static(bart, settings(bart, num_beams=4, max_new_tokens=5), 8) is None
    finally:
        torch.set_num_threads(threads)


def test_continuous_when_static_batches_would_run_upstreams_beam_loop(bart, two_threads, rows_rule):
    chosen = settings(bart, num_beams=4, max_new_tokens=5)
    with fastgen.patched(features=[f for f in fastgen.known_features() if f != "beam"]):
        assert continuous_hf.prefers_static(bart, chosen, 16) is None


def test_decoder_only_keeps_continuous_batching(two_threads, rows_rule):
    model = harness.tiny_hf_model("gpt2")
    assert continuous_hf.prefers_static(model, settings(model, num_beams=4, max_new_tokens=5), 16) is None


@pytest.mark.parametrize("kwargs", [dict(num_beams=4, max_new_tokens=5), dict(num_beams=1, max_new_tokens=5)])
def test_static_for_a_small_model_on_a_cpu(bart, kwargs):
    """A 7.9M-parameter BART measured 0.5-0.85x static batches under continuous batching, greedy and beam."""
    reason = continuous_hf.prefers_static(bart, settings(bart, **kwargs), 4)
    assert reason is not None and "M parameters on a CPU" in reason


@pytest.mark.parametrize("mode", ["int8", "fast"])
def test_static_in_the_fast_modes_on_a_cpu(bart, rows_rule, mode):
    """In the fast modes a continuous batch's step runs in Python where static batches run it in C++."""
    chosen = settings(bart, num_beams=1, max_new_tokens=5)
    assert continuous_hf.prefers_static(bart, chosen, 4) is None  # the exact mode: the rows rule says continuous
    with fastgen.mode(mode):
        reason = continuous_hf.prefers_static(bart, chosen, 4)
    assert reason is not None and f"the {mode} mode on a CPU" in reason


def test_sampling_is_never_switched(bart):
    assert continuous_hf.prefers_static(bart, settings(bart, do_sample=True, max_new_tokens=5), 4) is None


def test_cli_says_which_it_chose_and_the_outputs_agree(tmp_path, capsys, caplog, two_threads):
    files = bart_and_inputs(tmp_path, sentences=12, max_words=10)
    args = [str(files["bart"]), "--input", str(files["inputs"]), "--batch-size", "9", "--num-beams", "4"]
    args += ["--max-new-tokens", "6", "--postprocess-workers", "0", "--no-progress-bar"]
    outputs = {}
    for name, extra in (
        ("default", []),
        ("forced", ["--continuous-batching"]),
        ("static", ["--no-continuous-batching"]),
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fastgen.cli.generate_hf"):
            assert main([*args, "--output", str(tmp_path / f"{name}.txt"), *extra]) == 0
        capsys.readouterr()
        outputs[name] = (tmp_path / f"{name}.txt").read_text()
        if name == "default":
            assert "static batches: a model of" in caplog.text  # the tiny model (the rows rule would say so too)
            assert "continuous batching:" not in caplog.text
        if name == "forced":
            assert "continuous batching: 36 decoder rows" in caplog.text
    assert outputs["default"] == outputs["forced"] == outputs["static"]
