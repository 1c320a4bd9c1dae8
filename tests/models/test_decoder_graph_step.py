"""The decoder-only static decode step (fastgen.models.decoder_graph_step), replayed as CUDA graphs on a GPU.

On CPU the same static step runs uncaptured (``decoder_graph_step.STATIC_ON_CPU``): the model's own forward
over K/V buffers of the call's whole length, a 4-D mask over them and explicit positions must give
upstream's tokens (scores within the harness's tolerance) for GPT-2, Llama and Qwen2, in beam search with
n-gram bans, early EOS and padding, greedy, sampling, several returned sequences and inputs that finish
early. On a GPU (``gpu`` marker) the captured graphs must give the eager step's results in fp32.
"""

from __future__ import annotations

import pytest
import torch

import fastgen
from fastgen.models import decoder_graph_step, graph_step
from tests import harness
from tests.models.test_graph_step import CASES  # the encoder-decoder static step's cases, for these families too

pytestmark = harness.requires_feature("beam")

FAMILIES = ("gpt2", "llama", "qwen2")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest):
    return harness.non_degenerate(harness.tiny_hf_model(request.param))


@pytest.fixture
def static_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1")
    monkeypatch.setattr(decoder_graph_step, "STATIC_ON_CPU", True)


#: in CI: the cases that exercise the most (n-gram bans, early EOS, padding; upstream's sampling loop)
IN_CI = ("beam4-early-eos", "beam3-ngram2-two-returned", "sample")


def _static_ran(report) -> bool:
    return "decode step: static shapes" in report.ran.get("lean_step", [])


