"""The patch registry: apply, undo exactly, scope, version gates, lazy import, env switches."""

import logging
import os
import pathlib
import subprocess
import sys

import pytest

import fastgen
from fastgen.optimizer import registry
from fastgen.optimizer.registry import Patch
from tests.optimizer import fake_target as ft

F = "tests.optimizer.fake_factories"
T = "tests.optimizer.fake_target"


def _patches(**extra):
    return [
        Patch("fake", f"{T}:greet", f"{F}:shout", "torch", ">=2", expects=("name",)),
        Patch("fake", f"{T}:Processor.__call__", f"{F}:plus_hundred", "torch", ">=2"),
        Patch("fake", f"{T}:Processor.expand", f"{F}:triple", "torch", ">=2"),
        Patch("fake", f"{T}:Processor.build", f"{F}:tag_build", "torch", ">=2"),
        Patch("other", f"{T}:Child.__call__", f"{F}:plus_hundred", "torch", ">=2"),
        *extra.get("more", []),
    ]


@pytest.fixture
def fake_registry(monkeypatch):
    """Swap the declared patches for the fake ones; leave fastgen as it was afterwards."""
    was_enabled = registry.is_enabled()
    fastgen.disable()
    patches = _patches()
    monkeypatch.setattr(registry, "declared_patches", lambda: patches)
    yield patches
    fastgen.disable()
    monkeypatch.undo()
    if was_enabled:
        fastgen.enable()


def _originals():
    return {name: ft.Processor.__dict__[name] for name in ("__call__", "expand", "build")} | {"greet": ft.greet}


def test_enable_applies_and_disable_restores_identity(fake_registry):
    before = _originals()
    fastgen.enable()
    assert ft.greet("a") == "HELLO A"
    assert ft.Processor()(1) == 102
    assert ft.Processor.expand(7) == [7, 7, 7]
    assert ft.Processor.build(3) == ((ft.Processor, 3), "patched")
    assert ft.Child()(1) == 102 and "__call__" in ft.Child.__dict__
    assert isinstance(ft.Processor.__dict__["expand"], staticmethod)
    assert isinstance(ft.Processor.__dict__["build"], classmethod)
    fastgen.disable()
    after = _originals()
    assert all(after[k] is before[k] for k in before)
    assert "__call__" not in ft.Child.__dict__  # the inherited attribute is not left behind
    assert ft.greet("a") == "hello a" and ft.Processor()(1) == 2


def test_unpatched_runs_upstream_in_scope_only(fake_registry):
    fastgen.enable()
    with fastgen.unpatched():
        assert ft.greet("a") == "hello a" and ft.Processor()(1) == 2 and not fastgen.active()
    assert ft.greet("a") == "HELLO A" and fastgen.active()


def test_patched_restores_previous_state(fake_registry):
    assert not registry.is_enabled()
    with fastgen.patched(["other"]):
        assert ft.Child()(1) == 102 and ft.Processor()(1) == 2
    assert not registry.is_enabled() and ft.Child()(1) == 2
    fastgen.enable(["fake"])
    with fastgen.patched():
        assert ft.Child()(1) == 102
    # back to only "fake": "other"'s patch stays installed (blocks of other threads may use it) but runs upstream
    assert ft.Processor()(1) == 102 and ft.Child()(1) == 2
    fastgen.disable()
    assert "__call__" not in ft.Child.__dict__


def test_features_select_and_unknown_feature_is_an_error(fake_registry):
    fastgen.enable(["other"])
    assert ft.greet("a") == "hello a"
    states = {row.target: row.state for row in fastgen.status()}
    assert states[f"{T}:greet"].startswith("disabled: feature not selected")
    assert states[f"{T}:Child.__call__"] == "applied"
    with pytest.raises(ValueError, match="unknown fastgen feature"):
        fastgen.enable(["nope"])


def test_enable_with_no_features_enables_none(fake_registry):
    fastgen.enable([])
    assert fastgen.is_enabled() and ft.greet("a") == "hello a"
    assert all(row.state.startswith("disabled: feature not selected") for row in fastgen.status())
    with fastgen.patched(["fake"]):
        assert ft.greet("a") == "HELLO A"
    assert ft.greet("a") == "hello a"  # back to the empty selection, not to "everything"


def test_enable_twice_is_idempotent(fake_registry):
    fastgen.enable()
    fastgen.enable()
    assert ft.greet("a") == "HELLO A"  # not "wrapped twice"
    fastgen.disable()
    assert ft.greet("a") == "hello a"


def test_unsupported_version_is_skipped_with_reason(fake_registry, monkeypatch, caplog):
    fake_registry.append(Patch("fake", f"{T}:greet", f"{F}:shout", "torch", "<1"))
    fake_registry[0:1] = []
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        fastgen.enable()
    assert ft.greet("a") == "hello a"
    row = next(r for r in fastgen.status() if r.target == f"{T}:greet")
    assert row.state.startswith("skipped: torch ") and "outside the tested range <1" in row.state
    assert any("outside the tested range" in r.message for r in caplog.records)


