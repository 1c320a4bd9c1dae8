"""The static-shape decode step (fastgen.models.graph_step), replayed as CUDA graphs on a GPU.

On CPU the same static step runs uncaptured (``lean_step.STATIC_ON_CPU``): its arithmetic (the position
written through a device tensor, attention over the whole reserved buffer under a mask, positions embedded
from a tensor) must give upstream's tokens and scores within the harness's tolerance, across the four
families, beam search with n-gram bans and early EOS, greedy, sampling and inputs that finish early. On a
GPU (``gpu`` marker) the captured graphs must give the same results as the eager step in fp32.
"""

from __future__ import annotations

import pytest
import torch

import fastgen
from fastgen.models import graph_step, lean_step
from tests import harness

pytestmark = harness.requires_feature("beam")

FAMILIES = ("bart", "marian", "mbart", "pegasus")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest):
    return harness.non_degenerate(harness.tiny_hf_model(request.param))


@pytest.fixture
def static_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1")
    monkeypatch.setenv("FASTGEN_COMPILED_STEP", "0")  # the static step sits before the compiled one anyway
    monkeypatch.setattr(lean_step, "STATIC_ON_CPU", True)


CASES = {
    "beam4": dict(num_beams=4, max_new_tokens=8),
    "beam3-ngram2-two-returned": dict(num_beams=3, no_repeat_ngram_size=2, num_return_sequences=2, max_new_tokens=8),
    "beam4-early-eos": dict(num_beams=4, max_new_tokens=10, eos_token_id=[harness.EOS, 7, 11], length_penalty=0.5),
    "greedy": dict(do_sample=False, max_new_tokens=9),
    "sample": dict(do_sample=True, top_k=20, max_new_tokens=9),
}


#: in CI: the cases that exercise the most (n-gram bans, early EOS, padding; upstream's sampling loop)
IN_CI = ("beam4-early-eos", "sample")