@pytest.mark.parametrize("case", [c if c in IN_CI else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_the_static_step_equals_upstream(model, case, static_on_cpu):
    inputs = harness.tiny_inputs(model, batch=3, length=10)  # padded: the inputs have different lengths
    assert not bool(inputs["attention_mask"].all())
    _, _, report = harness.assert_same_generation(model, inputs, with_report=True, **CASES[case])
    assert _static_ran(report), report.ran


def test_an_unpadded_batch(static_on_cpu):
    """Without padding upstream's decode step passes SDPA no mask; the static step always passes one."""
    model = harness.non_degenerate(harness.tiny_hf_model("gpt2"))
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
    _, _, report = harness.assert_same_generation(model, inputs, with_report=True, num_beams=3, max_new_tokens=7)
    assert _static_ran(report)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # the tiny GPT-2's inputs all end at the same step
def test_inputs_that_finish_early_leave_under_the_static_step(family, static_on_cpu):
    report = harness.assert_leaving_inputs_match_upstream(harness.non_degenerate(harness.tiny_hf_model(family)))
    assert _static_ran(report)


def test_free_slots_are_zeroed_before_the_step_reads_them(monkeypatch, static_on_cpu):
    """A masked slot must add an exact zero: NaN planted past the filled prefix would otherwise reach the logits."""
    model = harness.non_degenerate(harness.tiny_hf_model("llama"))
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    made = decoder_graph_step.StaticLayer.__init__

    def made_with_nan(layer, *args, **kwargs):
        made(layer, *args, **kwargs)
        layer.key_buffer[:, :, layer.length + 1 :] = float("nan")

    monkeypatch.setattr(decoder_graph_step.StaticLayer, "__init__", made_with_nan)
    with pytest.raises(AssertionError):  # NaN keys in masked slots poison softmax(QK^T): the planted fault shows
        harness.assert_same_generation(model, inputs, num_beams=2, max_new_tokens=6)


def test_the_returned_cache_is_upstreams_layout(static_on_cpu):
    """The cache handed back holds each row's prompt and generated K/V, as upstream's (per hypothesis)."""
    model = harness.non_degenerate(harness.tiny_hf_model("gpt2"))
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    kwargs = dict(num_beams=2, max_new_tokens=5, return_dict_in_generate=True)
    with fastgen.unpatched(), torch.no_grad():
        theirs = model.generate(**inputs, **kwargs)
    with fastgen.report() as report, torch.no_grad():
        ours = model.generate(**inputs, **kwargs)
    assert _static_ran(report)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert not {"reorder_cache", "batch_select_indices", "batch_select_inputs"} & set(vars(ours.cache))
    for (our_k, our_v, *_), (their_k, their_v, *_) in zip(ours.cache, theirs.cache, strict=True):
        assert our_k.shape == their_k.shape
        torch.testing.assert_close(our_k, their_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(our_v, their_v, atol=1e-5, rtol=1e-5)


def test_a_static_layer_reorders_in_place_as_a_plain_layer_does():
    from transformers.cache_utils import DynamicLayer

    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(6, 2, 5, 4, generator=generator), torch.randn(6, 2, 5, 3, generator=generator)
    plain = DynamicLayer()
    plain.update(keys, values)
    static = decoder_graph_step.StaticLayer(keys, values, 9, torch.zeros(1, dtype=torch.long), origin=None)
    address = static.key_buffer.data_ptr()
    for indices in (torch.tensor([5, 5, 0, 1, 3, 2]), torch.tensor([1, 0, 2, 2, 4, 5])):
        plain.reorder_cache(indices)
        static.reorder_cache(indices)
        assert torch.equal(plain.keys, static.keys) and torch.equal(plain.values, static.values)
        assert static.key_buffer.data_ptr() == address
        assert not bool(static.key_buffer[:, :, 5:].any())  # free slots stay zero
    plain.batch_select_indices(torch.tensor([0, 3, 4]))
    static.batch_select_indices(torch.tensor([0, 3, 4]))
    assert torch.equal(plain.keys, static.keys) and static.rows == 3


def test_a_long_length_limit_keeps_upstreams_forward(monkeypatch, static_on_cpu):
    monkeypatch.setattr(decoder_graph_step, "MAX_CAPACITY", 12)
    model = harness.non_degenerate(harness.tiny_hf_model("gpt2"))
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    _, _, report = harness.assert_same_generation(model, inputs, with_report=True, num_beams=2, max_new_tokens=6)
    assert not _static_ran(report)
    assert any("length limit" in note for note in report.ran.get("lean_step", []))


@pytest.mark.parametrize(
    "family, overrides",
    [("gpt2", dict(_attn_implementation="eager")), ("bart", {})],
    ids=["eager-attention", "encoder-decoder"],
)
def test_models_it_does_not_serve_are_refused(family, overrides):
    model = harness.tiny_hf_model(family)
    for name, value in overrides.items():
        setattr(model.config, name, value)
    assert decoder_graph_step.model_problem(model) is not None


def test_it_stays_off_the_cpu_unless_asked():
    model = harness.tiny_hf_model("gpt2")
    assert decoder_graph_step.decode_step(model, 32) is None


def test_graphs_can_be_switched_off(monkeypatch, static_on_cpu):
    monkeypatch.setenv(graph_step.GRAPHS_ENV, "0")
    model = harness.tiny_hf_model("gpt2")
    assert decoder_graph_step.decode_step(model, 32) is None
    assert decoder_graph_step.call_problem(model) == f"{graph_step.GRAPHS_ENV}=0"


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["beam4", "beam4-early-eos", "greedy", "sample"])
def test_cuda_graphs_equal_the_eager_step_in_fp32(family, case, monkeypatch):
    model = harness.non_degenerate(harness.tiny_hf_model(family)).cuda()
    inputs = {k: v.cuda() for k, v in harness.tiny_inputs(model, batch=3, length=10).items()}
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1")
    kwargs = dict(return_dict_in_generate=True, output_scores=True, **CASES[case])
    monkeypatch.setenv(graph_step.GRAPHS_ENV, "0")
    with torch.no_grad():
        torch.manual_seed(0)
        eager = model.generate(**inputs, **kwargs)
    monkeypatch.setenv(graph_step.GRAPHS_ENV, "1")
    with fastgen.report() as report, torch.no_grad():
        torch.manual_seed(0)
        graphed = model.generate(**inputs, **kwargs)
    notes = report.ran.get("lean_step", [])
    assert any(note.startswith("decode step: CUDA graphs (") for note in notes), notes
    assert torch.equal(graphed.sequences, eager.sequences)
    for ours, theirs in zip(graphed.scores, eager.scores, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    harness.assert_same_generation(model, inputs, **CASES[case])


def test_the_beam_reorder_gathers_every_layer_at_once(monkeypatch, static_on_cpu):
    """Layers of one shape share one stacked buffer: the cache's reorder is one gather of the stack."""
    calls = []
    reorder = decoder_graph_step.DecoderGraphStep._reorder_stack

    def spy(step, beam_idx):
        calls.append(beam_idx.shape[0])
        reorder(step, beam_idx)

    monkeypatch.setattr(decoder_graph_step.DecoderGraphStep, "_reorder_stack", spy)
    model = harness.non_degenerate(harness.tiny_hf_model("llama"))
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    harness.assert_same_generation(model, inputs, num_beams=3, max_new_tokens=6)
    assert calls and set(calls) == {6}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_without_prompt_sharing_each_hypothesis_prefilled(family, static_on_cpu):
    """Without ``dedup`` (as on a GPU by default) upstream's prefill computes the prompt once per hypothesis: the
    static step makes an input's copies one and reorders only the generated positions; tokens stay upstream's."""
    model = harness.non_degenerate(harness.tiny_hf_model(family))
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    _, _, report = harness.assert_same_generation(
        model, inputs, features=["beam"], with_report=True, num_beams=4, no_repeat_ngram_size=2, max_new_tokens=9
    )
    assert _static_ran(report) and "dedup" not in report.ran


def test_a_mask_of_another_width_gives_the_step_back_to_upstream(static_on_cpu):
    """A later step whose 2-D mask is not over the cache and the new token: upstream's forward from there on, with
    the cache's layers given back in upstream's layout (no crash, no wrong mask)."""
    model = harness.non_degenerate(harness.tiny_hf_model("gpt2"))
    inputs = harness.tiny_inputs(model, batch=2, length=6)
    step = decoder_graph_step.DecoderGraphStep(model, 20, capture=False, beams=1)
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        ids = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], dim=1)
        first = step.step({"input_ids": ids, "cache": cache, "attention_mask": mask, "use_cache": True})
        assert first is not None and isinstance(cache.layers[0], decoder_graph_step.StaticLayer)
        wrong = torch.ones(2, 3, dtype=torch.long)
        assert step.step({"input_ids": ids, "cache": cache, "attention_mask": wrong, "use_cache": True}) is None
    assert step.problem and not any(isinstance(layer, decoder_graph_step.StaticLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 7
