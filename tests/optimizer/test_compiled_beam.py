"""The compiled beam step (fastgen.optimizer.transformers.compiled_beam): the long way's results, step for step.

With the lean step's C++ program, the fused candidates and the native bookkeeping, the beam loop runs a batch's
later steps as four native calls. ``generate`` must return exactly what it returns with ``FASTGEN_COMPILED_BEAM=0``
(every step the long way: ``prepare_inputs_for_generation``, the lean step, the loop's own calls): the sequences,
over inputs that finish at different steps and leave the batch (the short way starts again
after each), padded inputs, end-of-sequence lists, every ``early_stopping`` setting, a length penalty, more than
one returned sequence, a processor that writes on some steps only, and logits the fused candidates refuse.
"""

from __future__ import annotations

import pytest
import torch

import fastgen
from fastgen.models import lean_step
from fastgen.ops import cpu_kernels, fast_linear
from fastgen.optimizer import linear_modes
from fastgen.optimizer.transformers import compiled_beam
from tests import harness

pytestmark = [harness.requires_feature("beam"), harness.requires_feature("int8")]

DEFAULT = sorted(set(fastgen.known_features()) - fastgen.optimizer.registry.OPT_IN_FEATURES)
EOS_LIST = list(range(3, 30))  # a quarter of the vocabulary ends a hypothesis: inputs finish at different steps

CASES = {
    "leaving-early-stopping": dict(num_beams=3, max_new_tokens=16, eos_token_id=EOS_LIST, early_stopping=True),
    "heuristic-length-penalty": dict(num_beams=4, max_new_tokens=12, eos_token_id=EOS_LIST, length_penalty=0.5),
    "never": dict(num_beams=3, max_new_tokens=12, eos_token_id=EOS_LIST, early_stopping="never"),
    "two-returned": dict(num_beams=3, max_new_tokens=12, eos_token_id=EOS_LIST, num_return_sequences=2),
    "min-new-tokens": dict(num_beams=2, max_new_tokens=20, min_new_tokens=6, eos_token_id=EOS_LIST),
    "to-the-limit": dict(num_beams=4, max_new_tokens=40),
}

_models: dict[str, object] = {}


def _model():
    """A tiny BART with 64-wide heads (fastgen's CPU attention, and so the C++ step, takes beam-grouped queries)."""
    if "bart" not in _models:
        model = harness.tiny_hf_model("bart", d_model=128, encoder_attention_heads=2, decoder_attention_heads=2)
        _models["bart"] = harness.non_degenerate(model)
    return _models["bart"]


