"""The Transformers contract: the cache's name matches the installed release, and a release whose
structure fastgen does not know skips the patches that need it, saying so in words a user can act on."""

from __future__ import annotations

import inspect
import logging

import pytest
import transformers
from transformers.generation import utils as generation_utils

import fastgen
import fastgen.continuous.settings  # a patch target: imported, its patch is applied or skipped, never pending
from fastgen.optimizer import registry
from fastgen.optimizer.transformers import contract
from tests.harness import requires_feature

pytestmark = [pytest.mark.fast_path, requires_feature("dedup")]


def test_cache_name_is_the_installed_forward_and_generate_kwarg() -> None:
    assert contract.problem() is None
    for model_class in (transformers.BartForConditionalGeneration, transformers.LlamaForCausalLM):
        assert contract.CACHE in inspect.signature(model_class.forward).parameters
    assert generation_utils.ALL_CACHE_NAMES[0] == contract.CACHE


@pytest.fixture
def unknown_release(monkeypatch: pytest.MonkeyPatch):
    """The installed release as if a later one had renamed the cache again."""
    monkeypatch.setattr(generation_utils, "ALL_CACHE_NAMES", ["kv_state", *generation_utils.ALL_CACHE_NAMES[1:]])
    contract._resolved.cache_clear()
    yield
    monkeypatch.undo()
    contract._resolved.cache_clear()
    fastgen.enable()


def test_unknown_structure_skips_the_cache_patches_with_an_actionable_reason(unknown_release, caplog) -> None:
    reason = contract.problem()
    assert reason is not None
    for words in (transformers.__version__, contract.NEWEST_TESTED, "pin transformers==", "upgrade fastgen"):
        assert words in reason, reason
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        fastgen.enable()
    rows = {(row.feature, row.target): row.state for row in fastgen.status()}
    needing = [
        p for p in registry.declared_patches() if p.requires == "fastgen.optimizer.transformers.contract:problem"
    ]
    assert {p.feature for p in needing} >= {"dedup", "beam", "speculative"}
    for patch in needing:
        state = rows[(patch.feature, patch.target)]
        assert state.startswith("skipped: transformers") and contract.NEWEST_TESTED in state, state
    # Patches that do not need the cache still apply.
    assert any(state == "applied" for (feature, _), state in rows.items() if feature == "ngram")
    warned = [r.getMessage() for r in caplog.records if contract.NEWEST_TESTED in r.getMessage()]
    assert warned and len(warned) == len(set(warned)), warned  # said, once per feature


def test_generation_equals_upstream_when_the_patches_are_skipped(unknown_release) -> None:
    from tests import harness

    fastgen.enable()
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    _, _, report = harness.assert_same_generation(model, inputs, with_report=True, num_beams=3, max_new_tokens=6)
    assert "dedup" not in report.ran and "beam" not in report.ran, str(report)
