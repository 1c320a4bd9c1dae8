"""The scheduler's online hook (fastgen.continuous.online): inputs that arrive between steps, results as they
finish, cancellation at a step boundary. Each result still equals ``generate`` on its input alone."""

from __future__ import annotations

import pytest
import torch

from fastgen.continuous.decoder_only import run_decoder_only
from fastgen.continuous.online import WAIT, Online
from fastgen.continuous.scheduler import run_continuous
from fastgen.continuous.settings import resolve
from tests.continuous_cases import alone, make_inputs
from tests.harness import tiny_hf_model


def _run(model, settings, kwargs, source, online):
    if model.config.is_encoder_decoder:
        return run_continuous(model, source, settings, 6, online=online)
    return run_decoder_only(model, source, settings, 6, kwargs, online=online)


@pytest.mark.parametrize("family", ["bart", "gpt2"])
@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 7}, {"num_beams": 3, "max_new_tokens": 6}])
def test_late_arrivals_and_cancellation(family, kwargs):
    model = tiny_hf_model(family)
    settings, reason = resolve(model, kwargs)
    assert reason is None
    inputs = make_inputs(7, seed=3)
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4, 5], 9: [6]}  # step -> inputs that arrive before it
    cancel_at, cancelled = 4, 1  # input 1 leaves before step 4
    steps, sizes = [0], []
    online = Online(on_step=lambda state: sizes.append(len(state)))

    def source():
        sent = 0
        while sent < len(inputs):
            due = sum(len(indices) for step, indices in arrivals.items() if step <= steps[0])
            while sent < due:
                yield inputs[sent]
                sent += 1
            yield WAIT

    results, finished_at = {}, {}
    for item in _run(model, settings, kwargs, source(), online):
        if item is None:
            steps[0] += 1
            if steps[0] == cancel_at:
                online.cancelled.add(cancelled)
            continue
        assert item.index not in results
        results[item.index], finished_at[item.index] = item, steps[0]
    if cancelled in results:  # it ended (EOS) before it was cancelled: nothing to drop then
        assert finished_at[cancelled] < cancel_at
        online.cancelled.clear()
        del results[cancelled]
    assert sorted(results) == [i for i in range(len(inputs)) if i != cancelled]
    assert not online.cancelled  # the loop discarded the index it dropped
    for index, result in results.items():
        expected = alone(model, inputs[index], kwargs).sequences
        assert torch.equal(result.sequences, expected), index
    assert max(sizes) > 1  # late inputs shared steps with earlier ones
