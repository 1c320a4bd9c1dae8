"""The compiled decode step (fastgen.models.compiled_step, csrc/cpu/decoder_step.cpp): the Python lean step's bits.

In every mode (int8 on fastgen's own kernels, on oneDNN's or on a mix; exact; fast_gemm), ``generate`` with
``FASTGEN_COMPILED_STEP=1`` must return exactly what it returns with ``=0`` (the Python lean step, itself upstream's
step op for op): every step's scores ``torch.equal``, the tokens and sequence scores too, over beam search
(beam-shared cross K/V), greedy, sampling with a seed, padded inputs, inputs that finish at different steps and a
generation long enough to grow the self-attention buffers. The report says which step ran; anything the program does
not reproduce (fbgemm's int8 weights, hooks on a module of the step, the switch) keeps the Python step.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import fastgen
from fastgen.models import compiled_step, lean_step
from fastgen.ops import fast_linear, int8_linear, linear
from fastgen.optimizer import linear_modes
from tests import harness

pytestmark = [harness.requires_feature("beam"), harness.requires_feature("int8")]

FAMILIES = ("bart", "marian", "mbart", "pegasus")
COMPILED = "decode step: compiled (C++)"


def _own_int8_kinds() -> list[str]:
    return [
        kind for kind, ready in (("vnni", int8_linear.has_vnni_kernel), ("amx", int8_linear.has_amx_kernel)) if ready()
    ]


@pytest.fixture(
    params=[
        "int8-vnni",
        "int8-amx",
        "int8-onednn",
        "int8-mixed",
        "exact",
        "exact-ordered",
        "fast-packed",
        "fast-timed",
        "fast-mkl",
        "exact-mkl",
    ]
)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The features of one mode the program reproduces: int8 on fastgen's own op of one kind (skipped where the CPU has
    none), on oneDNN, or mixed (``auto``'s choice at each weight's first product alternating between oneDNN and
    an own op, as on a CPU where each wins some shapes); the exact mode with its calibration settled at a step's
    first product (``exact-ordered``: every linear whose bits some order reproduces keeps the ordered kernel,
    whatever the timings say; ``exact-mkl``: MKL's packed form wherever its bits are F.linear's); ``fast_gemm``
    with every linear packed, timed against the exact form at its first product, or on MKL's packed sgemm wherever
    the timing offers it (``fast-mkl``)."""
    name = request.param
    if name.startswith("fast"):
        if fast_linear.unavailable() is not None:
            pytest.skip(fast_linear.unavailable())
        monkeypatch.setattr(fast_linear, "CALIBRATE_AFTER", 1)
        monkeypatch.setattr(linear, "CALIBRATE_AFTER", 1)
        monkeypatch.setattr(linear, "TRIAL_CALLS", 0)
        if name == "fast-packed":
            monkeypatch.setattr(fast_linear, "MAX_CALIBRATION_MACS", 0)  # never timed: packed
        if name == "fast-mkl":
            if fast_linear.mkl_unavailable() is not None:
                pytest.skip(fast_linear.mkl_unavailable())
            monkeypatch.setattr(fast_linear, "_kept", lambda choice: "mkl" if "mkl" in choice else min(choice))
        fast_linear.forget_packed()
        linear.forget_choices()
        yield ("fast_gemm",)
        fast_linear.forget_packed()
        linear.forget_choices()
        return
    if name.startswith("int8"):
        kind = name.removeprefix("int8-")
        if kind == "mixed":
            if not _own_int8_kinds() or int8_linear.backend() != "auto":
                pytest.skip("int8's auto backend has no own op to mix with oneDNN on this CPU")
            picks = itertools.cycle(["onednn", _own_int8_kinds()[0]])
            monkeypatch.setattr(int8_linear, "preferred_kind", lambda choice_ms: next(picks))
            monkeypatch.delenv(int8_linear.BACKEND_ENV, raising=False)
        elif kind == "onednn" and not int8_linear._has_onednn():
            pytest.skip("no oneDNN int8 op in this torch build")
        elif kind != "onednn" and kind not in _own_int8_kinds():
            pytest.skip(f"no {kind} int8 op on this CPU")
        else:
            monkeypatch.setenv(int8_linear.BACKEND_ENV, kind)
        linear_modes.forget_int8()
        yield ("int8",)
        linear_modes.forget_int8()
        return
    monkeypatch.setattr(linear, "CALIBRATE_AFTER", 1)
    monkeypatch.setattr(linear, "TRIAL_CALLS", 0)
    if name == "exact-mkl":
        if linear.mkl_op() is None:
            pytest.skip("no MKL packed sgemm with fastgen's kernels here")
        monkeypatch.setattr(linear, "pick", lambda medians: "mkl" if "mkl" in medians else "linear")
    if name == "exact-ordered":
        if linear.ordered_kernel() is None:
            pytest.skip("fastgen's ordered kernel is not loaded")
        monkeypatch.setattr(
            linear, "pick", lambda medians: min(medians, key=lambda form: not form.startswith("ordered"))
        )
    linear.forget_choices()
    yield ()
    linear.forget_choices()


