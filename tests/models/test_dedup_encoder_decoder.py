"""Beam-shared cross-attention (feature "dedup") for Transformers encoder-decoder models.

Every case runs upstream (``fastgen.unpatched()``) and patched generation on the same tiny
seeded model and padded batch: sequences must be identical, scores close. With SDPA the scores
differ by a few ulp: the CPU kernel rounds one block of M grouped query rows differently from M
single rows (eager attention is bitwise identical in these tests). The tiny T5's log-probs reach
~300 with very sharp softmaxes, where those ulps show up as ~1e-3 absolute; the harness scales
its absolute tolerance with the score magnitude for that reason.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

import fastgen
from fastgen.models import encoder_decoder
from fastgen.models.encoder_decoder import CROSS_ATTENTION_FAMILIES, BeamSharedCrossAttentionCache, cache_nbytes
from fastgen.optimizer.transformers.contract import CACHE
from tests import harness

pytestmark = harness.requires_feature("dedup")

BATCH = 3
NEW_TOKENS = 10

CASES = harness.DEDUP_CASES


#: Whisper generates through its own ``generate`` (features in, no dict outputs when shared): test_dedup_whisper.py.
TEXT_FAMILIES = [family for family in harness.ENCODER_DECODER if family != "whisper"]


@pytest.fixture(scope="module", params=TEXT_FAMILIES)
def model(request: pytest.FixtureRequest) -> transformers.PreTrainedModel:
    return harness.tiny_hf_model(request.param)


def _generate(model: transformers.PreTrainedModel, inputs: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    return model.generate(**inputs, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_same_generation(model: transformers.PreTrainedModel, case: str) -> None:
    inputs = harness.tiny_inputs(model, batch=BATCH)
    with harness.recorded_caches(model) as caches:
        _, patched, report = harness.assert_same_generation(
            model,
            inputs,
            features=["dedup"],
            max_new_tokens=NEW_TOKENS,
            with_report=True,
            **CASES[case],
        )
    shared = case != "greedy"  # greedy has nothing to share and must stay upstream's
    assert report.fast_path("dedup") == shared, str(report)
    assert isinstance(caches[-1], BeamSharedCrossAttentionCache) == shared
    # What leaves generate is upstream's class and layout, whatever ran inside.
    assert type(getattr(patched, CACHE)) is EncoderDecoderCache


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_eager_attention_and_returned_internals(family: str) -> None:
    """Eager kernels; per-beam cross-attention weights and hidden states as upstream returns them."""
    model = harness.tiny_hf_model(family)
    model.set_attn_implementation("eager")
    inputs = harness.tiny_inputs(model, batch=BATCH)
    reference, patched = harness.assert_same_generation(
        model,
        inputs,
        features=["dedup"],
        max_new_tokens=6,
        num_beams=3,
        output_attentions=True,
        output_hidden_states=True,
    )
    for name in ("encoder_hidden_states", "encoder_attentions", "decoder_hidden_states", "cross_attentions"):
        ref_flat, new_flat = _flatten(getattr(reference, name)), _flatten(getattr(patched, name))
        # Some versions return no encoder attentions for T5 (upstream too); compare what there is.
        assert len(ref_flat) == len(new_flat) and (ref_flat or name == "encoder_attentions"), name
        for ref, new in zip(ref_flat, new_flat, strict=True):
            assert ref.shape == new.shape, name
            torch.testing.assert_close(new, ref, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _flatten(nested: Any) -> list[torch.Tensor]:
    if isinstance(nested, torch.Tensor):
        return [nested]
    return [tensor for item in nested for tensor in _flatten(item)]


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_decoder_prompt_longer_than_one_token(family: str) -> None:
    """A decoder prompt makes the first step attend with q > 1 rows per beam (mask/bias tiled per beam)."""
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=BATCH)
    start = model.generation_config.decoder_start_token_id
    prompt = torch.tensor([[start, 7, 9]] * BATCH)
    harness.assert_same_generation(
        model,
        {**inputs, "decoder_input_ids": prompt},
        features=["dedup"],
        max_new_tokens=6,
        num_beams=3,
    )


def test_cross_attention_cache_is_shared_and_never_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=BATCH)
    beams = 4
    steps: list[tuple[list[tuple[int, int]], list[int]]] = []

    def record(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        cache = getattr(output, CACHE)
        cross = [(layer.keys.data_ptr(), layer.keys.shape[0]) for layer in cache.cross_attention_cache.layers]
        steps.append((cross, [layer.keys.shape[0] for layer in cache.self_attention_cache.layers]))

    reordered: list[int] = []
    original_reorder = DynamicCache.reorder_cache

    def spy_reorder(self: DynamicCache, beam_idx: torch.LongTensor) -> None:
        reordered.append(id(self))
        original_reorder(self, beam_idx)

    monkeypatch.setattr(DynamicCache, "reorder_cache", spy_reorder)
    grouped_calls = []
    original_group = encoder_decoder.group_beam_queries

    def spy_group(query: torch.Tensor, group_size: int) -> torch.Tensor:
        grouped_calls.append(group_size)
        return original_group(query, group_size)

    monkeypatch.setattr(encoder_decoder, "group_beam_queries", spy_group)
    handle = model.get_decoder().register_forward_hook(record, with_kwargs=True)
    try:
        with fastgen.patched(["dedup"]), harness.recorded_caches(model) as caches:
            _generate(model, inputs, num_beams=beams, min_new_tokens=NEW_TOKENS)
    finally:
        handle.remove()

    cache = caches[-1]
    assert isinstance(cache, BeamSharedCrossAttentionCache)
    assert len(steps) == NEW_TOKENS
    first_cross = steps[0][0]
    assert all(rows == BATCH for _, rows in first_cross), "cross-attention K/V must hold one row per input"
    assert all(cross == first_cross for cross, _ in steps), "cross-attention K/V must not be copied per step"
    assert all(rows == BATCH * beams for _, self_rows in steps for rows in self_rows)
    # Beam reordering touched the self-attention cache every step and the cross cache never.
    assert reordered and set(reordered) == {id(cache.self_attention_cache)}
    assert len(reordered) == NEW_TOKENS
    # Every cross-attention call of every step ran grouped (beams as query rows), none expanded.
    assert grouped_calls == [beams] * (NEW_TOKENS * model.config.decoder_layers)


def test_cross_attention_cache_bytes_are_one_over_beams() -> None:
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=BATCH)
    beams = 4
    with fastgen.unpatched():
        upstream = getattr(_generate(model, inputs, num_beams=beams, min_new_tokens=NEW_TOKENS), CACHE)
    with fastgen.patched(["dedup"]), fastgen.report() as report:
        returned = getattr(_generate(model, inputs, num_beams=beams, min_new_tokens=NEW_TOKENS), CACHE)
    assert type(upstream) is EncoderDecoderCache
    upstream_self, upstream_cross = cache_nbytes(upstream)
    # Inside the call the cross K/V held 1/beams of upstream's bytes; the returned cache has upstream's size.
    assert report.cache_bytes_saved * beams == upstream_cross * (beams - 1)
    assert cache_nbytes(returned) == (upstream_self, upstream_cross)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(cache_implementation="static"), id="static-cache"),
        pytest.param(dict(use_cache=False), id="no-cache"),
    ],
)
def test_unsupported_cache_falls_back_to_upstream(kwargs: dict[str, Any]) -> None:
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    _, patched = harness.assert_same_generation(
        model, inputs, features=["dedup"], max_new_tokens=5, num_beams=3, **kwargs
    )
    assert not isinstance(getattr(patched, CACHE), BeamSharedCrossAttentionCache)


def test_precomputed_encoder_outputs() -> None:
    """Precomputed encoder_outputs take the shared path (and, unlike upstream, are not expanded in place)."""
    model = harness.tiny_hf_model("marian")
    inputs = harness.tiny_inputs(model, batch=2)
    with torch.no_grad():
        hidden = model.get_encoder()(**inputs).last_hidden_state
    kwargs = dict(attention_mask=inputs["attention_mask"], num_beams=3, output_scores=True)
    with fastgen.unpatched():
        reference = _generate(model, {}, encoder_outputs=BaseModelOutput(last_hidden_state=hidden.clone()), **kwargs)
    encoder_outputs = BaseModelOutput(last_hidden_state=hidden.clone())
    with fastgen.patched(["dedup"]), fastgen.report() as report:
        patched = _generate(model, {}, encoder_outputs=encoder_outputs, **kwargs)
    assert torch.equal(reference.sequences, patched.sequences)
    torch.testing.assert_close(patched.sequences_scores, reference.sequences_scores, atol=1e-5, rtol=1e-5)
    assert report.fast_path("dedup"), str(report)
    assert encoder_outputs.last_hidden_state.shape[0] == 2


def test_decoder_only_models_get_no_cross_attention_cache() -> None:
    """Decoder-only models take the shared-prompt path (test_dedup_decoder_only.py), not this one."""
    model = harness.tiny_hf_model("gpt2")
    inputs = harness.tiny_inputs(model, batch=2)
    _, patched = harness.assert_same_generation(model, inputs, features=["dedup"], max_new_tokens=5, num_beams=3)
    assert isinstance(getattr(patched, CACHE), DynamicCache)
    assert not isinstance(getattr(patched, CACHE), BeamSharedCrossAttentionCache)


def test_patches_are_declared_and_applied() -> None:
    with fastgen.patched(["dedup"]):
        states = {
            row.target: row.state
            for row in fastgen.status()
            if row.feature == "dedup" and row.target.startswith("transformers.")
        }
    assert len(states) == 5  # expand inputs, prepare cache, prefill (decoder-only), attention interface, generate
    assert set(states.values()) == {"applied"}, states


@pytest.mark.parametrize("family", harness.ENCODER_DECODER)
def test_family_table_matches_models(family: str) -> None:
    """The support table names exactly the tested families, and the classes their decoders really use."""
    assert set(CROSS_ATTENTION_FAMILIES) == set(harness.ENCODER_DECODER)
    model = harness.tiny_hf_model(family)
    module_name, _, class_name = CROSS_ATTENTION_FAMILIES[model.config.model_type].rpartition(".")
    attention_class = getattr(importlib.import_module(module_name), class_name)
    decoder_attention = {type(m) for m in model.get_decoder().modules() if isinstance(m, attention_class)}
    assert decoder_attention == {attention_class}


def _filled_cache(cls: type[EncoderDecoderCache], self_rows: int, cross_rows: int) -> EncoderDecoderCache:
    torch.manual_seed(0)
    cache = cls(DynamicCache(), DynamicCache())
    for layer in range(2):
        cache.self_attention_cache.update(torch.randn(self_rows, 2, 3, 4), torch.randn(self_rows, 2, 3, 4), layer)
        cache.cross_attention_cache.update(torch.randn(cross_rows, 2, 5, 4), torch.randn(cross_rows, 2, 5, 4), layer)
    return cache


def _per_row_cross(cache: EncoderDecoderCache) -> list[torch.Tensor]:
    group = cache.group_size() if isinstance(cache, BeamSharedCrossAttentionCache) else 1
    return [layer.keys.repeat_interleave(group, 0) for layer in cache.cross_attention_cache.layers]


def test_shared_cache_row_operations_match_an_expanded_cache() -> None:
    """reorder / repeat / select on the shared cache mean the same per hypothesis as on upstream's."""
    batch, group = 2, 3
    shared = _filled_cache(BeamSharedCrossAttentionCache, batch * group, batch)
    upstream = EncoderDecoderCache(DynamicCache(), DynamicCache())
    for layer in range(2):
        self_layer, cross_layer = shared.self_attention_cache.layers[layer], shared.cross_attention_cache.layers[layer]
        upstream.self_attention_cache.update(self_layer.keys.clone(), self_layer.values.clone(), layer)
        upstream.cross_attention_cache.update(
            cross_layer.keys.repeat_interleave(group, 0), cross_layer.values.repeat_interleave(group, 0), layer
        )
    assert shared.group_size() == group
    beam_idx = torch.tensor([2, 2, 0, 4, 3, 3])  # beams stay within their input, as beam search guarantees
    operations = [
        ("reorder_cache", beam_idx),
        ("batch_repeat_interleave", 2),
        ("batch_select_indices", torch.tensor([0, 5, 7, 11])),
    ]
    for name, argument in operations:
        getattr(shared, name)(argument)
        getattr(upstream, name)(argument)
        for mine, theirs in zip(_per_row_cross(shared), _per_row_cross(upstream), strict=True):
            assert torch.equal(mine, theirs), name
        for mine, theirs in zip(shared.self_attention_cache.layers, upstream.self_attention_cache.layers, strict=True):
            assert torch.equal(mine.keys, theirs.keys), name
    assert shared.group_size() == 1  # arbitrary selection gave every row its own cross K/V


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_training_mode_without_dropout_keeps_the_fast_path(family: str) -> None:
    """Training mode with dropout 0 draws no random numbers: the shared path runs and matches."""
    model = harness.tiny_hf_model(family).train()  # dropout is 0 in the tiny configs: deterministic
    inputs = harness.tiny_inputs(model, batch=BATCH)
    _, _, report = harness.assert_same_generation(
        model, inputs, features=["dedup"], max_new_tokens=5, num_beams=3, with_report=True
    )
    assert report.fast_path("dedup"), str(report)