@pytest.mark.parametrize("case", [c if c in IN_CI else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_the_static_step_equals_upstream(model, case, static_on_cpu):
    inputs = harness.tiny_inputs(model, batch=3, length=10)  # padded: the inputs have different lengths
    _, _, report = harness.assert_same_generation(model, inputs, with_report=True, **CASES[case])
    feature = "beam" if CASES[case].get("num_beams", 1) > 1 else "lean_step"
    assert "decode step: static shapes" in report.ran.get("lean_step", []) + report.ran.get(feature, [])


def test_inputs_that_finish_early_leave_under_the_static_step(model, static_on_cpu):
    report = harness.assert_leaving_inputs_match_upstream(model)
    assert "decode step: static shapes" in report.ran.get("lean_step", [])


def test_free_slots_are_zeroed_before_the_static_step_reads_them(monkeypatch, static_on_cpu):
    """Uninitialised memory past the filled prefix must not reach the logits (NaN times a zero weight)."""
    model = harness.non_degenerate(harness.tiny_hf_model("bart"))
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    adopt = lean_step.GrowingLayer._adopt

    def adopt_into_nan(layer, keys, values, extra):
        adopt(layer, keys, values, extra)
        for buffer in layer._buffers:
            buffer[layer.length :] = float("nan")

    monkeypatch.setattr(lean_step.GrowingLayer, "_adopt", adopt_into_nan)
    harness.assert_same_generation(model, inputs, num_beams=2, max_new_tokens=6)


def test_the_length_limit_bounds_the_static_step():
    step = graph_step.StaticStep(lean=None, length_limit=3, capture=False)
    layer = lean_step.GrowingLayer.__new__(lean_step.GrowingLayer)
    layer._length = 3
    assert not step.takes(torch.zeros(2, 1, dtype=torch.long), [layer])
    layer._length = 2
    assert step.takes(torch.zeros(2, 1, dtype=torch.long), [layer])


def test_graphs_can_be_switched_off(monkeypatch, static_on_cpu):
    monkeypatch.setenv(graph_step.GRAPHS_ENV, "0")
    model = harness.non_degenerate(harness.tiny_hf_model("bart"))
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    _, _, report = harness.assert_same_generation(model, inputs, with_report=True, num_beams=2, max_new_tokens=5)
    assert not any("static shapes" in note for note in report.ran.get("lean_step", []))


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["beam4", "beam4-early-eos", "greedy"])
def test_cuda_graphs_equal_the_eager_step_in_fp32(family, case, monkeypatch):
    model = harness.non_degenerate(harness.tiny_hf_model(family)).cuda()
    inputs = {k: v.cuda() for k, v in harness.tiny_inputs(model, batch=3, length=10).items()}
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1")
    kwargs = dict(return_dict_in_generate=True, output_scores=True, **CASES[case])
    monkeypatch.setenv(graph_step.GRAPHS_ENV, "0")
    with torch.no_grad():
        eager = model.generate(**inputs, **kwargs)
    monkeypatch.setenv(graph_step.GRAPHS_ENV, "1")
    with fastgen.report() as report, torch.no_grad():
        graphed = model.generate(**inputs, **kwargs)
    notes = report.ran.get("lean_step", [])
    assert any(note.startswith("decode step: CUDA graphs (") for note in notes), notes
    assert torch.equal(graphed.sequences, eager.sequences)
    for ours, theirs in zip(graphed.scores, eager.scores, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    _, _, report = harness.assert_same_generation(model, inputs, with_report=True, **CASES[case])


def test_a_pinned_layer_reorders_in_place_as_an_unpinned_one_does():
    from transformers.cache_utils import DynamicLayer

    generator = torch.Generator().manual_seed(0)
    plain = DynamicLayer()
    plain.update(torch.randn(6, 2, 5, 4, generator=generator), torch.randn(6, 2, 5, 4, generator=generator))
    swapping, pinned = lean_step.GrowingLayer(plain), lean_step.GrowingLayer(plain)
    pinned.reserve(40)
    pinned.pin()
    address = pinned.key_buffer.data_ptr()
    for indices in (torch.tensor([5, 5, 0, 1, 3, 2]), torch.tensor([1, 0, 2, 2, 4, 5]), torch.tensor([0, 3, 4])):
        swapping.reorder_cache(indices)
        pinned.reorder_cache(indices)
        assert torch.equal(swapping.keys, pinned.keys) and torch.equal(swapping.values, pinned.values)
        assert pinned.pinned and len(pinned._buffers) == 2
    assert pinned.key_buffer.data_ptr() != address  # fewer rows: new buffers, pinned there
    address = pinned.key_buffer.data_ptr()
    pinned.reorder_cache(torch.tensor([2, 1, 0]))
    swapping.reorder_cache(torch.tensor([2, 1, 0]))
    assert pinned.key_buffer.data_ptr() == address and torch.equal(swapping.keys, pinned.keys)


@pytest.mark.parametrize("num_beams", [3, 1])
def test_buffers_that_double_as_the_cache_grows_give_upstreams_tokens(num_beams, static_on_cpu, monkeypatch):
    """A length limit past FULL_LIMIT: the buffers double as the cache grows (new buffers, zeroed, pinned)."""
    monkeypatch.setattr(graph_step, "FULL_LIMIT", 8)
    grown = []
    reserve = lean_step.GrowingLayer.reserve

    def recording_reserve(layer, new):
        before = layer.key_buffer.shape[0]
        reserve(layer, new)
        if layer.key_buffer.shape[0] != before:
            grown.append(layer.key_buffer.shape[0])

    monkeypatch.setattr(lean_step.GrowingLayer, "reserve", recording_reserve)
    model = harness.non_degenerate(harness.tiny_hf_model("mbart"))
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    harness.assert_same_generation(model, inputs, num_beams=num_beams, min_new_tokens=40, max_new_tokens=40)
    assert grown and max(grown) >= 41  # started at 33 positions, grew to hold the 41 of the call
