"""The continuous loop's own per-step work (issue 24): newcomers encoded in batches, results unchanged."""

from __future__ import annotations

import torch

import fastgen
from fastgen.continuous.scheduler import run_continuous
from fastgen.continuous.settings import resolve
from tests.continuous_cases import alone, eos_model, make_inputs


def test_greedy_newcomers_are_encoded_a_batch_at_a_time():
    """Greedy inputs finish one at a time; each handful of newcomers used to get an encoder call of its own
    (one or two rows). Now one call encodes up to ``batch_rows`` inputs ahead; results still equal each
    input's ``generate`` alone."""
    model = eos_model("bart", gain=8.0)
    inputs = make_inputs(12, seed=3)
    kwargs = dict(num_beams=1, max_new_tokens=30)
    calls = []
    handle = model.get_encoder().register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        settings, reason = resolve(model, kwargs)
        assert reason is None
        results = list(run_continuous(model, inputs, settings, batch_rows=4))
    finally:
        handle.remove()
    assert len({len(result.sequences[0]) for result in results}) > 1  # inputs finish at different steps
    assert len(calls) == 3  # 12 inputs, 4 per call (before: 5 calls, some of one input)
    for ids, result in zip(inputs, results, strict=True):
        assert torch.equal(result.sequences, alone(model, ids, kwargs).sequences)


def test_beam_results_unchanged_by_encoding_ahead():
    """Beam search with refills in the middle of encoded groups: every input as ``generate`` gives it alone."""
    model = eos_model("bart", gain=4.0)
    inputs = make_inputs(9, seed=5)
    kwargs = dict(num_beams=3, max_new_tokens=10)
    results = list(fastgen.generate_many(model, inputs, batch_rows=6, return_scores=True, **kwargs))
    for ids, (sequences, scores) in zip(inputs, results, strict=True):
        expected = alone(model, ids, kwargs)
        assert torch.equal(sequences, expected.sequences)
        torch.testing.assert_close(scores, expected.sequences_scores, rtol=1e-5, atol=1e-5)
