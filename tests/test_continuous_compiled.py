"""Continuous batching's decode step run from C++ (``DecoderStep.step_rows``): the Python lean step's bits.

In the exact mode, ``generate_many`` with ``FASTGEN_COMPILED_STEP=1`` must return exactly what it returns with
``=0`` (the Python lean step of :mod:`fastgen.continuous.lean`, itself the model's forward bit for bit): tokens
and scores ``torch.equal``, over inputs that join and leave at different steps (rows at different positions,
row counts that change, the self-attention buffers growing), for beam search, greedy and sampling; and the
program must actually have run most steps. Beam search's tokens also equal upstream ``generate`` on each input
alone. In the fast modes the program must equal their Python step the same way.
"""

from __future__ import annotations

import pytest
import torch

import fastgen
from fastgen.continuous import lean
from fastgen.models import compiled_step
from fastgen.ops import cpu_kernels, linear
from tests import harness
from tests.continuous_cases import alone, eos_model, make_inputs

FAMILIES = ("bart", "mbart", "marian", "pegasus")

CASES = {
    "beam": dict(num_beams=3, num_return_sequences=2, max_new_tokens=10, length_penalty=0.7),
    "beam-long": dict(num_beams=2, max_new_tokens=40, min_new_tokens=20),
    "greedy": dict(max_new_tokens=12),
    "sample": dict(do_sample=True, top_k=20, temperature=0.8, max_new_tokens=9),
}


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    if not cpu_kernels.available():
        pytest.skip(f"fastgen's CPU kernels: {cpu_kernels.unavailable_reason()}")
    monkeypatch.setattr(linear, "CALIBRATE_AFTER", 1)  # forms settle at their first product
    monkeypatch.setattr(linear, "TRIAL_CALLS", 0)
    linear.forget_choices()
    yield
    linear.forget_choices()


def run(model, inputs, kwargs, monkeypatch, compiled: bool) -> tuple[list, int, int]:
    """``generate_many``'s results with the C++ step on or off; the steps taken and those the program ran."""
    monkeypatch.setenv(compiled_step.ENV, "1" if compiled else "0")
    steps, programs = [], []
    stock_step, stock_compiled = lean.LeanStep.step, lean.LeanStep._compiled_step
    monkeypatch.setattr(lean.LeanStep, "step", lambda self, *args: steps.append(1) or stock_step(self, *args))

    def counted(self, *args):
        logits = stock_compiled(self, *args)
        programs.append(logits is not None)
        return logits

    monkeypatch.setattr(lean.LeanStep, "_compiled_step", counted)
    seeds = {"seed": list(range(len(inputs)))} if kwargs.get("do_sample") else {}
    results = list(fastgen.generate_many(model, inputs, batch_rows=8, return_scores=True, **kwargs, **seeds))
    return results, len(steps), sum(programs)


@pytest.mark.parametrize(
    ("family", "case"),
    harness.family_case_grid(FAMILIES, CASES, lambda family, case: family == "bart" or case in ("beam", "greedy")),
)
def test_compiled_step_equals_the_python_step(family, case, monkeypatch):
    model, kwargs = eos_model(family, gain=4.0), CASES[case]
    inputs = make_inputs(9, seed=5)
    python, _, python_programs = run(model, inputs, kwargs, monkeypatch, False)
    compiled, steps, programs = run(model, inputs, kwargs, monkeypatch, True)
    assert python_programs == 0
    assert programs >= steps // 2, (programs, steps)  # the first step of a run and new row counts may not
    for (sequences, scores), (expected, expected_scores) in zip(compiled, python, strict=True):
        assert torch.equal(sequences, expected)
        assert (scores is None and expected_scores is None) or torch.equal(scores, expected_scores)
    if kwargs.get("num_beams"):  # and the oracle: generate on each input alone
        for ids, (sequences, _) in zip(inputs, compiled, strict=True):
            assert torch.equal(sequences, alone(model, ids, kwargs).sequences)


def test_planted_position_is_caught(monkeypatch):
    """The program given every row at the widest row's position: the comparison sees it."""
    model, kwargs = eos_model("bart", gain=4.0), CASES["greedy"]
    inputs = make_inputs(12, seed=8)
    python, _, _ = run(model, inputs, kwargs, monkeypatch, False)
    stock = lean.LeanStep._compiled_step

    def common_position(self, program, ids, positions, *args):
        return stock(self, program, ids, torch.full_like(positions, int(positions.max())), *args)

    monkeypatch.setattr(lean.LeanStep, "_compiled_step", common_position)
    planted, _, programs = run(model, inputs, kwargs, monkeypatch, True)
    assert programs > 0
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(planted, python, strict=True))


@pytest.mark.parametrize("mode", ["int8", "fast"])
@pytest.mark.parametrize("case", ["beam", "greedy"])
def test_fast_modes_compiled_step_equals_their_python_step(mode, case, monkeypatch):
    """In the fast modes the program attends with fastgen's CPU kernel, self-attention mask included, as the
    Python step's attention does there: the same bits. Heads of 64 dimensions: the kernel's (and so the program's)
    cross-attention takes several beams per input only there."""
    model = harness.tiny_hf_model("bart", d_model=128, encoder_attention_heads=2, decoder_attention_heads=2)
    with torch.no_grad():
        model.get_output_embeddings().weight[harness.EOS] *= 4.0
    kwargs = CASES[case]
    inputs = make_inputs(9, seed=5)
    with fastgen.mode(mode, model=model):
        python, _, _ = run(model, inputs, kwargs, monkeypatch, False)
        compiled, steps, programs = run(model, inputs, kwargs, monkeypatch, True)
    assert programs >= steps // 2, (programs, steps)
    for (sequences, scores), (expected, expected_scores) in zip(compiled, python, strict=True):
        assert torch.equal(sequences, expected)
        assert (scores is None and expected_scores is None) or torch.equal(scores, expected_scores)
