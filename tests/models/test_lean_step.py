"""The lean BART-family decode step (fastgen.models.lean_step): upstream's logits bit for bit.

Three levels: one step against the model's own forward on copies of one cache (logits and the grown
cache ``torch.equal``), ``generate`` with and without the step (``FASTGEN_LEAN_STEP=0``: bit-identical
scores), and ``generate`` against upstream (tokens identical, scores within the harness's tolerance).
A model it does not reproduce, or one with a hook on a module it would skip, runs upstream's forward.
The self-attention cache grows in place under the step (fastgen.models.growing_cache) and leaves
``generate`` as upstream's plain layers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache

import fastgen
from fastgen.models import lean_step
from fastgen.models.growing_cache import GrowingLayer
from tests import harness

pytestmark = harness.requires_feature("beam")

FAMILIES = ("bart", "marian", "mbart", "pegasus")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest):
    return harness.non_degenerate(harness.tiny_hf_model(request.param))


def _prefilled(model, rows_per_input: int = 3):
    """Encoder outputs, the encoder mask and a cache after one forward of a decoder prompt of 2 tokens."""
    inputs = harness.tiny_inputs(model, batch=2, length=9)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(**inputs)
    encoder_outputs.last_hidden_state = encoder_outputs.last_hidden_state.repeat_interleave(rows_per_input, 0)
    mask = inputs["attention_mask"].repeat_interleave(rows_per_input, 0)
    start = model.config.decoder_start_token_id
    prompt = torch.tensor([[start, 5]] * mask.shape[0])
    with torch.no_grad():
        out = model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=prompt, use_cache=True)
    return encoder_outputs, mask, out.cache if hasattr(out, "cache") else out.past_key_values


def test_one_step_equals_the_forward_bit_for_bit(model):
    assert lean_step.model_problem(model) is None
    encoder_outputs, mask, cache = _prefilled(model)
    step = lean_step.LeanDecodeStep(model)
    generator = torch.Generator().manual_seed(3)
    upstream_cache, lean_cache = cache, copy.deepcopy(cache)
    for _ in range(4):
        ids = torch.randint(3, harness.VOCAB, (mask.shape[0], 1), generator=generator)
        inputs = dict(decoder_input_ids=ids, attention_mask=mask, encoder_outputs=encoder_outputs, use_cache=True)
        with torch.no_grad():
            reference = model(**inputs, cache=upstream_cache)
            logits, lean_cache = step.step({**inputs, "cache": lean_cache})
        assert torch.equal(logits, reference.logits)
        layers = zip(lean_cache.self_attention_cache.layers, upstream_cache.self_attention_cache.layers, strict=True)
        for ours, theirs in layers:
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_the_first_step_equals_the_forward_bit_for_bit(model):
    """The call's first decode step: both caches empty, the cross-attention K/V projected and stored."""
    inputs = harness.tiny_inputs(model, batch=2, length=9)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(**inputs)
    ids = torch.full((2, 1), model.config.decoder_start_token_id)
    base = dict(decoder_input_ids=ids, attention_mask=inputs["attention_mask"], encoder_outputs=encoder_outputs)
    upstream_cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    lean_cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    step = lean_step.LeanDecodeStep(model)
    assert step.first_step_problem({**base, "use_cache": True, "cache": lean_cache}) is None
    with torch.no_grad():
        reference = model(**base, use_cache=True, cache=upstream_cache)
        logits, lean_cache = step.step({**base, "use_cache": True, "cache": lean_cache})
    assert torch.equal(logits, reference.logits)
    assert lean_cache.is_updated == upstream_cache.is_updated
    for part in ("self_attention_cache", "cross_attention_cache"):
        ours, theirs = getattr(lean_cache, part).layers, getattr(upstream_cache, part).layers
        assert len(ours) == len(theirs) == model.config.decoder_layers
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert step.first_step_problem({**base, "use_cache": True, "cache": lean_cache}) is not None  # filled now


@pytest.mark.parametrize("num_beams", [3, 1])
def test_generate_takes_its_first_step_through_the_lean_step(model, num_beams, monkeypatch):
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1")
    calls = []
    first = lean_step.LeanDecodeStep._first_step
    monkeypatch.setattr(
        lean_step.LeanDecodeStep, "_first_step", lambda self, inputs: calls.append(1) or first(self, inputs)
    )
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    harness.assert_same_generation(model, inputs, num_beams=num_beams, max_new_tokens=6)
    assert calls == [1]


_generate = harness.generate_with_step


CASES = {
    "beam4": dict(num_beams=4, max_new_tokens=8),
    "beam3-ngram2-two-returned": dict(num_beams=3, no_repeat_ngram_size=2, num_return_sequences=2, max_new_tokens=8),
    "beam4-early-eos": dict(num_beams=4, max_new_tokens=10, eos_token_id=[harness.EOS, 7, 11], length_penalty=0.5),
}