@pytest.fixture(params=["int8", "fast_gemm"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """int8 (auto's ops), or ``fast_gemm`` with every linear packed at its first product (never timed, so that its
    program, built per row count, serves from the first step at each)."""
    if request.param == "fast_gemm":
        if fast_linear.unavailable() is not None:
            pytest.skip(fast_linear.unavailable())
        monkeypatch.setattr(fast_linear, "CALIBRATE_AFTER", 1)
        monkeypatch.setattr(fast_linear, "MAX_CALIBRATION_MACS", 0)
    linear_modes.forget_int8()
    fast_linear.forget_packed()
    yield request.param
    linear_modes.forget_int8()
    fast_linear.forget_packed()


class _Spy:
    """Counts the short way's steps (and those it handed back) and the lean step's readiness checks after a drop."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps = self.handed_back = self.asked_after_drop = self.ready_after_drop = 0
        step, ready = compiled_beam.CompiledBeamStep.step, lean_step.LeanDecodeStep.compiled_ready

        def counted_step(this, *args):
            logits = step(this, *args)
            self.steps += 1
            self.handed_back += logits is not None
            return logits

        def counted_ready(this, *args):
            answer = ready(this, *args)
            self.asked_after_drop += 1
            self.ready_after_drop += answer
            return answer

        monkeypatch.setattr(compiled_beam.CompiledBeamStep, "step", counted_step)
        monkeypatch.setattr(lean_step.LeanDecodeStep, "compiled_ready", counted_ready)


def _generate(model, inputs, short: bool, mode: str, monkeypatch: pytest.MonkeyPatch, **kwargs):
    monkeypatch.setenv(compiled_beam.ENV, "1" if short else "0")
    with fastgen.patched([*DEFAULT, mode]), fastgen.report() as report, torch.no_grad():
        out = model.generate(**inputs, **kwargs)  # sequences only: a returned cache or scores keep every input
    return out, report


def _assert_identical(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("case", CASES)
def test_the_short_way_returns_the_long_ways_results(case, mode, monkeypatch):
    model = _model()
    inputs = harness.tiny_inputs(model, batch=4, length=10)  # padded: a cross-attention mask
    long, _ = _generate(model, inputs, False, mode, monkeypatch, **CASES[case])
    spy = _Spy(monkeypatch)
    short, report = _generate(model, inputs, True, mode, monkeypatch, **CASES[case])
    _assert_identical(short, long)
    assert spy.steps > 0 and spy.handed_back == 0
    if "finished inputs left the batch" in report.ran.get("beam", []):
        assert spy.asked_after_drop > 0  # the short way asked to go on after inputs left


def test_inputs_leave_the_batch_on_the_short_way(monkeypatch):
    """int8's program serves any row count, so the short way goes on after inputs leave (``fast_gemm`` builds a
    program per row count, once its linears have settled their forms there: the long way until then)."""
    model = _model()
    inputs = harness.tiny_inputs(model, batch=4, length=10)
    kwargs = CASES["leaving-early-stopping"]
    spy = _Spy(monkeypatch)
    linear_modes.forget_int8()
    _, report = _generate(model, inputs, True, "int8", monkeypatch, **kwargs)
    assert "finished inputs left the batch" in report.ran.get("beam", [])
    assert spy.ready_after_drop > 0


def test_logits_the_fused_candidates_refuse_go_the_long_way(mode, monkeypatch):
    """The fused candidates refuse a step's logits (as for a NaN): the short way hands them back and the loop
    finishes that step on upstream's log-softmax, as the long way does at the same steps."""
    model = _model()
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    kwargs = dict(num_beams=4, max_new_tokens=10)
    if not cpu_kernels.available():
        pytest.skip("fastgen's CPU kernels are not available")
    fused = torch.ops.fastgen_cpu.log_softmax_top_k
    decisions: dict[bytes, bool] = {}  # per step's logits: every other step refused, the same ones in both runs

    def refusing_some(logits, scores, k):
        values, beams, tokens, ok = fused(logits, scores, k)
        refused = decisions.setdefault(logits.numpy().tobytes(), len(decisions) % 2 == 1)
        return values, beams, tokens, torch.tensor(bool(ok) and not refused)

    results = []
    for short in (False, True):
        decisions.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.ops.fastgen_cpu, "log_softmax_top_k", refusing_some)
            spy = _Spy(patch)
            results.append(_generate(model, inputs, short, mode, patch, **kwargs)[0])
    _assert_identical(results[1], results[0])
    assert spy.handed_back > 0 and spy.steps > spy.handed_back


def test_per_step_scores_and_the_exact_mode_keep_the_long_way(monkeypatch):
    model = _model()
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    spy = _Spy(monkeypatch)
    kwargs = dict(num_beams=3, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    _generate(model, inputs, True, "int8", monkeypatch, **kwargs)
    monkeypatch.setenv(compiled_beam.ENV, "1")
    with fastgen.patched(DEFAULT), torch.no_grad():
        model.generate(**inputs, num_beams=3, max_new_tokens=6)
    assert spy.steps == 0


def test_the_switch_keeps_the_long_way(monkeypatch):
    model = _model()
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    spy = _Spy(monkeypatch)
    _generate(model, inputs, False, "int8", monkeypatch, num_beams=3, max_new_tokens=6)
    assert spy.steps == 0
