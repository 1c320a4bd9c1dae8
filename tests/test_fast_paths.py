"""Every Transformers fast path runs on the installed release, for every supported family (DESIGN.md §9).

Equality tests alone pass when a feature silently falls back (a fallback gives upstream's output), so
an upstream rename once switched fastgen off with the suite green. These tests fail instead: each asserts
through ``fastgen.report()`` that the feature ran, that the shared caches saved bytes, and that the
output equals upstream's. CI runs them on the previous minor release as well (``-m fast_path``), and
``scripts/canary.sh`` runs them against the newest release on the package index.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fastgen
from fastgen.optimizer.transformers import speculative
from fastgen.optimizer.transformers.contract import CACHE
from tests import harness

pytestmark = [pytest.mark.fast_path, harness.requires_feature("dedup")]

FAMILIES = harness.ENCODER_DECODER + harness.DECODER_ONLY


def _not_degenerate(sequences: torch.Tensor) -> None:
    assert len(set(sequences.flatten().tolist())) > 3, "degenerate model output"
    assert not torch.equal(sequences[0], sequences[-1]), "rows must differ"


@pytest.mark.parametrize("family", FAMILIES)
def test_dedup_beam_and_ngram_run(family: str) -> None:
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=3)
    reference, candidate, report = harness.assert_same_generation(
        model, inputs, with_report=True, num_beams=3, no_repeat_ngram_size=2, max_new_tokens=8
    )
    _not_degenerate(reference.sequences)
    for feature in ("dedup", "beam", "ngram"):
        assert report.fast_path(feature), f"{feature} did not run on {family}:\n{report}"
    assert report.cache_bytes_saved > 0, str(report)
    # What leaves generate is upstream's cache class, so it continues in upstream code.
    assert type(getattr(candidate, CACHE)) is type(getattr(reference, CACHE))


@pytest.mark.parametrize("family", ["bart", "t5", "gpt2", "llama"])
def test_dedup_runs_for_sampling_with_several_sequences(family: str) -> None:
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=2)
    reference, _, report = harness.assert_same_generation(
        model, inputs, with_report=True, do_sample=True, num_return_sequences=3, max_new_tokens=8
    )
    _not_degenerate(reference.sequences)
    assert report.fast_path("dedup") and report.cache_bytes_saved > 0, str(report)


@pytest.mark.parametrize("family", list(speculative.MODEL_FAMILIES))
def test_batched_speculative_decoding_runs(family: str) -> None:
    model = harness.tiny_hf_model(family)
    draft = copy.deepcopy(model)
    inputs = harness.tiny_inputs(model, batch=3, length=8)
    with fastgen.unpatched():
        reference = model.generate(**inputs, do_sample=False, max_new_tokens=12)
    _not_degenerate(reference[:, -12:])
    speculative.last_stats.clear()
    with fastgen.report() as report:
        candidate = model.generate(**inputs, assistant_model=draft, do_sample=False, max_new_tokens=12)
    assert torch.equal(reference, candidate)
    assert report.fast_path("speculative") and not report.fell_back, str(report)
    assert speculative.last_stats.get("steps", 0) > 0, "fastgen's batched loop did not run"
