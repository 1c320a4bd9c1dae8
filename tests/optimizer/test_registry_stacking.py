"""Two features hooking one target: the later wraps the earlier, and disable() unwinds both."""

import pytest

import fastgen
from fastgen.optimizer import registry
from fastgen.optimizer.registry import Patch
from tests.optimizer import fake_target as ft

F = "tests.optimizer.fake_factories"
T = "tests.optimizer.fake_target"


@pytest.fixture
def stacked(monkeypatch):
    was_enabled = registry.is_enabled()
    fastgen.disable()
    patches = [
        Patch("first", f"{T}:greet", f"{F}:shout", "torch", ">=2", expects=("name",)),
        Patch("second", f"{T}:greet", f"{F}:exclaim", "torch", ">=2", expects=("name",)),
        Patch("first", f"{T}:Processor.__call__", f"{F}:plus_hundred", "torch", ">=2"),
        Patch("first", f"{T}:Processor.__call__", f"{F}:plus_hundred", "torch", ">=2", expects=("x",)),
    ]
    monkeypatch.setattr(registry, "declared_patches", lambda: patches)
    yield patches
    fastgen.disable()
    monkeypatch.undo()
    if was_enabled:
        fastgen.enable()


def test_second_feature_wraps_the_first_and_disable_restores_the_original(stacked):
    original = ft.greet
    fastgen.enable()
    assert ft.greet("a") == "HELLO A!"
    states = [row.state for row in fastgen.status() if row.target.endswith(":greet")]
    assert states == ["applied", "applied"]
    with fastgen.unpatched():
        assert ft.greet("a") == "hello a"
    fastgen.enable(["second"])
    assert ft.greet("a") == "hello a!"
    fastgen.enable(["first"])
    assert ft.greet("a") == "HELLO A"
    fastgen.disable()
    assert ft.greet is original


def test_the_same_feature_twice_on_one_target_is_still_refused(stacked):
    fastgen.enable()
    states = [row.state for row in fastgen.status() if row.target.endswith("Processor.__call__")]
    assert states == ["applied", "skipped: already patched"]
    assert ft.Processor()(1) == 102
