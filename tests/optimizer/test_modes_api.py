"""One switch per mode: exact / fast / int8, spelled in Python, in the shell and on the command line.

Checked against the registry's own table (``known_features``, ``OPT_IN_FEATURES``): which features each
spelling selects, that the old spellings keep their meaning, that typos warn once (naming the known names)
and leave the defaults on, that a model's mode reaches fastgen's own loops, and that ``status()`` /
``python -m fastgen.info`` say the mode.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

import fastgen
from fastgen.ops import int8_linear
from fastgen.optimizer import registry
from tests import harness
from tests.conftest import HAS_FAIRSEQ

#: the spellings are checked through the Transformers patches they select, declared for 5.18+ (CI runs 5.15.1,
#: where they are skipped with a warning, which these tests would count)
pytestmark = [harness.requires_feature("int8"), harness.requires_feature("dedup")]

DEFAULTS = registry.default_features()
HAS_INT8 = int8_linear.unavailable() is None
needs_int8 = pytest.mark.skipif(not HAS_INT8, reason=str(int8_linear.unavailable()))


@pytest.fixture
def restore(monkeypatch: pytest.MonkeyPatch):
    """Leave the process-wide selection as it was; warnings counted afresh (they are said once)."""
    previous = registry._state.enabled_features
    monkeypatch.setattr(registry._state, "warned", set())
    for name in ("FASTGEN_MODE", "FASTGEN_FEATURES"):
        monkeypatch.delenv(name, raising=False)
    yield
    monkeypatch.delenv("FASTGEN_MODE", raising=False)
    monkeypatch.delenv("FASTGEN_FEATURES", raising=False)
    if previous is None:
        fastgen.disable()
    else:
        fastgen.enable(sorted(previous))


def _selected() -> set[str]:
    return set(registry._state.enabled_features or ())


def test_the_modes_are_the_defaults_plus_one_opt_in_feature():
    assert {"fast_gemm", "int8"} == registry.OPT_IN_FEATURES
    assert set(fastgen.known_features()) - {"fast_gemm", "int8"} == DEFAULTS
    assert registry.mode_features("exact") == DEFAULTS
    assert registry.mode_features(" FAST ") == DEFAULTS | {"fast_gemm"}
    assert registry.mode_features("int8") == DEFAULTS | {"int8"}
    assert [registry.mode_name(registry.mode_features(m)) for m in fastgen.MODES] == ["exact", "fast", "int8"]
    assert registry.mode_name([]) == "off" and registry.mode_name(["ngram"]) == "custom"
    with pytest.raises(ValueError, match="unknown fastgen mode 'int9'; modes: exact, fast, int8"):
        registry.mode_features("int9")


def test_enable_spellings(restore, caplog):
    fastgen.enable(mode="int8")
    assert _selected() == DEFAULTS | {"int8"} and fastgen.current_mode() == "int8"
    fastgen.enable("+int8")
    assert _selected() == DEFAULTS | {"int8"}
    fastgen.enable(" + Fast_Gemm ")
    assert _selected() == DEFAULTS | {"fast_gemm"} and fastgen.current_mode() == "fast"
    fastgen.enable("-speculative")
    assert _selected() == DEFAULTS - {"speculative"} and fastgen.current_mode() == "custom"
    fastgen.enable("-speculative,+int8")
    assert _selected() == (DEFAULTS | {"int8"}) - {"speculative"}
    fastgen.enable(["-speculative"], mode="int8")
    assert _selected() == (DEFAULTS | {"int8"}) - {"speculative"}
    fastgen.enable(mode="exact")
    assert _selected() == DEFAULTS and fastgen.current_mode() == "exact"
    # The old spellings keep their meaning.
    fastgen.enable(["ngram", "dedup"])
    assert _selected() == {"ngram", "dedup"}
    fastgen.enable([])
    assert _selected() == set() and fastgen.current_mode() == "off"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_lone_opt_in_name_keeps_its_old_meaning_and_says_so_once(restore, caplog):
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        fastgen.enable("int8")
        fastgen.enable("int8")
    assert _selected() == {"int8"}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "fastgen.enable('int8') selects int8 alone: the default features (" in messages[0]
    assert "fastgen.enable(mode='int8') or fastgen.enable('+int8')" in messages[0]


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("int9",), {}, r"unknown fastgen feature\(s\): int9; known features: dedup"),
        (("fast",), {}, r"fast: a mode, selected with mode='fast'"),
        (("ngram,+int8",), {}, "either a list of names or"),
        ((["ngram"],), {"mode": "int8"}, "not both"),
        ((), {"mode": "int9"}, "unknown fastgen mode"),
    ],
)
def test_enable_refuses_what_it_cannot_read(restore, args, kwargs, match):
    before = _selected()
    with pytest.raises(ValueError, match=match):
        fastgen.enable(*args, **kwargs)
    assert _selected() == before


@pytest.mark.parametrize(
    "environment, expected",
    [
        ({"FASTGEN_MODE": "int8"}, DEFAULTS | {"int8"}),
        ({"FASTGEN_MODE": " Fast "}, DEFAULTS | {"fast_gemm"}),
        ({"FASTGEN_MODE": "exact"}, DEFAULTS),
        ({"FASTGEN_FEATURES": "+int8"}, DEFAULTS | {"int8"}),
        ({"FASTGEN_FEATURES": "-speculative"}, DEFAULTS - {"speculative"}),
        ({"FASTGEN_MODE": "int8", "FASTGEN_FEATURES": "-speculative"}, (DEFAULTS | {"int8"}) - {"speculative"}),
        ({"FASTGEN_FEATURES": "ngram,dedup"}, {"ngram", "dedup"}),  # the old spelling
    ],
)
def test_environment_spellings(restore, monkeypatch, caplog, environment, expected):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    fastgen.enable()
    assert _selected() == expected
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "environment, expected, says",
    [
        ({"FASTGEN_FEATURES": "int9"}, DEFAULTS, "FASTGEN_FEATURES=int9: unknown fastgen feature(s): int9; known"),
        ({"FASTGEN_FEATURES": "+int9"}, DEFAULTS, "unknown fastgen feature(s): int9; known features: dedup"),
        ({"FASTGEN_FEATURES": "ngram,+int8"}, DEFAULTS, "either a list of names or +name/-name changes"),
        (
            {"FASTGEN_MODE": "int8", "FASTGEN_FEATURES": "-specualtive"},
            DEFAULTS | {"int8"},
            "FASTGEN_FEATURES is ignored: running mode int8",
        ),
        ({"FASTGEN_MODE": "int9"}, DEFAULTS, "FASTGEN_MODE=int9 is not a mode (modes: exact, fast, int8)"),
        ({"FASTGEN_FEATURES": "int8"}, {"int8"}, "FASTGEN_MODE=int8 or FASTGEN_FEATURES=+int8"),
        ({"FASTGEN_FEATURES": "fast_gemm"}, {"fast_gemm"}, "FASTGEN_MODE=fast or FASTGEN_FEATURES=+fast_gemm"),
    ],
)
def test_environment_typos_warn_once_and_keep_fastgen_on(restore, monkeypatch, caplog, environment, expected, says):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        fastgen.enable()
        fastgen.enable()
    assert _selected() == expected
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and says in messages[0], messages
    if "unknown" in says:
        assert ", ".join(fastgen.known_features()) in messages[0]


def test_status_says_the_mode_where_it_is_asked(restore):
    fastgen.enable()
    table = fastgen.status()
    assert table.mode == "exact" and set(table.features) == DEFAULTS
    assert str(table).splitlines()[0] == "fastgen mode: exact (process-wide: fastgen.enable() or FASTGEN_MODE)"
    with fastgen.mode("int8"):
        table = fastgen.status()
        lines = str(table).splitlines()
        assert table.mode == "int8" and lines[0].startswith("fastgen mode: int8 (a fastgen.mode()")
        assert "int8" in lines[1] and max(map(len, lines)) <= 80
        assert {row.state.partition(":")[0] for row in table if row.feature == "int8"} <= {"applied", "pending"}
    assert {row.state for row in fastgen.status() if row.feature == "int8"} == {"disabled: feature not selected"}
    with fastgen.unpatched():
        assert fastgen.status().mode == "off"
    from fastgen import info

    with fastgen.mode("fast"):
        assert "\nfastgen mode: fast (" in info.report()


def test_mode_handles():
    with pytest.raises(ValueError, match="unknown fastgen mode"):
        fastgen.mode("int9")
    with pytest.raises(TypeError, match="needs model="):
        fastgen.mode(None)
    block = fastgen.mode("fast")
    for _ in range(2):  # a handle without a model is a reusable block
        with block:
            assert fastgen.current_mode() == "fast"
        assert fastgen.current_mode() == "exact"
    with fastgen.mode("int8"), fastgen.mode("exact"):
        assert fastgen.current_mode() == "exact"  # the innermost block wins


def test_a_model_handle_kept_unentered_becomes_the_models_mode_when_its_thread_goes_on():
    """``h = fastgen.mode("int8", model=m)``, kept: its thread sees it at once and makes it ``m``'s mode for
    every thread then; entering it afterwards is refused (it is no block any more)."""
    model = torch.nn.Linear(2, 2)
    seen: list[str] = []

    def other() -> None:
        seen.append(fastgen.current_mode(model))

    handle = fastgen.mode("int8", model=model)
    try:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert seen == ["exact"]  # not yet made the model's: it might still be entered as a block
        assert fastgen.current_mode(model) == "int8"  # its own thread goes on: now the model's mode
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert seen == ["exact", "int8"]
        with pytest.raises(RuntimeError, match="already became the model's own mode"), handle:
            pass
    finally:
        fastgen.mode(None, model=model)
    del handle
    assert fastgen.current_mode(model) == "exact" and registry._state.model_rules == 0
    with fastgen.mode("fast", model=model):  # a block: no trace left
        assert fastgen.current_mode(model) == "fast" and fastgen.current_mode() == "exact"
    assert fastgen.current_mode(model) == "exact" and registry._state.model_rules == 0


def test_a_models_mode_goes_when_the_model_goes():
    model = torch.nn.Linear(2, 2)
    fastgen.mode("fast", model=model)
    assert fastgen.current_mode(model) == "fast" and registry._state.model_rules == 1
    del model
    assert registry._state.model_rules == 0


def test_blocks_and_a_models_mode_work_with_fastgen_disabled(restore):
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    kwargs = dict(num_beams=2, max_new_tokens=3, min_new_tokens=3)
    fastgen.disable()
    with fastgen.report() as off:
        model.generate(**inputs, **kwargs)
    with fastgen.mode("exact"), fastgen.report() as block:
        model.generate(**inputs, **kwargs)
    fastgen.mode("exact", model=model)
    try:
        with fastgen.report() as own:
            model.generate(**inputs, **kwargs)
    finally:
        fastgen.mode(None, model=model)
    assert not off.ran and block.fast_path("beam") and own.fast_path("beam")


@needs_int8
def test_a_models_mode_reaches_generate_many_however_late_it_is_read():
    model = harness.tiny_hf_model("bart")
    inputs = [[5, 6, 7, 8, 9], [10, 11, 12]]
    kwargs = dict(num_beams=2, max_new_tokens=3, min_new_tokens=3)
    with fastgen.patched(mode="int8"):
        expected = list(fastgen.generate_many(model, inputs, **kwargs))
    fastgen.mode("int8", model=model)
    try:
        with fastgen.report() as report:
            results = list(fastgen.generate_many(model, inputs, **kwargs))
    finally:
        fastgen.mode(None, model=model)
    assert report.fast_path("int8") and report.fast_path("continuous"), report
    assert all(torch.equal(a, b) for a, b in zip(results, expected, strict=True))
    with fastgen.mode("int8"):
        lazy = fastgen.generate_many(model, inputs, **kwargs)
    with fastgen.report() as report:  # read outside the block: still the block's mode
        results = list(lazy)
    assert report.fast_path("int8") and all(torch.equal(a, b) for a, b in zip(results, expected, strict=True))


@needs_int8
@pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")
def test_a_fairseq_models_mode_reaches_the_sequence_generator():
    model, dictionary = harness.tiny_fairseq_transformer(vocab=200)
    sample = harness.tiny_fairseq_sample(dictionary, batch=2)
    fastgen.mode("int8", model=model)
    try:
        with fastgen.report() as report:
            harness.fairseq_generate(model, dictionary, sample, beam_size=2, max_len_b=2, min_len=2)
    finally:
        fastgen.mode(None, model=model)
    assert report.fast_path("int8"), report
    with fastgen.report() as report:
        harness.fairseq_generate(model, dictionary, sample, beam_size=2, max_len_b=2, min_len=2)
    assert "int8" not in report.ran


# ---------------------------------------------------------------------------- command line


def test_mode_block_of_the_command_line_tools():
    from fastgen.cli.common import mode_block

    with mode_block(None):
        assert fastgen.current_mode() == "exact"
    with mode_block("int8"):
        assert fastgen.current_mode() == "int8"
    with mode_block("fast", without=["dedup"]):
        assert set(fastgen.status().features) == (DEFAULTS | {"fast_gemm"}) - {"dedup"}
    assert fastgen.current_mode() == "exact"


@pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")
def test_fastgen_generate_takes_mode():
    from fastgen.cli.generate import parse_args

    assert parse_args(["data", "--path", "x.pt", "--mode", "INT8"]).mode == "int8"
    assert parse_args(["data", "--path", "x.pt"]).mode is None


@needs_int8
def test_fastgen_generate_hf_runs_in_the_mode_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from fastgen.cli.generate_hf import main
    from scripts import make_tiny_model

    model_dir = make_tiny_model.make(tmp_path / "bart", "bart")
    source = tmp_path / "in.txt"
    source.write_text("\n".join(make_tiny_model.sentences(4, seed=3, max_words=8)) + "\n")
    common = [str(model_dir), "--input", str(source), "--max-new-tokens", "3", "--no-progress-bar"]
    common += ["--no-continuous-batching", "--num-beams", "2"]
    with fastgen.report() as report:
        assert main([*common, "--output", str(tmp_path / "int8.txt"), "--mode", "int8"]) == 0
    assert report.fast_path("int8"), report
    with fastgen.report() as report:
        assert main([*common, "--output", str(tmp_path / "exact.txt")]) == 0
    assert "int8" not in report.ran and fastgen.current_mode() == "exact"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main([*common, "--output", str(tmp_path / "x.txt"), "--mode", "int9"])
    assert exit_.value.code == 2 and "--mode: invalid choice: 'int9'" in capsys.readouterr().err
