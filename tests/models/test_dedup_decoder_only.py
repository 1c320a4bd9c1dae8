"""Shared prompt K/V (feature "dedup") for Transformers decoder-only models: GPT2, Llama (GQA), Qwen2.

Every generation case runs upstream (``fastgen.unpatched()``) and patched on the same tiny seeded
model and left-padded batch: sequences must be identical, scores close. They are not bitwise
equal: the B-row prefill's LM-head GEMM and the prefix+suffix attention round differently from
upstream's B*M-row GEMM and SDPA kernel (|diff| ~1e-6 on the tiny models' scores).
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache, DynamicLayer

import fastgen
from fastgen.models import decoder_only
from fastgen.models.decoder_only import (
    PREFIX_ATTR,
    PROMPT_SHARING_FAMILIES,
    SharedPrefixCache,
    SharedPrefixLayer,
    prefix_attention,
)
from fastgen.optimizer.transformers.contract import CACHE
from tests import harness

pytestmark = harness.requires_feature("dedup")

BATCH = 3
NEW_TOKENS = 8

CASES = harness.DEDUP_CASES


@pytest.fixture(scope="module", params=harness.DECODER_ONLY)
def model(request: pytest.FixtureRequest) -> transformers.PreTrainedModel:
    return harness.tiny_hf_model(request.param)


def _group(case: dict[str, Any]) -> int:
    return max(case.get("num_beams", 1), case.get("num_return_sequences", 1))


@pytest.mark.parametrize("case", list(CASES))
def test_same_generation(model: transformers.PreTrainedModel, case: str) -> None:
    inputs = harness.tiny_inputs(model, batch=BATCH)  # left padding: rows shorter by 0, 2, 4 tokens
    with harness.recorded_caches(model) as caches:
        _, patched, report = harness.assert_same_generation(
            model, inputs, features=["dedup"], max_new_tokens=NEW_TOKENS, with_report=True, **CASES[case]
        )
    assert type(getattr(patched, CACHE)) is DynamicCache  # what leaves generate: upstream's class and layout
    cache = caches[-1]
    if case == "greedy":  # nothing repeated: upstream's cache, untouched
        assert type(cache) is DynamicCache and not report.ran, str(report)
        return
    assert isinstance(cache, SharedPrefixCache) and report.fast_path("dedup"), str(report)
    prompt_len, rows = inputs["input_ids"].shape[1], BATCH * _group(CASES[case])
    for layer in cache.layers:
        assert layer.prefix_keys.shape[0] == layer.prefix_values.shape[0] == BATCH
        assert layer.prefix_length == prompt_len
        assert layer.keys.shape[0] == rows and layer.suffix_length == NEW_TOKENS - 1


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_unpadded_batch_where_sdpa_skips_the_mask(family: str) -> None:
    """No padding: sdpa gets mask=None at decode steps and the wrapper attends to every key."""
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=2, padded=False)
    _, _, report = harness.assert_same_generation(
        model, inputs, features=["dedup"], max_new_tokens=6, num_beams=3, with_report=True
    )
    assert report.fast_path("dedup"), str(report)


@pytest.mark.parametrize("family", harness.DECODER_ONLY)
def test_eager_attention_and_returned_internals(family: str) -> None:
    """Eager kernels; per-hypothesis attention weights (prefix+suffix columns) and hidden states as upstream."""
    model = harness.tiny_hf_model(family)
    model.set_attn_implementation("eager")
    inputs = harness.tiny_inputs(model, batch=BATCH)
    reference, patched, report = harness.assert_same_generation(
        model,
        inputs,
        features=["dedup"],
        max_new_tokens=5,
        num_beams=3,
        output_attentions=True,
        output_hidden_states=True,
        output_logits=True,
        with_report=True,
    )
    assert report.fast_path("dedup"), str(report)
    for name in ("attentions", "hidden_states", "logits"):
        ref_flat, new_flat = _flatten(getattr(reference, name)), _flatten(getattr(patched, name))
        assert len(ref_flat) == len(new_flat) > 0, name
        for ref, new in zip(ref_flat, new_flat, strict=True):
            assert ref.shape == new.shape, name
            torch.testing.assert_close(new, ref, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _flatten(nested: Any) -> list[torch.Tensor]:
    if isinstance(nested, torch.Tensor):
        return [nested]
    return [tensor for item in nested for tensor in _flatten(item)]


def test_gpt2_layer_scaled_attention() -> None:
    """``scale_attn_by_inverse_layer_idx`` reaches attention as the ``scaling`` argument, which the fast path uses."""
    model = harness.tiny_hf_model("gpt2", scale_attn_by_inverse_layer_idx=True)
    inputs = harness.tiny_inputs(model, batch=BATCH)
    _, _, report = harness.assert_same_generation(
        model, inputs, features=["dedup"], max_new_tokens=6, num_beams=3, with_report=True
    )
    assert report.fast_path("dedup"), str(report)


def test_gpt2_token_type_ids_are_per_row_inputs() -> None:
    """token_type_ids are sliced for the B-row prefill and grow per hypothesis afterwards, as upstream."""
    model = harness.tiny_hf_model("gpt2")
    inputs = harness.tiny_inputs(model, batch=2)
    inputs["token_type_ids"] = (torch.arange(12) % 3).expand(2, 12).clone()
    _, _, report = harness.assert_same_generation(
        model, inputs, features=["dedup"], max_new_tokens=6, num_beams=3, with_report=True
    )
    assert report.fast_path("dedup"), str(report)


def test_concurrent_generate_calls_keep_their_own_prefixes() -> None:
    """The prefix travels with each call's own tensors: threads sharing models and fastgen state do not mix."""
    models = {family: harness.tiny_hf_model(family) for family in harness.DECODER_ONLY}
    inputs = {family: harness.tiny_inputs(model, batch=BATCH) for family, model in models.items()}
    kwargs = dict(num_beams=4, max_new_tokens=NEW_TOKENS)
    with fastgen.unpatched():
        expected = {family: model.generate(**inputs[family], **kwargs) for family, model in models.items()}
    results: dict[tuple[str, int], torch.Tensor] = {}

    def run(family: str, copy: int) -> None:
        results[family, copy] = models[family].generate(**inputs[family], **kwargs)

    threads = [threading.Thread(target=run, args=(family, copy)) for family in models for copy in range(2)]
    with fastgen.patched(["dedup"]):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(results) == len(threads)
    for (family, _), sequences in results.items():
        assert torch.equal(sequences, expected[family]), family


