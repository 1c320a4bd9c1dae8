"""Batched speculative decoding shows in ``fastgen.report()``, and a bad fastgen draft option is an error."""

from __future__ import annotations

import copy

import pytest

import fastgen
from tests.harness import requires_feature, tiny_hf_model, tiny_inputs
from tests.optimizer.test_speculative import _noisy_copy

pytestmark = requires_feature("speculative")


def test_report_counts_rows_proposed_and_accepted_drafts() -> None:
    model = tiny_hf_model("llama")
    draft = _noisy_copy(model)
    first, second = tiny_inputs(model, batch=3, seed=1), tiny_inputs(model, batch=2, seed=2)
    with fastgen.patched(["speculative"]), fastgen.report() as r:
        model.generate(**first, assistant_model=draft, do_sample=False, max_new_tokens=12)
        model.generate(**second, prompt_lookup_num_tokens=3, do_sample=False, max_new_tokens=12)
    assert r.fast_path("speculative")
    assert any("draft model" in what for what in r.ran["speculative"])
    assert any("prompt lookup" in what for what in r.ran["speculative"])
    counts = r.counts["speculative"]
    assert counts["calls"] == 2 and counts["rows"] == 5
    assert 0 < counts["accepted"] <= counts["proposed"]
    assert r.acceptance_rate("speculative") == counts["accepted"] / counts["proposed"]
    assert "acceptance rate" in str(r) and "speculative" in str(r)


def test_batch_one_records_nothing_it_did_not_do() -> None:
    model = tiny_hf_model("gpt2")
    with fastgen.patched(["speculative"]), fastgen.report() as r:
        model.generate(**tiny_inputs(model, batch=1), assistant_model=model, do_sample=False, max_new_tokens=6)
    assert not r.fast_path("speculative") and "speculative" not in r.counts


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("fastgen_draft_schedule", "foo", "fastgen_draft_schedule must be one of 'bass', 'heuristic', 'constant'"),
        ("fastgen_draft_length", 0, "fastgen_draft_length must be a positive integer"),
        ("fastgen_draft_limit", "8", "fastgen_draft_limit must be a positive integer"),
    ],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_bad_draft_option_is_a_value_error(option: str, value, message: str, batch: int) -> None:
    model = tiny_hf_model("gpt2")
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.do_sample = 6, False
    setattr(config, option, value)
    with fastgen.patched(["speculative"]), pytest.raises(ValueError, match=message):
        model.generate(**tiny_inputs(model, batch=batch), assistant_model=model, generation_config=config)
