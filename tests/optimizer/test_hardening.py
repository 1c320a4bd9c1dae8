"""Never worse than upstream (issue 7): torch.compile, whole fallbacks, the returned cache, reports.

Each test here failed on main at 4161a73 and describes the promise it keeps.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
import torch._dynamo as dynamo
import transformers
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation.configuration_utils import CompileConfig

import fastgen
from fastgen.models.decoder_only import SharedPrefixCache
from fastgen.models.encoder_decoder import BeamSharedCrossAttentionCache
from fastgen.optimizer.transformers.contract import CACHE
from tests import harness

pytestmark = harness.requires_feature("dedup")


def _forward_inputs(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    inputs = harness.tiny_inputs(model, batch=2)
    if model.config.is_encoder_decoder:
        start = model.generation_config.decoder_start_token_id
        inputs["decoder_input_ids"] = torch.tensor([[start, 5, 9], [start, 7, 4]])
    return inputs


# ---------------------------------------------------------------------------- torch.compile (item 3, 9)


#: families whose "enabled" case runs in CI (one decoder-only, one encoder-decoder; both also run "unpatched").
#: The other families' "enabled" cases are marked slow (two Dynamo traces, ~5-9 s each on CI's CPU): in CI,
#: test_fullgraph_compile_of_every_family[family] traces the same patched forward on the same inputs (no_grad) with
#: ``fullgraph=True``, which raises on any graph break, so a break fastgen added there still fails CI.
EXPLAINED_IN_CI = ("llama", "t5")
#: upstream's graph-break count of a family's forward (fastgen disabled): the same for both scopes
_UPSTREAM_BREAKS: dict[str, int] = {}


@pytest.mark.parametrize(
    "family, scope",
    [
        pytest.param(family, "enabled", marks=() if family in EXPLAINED_IN_CI else pytest.mark.slow)
        for family in harness.HF_FAMILIES
    ]
    + [("llama", "unpatched"), ("t5", "unpatched")],
)
def test_fastgen_adds_no_graph_break(family: str, scope: str) -> None:
    """Dynamo traces every tiny family's forward with fastgen as without it: no break added."""
    model = harness.tiny_hf_model(family)
    inputs = _forward_inputs(model)
    if family not in _UPSTREAM_BREAKS:
        with harness.fastgen_disabled():
            dynamo.reset()
            _UPSTREAM_BREAKS[family] = dynamo.explain(model)(**inputs).graph_break_count
    upstream = _UPSTREAM_BREAKS[family]
    context = fastgen.unpatched() if scope == "unpatched" else fastgen.patched()
    with context:
        dynamo.reset()
        explained = dynamo.explain(model)(**inputs)
    assert explained.graph_break_count == upstream == 0, [str(b.reason)[:200] for b in explained.break_reasons]


@pytest.mark.parametrize("family", list(harness.HF_FAMILIES))
def test_fullgraph_compile_of_every_family(family: str, caplog: pytest.LogCaptureFixture) -> None:
    """``torch.compile(model, fullgraph=True)`` traces with fastgen imported and gives eager's output."""
    model = harness.tiny_hf_model(family)
    inputs = _forward_inputs(model)
    with torch.no_grad():
        expected = model(**inputs).logits
    dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with fastgen.patched(), warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        with torch.no_grad():
            logits = compiled(**inputs).logits
    torch.testing.assert_close(logits, expected)
    messages = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "fastgen" in m or "silent incorrectness" in m], messages


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_generate_with_compile_config_matches_upstream(family: str) -> None:
    """Transformers' own compiled path (static cache, fullgraph): what the upstream compile test runs."""
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=2)
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend="eager")
    compile_config._compile_all_devices = True  # compile on CPU too
    dynamo.reset()
    harness.assert_same_generation(
        model, inputs, max_new_tokens=4, cache_implementation="static", compile_config=compile_config
    )


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_beam_search_with_a_compiled_forward_falls_back_whole(family: str) -> None:
    """A compiled forward never gets the attention wrappers, so dedup must not reshape its inputs."""
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=2)
    dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager", dynamic=True)
    try:
        _, _, report = harness.assert_same_generation(
            model, inputs, max_new_tokens=4, num_beams=3, features=["dedup"], with_report=True
        )
    finally:
        del model.forward
    assert report.fell_back == [("dedup", "the model's forward is compiled (torch.compile)")]
    assert "dedup" not in report.ran


def test_shared_prefix_layer_gives_upstream_kv_under_compilation() -> None:
    """Belt and braces: a shared-prompt layer reached by compiled code folds its prefix back first."""
    from fastgen.models.decoder_only import SharedPrefixLayer

    layer = SharedPrefixLayer(hypotheses=4, attention_ready=lambda: True)
    prompt = torch.randn(2, 2, 3, 4)
    layer.update(prompt, prompt + 1)

    def step(key: torch.Tensor) -> torch.Tensor:
        keys, _ = layer.update(key, key)
        return keys

    new = torch.randn(4, 2, 1, 4)
    keys = torch.compile(step, fullgraph=True, backend="eager")(new)
    assert keys.shape == (4, 2, 4, 4)
    assert torch.equal(keys[:, :, :3], prompt.repeat_interleave(2, 0)) and torch.equal(keys[:, :, 3:], new)


