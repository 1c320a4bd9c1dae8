"""Feature ``lean_step``: upstream's greedy / sampling loop with the lean BART-family decode step.

Each case runs ``generate`` upstream (``fastgen.unpatched()``) and with fastgen (tokens identical, scores within
the harness's fp32 tolerance), and with fastgen with and without the step (``FASTGEN_LEAN_STEP=0``: scores
``torch.equal``): greedy, seeded sampling, n-gram blocking, padded inputs of a batch that finish at different
steps. The instance forward leaves with the call, serves only its own thread, and steps aside for models,
hooks and forwards it does not reproduce.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.cache_utils import DynamicLayer

import fastgen
from fastgen.optimizer.transformers import lean_sample
from tests import harness

pytestmark = harness.requires_feature("lean_step")

FAMILIES = ("bart", "marian", "mbart", "pegasus")
LEAN = "decode step: the lean BART-family step"
CASES = {
    "greedy": dict(max_new_tokens=8),
    "greedy-ngram2-min-length": dict(max_new_tokens=10, no_repeat_ngram_size=2, min_new_tokens=3),
    # a quarter of the vocabulary ends a row: rows finish at different steps and are padded after
    "greedy-early-eos": dict(max_new_tokens=12, eos_token_id=list(range(3, 27))),
    "sample-top-k": dict(max_new_tokens=8, do_sample=True, top_k=20, temperature=0.8),
    "sample-top-p": dict(max_new_tokens=8, do_sample=True, top_p=0.9),
}


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest):
    return harness.non_degenerate(harness.tiny_hf_model(request.param))


_generate = harness.generate_with_step


@pytest.mark.parametrize("case", CASES)
def test_equals_upstream(model, case, monkeypatch):
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1")
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    reference, _, report = harness.assert_same_generation(model, inputs, with_report=True, **CASES[case])
    assert LEAN in report.ran.get("lean_step", []), report.ran
    assert reference.sequences.shape[1] > 3  # the loop ran several decode steps
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("case", CASES)
def test_bit_identical_to_the_models_own_forward(model, case, monkeypatch):
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    without, report = _generate(model, inputs, False, monkeypatch, **CASES[case])
    assert "decode step: upstream's forward (FASTGEN_LEAN_STEP=0)" in report.ran.get("lean_step", [])
    with_step, report = _generate(model, inputs, True, monkeypatch, **CASES[case])
    assert LEAN in report.ran.get("lean_step", [])
    assert torch.equal(with_step.sequences, without.sequences)
    for ours, theirs in zip(with_step.scores, without.scores, strict=True):
        assert torch.equal(ours, theirs)


def test_the_returned_cache_is_upstreams_plain_one(model, monkeypatch):
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    outs = [_generate(model, inputs, lean, monkeypatch, max_new_tokens=5)[0] for lean in (False, True)]
    caches = [getattr(out, "cache", None) or out.past_key_values for out in outs]
    for ours, theirs in zip(caches[1].self_attention_cache.layers, caches[0].self_attention_cache.layers, strict=True):
        assert type(ours) is DynamicLayer and ours.keys.is_contiguous()
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_a_hook_on_a_skipped_module_keeps_upstreams_forward(model, monkeypatch):
    calls = []
    handle = model.get_decoder().layers[0].register_forward_hook(lambda *args: calls.append(1))
    try:
        out, report = _generate(
            model, harness.tiny_inputs(model, batch=2, length=8), True, monkeypatch, max_new_tokens=4
        )
    finally:
        handle.remove()
    assert any("upstream's forward (hooks on a module" in entry for entry in report.ran["lean_step"])
    assert len(calls) == out.sequences.shape[1] - 1  # the hook saw every step


def test_an_instance_forward_of_the_users_is_left_alone(monkeypatch):
    model = harness.tiny_hf_model("bart")
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        return type(model).forward(model, *args, **kwargs)

    model.forward = forward
    out, report = _generate(model, harness.tiny_inputs(model, batch=2, length=8), True, monkeypatch, max_new_tokens=4)
    assert any("instance forward" in entry for entry in report.ran["lean_step"]), report.ran
    assert len(calls) == out.sequences.shape[1] - 1 and model.forward is forward


def test_other_families_keep_upstreams_forward(monkeypatch):
    model = harness.tiny_hf_model("t5")
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    _, _, report = harness.assert_same_generation(model, inputs, with_report=True, max_new_tokens=4)
    assert "decode step: upstream's forward (not a model class the lean step reproduces)" in report.ran["lean_step"]


def test_the_forward_serves_only_its_own_thread():
    """Another thread calling the model while a call holds the forward runs the class's forward."""
    model = harness.tiny_hf_model("bart")

    class Refusing:
        steps = 0

        def step(self, inputs):
            Refusing.steps += 1
            raise AssertionError("another thread's call reached the lean step")

        def finish(self):
            pass

    inputs = harness.tiny_inputs(model, batch=2, length=8)
    with torch.no_grad():
        expected = model(**inputs, decoder_input_ids=torch.full((2, 1), harness.EOS)).logits
    seen = []
    with lean_sample._forward_through(model, Refusing()), torch.no_grad():
        thread = threading.Thread(
            target=lambda: seen.append(model(**inputs, decoder_input_ids=torch.full((2, 1), harness.EOS)).logits)
        )
        thread.start()
        thread.join()
        assert "forward" in model.__dict__
    assert "forward" not in model.__dict__ and Refusing.steps == 0
    assert torch.equal(seen[0], expected)


@pytest.mark.parametrize(
    "extra",
    [
        dict(output_logits=True),
        dict(output_hidden_states=True),
        dict(num_return_sequences=2, do_sample=True, top_k=5),
        dict(decoder_input_ids=torch.tensor([[harness.EOS, 5], [harness.EOS, 7]])),
        dict(use_cache=False),
    ],
    ids=["logits", "hidden-states", "sampled-returns", "decoder-prompt", "no-cache"],
)
def test_what_upstream_returns_comes_back_alike(extra):
    """Raw logits, decoder hidden states (their steps run the model's own forward), several sampled returns, a
    decoder prompt, no cache: the outputs are upstream's."""
    model = harness.tiny_hf_model("bart")  # fresh: output recording may leave hooks on a model's modules
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    outs = []
    for scope in (fastgen.unpatched(), fastgen.patched()):
        with scope, torch.no_grad():
            torch.manual_seed(0)
            outs.append(model.generate(**inputs, max_new_tokens=6, return_dict_in_generate=True, **extra))
    upstream, ours = outs
    assert torch.equal(ours.sequences, upstream.sequences)
    for name in ("logits", "decoder_hidden_states"):
        if getattr(upstream, name, None) is not None:
            flat = [torch.stack(s) if isinstance(s, tuple) else s for s in getattr(upstream, name)]
            mine = [torch.stack(s) if isinstance(s, tuple) else s for s in getattr(ours, name)]
            assert all(torch.equal(a, b) for a, b in zip(flat, mine, strict=True)), name
