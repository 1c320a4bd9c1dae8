"""``exact_linear``: bit for bit ``F.linear``, whatever form the calibration keeps.

Small block sizes stand in for the real ones so that tiny weights exercise the blocked path; the
calibration's own identity check decides, as it does at real shapes. No timings are asserted:
where a test needs a particular choice it replaces :func:`fastgen.ops.linear.pick`. The ordered kernel's
forms are kept out here (``tests/ops/test_exact_gemm.py`` tests them).
"""

import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen.ops import linear


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(linear, "BLOCK_SIZES", (8, 32, 64))
    monkeypatch.setattr(linear, "CALIBRATE_AFTER", 1)
    monkeypatch.setattr(linear, "MIN_OUT_FEATURES", 16)
    monkeypatch.setattr(linear, "TRIAL_CALLS", 0)  # the kept form serves at once (its trial: test_linear.py)
    monkeypatch.setattr(linear, "ordered_kernel", lambda: None)
    linear.forget_choices()
    yield
    linear.forget_choices()


def prefer_blocked(monkeypatch):
    """Keep the first identical blocked candidate whatever the timings say (forces the blocked path)."""
    monkeypatch.setattr(linear, "pick", lambda medians: next((n for n in medians if n != "linear"), "linear"))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    out_features=st.sampled_from([16, 33, 96, 130, 257]),
    in_features=st.sampled_from([8, 32, 48]),
    bias=st.booleans(),
    leading=st.sampled_from([(), (1,), (2,)]),
    seed=st.integers(0, 2**16),
)
def test_equals_f_linear_on_calibration_and_later_inputs(rows, out_features, in_features, bias, leading, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    shape = (*leading, rows, in_features) if leading else (rows, in_features)
    for _ in range(3):  # the first call calibrates, the others run the kept form on new values
        x = torch.randn(shape, generator=generator) * 10
        result = linear.exact_linear(x, weight, b)
        expected = F.linear(x, weight, b)
        assert result.shape == expected.shape and torch.equal(result, expected)


def test_forced_blocked_form_is_identical_and_remembered(monkeypatch):
    prefer_blocked(monkeypatch)
    weight = torch.randn(257, 48)
    x = torch.randn(16, 1, 48)
    assert torch.equal(linear.exact_linear(x, weight), F.linear(x, weight))
    choice = linear.choice_for(x, weight)
    assert choice is not None and choice.block is not None, choice
    for seed in range(5):
        x = torch.randn(16, 1, 48, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(linear.exact_linear(x, weight), F.linear(x, weight))
    assert len(linear.choices()) == 1


def test_candidates_with_other_bits_are_dropped(monkeypatch):
    """Blocks of 8 columns give other bits than one GEMM at 6+ rows here (MKL picks another kernel)."""
    prefer_blocked(monkeypatch)
    monkeypatch.setattr(linear, "BLOCK_SIZES", (8,))
    weight = torch.randn(96, 32)
    x = torch.randn(16, 32)
    blocked = linear._blocked(x, weight, None, 8)
    if torch.equal(blocked, F.linear(x, weight)):
        pytest.skip("this BLAS gives the same bits for blocks of 8: nothing to drop")
    assert torch.equal(linear.exact_linear(x, weight), F.linear(x, weight))
    choice = linear.choice_for(x, weight)
    assert choice.form == "linear" and choice.not_identical == ("blocked8",)


def test_pick_keeps_f_linear_unless_a_candidate_is_clearly_faster():
    assert linear.pick({"linear": 10.0}) == "linear"
    assert linear.pick({"linear": 10.0, "blocked512": 11.0}) == "linear"
    assert linear.pick({"linear": 10.0, "blocked512": 9.9}) == "linear"  # within MIN_GAIN: not worth it
    assert linear.pick({"linear": 10.0, "blocked512": 8.0, "blocked1024": 9.0}) == "blocked512"


def test_calibration_keeps_f_linear_when_blocking_is_slower(monkeypatch):
    slow = linear._blocked

    def slower(*args):
        import time

        time.sleep(0.002)
        return slow(*args)

    monkeypatch.setattr(linear, "_blocked", slower)
    weight = torch.randn(96, 32)
    x = torch.randn(4, 32)
    assert torch.equal(linear.exact_linear(x, weight), F.linear(x, weight))
    choice = linear.choice_for(x, weight)
    assert choice.form == "linear" and choice.block is None and "linear" in choice.times_ms


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda x, w: (x.double(), w.double()), "not float32"),
        (lambda x, w: (x.bfloat16(), w.bfloat16()), "not float32"),
        (lambda x, w: (x, w.requires_grad_()), "autograd"),
        (lambda x, w: (x.t().contiguous().t(), w), "non-contiguous tensors"),
        (lambda x, w: (x[0], w), "shapes F.linear must judge"),
        (lambda x, w: (x, w[:8]), "too few output features to block"),
    ],
)
def test_unsupported_calls_run_f_linear(monkeypatch, make, reason):
    prefer_blocked(monkeypatch)
    x, weight = make(torch.randn(6, 32), torch.randn(96, 32))
    assert linear.unsupported(x, weight, None) == reason
    assert torch.equal(linear.exact_linear(x, weight), F.linear(x, weight))
    assert linear.choices() == {}