@pytest.mark.parametrize("case", CASES)
def test_generate_with_the_step_is_bit_identical_to_without(model, case, monkeypatch):
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    without, _ = _generate(model, inputs, False, monkeypatch, **CASES[case])
    with_step, report = _generate(model, inputs, True, monkeypatch, **CASES[case])
    assert "decode step: the lean BART-family step" in report.ran.get("beam", [])
    assert torch.equal(with_step.sequences, without.sequences)
    assert torch.equal(with_step.sequences_scores, without.sequences_scores)
    for ours, theirs in zip(with_step.scores, without.scores, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("case", CASES)
def test_generate_with_the_step_equals_upstream(model, case, monkeypatch):
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1")
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    _, _, report = harness.assert_same_generation(model, inputs, with_report=True, **CASES[case])
    assert "decode step: the lean BART-family step" in report.ran.get("beam", [])


def test_finished_inputs_leave_the_batch_under_the_step(model, monkeypatch):
    """Without per-step scores the loop drops finished inputs (the masks' batch changes mid-call)."""
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1")
    report = harness.assert_leaving_inputs_match_upstream(model)
    assert "decode step: the lean BART-family step" in report.ran.get("beam", [])


def test_a_hook_on_a_skipped_module_keeps_upstreams_forward(model, monkeypatch):
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1")
    calls = []
    handle = model.get_decoder().layers[0].register_forward_hook(lambda *args: calls.append(1))
    try:
        inputs = harness.tiny_inputs(model, batch=2, length=8)
        out, report = _generate(model, inputs, True, monkeypatch, num_beams=2, max_new_tokens=4)
    finally:
        handle.remove()
    ran = report.ran.get("beam", [])
    assert any("upstream's forward (hooks on a module" in entry for entry in ran), ran
    assert len(calls) == out.sequences.shape[1] - 1  # the hook saw every step


def test_other_families_and_eager_attention_keep_upstreams_forward():
    assert lean_step.model_problem(harness.tiny_hf_model("t5")) == "not a model class the lean step reproduces"
    eager = harness.tiny_hf_model("bart", attn_implementation="eager")
    assert "attention implementation 'eager'" in lean_step.model_problem(eager)
    training = harness.tiny_hf_model("bart").train()
    assert lean_step.model_problem(training) == "training mode"


def test_unknown_model_inputs_are_refused():
    assert lean_step.LeanDecodeStep.inputs_problem({"decoder_input_ids": torch.zeros(2, 1), "head_mask": 1}) == (
        "model inputs ['head_mask']"
    )
    assert lean_step.LeanDecodeStep.inputs_problem({"decoder_input_ids": torch.zeros(2, 3)}) == (
        "not a one-token decode step"
    )


def test_without_dedup_the_step_reads_per_hypothesis_cross_kv(model, monkeypatch):
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1")
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    _, _, report = harness.assert_same_generation(
        model, inputs, features=["beam"], with_report=True, num_beams=3, max_new_tokens=6
    )
    assert "dedup" not in report.ran
    assert "decode step: the lean BART-family step" in report.ran.get("beam", [])


def test_the_returned_cache_has_plain_contiguous_layers_equal_to_upstreams(model, monkeypatch):
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    outs = [_generate(model, inputs, lean, monkeypatch, num_beams=3, max_new_tokens=5)[0] for lean in (False, True)]
    caches = [getattr(out, "cache", None) or out.past_key_values for out in outs]
    for ours, theirs in zip(caches[1].self_attention_cache.layers, caches[0].self_attention_cache.layers, strict=True):
        assert type(ours) is DynamicLayer and ours.keys.is_contiguous() and ours.values.is_contiguous()
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@pytest.mark.parametrize("in_place", [True, False], ids=["reorder-in-place", "reorder-gather"])
def test_a_growing_layer_does_what_a_dynamic_layer_does(in_place, monkeypatch):
    decided = harness.force_in_place_reorder(monkeypatch, in_place)
    generator = torch.Generator().manual_seed(0)

    def states(rows: int, length: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (rows, 2, length, 4)
        return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)

    plain = DynamicLayer()
    plain.update(*states(6, 3))
    growing = GrowingLayer(copy.deepcopy(plain))
    steps = [
        ("update", states(6)),
        ("reorder_cache", torch.tensor([1, 1, 0, 5, 4, 2])),
        *[("update", states(6)) for _ in range(40)],  # past the first buffer's room
        ("batch_select_indices", torch.tensor([0, 2, 3, 5])),
        ("update", states(4, 2)),
        ("crop", -3),
        ("batch_repeat_interleave", 2),
        ("update", states(8)),
        ("reorder_cache", torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])),
    ]
    for method, argument in steps:
        arguments = argument if method == "update" else (argument,)
        memory = growing.key_buffer.data_ptr()
        getattr(plain, method)(*arguments)
        getattr(growing, method)(*arguments)
        assert torch.equal(growing.keys, plain.keys) and torch.equal(growing.values, plain.values), method
        assert growing.get_seq_length() == plain.get_seq_length()
        if method == "batch_select_indices":  # in place: the kept rows at the front of the same buffer
            assert (growing.key_buffer.data_ptr() == memory) is in_place
    final = growing.plain()
    assert type(final) is DynamicLayer and final.keys.is_contiguous() and torch.equal(final.keys, plain.keys)
    assert decided == [in_place] * 3  # the two reorders and the rows that left, in place or gathered


