"""Beam-shared cross-attention (feature "dedup") for Whisper, through ``WhisperForConditionalGeneration.generate``.

Whisper's own ``generate`` wraps ``GenerationMixin.generate``: it builds the decoder prompt, expands
``input_features`` itself for ``num_return_sequences`` and, with ``return_dict_in_generate``, splits
the returned cache per row. fastgen shares the encoder states and cross K/V across beams for
short-form calls (sequences or dict outputs: the returned cache is folded back to upstream's layout
before Whisper splits it); timestamp / long-form decoding run upstream (tested here too).
Features are random log-mel frames of the tiny config's full 30 s shape.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.cache_utils import EncoderDecoderCache

import fastgen
from fastgen.models.encoder_decoder import BeamSharedCrossAttentionCache
from fastgen.optimizer.transformers.contract import CACHE
from tests import harness

pytestmark = harness.requires_feature("dedup")

BATCH = 3
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model() -> transformers.PreTrainedModel:
    return harness.tiny_hf_model("whisper")


def _generate_recording(model: transformers.PreTrainedModel, inputs: dict, seed: int, **kwargs: Any) -> tuple:
    """Sequences, plus per decoder call: (query rows, encoder-state rows, cross K/V rows, cache type)."""
    calls: list[tuple[int, int, int, type]] = []

    def record(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        cache = getattr(output, CACHE)
        cross = cache.cross_attention_cache.layers[0].keys.shape[0]
        calls.append((kwargs["input_ids"].shape[0], kwargs["encoder_hidden_states"].shape[0], cross, type(cache)))

    handle = model.get_decoder().register_forward_hook(record, with_kwargs=True)
    try:
        torch.manual_seed(seed)
        sequences = model.generate(**inputs, max_new_tokens=NEW_TOKENS, **kwargs)
    finally:
        handle.remove()
    return sequences, calls


@pytest.mark.parametrize("case", list(harness.DEDUP_CASES))
def test_same_generation(model: transformers.PreTrainedModel, case: str) -> None:
    kwargs = dict(harness.DEDUP_CASES[case])
    if kwargs.get("do_sample"):
        # Whisper samples only with a temperature (do_sample alone is overridden), and then with one beam.
        kwargs["temperature"] = 1.0
    inputs = harness.tiny_inputs(model, batch=BATCH)  # rows end in 0, 1/8, 2/8 of "silence"
    with fastgen.unpatched():
        reference, upstream_calls = _generate_recording(model, inputs, 0, **kwargs)
    with fastgen.patched(["dedup"]):
        candidate, calls = _generate_recording(model, inputs, 0, **kwargs)
    assert torch.equal(reference, candidate), harness._first_mismatch(reference, candidate)
    assert len({tuple(row) for row in reference.tolist()}) > 1, "trivial output: every row the same"
    # Whisper repeats the features per returned sequence itself; beams are GenerationMixin's expansion.
    beams = 1 if kwargs.get("do_sample") else kwargs.get("num_beams", 1)
    inputs_per_call = BATCH * kwargs.get("num_return_sequences", 1)
    if beams > 1:  # shared: encoder states and cross K/V at one row per input, beams as query rows
        assert {call[1:] for call in calls} == {(inputs_per_call, inputs_per_call, BeamSharedCrossAttentionCache)}
        assert {call[0] for call in calls} == {inputs_per_call * beams}
        assert {call[1:3] for call in upstream_calls} == {(inputs_per_call * beams, inputs_per_call * beams)}
    else:  # greedy / sampling: nothing repeated by GenerationMixin, upstream's path untouched
        assert [call[:3] for call in calls] == [call[:3] for call in upstream_calls]
        assert all(call[3] is EncoderDecoderCache for call in calls)


def test_batch_one_beam_search(model: transformers.PreTrainedModel) -> None:
    inputs = harness.tiny_inputs(model, batch=1)
    with fastgen.unpatched():
        reference, _ = _generate_recording(model, inputs, 0, num_beams=5)
    with fastgen.patched(["dedup"]):
        candidate, calls = _generate_recording(model, inputs, 0, num_beams=5)
    assert torch.equal(reference, candidate)
    assert {call[:3] for call in calls} == {(5, 1, 1)}


def test_dict_outputs_take_the_shared_path() -> None:
    """Whisper splits the returned cache per row: it gets upstream's layout (returned_cache.py)."""
    model = harness.tiny_hf_model("whisper")
    inputs = harness.tiny_inputs(model, batch=BATCH)
    kwargs = dict(return_dict_in_generate=True, output_scores=True, max_new_tokens=NEW_TOKENS, num_beams=3)
    with fastgen.unpatched():
        reference = model.generate(**inputs, **kwargs)
    with fastgen.patched(["dedup"]), fastgen.report() as report:
        candidate = model.generate(**inputs, **kwargs)
    assert report.fast_path("dedup"), str(report)
    assert torch.equal(reference.sequences, candidate.sequences)
    for ref, new in zip(reference.scores, candidate.scores, strict=True):
        torch.testing.assert_close(new, ref, atol=1e-5, rtol=1e-5)
    assert type(getattr(candidate, CACHE)) is type(getattr(reference, CACHE))


@pytest.mark.parametrize(
    "kwargs, reason",
    [pytest.param(dict(return_timestamps=True), "return_timestamps", id="timestamps")],
)
def test_timestamps_run_upstream(kwargs: dict, reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Timestamp decoding is not verified: upstream, with the reason."""
    reasons = harness.record_fallbacks(monkeypatch)
    model = harness.tiny_hf_model("whisper")
    model.generation_config.no_timestamps_token_id = 3  # a tiny vocabulary has no real timestamp tokens
    inputs = harness.tiny_inputs(model, batch=BATCH)
    with fastgen.unpatched():
        torch.manual_seed(0)
        reference = model.generate(**inputs, max_new_tokens=NEW_TOKENS, num_beams=3, **kwargs)
    with fastgen.patched(["dedup"]):
        torch.manual_seed(0)
        candidate = model.generate(**inputs, max_new_tokens=NEW_TOKENS, num_beams=3, **kwargs)
    assert any(reason in message for message in reasons), reasons
    if isinstance(reference, torch.Tensor):
        assert torch.equal(reference, candidate)
        return
    assert torch.equal(reference.sequences, candidate.sequences)
    for ref, new in zip(reference.scores, candidate.scores, strict=True):
        torch.testing.assert_close(new, ref, atol=0, rtol=0)
    assert type(getattr(candidate, CACHE)) is EncoderDecoderCache


def test_long_form_audio_runs_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    """More than 30 s of features: Whisper decodes segments with timestamps; every segment call falls back."""
    reasons = harness.record_fallbacks(monkeypatch)
    model = harness.tiny_hf_model("whisper")
    model.generation_config.no_timestamps_token_id = 3
    frames = 2 * model.config.max_source_positions
    features = torch.randn(1, model.config.num_mel_bins, 2 * frames + 17, generator=torch.Generator().manual_seed(3))
    kwargs = dict(return_timestamps=True, num_beams=2, max_new_tokens=6)
    with fastgen.unpatched():
        reference = model.generate(input_features=features, **kwargs)
    with fastgen.patched(["dedup"]):
        candidate = model.generate(input_features=features, **kwargs)
    assert torch.equal(reference, candidate)
    assert reasons and all("return_timestamps" in reason for reason in reasons), reasons