# ---------------------------------------------------------------------------- whole fallbacks (item 2)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bart"])
def test_training_mode_with_dropout_falls_back_whole(family: str) -> None:
    """Dropout draws from the random stream in a layout-dependent order: upstream's, bit for bit."""
    overrides = {
        "llama": dict(attention_dropout=0.3),
        "gpt2": dict(attn_pdrop=0.3, resid_pdrop=0.3, embd_pdrop=0.3),
        "bart": dict(dropout=0.3, attention_dropout=0.3),
    }[family]
    model = harness.tiny_hf_model(family, **overrides).train()
    inputs = harness.tiny_inputs(model, batch=3)
    with harness.recorded_caches(model) as caches:
        _, _, report = harness.assert_same_generation(
            model, inputs, features=["dedup"], max_new_tokens=6, num_beams=3, seed=7, with_report=True
        )
    assert report.fell_back == [("dedup", "training mode with dropout (the random stream depends on the layout)")]
    assert not any(isinstance(c, SharedPrefixCache | BeamSharedCrossAttentionCache) for c in caches)


def test_decoder_only_prefill_that_cannot_share_runs_on_upstreams_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A problem found at the prefill puts upstream's own cache back: no half-deduplicated call."""
    from fastgen.optimizer.transformers import prompt_dedup

    monkeypatch.setattr(prompt_dedup, "_repeats_within_groups", lambda tensor, group: False)
    model = harness.tiny_hf_model("llama")
    inputs = harness.tiny_inputs(model, batch=2)
    with harness.recorded_caches(model) as caches:
        _, _, report = harness.assert_same_generation(
            model, inputs, features=["dedup"], max_new_tokens=4, num_beams=3, with_report=True
        )
    assert report.fell_back == [("dedup", "the hypotheses of an input do not share one prompt")]
    assert [type(cache) for cache in caches] == [DynamicCache, DynamicCache]  # upstream's run, then fastgen's


def test_decoder_only_prompt_sharing_is_off_on_gpus_unless_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured 0.54x upstream on an H200 (issue 26): on a GPU the call keeps upstream's cache, one warning."""
    from fastgen.optimizer.transformers import prompt_dedup

    monkeypatch.delenv(prompt_dedup.GPU_SWITCH, raising=False)
    assert prompt_dedup.gpu_problem(torch.device("cpu")) is None
    reason = prompt_dedup.gpu_problem(torch.device("cuda"))
    assert reason is not None and prompt_dedup.GPU_SWITCH in reason
    monkeypatch.setenv(prompt_dedup.GPU_SWITCH, "1")
    assert prompt_dedup.gpu_problem(torch.device("cuda")) is None
    # the call itself (a CPU model standing in for a GPU one): upstream's cache, upstream's output
    monkeypatch.setattr(prompt_dedup, "gpu_problem", lambda device: "prompt sharing on cuda (test)")
    model = harness.tiny_hf_model("gpt2")
    inputs = harness.tiny_inputs(model, batch=2)
    with harness.recorded_caches(model) as caches:
        _, _, report = harness.assert_same_generation(
            model, inputs, features=["dedup"], max_new_tokens=4, num_beams=3, with_report=True
        )
    assert report.fell_back == [("dedup", "prompt sharing on cuda (test)")]
    assert [type(cache) for cache in caches] == [DynamicCache, DynamicCache]


# ---------------------------------------------------------------------------- the returned cache (item 4)


