"""Per-family quirks of the dedup families (fastgen/models/family_checks.py): each handled exactly or refused.

- UMT5 / Whisper project cross K/V with the query batch: their cross cache is primed at one row per input.
- Sliding windows (Mistral, Qwen3, Gemma 2/3, Phi-3): shared while the whole sequence fits in the window,
  upstream's path (with the reason) once the window would cut in; the boundary is tested on both sides.
- Gemma 2's attention logit soft-capping: exact on the eager fast path.
- Bidirectional attention (Gemma 3 ``use_bidirectional_attention``): refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

import fastgen
from fastgen.models import decoder_only
from fastgen.models.encoder_decoder import BeamSharedCrossAttentionCache
from fastgen.ops.attention import prefix_shared_attention
from fastgen.optimizer.transformers.contract import CACHE
from tests import harness

pytestmark = harness.requires_feature("dedup")

BATCH = 3
PROMPT = 12  # harness.tiny_inputs' default length
NEW_TOKENS = 8


@pytest.mark.parametrize("family", ["umt5", "m2m_100", "mt5"])
def test_cross_kv_are_projected_once_per_input(family: str) -> None:
    """UMT5 would fold B encoder rows into B*M query rows; primed, its cross K/V stay at B rows like the others'."""
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=BATCH)
    with harness.recorded_caches(model) as caches:
        _, patched = harness.assert_same_generation(
            model, inputs, features=["dedup"], max_new_tokens=NEW_TOKENS, num_beams=4
        )
    cache = caches[-1]
    assert isinstance(cache, BeamSharedCrossAttentionCache)
    assert {layer.keys.shape[0] for layer in cache.cross_attention_cache.layers} == {BATCH}
    assert {layer.keys.shape[0] for layer in cache.self_attention_cache.layers} == {BATCH * 4}
    assert len({tuple(row) for row in patched.sequences.tolist()}) > 1


def test_umt5_eager_attention_and_cross_attention_weights() -> None:
    model = harness.tiny_hf_model("umt5")
    model.set_attn_implementation("eager")
    inputs = harness.tiny_inputs(model, batch=BATCH)
    reference, patched = harness.assert_same_generation(
        model, inputs, features=["dedup"], max_new_tokens=5, num_beams=3, output_attentions=True
    )
    for ref_step, new_step in zip(reference.cross_attentions, patched.cross_attentions, strict=True):
        for ref, new in zip(ref_step, new_step, strict=True):
            torch.testing.assert_close(new, ref, atol=1e-5, rtol=1e-5)


def _upstream_layer_types(model: Any) -> set[type]:
    return {type(layer) for layer in DynamicCache(config=model.config).layers}


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma2", "gemma3_text", "phi3"])
def test_sliding_window_layers_are_shared_while_the_sequence_fits(family: str) -> None:
    """Upstream caches these layers in sliding-window layers; they keep every token while the sequence fits."""
    model = harness.tiny_hf_model(family)
    assert DynamicSlidingWindowLayer in _upstream_layer_types(model)
    inputs = harness.tiny_inputs(model, batch=BATCH)
    _, patched, report = harness.assert_same_generation(
        model, inputs, features=["dedup"], max_new_tokens=NEW_TOKENS, num_beams=4, with_report=True
    )
    assert report.fast_path("dedup"), str(report)
    # Returned in upstream's own cache object: its sliding-window layers, filled by their own update.
    assert {type(layer) for layer in getattr(patched, CACHE).layers} == _upstream_layer_types(model)


