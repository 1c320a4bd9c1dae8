"""The approximate modes' beam step: candidates straight from the logits (fused log-softmax and top-k).

What is asserted: in ``int8`` and ``fast_gemm`` a beam search takes its candidates from
:func:`fastgen.ops.beam_topk.approximate_top_k` and returns the tokens the ordinary step (``log_softmax``,
``+ scores``, top-k) returns on the same logits; the exact mode, a call with a processor that writes into the
log-probs (n-gram bans) and a call that returns per-step scores keep the ordinary step.
"""

import pytest
import torch

import fastgen
from fastgen.ops import beam_topk, cpu_kernels
from fastgen.optimizer import registry
from fastgen.optimizer.transformers import beam_search
from tests import harness

DEFAULT_FEATURES = sorted(set(registry.known_features()) - registry.OPT_IN_FEATURES)
NOTE = "beam scores: log-softmax and top-k fused (approximate mode, C++)"
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=str(cpu_kernels.unavailable_reason()))
KWARGS = dict(max_new_tokens=10, num_beams=4, early_stopping=False, no_repeat_ngram_size=0)


def _inputs(model):
    inputs = harness.tiny_inputs(model, batch=3)
    inputs["attention_mask"][1, -3:] = 0  # padding: inputs of different lengths
    return inputs


def _generate(model, inputs, features, **kwargs):
    with fastgen.patched(features), fastgen.report() as report, torch.inference_mode():
        return model.generate(**inputs, **(KWARGS | kwargs)), report


def _counting(monkeypatch):
    calls = []
    original = beam_search.approximate_top_k

    def counted(*args):
        result = original(*args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(beam_search, "approximate_top_k", counted)
    return calls


@pytest.mark.parametrize("mode", ["int8", "fast_gemm"])
@pytest.mark.parametrize("family", ["bart", "marian"])
def test_approximate_modes_take_the_fused_step_with_the_ordinary_steps_tokens(mode, family, monkeypatch):
    if harness.feature_unavailable(mode):
        pytest.skip(harness.feature_unavailable(mode))
    model = harness.tiny_hf_model(family)
    inputs = _inputs(model)
    calls = _counting(monkeypatch)
    fused, report = _generate(model, inputs, [*DEFAULT_FEATURES, mode])
    assert NOTE in report.ran.get(beam_search.FEATURE, []), report
    assert calls and all(calls)  # every step took the fused candidates
    monkeypatch.setattr(beam_search, "approximate_top_k", lambda *args: None)  # the ordinary step
    ordinary, report = _generate(model, inputs, [*DEFAULT_FEATURES, mode])
    assert torch.equal(fused, ordinary)
    assert len(set(map(tuple, fused.tolist()))) > 1  # the inputs' outputs differ: a non-degenerate model


def test_exact_mode_keeps_the_ordinary_step(monkeypatch):
    model = harness.tiny_hf_model("bart")
    calls = _counting(monkeypatch)
    _, report = _generate(model, _inputs(model), DEFAULT_FEATURES)
    assert not calls and NOTE not in report.ran.get(beam_search.FEATURE, [])


@pytest.mark.parametrize(
    "kwargs", [dict(no_repeat_ngram_size=2), dict(return_dict_in_generate=True, output_scores=True)]
)
def test_processors_and_returned_scores_keep_the_ordinary_step(kwargs, monkeypatch):
    if harness.feature_unavailable("int8"):
        pytest.skip(harness.feature_unavailable("int8"))
    model = harness.tiny_hf_model("bart")
    calls = _counting(monkeypatch)
    _, report = _generate(model, _inputs(model), [*DEFAULT_FEATURES, "int8"], **kwargs)
    assert not calls and NOTE not in report.ran.get(beam_search.FEATURE, [])


def test_the_kernel_declines_a_nan_step_and_the_step_still_runs():
    logits = torch.randn(8, 50)
    logits[3, 7] = float("nan")
    assert beam_topk.approximate_top_k(logits, torch.zeros(2, 4), 8) is None