@pytest.mark.parametrize("leave", ["unpatched", "disable"])
@pytest.mark.parametrize("family", ["bart", "t5"])
def test_returned_encoder_decoder_cache_continues_in_upstream_code(family: str, leave: str) -> None:
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=2)
    kwargs = dict(num_beams=3, max_new_tokens=4, min_new_tokens=4, return_dict_in_generate=True)
    with fastgen.unpatched():
        upstream = model.generate(**inputs, **kwargs)
    with fastgen.patched(["dedup"]), fastgen.report() as report:
        returned = model.generate(**inputs, **kwargs)
    assert report.fast_path("dedup") and torch.equal(returned.sequences, upstream.sequences)
    cache, reference = getattr(returned, CACHE), getattr(upstream, CACHE)
    assert type(cache) is EncoderDecoderCache
    assert type(cache.self_attention_cache) is type(cache.cross_attention_cache) is DynamicCache
    for mine, theirs in zip(cache.cross_attention_cache.layers, reference.cross_attention_cache.layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
    assert cache.is_updated == reference.is_updated
    rows = cache.self_attention_cache.layers[0].keys.shape[0]
    step: dict[str, Any] = dict(
        attention_mask=inputs["attention_mask"].repeat_interleave(3, 0),
        decoder_input_ids=torch.full((rows, 1), 7),
        encoder_outputs=(model.get_encoder()(**inputs).last_hidden_state.repeat_interleave(3, 0),),
    )
    context = fastgen.unpatched() if leave == "unpatched" else harness.fastgen_disabled()
    with context, torch.no_grad():
        expected = model(**step, **{CACHE: reference}).logits
        logits = model(**step, **{CACHE: cache}).logits
    # Self-attention K/V differ from upstream's by SDPA rounding (grouped rows); T5's logits reach ~100.
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_returned_cross_attention_rows_are_built_only_when_read() -> None:
    """The returned cache's cross layers hold one row per input until read (issue 26: on a GPU, building
    them at the end of every call doubled the peak memory); read, written, copied or pickled, they are
    upstream's per-hypothesis K/V."""
    import copy
    import pickle

    from fastgen.models._caches import RepeatedRowsLayer

    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    kwargs = dict(num_beams=3, max_new_tokens=4, min_new_tokens=4, return_dict_in_generate=True)
    with fastgen.unpatched():
        reference = getattr(model.generate(**inputs, **kwargs), CACHE).cross_attention_cache.layers
    with fastgen.patched(["dedup"]):
        layers = getattr(model.generate(**inputs, **kwargs), CACHE).cross_attention_cache.layers
    assert all(isinstance(layer, RepeatedRowsLayer) and not layer.built for layer in layers)
    shared = layers[0].__dict__["_shared"][0]
    assert shared.shape[0] == 2 and reference[0].keys.shape[0] == 6  # one row per input, not per beam
    copied, unpickled = copy.deepcopy(layers[0]), pickle.loads(pickle.dumps(layers[0]))
    assert not copied.built and not unpickled.built
    for mine, theirs in zip([layers[0], copied, unpickled], [reference[0]] * 3, strict=True):
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)  # a read builds both
        assert mine.built and mine.keys.shape == theirs.keys.shape
    assert layers[0].get_seq_length() == reference[0].get_seq_length()
    layers[1].keys = torch.zeros(1)  # a write builds first, then replaces that one tensor
    assert layers[1].built and layers[1].keys.shape == (1,) and layers[1].values.shape == reference[1].values.shape
    fresh = RepeatedRowsLayer(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), 3)
    assert fresh.get_seq_length() == 5 and not fresh.built
    fresh.reset()
    assert fresh.keys is None and fresh.values is None


def test_returned_cache_is_folded_only_when_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastgen.models.encoder_decoder import BeamSharedCrossAttentionCache as Shared

    folds = []
    original = Shared.to_upstream
    monkeypatch.setattr(Shared, "to_upstream", lambda self: folds.append(1) or original(self))
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    with fastgen.patched(["dedup"]):
        model.generate(**inputs, num_beams=3, max_new_tokens=3)
        assert folds == []
        model.generate(**inputs, num_beams=3, max_new_tokens=3, return_dict_in_generate=True)
    assert folds == [1]


# ---------------------------------------------------------------------------- reports (item 10)


def test_report_says_what_ran_and_what_fell_back() -> None:
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    with fastgen.patched(), fastgen.report() as report:
        model.generate(**inputs, num_beams=3, max_new_tokens=5, no_repeat_ngram_size=2)
        model.generate(**inputs, num_beams=3, max_new_tokens=3, cache_implementation="static")
    assert report.ran["dedup"] == ["cross-attention K/V shared by 3 hypotheses per input"]
    assert report.ran["ngram"] == ["no_repeat_ngram_size on fastgen's n-gram op"]
    assert report.fell_back == [("dedup", "cache_implementation='static'")]
    assert not report.fast_path("dedup") and report.fast_path("ngram")
    assert report.cache_bytes_saved > 0
    text = str(report)
    assert "ran       dedup" in text and "fell back dedup: cache_implementation='static'" in text


def test_report_outside_fastgen_records_nothing() -> None:
    model = harness.tiny_hf_model("gpt2")
    inputs = harness.tiny_inputs(model, batch=2)
    with fastgen.unpatched(), fastgen.report() as report:
        model.generate(**inputs, num_beams=3, max_new_tokens=3)
    assert report == fastgen.Report()


# ---------------------------------------------------------------------------- warnings (item 11)


def test_fallback_warnings_have_one_wording_and_no_cache_repr(caplog: pytest.LogCaptureFixture) -> None:
    from fastgen.optimizer import registry

    registry._state.warned.clear()
    encoder_decoder = harness.tiny_hf_model("bart")
    encoder_decoder.config.model_type = "not-a-family"
    decoder_only = harness.tiny_hf_model("qwen2", sliding_window=4, use_sliding_window=True, max_window_layers=0)
    decoder_only.config.model_type = "not-a-family"
    with fastgen.patched(["dedup"]), caplog.at_level(logging.WARNING, logger="fastgen"):
        for model in (encoder_decoder, decoder_only):
            model.generate(**harness.tiny_inputs(model, batch=2), num_beams=2, max_new_tokens=2)
    messages = [r.getMessage() for r in caplog.records if r.name == "fastgen"]
    unsupported = [m for m in messages if "model type 'not-a-family' is not supported yet" in m]
    assert len(unsupported) == 2, messages
    assert all(m.startswith("[dedup] falling back to upstream: ") for m in messages), messages
    assert not [m for m in messages if "Cache(" in m or "Layer(" in m], messages