def test_missing_package_moved_symbol_changed_signature_and_broken_factory(fake_registry):
    fake_registry[:] = [
        Patch("fake", "not_a_pkg.mod:f", f"{F}:shout", "not_a_pkg", ">=0"),
        Patch("fake", f"{T}:Processor.gone", f"{F}:shout", "torch", ">=2"),
        Patch("fake", f"{T}:greet", f"{F}:shout", "torch", ">=2", expects=("name", "extra")),
        Patch("fake", f"{T}:Processor.expand", f"{F}:broken", "torch", ">=2"),
    ]
    fastgen.enable()
    states = [row.state for row in fastgen.status()]
    assert states[0] == "skipped: not_a_pkg is not installed"
    assert states[1].startswith("skipped: target not found") and "symbol path may have changed" in states[1]
    assert states[2] == "skipped: target signature changed: missing parameter(s) extra"
    assert states[3].startswith("skipped: factory failed (RuntimeError: factory exploded)")
    assert ft.greet("a") == "hello a" and ft.Processor.expand(1) == [1, 1]


def test_patch_applied_when_module_is_imported_later(fake_registry):
    name = "tests.optimizer.fake_lazy_target"
    sys.modules.pop(name, None)
    fake_registry.append(Patch("fake", f"{name}:compute", f"{F}:negate", "torch", ">=2"))
    fastgen.enable()
    assert next(r for r in fastgen.status() if r.target.startswith(name)).state.startswith("pending")
    from tests.optimizer import fake_lazy_target

    assert fake_lazy_target.compute(2) == -20
    assert next(r for r in fastgen.status() if r.target.startswith(name)).state == "applied"
    fastgen.disable()
    assert fake_lazy_target.compute(2) == 20
    sys.modules.pop(name, None)


def test_patch_whose_factory_module_imports_the_target_is_applied(fake_registry):
    """Importing the factory's module first imports the target mid-way (the factory is not defined
    yet): the patch stays pending and is applied once the factory's module has been executed."""
    target, factory = "tests.optimizer.fake_circular_target", "tests.optimizer.fake_circular_factory"
    for name in (target, factory):
        sys.modules.pop(name, None)
    fake_registry.append(Patch("fake", f"{target}:compute", f"{factory}:make_compute", "torch", ">=2"))
    fastgen.enable()
    from tests.optimizer import fake_circular_factory, fake_circular_target

    assert next(r for r in fastgen.status() if r.target.startswith(target)).state == "applied"
    assert fake_circular_target.compute(2) == -3 and fake_circular_factory.ORIGINAL(2) == 3
    fastgen.disable()
    assert fake_circular_target.compute(2) == 3
    for name in (target, factory):
        sys.modules.pop(name, None)


def test_fallback_warns_once_per_reason(fake_registry, caplog):
    registry._state.warned.clear()
    fastgen.enable()
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        assert ft.Processor()(-5) == -4
        assert ft.Processor()(-6) == -5
    # pytest's handler names the logger, so the message does not repeat "fastgen" (issue 7, item 11).
    assert [r.message for r in caplog.records].count("[fake] falling back to upstream: negative input") == 1


def test_status_prints_a_table_that_fits_80_columns(fake_registry):
    fastgen.enable()
    text = str(fastgen.status())
    lines = text.splitlines()
    assert lines[0] == "fastgen mode: exact (process-wide: fastgen.enable() or FASTGEN_MODE)"
    assert lines[1] == "  features on: fake, other"
    assert "'pending': applied when its module is imported" in lines[2]
    assert lines[3].split() == ["feature", "state", "target"]
    assert T in lines and any(line.split() == ["fake", "applied", "Processor.__call__"] for line in lines)
    assert max(map(len, lines)) <= 80


def test_real_status_table_fits_80_columns():
    import transformers.generation.utils  # noqa: F401  (resolve the Transformers rows)

    lines = str(fastgen.status()).splitlines()
    assert len(lines) > len(registry.declared_patches()) and max(map(len, lines)) <= 80


def _python(code: str, **env: str) -> str:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FASTGEN_")} | env
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, check=True)
    return result.stdout.strip()


def test_import_is_lazy_and_env_switches_work():
    # Importing fastgen must not import fairseq (slow, and it reconfigures logging) nor HF generation.
    out = _python(
        "import sys, fastgen; print(fastgen.is_enabled(), 'fairseq' in sys.modules, "
        "'transformers.generation.utils' in sys.modules)"
    )
    assert out == "True False False"
    assert _python("import fastgen; print(fastgen.is_enabled())", FASTGEN_DISABLE="1") == "False"
    code = "import fastgen; from fastgen.optimizer import registry; print(sorted(registry._state.enabled_features))"
    default = sorted(set(fastgen.known_features()) - registry.OPT_IN_FEATURES)
    assert _python(code, FASTGEN_FEATURES="") == str(default)  # unset/empty: all but the opt-in ones
    assert _python(code, FASTGEN_FEATURES="ngram") == "['ngram']"
    assert _python(code, FASTGEN_FEATURES=" NGram , DEDUP ") == "['dedup', 'ngram']"