_models: dict[str, object] = {}


def _model(family: str):
    """A tiny model with 64-wide heads (fastgen's CPU attention takes beam-grouped queries at that size)."""
    if family not in _models:
        model = harness.tiny_hf_model(family, d_model=128, encoder_attention_heads=2, decoder_attention_heads=2)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():  # biases start at zero, where "bias first" and "bias last" orders look alike
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
            if hasattr(model, "final_logits_bias"):
                model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=generator))
        _models[family] = harness.non_degenerate(model)
    return _models[family]


DEFAULT = sorted(set(fastgen.known_features()) - fastgen.optimizer.registry.OPT_IN_FEATURES)


def _generate(model, inputs, compiled: bool, monkeypatch, features=("int8",), **kwargs):
    monkeypatch.setenv(compiled_step.ENV, "1" if compiled else "0")
    with fastgen.patched([*DEFAULT, *features]), fastgen.report() as report, torch.no_grad():
        torch.manual_seed(0)
        out = model.generate(**inputs, return_dict_in_generate=True, output_scores=True, **kwargs)
    return out, report


def _assert_identical(ours, theirs):
    assert torch.equal(ours.sequences, theirs.sequences)
    if getattr(theirs, "sequences_scores", None) is not None:
        assert torch.equal(ours.sequences_scores, theirs.sequences_scores)
    for a, b in zip(ours.scores, theirs.scores, strict=True):  # every step's log-probabilities
        assert torch.equal(a, b)


CASES = {
    "beam4": dict(num_beams=4, max_new_tokens=8),
    "beam3-ngram2-two-returned": dict(num_beams=3, no_repeat_ngram_size=2, num_return_sequences=2, max_new_tokens=8),
    "beam4-early-eos": dict(num_beams=4, max_new_tokens=10, eos_token_id=[harness.EOS, 7, 11], length_penalty=0.5),
    "greedy": dict(max_new_tokens=8),
    "sampling": dict(do_sample=True, top_k=20, max_new_tokens=8),
    "beam2-past-the-buffer": dict(num_beams=2, max_new_tokens=40, min_new_tokens=40),
}


def _in_ci(family: str, case: str) -> bool:
    return family == "bart" or case in ("beam4", "greedy")


@pytest.mark.parametrize(("family", "case"), harness.family_case_grid(FAMILIES, CASES, _in_ci))
def test_the_compiled_step_returns_the_python_steps_bits(family, case, mode, monkeypatch):
    model = _model(family)
    inputs = harness.tiny_inputs(model, batch=3, length=10)  # padded: a cross-attention mask
    python, _ = _generate(model, inputs, False, monkeypatch, features=mode, **CASES[case])
    compiled, report = _generate(model, inputs, True, monkeypatch, features=mode, **CASES[case])
    assert COMPILED in report.ran.get("lean_step", []), report
    _assert_identical(compiled, python)


@pytest.mark.parametrize("mode", ["fast-mkl"], indirect=True)
def test_fast_gemm_on_mkls_packed_sgemm_runs_in_the_program(mode, monkeypatch):
    """The program's MKL kind: every decoder product on MKL's packed sgemm, the Python step's bits."""
    model = _model("bart")
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    python, _ = _generate(model, inputs, False, monkeypatch, features=mode, num_beams=3, max_new_tokens=8)
    compiled, report = _generate(model, inputs, True, monkeypatch, features=mode, num_beams=3, max_new_tokens=8)
    assert COMPILED in report.ran.get("lean_step", []), report
    kept = {fast_linear.settled_form(torch.empty(*key[:2]), key[2]) for key in fast_linear.choices()}
    assert kept == {"mkl"}
    _assert_identical(compiled, python)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["exact", "exact-ordered", "exact-mkl"], indirect=True)
