"""``fastgen.cli.heap``: when the CLI sets glibc's malloc thresholds, and that it does on CPU runs."""

from __future__ import annotations

import platform

import pytest

from fastgen.cli import heap


@pytest.mark.parametrize(
    ("environ", "reason"),
    [
        ({"FASTGEN_HEAP": "default"}, "FASTGEN_HEAP=default"),
        ({"MALLOC_TRIM_THRESHOLD_": "1000"}, "malloc is tuned in the environment"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000"}, "malloc is tuned in the environment"),
    ],
)
def test_user_settings_win(environ, reason):
    assert heap.why_not(environ) == reason


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert heap.why_not({}) == "the C library is not glibc"
    assert heap.keep_freed_memory() is False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_sets_the_thresholds_on_glibc(monkeypatch):
    for name in (
        "FASTGEN_HEAP",
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TOP_PAD_",
        "GLIBC_TUNABLES",
    ):
        monkeypatch.delenv(name, raising=False)
    assert heap.keep_freed_memory() is True


def test_the_cli_sets_them_for_a_cpu_run(tmp_path, monkeypatch, capsys):
    """The CLI calls :func:`heap.keep_freed_memory` before the model runs."""
    from fastgen.cli import generate_hf
    from scripts import make_tiny_model

    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(1) or True)
    model = make_tiny_model.make(tmp_path / "bart", "bart")
    (tmp_path / "in.txt").write_text("hello world\n")
    files = ["--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.txt")]
    code = generate_hf.main([str(model), *files, "--no-progress-bar", "--device", "cpu", "--max-new-tokens", "3"])
    assert code == 0
    assert calls == [1]


@pytest.mark.parametrize("feature", ["int8", "fast_gemm"])
def test_the_fast_modes_set_them_once_per_process(feature, monkeypatch):
    import fastgen
    from fastgen.optimizer import linear_modes, registry
    from tests import harness

    if harness.feature_unavailable(feature):
        pytest.skip(harness.feature_unavailable(feature))
    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(linear_modes, "_heap_tuned", [])
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    default = sorted(set(registry.known_features()) - registry.OPT_IN_FEATURES)
    with fastgen.patched(default):
        model.generate(**inputs, max_new_tokens=2)
    assert calls == []  # the exact mode leaves malloc alone
    for _ in range(2):
        with fastgen.patched([*default, feature]):
            model.generate(**inputs, max_new_tokens=2)
    assert calls == [1]