def test_prompt_is_prefilled_once_per_input_and_never_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    model = harness.tiny_hf_model("llama")
    inputs = harness.tiny_inputs(model, batch=BATCH)
    beams, prompt_len = 4, inputs["input_ids"].shape[1]
    forward_rows: list[tuple[int, int]] = []
    prefixes: list[list[tuple[int, int, int]]] = []  # per forward: (keys ptr, values ptr, rows) per layer

    def before(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        forward_rows.append(tuple(kwargs["input_ids"].shape))

    def after(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        layers = getattr(output, CACHE).layers
        prefixes.append(
            [(la.prefix_keys.data_ptr(), la.prefix_values.data_ptr(), la.prefix_keys.shape[0]) for la in layers]
        )

    reordered: list[tuple[int, int]] = []  # (rows, length) of what each reorder index_selects
    original_reorder = SharedPrefixLayer.reorder_cache

    def spy_reorder(self: SharedPrefixLayer, beam_idx: torch.LongTensor) -> None:
        prefix = (self.prefix_keys.data_ptr(), self.prefix_values.data_ptr())
        reordered.append((self.keys.shape[0], self.suffix_length))
        original_reorder(self, beam_idx)
        assert (self.prefix_keys.data_ptr(), self.prefix_values.data_ptr()) == prefix

    monkeypatch.setattr(SharedPrefixLayer, "reorder_cache", spy_reorder)
    fast_calls = []
    original_attention = decoder_only.prefix_shared_attention

    def spy_attention(query: torch.Tensor, prefix_key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        fast_calls.append((query.shape[0], prefix_key.shape[0]))
        return original_attention(query, prefix_key, *args, **kwargs)

    monkeypatch.setattr(decoder_only, "prefix_shared_attention", spy_attention)
    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        with fastgen.patched(["dedup"]):
            model.generate(**inputs, num_beams=beams, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    finally:
        for handle in handles:
            handle.remove()

    # The prompt ran once per input, then one token per hypothesis per step.
    assert forward_rows == [(BATCH, prompt_len)] + [(BATCH * beams, 1)] * (NEW_TOKENS - 1)
    # The prompt K/V were stored once, at B rows, and never copied or moved afterwards.
    assert all(rows == BATCH for _, _, rows in prefixes[0])
    assert all(step == prefixes[0] for step in prefixes)
    # Beam reordering index_selected only the generated tokens (nothing after the prefill: empty suffix).
    layers = model.config.num_hidden_layers
    expected = [(0, 0)] * layers + [(BATCH * beams, t) for t in range(1, NEW_TOKENS) for _ in range(layers)]
    assert [(rows if length else 0, length) for rows, length in reordered] == expected
    # Every decode-step attention took the shared-prefix path with B*M queries over B prefixes.
    assert fast_calls == [(BATCH * beams, BATCH)] * ((NEW_TOKENS - 1) * layers)


@pytest.mark.parametrize("family", harness.DECODER_ONLY)
def test_prompt_cache_bytes_are_one_over_beams(family: str) -> None:
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=BATCH)
    beams, prompt_len = 4, inputs["input_ids"].shape[1]
    kwargs = dict(num_beams=beams, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, return_dict_in_generate=True)
    with fastgen.unpatched():
        upstream = getattr(model.generate(**inputs, **kwargs), CACHE)
    with fastgen.patched(["dedup"]), harness.recorded_caches(model) as caches, fastgen.report() as report:
        returned = getattr(model.generate(**inputs, **kwargs), CACHE)
    shared = caches[-1]
    total = prompt_len + NEW_TOKENS - 1  # the last token's K/V is never computed

    def nbytes(*tensors: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    upstream_bytes = sum(nbytes(layer.keys, layer.values) for layer in upstream.layers)
    prefix_bytes = sum(nbytes(layer.prefix_keys, layer.prefix_values) for layer in shared.layers)
    suffix_bytes = sum(nbytes(layer.keys, layer.values) for layer in shared.layers)
    assert prefix_bytes * beams * total == upstream_bytes * prompt_len  # the prompt part, exactly 1/M
    assert suffix_bytes * total == upstream_bytes * (total - prompt_len)  # the generated part, as upstream
    assert report.cache_bytes_saved == prefix_bytes * (beams - 1)
    assert sum(nbytes(layer.keys, layer.values) for layer in returned.layers) == upstream_bytes
    # Same K/V per hypothesis as upstream's cache (up to float rounding), also as DynamicCache iterates them.
    for (keys, values, _), theirs in zip(shared, upstream.layers, strict=True):
        torch.testing.assert_close(keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, theirs.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("leave", ["unpatched", "disable"])
def test_returned_cache_continues_correctly_without_fastgen(leave: str) -> None:
    """The returned cache is a plain DynamicCache that upstream code continues from (issue 7, item 4)."""
    model = harness.tiny_hf_model("qwen2")
    inputs = harness.tiny_inputs(model, batch=2)
    kwargs = dict(num_beams=3, max_new_tokens=4, min_new_tokens=4, return_dict_in_generate=True)
    with fastgen.unpatched():
        upstream = getattr(model.generate(**inputs, **kwargs), CACHE)
    with fastgen.patched(["dedup"]), fastgen.report() as report:
        returned = getattr(model.generate(**inputs, **kwargs), CACHE)
    assert report.fast_path("dedup") and type(returned) is DynamicCache
    assert all(type(layer) is DynamicLayer for layer in returned.layers)
    rows, cached, prompt_len = upstream.layers[0].keys.shape[0], upstream.get_seq_length(), inputs["input_ids"].shape[1]
    assert returned.get_seq_length() == cached
    for mine, theirs in zip(returned.layers, upstream.layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
    generated = torch.ones(rows, cached + 1 - prompt_len, dtype=torch.long)
    mask = torch.cat([inputs["attention_mask"].repeat_interleave(3, 0), generated], dim=-1)
    step = dict(input_ids=torch.full((rows, 1), 7), attention_mask=mask)
    context = fastgen.unpatched() if leave == "unpatched" else harness.fastgen_disabled()
    with context, torch.no_grad():
        expected = model(**step, **{CACHE: upstream}).logits
        logits = model(**step, **{CACHE: returned}).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "family, overrides, kwargs",
    [
        pytest.param("llama", {}, dict(cache_implementation="static"), id="static-cache"),
        pytest.param("llama", {}, dict(use_cache=False), id="no-cache"),
        pytest.param("qwen2", {}, dict(prefill_chunk_size=5), id="prefill-chunking"),
        pytest.param("gpt2", dict(reorder_and_upcast_attn=True), {}, id="gpt2-reorder-and-upcast"),
    ],
)
def test_unsupported_calls_fall_back_to_upstream(family: str, overrides: dict, kwargs: dict[str, Any]) -> None:
    model = harness.tiny_hf_model(family, **overrides)
    if overrides:
        model.set_attn_implementation("eager")  # the GPT-2 option only changes the eager path
    inputs = harness.tiny_inputs(model, batch=2)
    with harness.recorded_caches(model) as caches:
        _, _, report = harness.assert_same_generation(
            model, inputs, features=["dedup"], max_new_tokens=5, num_beams=3, with_report=True, **kwargs
        )
    assert not any(isinstance(cache, SharedPrefixCache) for cache in caches)
    assert report.fell_back and "dedup" not in report.ran, str(report)


def test_user_cache_and_inputs_embeds_fall_back_to_upstream() -> None:
    model = harness.tiny_hf_model("llama")
    inputs = harness.tiny_inputs(model, batch=2)
    kwargs = dict(num_beams=3, max_new_tokens=4, return_dict_in_generate=True, output_scores=True)
    with fastgen.unpatched():
        reference = model.generate(**inputs, **{CACHE: DynamicCache()}, **kwargs)
    user_cache = DynamicCache()
    with fastgen.patched(["dedup"]):
        patched = model.generate(**inputs, **{CACHE: user_cache}, **kwargs)
    assert torch.equal(reference.sequences, patched.sequences)
    assert getattr(patched, CACHE) is user_cache and type(user_cache) is DynamicCache
    embeds = model.get_input_embeddings()(inputs["input_ids"]).detach()
    _, patched = harness.assert_same_generation(
        model,
        {"inputs_embeds": embeds, "attention_mask": inputs["attention_mask"]},
        features=["dedup"],
        max_new_tokens=4,
        num_beams=3,
    )
    assert type(getattr(patched, CACHE)) is DynamicCache


def test_assisted_generation_is_untouched() -> None:
    model, assistant = harness.tiny_hf_model("llama"), harness.tiny_hf_model("llama", seed=1)
    inputs = harness.tiny_inputs(model, batch=1)
    _, patched = harness.assert_same_generation(
        model, inputs, features=["dedup"], max_new_tokens=5, assistant_model=assistant
    )
    assert type(getattr(patched, CACHE)) is DynamicCache


def _plain_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any):
    out = torch.softmax(query @ key.transpose(-1, -2) * kw["scaling"] + mask, dim=-1) @ value
    return out.transpose(1, 2), ("plain", key.shape)


def test_tagged_keys_reaching_an_unsupported_call_get_upstream_kv() -> None:
    """Other implementations, training mode, or soft-capping see the materialised per-hypothesis K/V."""
    module = harness.tiny_hf_model("gpt2").transformer.h[0].attn
    batch, group, heads, prompt, dim = 2, 3, 4, 5, 8
    layer = SharedPrefixLayer(batch * group, attention_ready=lambda: True)
    layer.update(torch.randn(batch, heads, prompt, dim), torch.randn(batch, heads, prompt, dim))
    key, value = layer.update(torch.randn(batch * group, heads, 1, dim), torch.randn(batch * group, heads, 1, dim))
    assert getattr(key, PREFIX_ATTR).keys is layer.prefix_keys
    query, mask = torch.randn(batch * group, heads, 1, dim), torch.zeros(batch * group, 1, 1, prompt + 1)
    full_keys, full_values = layer.per_hypothesis()
    expected, _ = _plain_attention(module, query, full_keys, full_values, mask, scaling=0.3)
    reasons: list[str] = []
    for implementation, kwargs in [
        ("flash_attention_2", {}),
        ("sdpa", dict(softcap=30.0)),
        ("sdpa", dict(dropout=0.1)),
    ]:
        wrapped = prefix_attention(_plain_attention, implementation, reasons.append)
        out, info = wrapped(module, query, key, value, mask, scaling=0.3, **kwargs)
        assert info == ("plain", full_keys.shape)
        torch.testing.assert_close(out, expected)
    assert len(reasons) == 3
    fast, _ = prefix_attention(_plain_attention, "sdpa", reasons.append)(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(fast, expected, atol=1e-6, rtol=1e-5)
    assert len(reasons) == 3


def test_shared_layer_row_operations_match_a_plain_layer() -> None:
    """reorder / repeat / select / crop on the shared layer mean the same per hypothesis as on upstream's."""
    torch.manual_seed(0)
    batch, group = 2, 3

    def fresh() -> tuple[SharedPrefixLayer, DynamicLayer]:
        shared, plain = SharedPrefixLayer(batch * group, attention_ready=lambda: True), DynamicLayer()
        prompt_k, prompt_v = torch.randn(batch, 2, 4, 5), torch.randn(batch, 2, 4, 5)
        shared.update(prompt_k, prompt_v)
        plain.update(prompt_k.repeat_interleave(group, 0), prompt_v.repeat_interleave(group, 0))
        return shared, plain

    def both(name: str, argument: Any) -> None:
        getattr(shared, name)(argument)
        getattr(plain, name)(argument)
        keys, values = shared.per_hypothesis()
        assert torch.equal(keys, plain.keys) and torch.equal(values, plain.values), name
        assert shared.get_seq_length() == plain.get_seq_length(), name

    def step() -> None:
        rows = shared.hypotheses
        new_k, new_v = torch.randn(rows, 2, 1, 5), torch.randn(rows, 2, 1, 5)
        shared.update(new_k, new_v)
        plain.update(new_k, new_v)

    shared, plain = fresh()
    both("reorder_cache", torch.tensor([2, 2, 0, 4, 3, 3]))  # right after the prefill: nothing to move
    both("batch_repeat_interleave", 2)  # empty suffix: only the grouping changes
    assert shared.group_size() == 2 * group and shared.prefix_keys.shape[0] == batch
    step()
    step()
    both("reorder_cache", torch.tensor([1, 0, 0, 5, 4, 2, 6, 6, 11, 7, 8, 9]))  # within each input, as beam search
    both("crop", -1)  # within the suffix
    both("batch_repeat_interleave", 2)
    assert shared.prefix_keys is not None and shared.group_size() == 4 * group
    both("crop", -3)  # into the prompt: folded back into per-row K/V
    assert shared.prefix_keys is None
    both("batch_select_indices", torch.tensor([0, 5, 7, 11]))
    shared, plain = fresh()
    step()
    both("batch_select_indices", torch.tensor([0, 4, 5]))  # arbitrary rows: per-row K/V first
    assert shared.prefix_keys is None and shared.hypotheses == 3


def test_patches_are_declared_and_applied() -> None:
    with fastgen.patched(["dedup"]):
        states = {row.target: row.state for row in fastgen.status() if row.feature == "dedup"}
    assert states["transformers.generation.utils:GenerationMixin._prefill"] == "applied"


@pytest.mark.parametrize("family", harness.DECODER_ONLY)
def test_family_table_matches_models(family: str) -> None:
    """The support table names exactly the tested families, and the classes their layers really use."""
    assert set(PROMPT_SHARING_FAMILIES) == set(harness.DECODER_ONLY)
    model = harness.tiny_hf_model(family)
    module_name, _, class_name = PROMPT_SHARING_FAMILIES[model.config.model_type].rpartition(".")
    attention_class = getattr(importlib.import_module(module_name), class_name)
    attention_modules = [m for m in model.modules() if hasattr(m, "layer_idx") and "Attention" in type(m).__name__]
    assert {type(m) for m in attention_modules} == {attention_class}
    assert sorted(m.layer_idx for m in attention_modules) == list(range(model.config.num_hidden_layers))