def test_the_exact_modes_compiled_step_equals_upstream(family, mode, monkeypatch, request):
    model = _model(family)
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    monkeypatch.setenv(compiled_step.ENV, "1")
    _, _, report = harness.assert_same_generation(model, inputs, with_report=True, num_beams=3, max_new_tokens=8)
    assert COMPILED in report.ran.get("lean_step", []), report
    if request.node.callspec.params["mode"] == "exact-ordered":
        assert any(choice.order is not None for choice in linear.choices().values())
    if request.node.callspec.params["mode"] == "exact-mkl":
        assert any(choice.mkl for choice in linear.choices().values())


def test_finished_inputs_leave_the_batch_under_the_compiled_step(mode, monkeypatch):
    """Without per-step scores fastgen's beam loop drops finished inputs: the program sees fewer rows."""
    model = _model("bart")
    inputs = harness.tiny_inputs(model, batch=4, length=10)
    kwargs = dict(num_beams=3, max_new_tokens=16, eos_token_id=list(range(3, 30)), early_stopping=True)
    outs = []
    for compiled in (False, True):
        monkeypatch.setenv(compiled_step.ENV, "1" if compiled else "0")
        with fastgen.patched([*DEFAULT, *mode]), fastgen.report() as report, torch.no_grad():
            outs.append(model.generate(**inputs, **kwargs))
    assert "finished inputs left the batch" in report.ran.get("beam", [])
    assert COMPILED in report.ran.get("lean_step", [])
    assert torch.equal(outs[0], outs[1])


def _python_reason(report) -> str:
    entries = [entry for entry in report.ran.get("lean_step", []) if entry.startswith("decode step: Python")]
    assert entries and COMPILED not in report.ran.get("lean_step", []), report
    return entries[0]


def test_a_later_call_runs_its_first_step_in_the_program(mode, monkeypatch):
    """The first call's first step runs in Python (its linears choose their ops there); a later call of the same
    model finds them chosen and runs its first step in the program too: the same bits as the Python step (in the
    int8 mode on one row per input, each input's hypotheses being copies of one row then)."""
    model = _model("bart")
    inputs = harness.tiny_inputs(model, batch=3, length=10)
    settings = dict(num_beams=4, max_new_tokens=6)
    python, _ = _generate(model, inputs, False, monkeypatch, features=mode, **settings)
    first_steps = []
    original = lean_step.LeanDecodeStep._compiled_first_step

    def spy(self, *args):
        logits = original(self, *args)
        first_steps.append(logits is not None)
        return logits

    shared = []
    rows_of = lean_step._shared_first_rows
    monkeypatch.setattr(lean_step, "_shared_first_rows", lambda *args: shared.append(rows_of(*args)) or shared[-1])
    monkeypatch.setattr(lean_step.LeanDecodeStep, "_compiled_first_step", spy)
    compiled, report = _generate(model, inputs, True, monkeypatch, features=mode, **settings)
    assert COMPILED in report.ran.get("lean_step", []) and first_steps == [True]
    _assert_identical(compiled, python)
    # int8's program serves any row count: its first step ran one row per input (the 4 beams' copies after it)
    assert shared == ([4] if "int8" in mode else [])


def test_int8_weights_on_fbgemm_keep_the_python_step(monkeypatch):
    if not int8_linear._has_fbgemm():
        pytest.skip("no fbgemm int8 op in this torch build")
    monkeypatch.setenv(int8_linear.BACKEND_ENV, "fbgemm")
    linear_modes.forget_int8()
    try:
        model = _model("bart")
        inputs = harness.tiny_inputs(model, batch=2, length=8)
        _, report = _generate(model, inputs, True, monkeypatch, num_beams=2, max_new_tokens=4)
    finally:
        linear_modes.forget_int8()
    assert "an int8 weight on the fbgemm path" in _python_reason(report)


def test_the_switch_keeps_the_python_step(monkeypatch):
    model = _model("bart")
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    _, report = _generate(model, inputs, False, monkeypatch, num_beams=2, max_new_tokens=4)
    assert compiled_step.ENV in _python_reason(report)


def test_a_hook_on_a_linear_keeps_the_python_step_and_sees_every_step(monkeypatch):
    model = _model("bart")
    calls = []
    handle = model.get_decoder().layers[0].fc1.register_forward_hook(lambda *args: calls.append(1))
    try:
        inputs = harness.tiny_inputs(model, batch=2, length=8)
        out, report = _generate(model, inputs, True, monkeypatch, num_beams=2, max_new_tokens=4)
    finally:
        handle.remove()
    assert "hooks on a module of the step" in _python_reason(report)
    assert len(calls) == out.sequences.shape[1] - 1  # every decoder call, the first (upstream's forward) included