def test_qwen3_and_gemma_alternate_full_and_sliding_layers() -> None:
    for family in ("qwen3", "gemma2", "gemma3_text"):
        assert _upstream_layer_types(harness.tiny_hf_model(family)) == {DynamicLayer, DynamicSlidingWindowLayer}


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma2", "gemma3_text", "phi3"])
@pytest.mark.parametrize("window_minus_length", [0, -1, -6])
def test_sliding_window_boundary(family: str, window_minus_length: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_length == window: shared and exact; a window a token (or more) shorter cuts in: upstream, with a reason."""
    max_length = PROMPT + NEW_TOKENS
    window = max_length + window_minus_length
    model = harness.tiny_hf_model(family, sliding_window=window)
    reasons = harness.record_fallbacks(monkeypatch)
    inputs = harness.tiny_inputs(model, batch=BATCH)
    _, _, report = harness.assert_same_generation(
        model,
        inputs,
        features=["dedup"],
        max_new_tokens=NEW_TOKENS,
        num_beams=3,
        min_new_tokens=NEW_TOKENS,
        with_report=True,
    )
    shared = report.fast_path("dedup")
    assert shared == (window_minus_length >= 0)
    if not shared:
        assert any(f"sliding window of {window} tokens" in reason for reason in reasons), reasons


def test_softcapping_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2's soft-capped eager attention runs on the shared prefix, not on materialised K/V."""
    model = harness.tiny_hf_model("gemma2")
    assert model.config._attn_implementation == "eager" and model.config.attn_logit_softcapping == 2.0
    reasons = harness.record_fallbacks(monkeypatch)
    caps: list[Any] = []
    original = decoder_only.prefix_shared_attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        caps.append(kwargs.get("softcap"))
        return original(*args, **kwargs)

    monkeypatch.setattr(decoder_only, "prefix_shared_attention", spy)
    inputs = harness.tiny_inputs(model, batch=BATCH)
    harness.assert_same_generation(model, inputs, features=["dedup"], max_new_tokens=NEW_TOKENS, num_beams=4)
    layers = model.config.num_hidden_layers
    assert caps == [2.0] * ((NEW_TOKENS - 1) * layers)
    assert not reasons


def test_softcap_matches_eager_attention() -> None:
    """The op's soft-capping equals Transformers' Gemma 2 eager attention over the concatenated K/V."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    torch.manual_seed(0)
    batch, group, heads, kv_heads, prefix, suffix, dim = 2, 3, 4, 2, 7, 3, 8
    query = torch.randn(batch * group, heads, 1, dim) * 3
    prefix_k, prefix_v = torch.randn(batch, kv_heads, prefix, dim), torch.randn(batch, kv_heads, prefix, dim)
    suffix_k, suffix_v = (
        torch.randn(batch * group, kv_heads, suffix, dim),
        torch.randn(batch * group, kv_heads, suffix, dim),
    )
    mask = torch.zeros(batch * group, 1, 1, prefix + suffix)
    mask[0, ..., :2] = torch.finfo(torch.float32).min
    keys = torch.cat([prefix_k.repeat_interleave(group, 0), suffix_k], dim=-2)
    values = torch.cat([prefix_v.repeat_interleave(group, 0), suffix_v], dim=-2)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = heads // kv_heads, False
    expected, expected_weights = eager_attention_forward(module, query, keys, values, mask, scaling=0.5, softcap=1.5)
    out, weights = prefix_shared_attention(
        query, prefix_k, prefix_v, suffix_k, suffix_v, mask, scale=0.5, softcap=1.5, return_weights=True
    )
    torch.testing.assert_close(out.transpose(1, 2), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)
    uncapped, _ = prefix_shared_attention(query, prefix_k, prefix_v, suffix_k, suffix_v, mask, scale=0.5)
    assert not torch.allclose(uncapped.transpose(1, 2), expected, atol=1e-3)  # the cap matters at these scores


def test_bidirectional_gemma3_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = harness.tiny_hf_model("gemma3_text", use_bidirectional_attention=True)
    reasons = harness.record_fallbacks(monkeypatch)
    inputs = harness.tiny_inputs(model, batch=2)
    _, _, report = harness.assert_same_generation(
        model, inputs, features=["dedup"], max_new_tokens=5, num_beams=3, with_report=True
    )
    assert "dedup" not in report.ran
    assert any("bidirectional" in reason for reason in reasons), reasons


def test_decoder_only_families_output_is_not_trivial() -> None:
    """Guard for the equivalence suite: the tiny models' beams differ per input and from their prompt's end."""
    for family in ("mistral", "qwen3", "gemma2", "gemma3_text", "phi3"):
        model = harness.tiny_hf_model(family)
        inputs = harness.tiny_inputs(model, batch=BATCH)
        with fastgen.unpatched():
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, num_beams=4)
        generated = out[:, PROMPT:]
        assert len({tuple(row) for row in generated.tolist()}) == BATCH, family
        assert all(len(set(row)) > 2 for row in generated.tolist()), family


def test_returned_sliding_window_cache_continues_past_the_window() -> None:
    """A returned shared cache that replaced sliding layers, fed on past the window without fastgen, matches
    upstream's sliding cache: it keeps every token, and the window stays in the mask over the full length."""
    model = harness.tiny_hf_model("mistral", sliding_window=PROMPT + NEW_TOKENS)
    inputs = harness.tiny_inputs(model, batch=2)
    kwargs = dict(num_beams=3, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, return_dict_in_generate=True)
    with fastgen.unpatched():
        upstream = getattr(model.generate(**inputs, **kwargs), CACHE)
    with fastgen.patched(["dedup"]), fastgen.report() as report:
        shared = getattr(model.generate(**inputs, **kwargs), CACHE)
    assert report.fast_path("dedup"), str(report)
    assert {type(layer) for layer in upstream.layers} == {type(layer) for layer in shared.layers}
    assert {type(layer) for layer in upstream.layers} == {DynamicSlidingWindowLayer}
    rows = upstream.layers[0].keys.shape[0]
    generated = torch.ones(rows, upstream.get_seq_length() - PROMPT, dtype=torch.long)
    mask = torch.cat([inputs["attention_mask"].repeat_interleave(3, 0), generated], dim=-1)
    for step in range(4):  # the window (20 tokens) is full after the first step
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], dim=-1)
        feed = dict(input_ids=torch.full((rows, 1), 7 + step), attention_mask=mask)
        with fastgen.unpatched(), torch.no_grad():
            expected = model(**feed, **{CACHE: upstream}).logits
            logits = model(**feed, **{CACHE: shared}).logits
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert shared.get_seq_length() == upstream.get_seq_length() == PROMPT + NEW_TOKENS + 3