def test_other_transformers_releases_keep_upstreams_forward(monkeypatch):
    monkeypatch.setattr(lean_step.transformers, "__version__", "5.23.0")
    reason = lean_step.model_problem(harness.tiny_hf_model("bart"))
    assert reason == "Transformers 5.23.0 (the lean step reproduces the decode step of 5.24 and 5.25)"


class _NewTensors(TorchDispatchMode):
    """Records the shape of every tensor an op returns new (views and ``out=`` writes excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(ret.alias_info is None for ret in func._schema.returns):
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.made.append(tuple(tensor.shape))
        return out


@pytest.mark.parametrize("num_beams", [2, 1])
@pytest.mark.parametrize("lean", [True, False])
def test_the_steps_allocate_the_same_tensors_whatever_the_length(lean, num_beams, monkeypatch):
    """Under the lean step (beam search, and greedy) every decode step makes the same new tensors, of the same
    shapes, at step 2 as at step 40 (the in-place cache grows only when its room doubles); upstream's
    ``torch.cat`` makes a longer cache at every step, which the test sees (its control run)."""
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    steps: list[list[tuple[int, ...]]] = []
    grown: list[int] = []
    adopt = GrowingLayer._adopt
    monkeypatch.setattr(GrowingLayer, "_adopt", lambda self, *a, **k: grown.append(len(steps)) or adopt(self, *a, **k))
    lean_forward, own_forward = lean_step.LeanDecodeStep.step, type(model).forward

    def counted(run):
        def step(*args, **kwargs):
            with _NewTensors() as mode:
                result = run(*args, **kwargs)
            steps.append(mode.made)
            return result

        return step

    if lean:
        monkeypatch.setattr(lean_step.LeanDecodeStep, "step", counted(lean_forward))
    else:
        monkeypatch.setenv("FASTGEN_LEAN_STEP", "0")
        monkeypatch.setattr(type(model), "forward", counted(own_forward))
    # without gemm: its calibration and in-place trials serve some products by other ops from one step to the next
    with fastgen.patched(sorted(set(fastgen.known_features()) - {"gemm", "fast_gemm", "int8"})), torch.no_grad():
        model.generate(**inputs, num_beams=num_beams, min_new_tokens=40, max_new_tokens=40)
    decode = [made for i, made in enumerate(steps) if i >= 2 and i not in grown]  # past the prefill and growth
    assert len(decode) > 30
    if lean:
        assert all(sorted(made) == sorted(decode[0]) for made in decode), "a step made other tensors than the first"
        assert not grown or len(set(grown)) <= 2  # the room doubled at most once past the first 32 positions
    else:
        assert any(sorted(made) != sorted(decode[0]) for made in decode)  # upstream's cat: a longer cache each step


@pytest.mark.parametrize("features", [(), ("int8",)], ids=["exact", "int8"])
def test_inputs_leaving_keep_their_encoder_mask_rows(features, monkeypatch):
    """When inputs leave, the lean step keeps the kept inputs' rows of its encoder mask (what
    ``create_bidirectional_mask`` builds from their attention mask, compared here) instead of building it again;
    the tokens equal those of a run that builds it again, and upstream's (exact)."""
    from transformers.masking_utils import create_bidirectional_mask

    model = harness.non_degenerate(harness.tiny_hf_model("bart"))
    inputs = harness.tiny_inputs(model, batch=4, length=10)  # rows shorter by 0, 2, 4, 6 tokens: padding stays
    kwargs = dict(num_beams=3, max_new_tokens=16, eos_token_id=list(range(3, 30)), early_stopping=True)
    kept_masks = []
    keep_inputs = lean_step.LeanDecodeStep.keep_inputs

    def checked(self, keep, inputs_before, attention_mask, rows):
        keep_inputs(self, keep, inputs_before, attention_mask, rows)
        if self._encoder_mask_for is not None and self._encoder_mask_for[0] is attention_mask:
            rebuilt = create_bidirectional_mask(
                config=self.decoder.config,
                inputs_embeds=torch.empty(rows, 1, 0),
                attention_mask=attention_mask,
                encoder_hidden_states=torch.zeros(len(keep), attention_mask.shape[1], 1),
            )
            kept_masks.append(torch.equal(self._encoder_mask, rebuilt))

    features = [*sorted(set(fastgen.known_features()) - fastgen.optimizer.registry.OPT_IN_FEATURES), *features]
    results = []
    for shortcut in (False, True):
        monkeypatch.setattr(lean_step.LeanDecodeStep, "keep_inputs", checked if shortcut else lambda *args: None)
        with fastgen.patched(features), fastgen.report() as report, torch.no_grad():
            results.append(model.generate(**inputs, **kwargs))
    assert "finished inputs left the batch" in report.ran.get("beam", [])
    assert kept_masks and all(kept_masks)
    assert torch.equal(results[0], results[1])
    if "int8" not in features:
        with fastgen.unpatched(), torch.no_grad():
            assert torch.equal(model.generate(**inputs, **kwargs), results[1])