def test_beams_wider_than_the_kernel_takes_keep_the_python_step(monkeypatch):
    """16-wide heads with 4 beams: fastgen's CPU attention leaves the grouped cross-attention to SDPA, which the
    program does not run, so every step stays Python's (and the report says the program was built)."""
    model = harness.non_degenerate(harness.tiny_hf_model("bart"))
    assert model.config.d_model // model.config.decoder_attention_heads not in (64, 128)
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    python, _ = _generate(model, inputs, False, monkeypatch, num_beams=4, max_new_tokens=5)
    compiled, _ = _generate(model, inputs, True, monkeypatch, num_beams=4, max_new_tokens=5)
    _assert_identical(compiled, python)


def _program_stand_in(head_dim: int, approximate: bool) -> compiled_step.CompiledStep:
    step = object.__new__(compiled_step.CompiledStep)
    step.head_dim, step.approximate = head_dim, approximate
    return step


class _Layer:
    def __init__(self, length: int) -> None:
        self.length = length


def test_what_a_step_must_be_for_the_program():
    keys = torch.zeros(4, 2, 10, 16)  # 4 inputs, 2 heads, 10 source positions, 16-wide heads
    exact, fast = _program_stand_in(16, False), _program_stand_in(16, True)
    with torch.enable_grad():
        assert not exact.takes(16, keys, None)
    with torch.no_grad():  # as in generate
        _assert_takes(exact, fast, keys)


def _assert_takes(exact, fast, keys):
    assert exact.takes(16, keys, None, [_Layer(3), _Layer(3)])
    assert not exact.takes(16, keys, None, [_Layer(3), _Layer(4)])  # layers of different lengths
    assert not fast.takes(16, keys, None)  # 4 beams of 16-wide heads: the kernel leaves them to SDPA
    assert fast.takes(4, keys, None) and _program_stand_in(64, True).takes(16, keys, None)
    assert not exact.takes(15, keys, None)  # rows not a multiple of the inputs
    for mask, taken in [
        (torch.zeros(4, 1, 1, 10, dtype=torch.bool), True),
        (torch.zeros(1, 2, 1, 10), True),
        (torch.zeros(16, 1, 1, 10), False),  # one row per hypothesis
        (torch.zeros(4, 1, 3, 10), False),
        (torch.zeros(4, 1, 1, 9), False),
        (torch.zeros(4, 1, 1, 10, dtype=torch.float64), False),
    ]:
        assert exact.takes(16, keys, mask) is taken, mask.shape


def test_a_call_whose_linears_never_settle_stops_trying_and_keeps_the_python_step(monkeypatch):
    from fastgen.models import lean_step

    builds = []
    original = compiled_step.CompiledStep.__init__

    def counted(self, *args):
        builds.append(1)
        original(self, *args)

    monkeypatch.setattr(compiled_step.CompiledStep, "__init__", counted)
    monkeypatch.setattr(linear, "settled_form", lambda *args: None)  # every exact key still calibrating
    monkeypatch.setattr(lean_step, "MAX_PROGRAM_TRIES", 5)
    model = _model("bart")
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    python, _ = _generate(model, inputs, False, monkeypatch, features=(), num_beams=2, max_new_tokens=12)
    builds.clear()
    ours, report = _generate(model, inputs, True, monkeypatch, features=(), num_beams=2, max_new_tokens=12)
    assert len(builds) == 5
    assert COMPILED not in report.ran.get("lean_step", [])
    _assert_identical(ours, python)


def test_a_new_row_count_re_sets_only_the_linears_whose_form_changed(monkeypatch):
    """Inputs leaving the batch change the row count: the program keeps every linear whose settled form is the same
    and is handed only the others; a form not settled yet makes the caller build anew."""
    weights = [torch.randn(4, 4) for _ in range(3)]
    forms = {16: ["a", "a", "a"], 12: ["a", "b", "a"], 8: ["a", "b", None]}

    def fake_op(module, rows):
        form = forms[rows][module]
        return compiled_step.NOT_SETTLED if form is None else (0 if form == "a" else 3, weights[module].detach(), None)

    monkeypatch.setattr(compiled_step, "_exact_op", fake_op)
    calls = []
    step = compiled_step.CompiledStep.__new__(compiled_step.CompiledStep)
    step.program = type("Program", (), {"set_linear": lambda self, *args: calls.append(args)})()
    step.approximate, step.rows, step._linears = False, 16, [0, 1, 2]
    step._ops = [fake_op(i, 16) for i in range(3)]
    assert step.retarget(12) and step.rows == 12
    assert [args[0] for args in calls] == [1] and calls[0][1] == 3
    assert not step.retarget(8)
