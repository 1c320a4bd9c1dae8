"""Continuous batching's lean decode step (fastgen.continuous.lean): the model's forward's results bit for bit."""

from __future__ import annotations

import pytest
import torch

import fastgen
from fastgen.continuous import lean
from tests.continuous_cases import alone, eos_model, make_inputs

CASES = [
    dict(num_beams=3, num_return_sequences=2, max_new_tokens=10, length_penalty=0.7),
    dict(max_new_tokens=12),
    dict(do_sample=True, top_k=20, temperature=0.8, max_new_tokens=9),
]


def run(model, inputs, kwargs, monkeypatch, lean_step: bool) -> tuple[list, int]:
    """``generate_many``'s results with the lean step on or off, and how many steps it took."""
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1" if lean_step else "0")
    steps, stock = [], lean.LeanStep.step
    monkeypatch.setattr(lean.LeanStep, "step", lambda self, *args: steps.append(1) or stock(self, *args))
    seeds = {"seed": list(range(len(inputs)))} if kwargs.get("do_sample") else {}
    results = list(fastgen.generate_many(model, inputs, batch_rows=8, return_scores=True, **kwargs, **seeds))
    return results, len(steps)


@pytest.mark.parametrize("family", ["bart", "mbart", "marian", "pegasus"])
@pytest.mark.parametrize("kwargs", CASES, ids=["beam", "greedy", "sample"])
def test_lean_step_equals_the_forward(family, kwargs, monkeypatch):
    """Inputs joining and leaving at different steps: sequences and scores equal to the forward's, bit for bit."""
    model = eos_model(family, gain=4.0)
    inputs = make_inputs(9, seed=5)
    with_lean, lean_steps = run(model, inputs, kwargs, monkeypatch, True)
    forward, forward_lean_steps = run(model, inputs, kwargs, monkeypatch, False)
    assert lean_steps > 0 and forward_lean_steps == 0
    for (sequences, scores), (expected, expected_scores) in zip(with_lean, forward, strict=True):
        assert torch.equal(sequences, expected)
        assert (scores is None and expected_scores is None) or torch.equal(scores, expected_scores)
    if kwargs.get("num_beams"):  # and the oracle: generate on each input alone
        for ids, (sequences, _) in zip(inputs, with_lean, strict=True):
            assert torch.equal(sequences, alone(model, ids, kwargs).sequences)


@pytest.mark.parametrize("family", ["m2m_100", "t5"])
def test_other_families_keep_the_forward(family):
    assert lean.problem(eos_model(family, gain=4.0)) is not None


def test_hooked_layer_keeps_the_forward(monkeypatch):
    """A hook on a module the lean step skips runs: the call takes the model's forward."""
    model = eos_model("bart", gain=4.0)
    seen = []
    handle = model.get_decoder().layers[0].register_forward_hook(lambda *args: seen.append(1))
    try:
        results, lean_steps = run(model, make_inputs(3, seed=2), dict(max_new_tokens=5), monkeypatch, True)
    finally:
        handle.remove()
    assert lean_steps == 0 and seen and len(results) == 3


def test_planted_bug_is_caught(monkeypatch):
    """Every row at the widest row's position (as the stock decoder puts them): the comparison sees it."""
    model = eos_model("bart", gain=4.0)
    inputs, kwargs = make_inputs(12, seed=8), dict(max_new_tokens=12)
    forward, _ = run(model, inputs, kwargs, monkeypatch, False)
    stock = lean.LeanStep.step

    def common_position(self, tokens, positions, *args):
        return stock(self, tokens, torch.full_like(positions, int(positions.max())), *args)

    monkeypatch.setattr(lean.LeanStep, "step", common_position)
    planted, lean_steps = run(model, inputs, kwargs, monkeypatch, True)
    assert lean_steps > 0
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(planted, forward, strict=True))