def test_feature_names_accept_one_string_any_case(fake_registry):
    fastgen.enable("Fake")
    assert registry._state.enabled_features == {"fake"}
    fastgen.enable(" fake , OTHER ")
    assert registry._state.enabled_features == {"fake", "other"}
    fastgen.enable([" Other"])
    assert registry._state.enabled_features == {"other"}
    with pytest.raises(ValueError, match=r"unknown fastgen feature\(s\): fkae; known features: fake, other"):
        fastgen.enable("fkae")
    with pytest.raises(TypeError):
        fastgen.enable([1])


def test_unknown_feature_in_environment_warns_and_never_breaks_the_import():
    """A typo in FASTGEN_FEATURES leaves the defaults on (it must not switch fastgen off), with one warning
    naming the unknown name and the known ones."""
    code = (
        "import logging; logging.basicConfig(format='%(name)s|%(message)s'); import fastgen; "
        "from fastgen.optimizer import registry; print(sorted(registry._state.enabled_features))"
    )
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FASTGEN_")} | {
        "FASTGEN_FEATURES": "ngarm,dedup"
    }
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, check=True)
    default = sorted(set(fastgen.known_features()) - registry.OPT_IN_FEATURES)
    assert result.stdout.strip() == str(default)
    warnings = [line for line in result.stderr.splitlines() if "unknown" in line]
    # One warning; the logger name says "fastgen" once (no doubled prefix under a logging set-up).
    known = ", ".join(fastgen.known_features())
    assert len(warnings) == 1 and warnings[0].startswith(
        f"fastgen|FASTGEN_FEATURES=ngarm,dedup: unknown fastgen feature(s): ngarm; known features: {known}. "
        "FASTGEN_FEATURES is ignored: running mode exact ("
    )


def test_warning_names_fastgen_once_with_and_without_a_logging_setup():
    code = "import fastgen; from fastgen.optimizer import registry; registry.fallback('dedup', 'a reason')"
    plain = _python_stderr(code)
    configured = _python_stderr("import logging; logging.basicConfig(format='%(name)s | %(message)s'); " + code)
    # (other lines: e.g. on an unsupported transformers the version warning)
    assert "fastgen[dedup]: falling back to upstream: a reason" in plain.splitlines()
    assert "fastgen | [dedup] falling back to upstream: a reason" in configured.splitlines()


def _python_stderr(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTGEN_")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stderr.strip()


def test_a_failed_requirement_check_skips_the_patch_with_its_reason(fake_registry, caplog):
    fake_registry[:] = [
        Patch("fake", f"{T}:greet", f"{F}:shout", "torch", ">=2", requires=f"{F}:structure_unknown"),
        Patch("fake", f"{T}:Processor.expand", f"{F}:triple", "torch", ">=2", requires=f"{F}:broken_check"),
        Patch("fake", f"{T}:Processor.__call__", f"{F}:plus_hundred", "torch", ">=2", requires=f"{F}:structure_known"),
    ]
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        fastgen.enable()
    states = {row.target.partition(":")[2]: row.state for row in fastgen.status()}
    assert states["greet"] == "skipped: fakepkg 9.9 is newer than fastgen knows; pin fakepkg==1.0 or upgrade fastgen"
    assert states["Processor.expand"] == "skipped: requirement check failed (RuntimeError: boom)"
    assert states["Processor.__call__"] == "applied"
    assert ft.greet("a") == "hello a" and ft.Processor.expand(7) == [7, 7] and ft.Processor()(1) == 102
    assert any("pin fakepkg==1.0" in record.getMessage() for record in caplog.records)


def test_the_registry_imports_no_framework_table():
    """Declarations come from fastgen.optimizer.catalog; registry.py imports nothing above it."""
    source = pathlib.Path(registry.__file__).read_text()
    assert "optimizer.transformers" not in source and "optimizer.fairseq" not in source
    assert {p.package for p in registry.declared_patches()} >= {"transformers", "fairseq"}


def test_a_factory_importing_a_half_imported_module_is_applied_when_that_module_finishes():
    """Importing fastgen's beam loop first imports Transformers' generation module from inside it; that
    module's import hook applies the speculative patch, whose factory imports the half-executed loop."""
    code = (
        "import fastgen, fastgen.optimizer.transformers.beam_search\n"
        "rows = [r for r in fastgen.status() if r.feature == 'speculative' and r.target.startswith('transformers')]\n"
        "print(sorted({r.state for r in rows}))"
    )
    states = _python(code)
    if "outside" in states or "not installed" in states:
        pytest.skip(f"the speculative patches do not apply to this Transformers: {states}")
    assert states == "['applied']"