def test_compiled_caller_traces_f_linear_without_graph_breaks(monkeypatch):
    prefer_blocked(monkeypatch)
    weight = torch.randn(96, 32)
    x = torch.randn(8, 32)

    def project(x):
        return linear.exact_linear(x, weight) * 2

    explanation = torch._dynamo.explain(project)(x)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(project, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), F.linear(x, weight) * 2)
    assert linear.choices() == {}  # nothing calibrated inside the trace


def test_a_key_runs_f_linear_until_it_has_been_seen_often_enough(monkeypatch):
    prefer_blocked(monkeypatch)
    monkeypatch.setattr(linear, "CALIBRATE_AFTER", 4)
    weight = torch.randn(96, 32)
    x = torch.randn(16, 32)
    for _ in range(3):
        assert torch.equal(linear.exact_linear(x, weight), F.linear(x, weight))
        assert linear.choice_for(x, weight) is None
    assert linear.choice_for(torch.randn(8, 32), weight) is None  # another row count: its own key
    assert torch.equal(linear.exact_linear(x, weight), F.linear(x, weight))
    assert linear.choice_for(x, weight) is not None


def _trial_key(monkeypatch, slow_in_place: bool, verdict=linear.pick):
    """Calibrate a key whose blocked candidate the calibration keeps, then let its trial judge it in place
    (2 ms slower there when ``slow_in_place``, on a clock of the test's: no real timing decides) with ``verdict``
    as the trial's pick."""
    monkeypatch.setattr(linear, "TRIAL_CALLS", 3)
    calibrating = [True]
    monkeypatch.setattr(linear, "pick", lambda m: next(n for n in m if n != "linear") if calibrating[0] else verdict(m))
    clock = [0.0]
    monkeypatch.setattr(linear, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    fast = linear._blocked
    slowed = []

    def in_place(*args):
        if not calibrating[0]:
            slowed.append(1)
            clock[0] += 0.002 if slow_in_place else 0.0
        return fast(*args)

    monkeypatch.setattr(linear, "_blocked", in_place)
    weight = torch.randn(257, 48)
    x = torch.randn(16, 48)
    assert torch.equal(linear.exact_linear(x, weight), F.linear(x, weight))
    calibrating[0] = False
    choice = linear.choice_for(x, weight)
    assert choice.block is not None and choice.trial is not None
    for seed in range(8):  # 3 calls of each form, alternating, then the verdict; the same bits throughout
        x = torch.randn(16, 48, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(linear.exact_linear(x, weight), F.linear(x, weight))
    return linear.choice_for(x, weight), len(slowed)


def test_a_candidate_slower_in_place_than_calibrated_goes_back_to_f_linear(monkeypatch):
    choice, candidate_calls = _trial_key(monkeypatch, slow_in_place=True)
    assert choice.form == "linear" and choice.trial is None
    (candidate,) = set(choice.in_place_ms) - {"linear"}
    assert candidate_calls == 3 and choice.in_place_ms == pytest.approx({"linear": 0.0, candidate: 2.0})


def test_a_candidate_that_keeps_up_in_place_stays(monkeypatch):
    keep = lambda medians: next(n for n in medians if n != "linear")  # noqa: E731 (no timing decides here)
    choice, candidate_calls = _trial_key(monkeypatch, slow_in_place=False, verdict=keep)
    assert choice.block is not None and choice.trial is None and set(choice.in_place_ms) == {"linear", choice.form}
    assert candidate_calls == 3 + 2  # its 3 trial calls, then it serves the 2 calls left
