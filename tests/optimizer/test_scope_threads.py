"""Blocks (``patched``, ``unpatched``, ``mode``) are confined to their thread or asyncio task.

While one thread runs a tiny BART inside an int8 block, another thread's plain calls on the *same* model
must give exactly what the default mode gives (sequences and per-step scores, bit for bit), and the block's
own calls exactly what the int8 block gives alone. The two threads are made to overlap: the block's thread
keeps generating until the other one has finished its calls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch

import fastgen
from fastgen.ops import int8_linear
from fastgen.optimizer import registry
from tests import harness

pytestmark = [
    pytest.mark.skipif(int8_linear.unavailable() is not None, reason=str(int8_linear.unavailable())),
    harness.requires_feature("int8"),  # the modes' Transformers patches are declared for 5.18+ (CI runs 5.15.1)
    harness.requires_feature("dedup"),
]

DEFAULTS = sorted(registry.default_features())
KWARGS = dict(num_beams=2, max_new_tokens=5, min_new_tokens=5, return_dict_in_generate=True, output_scores=True)


def _generate(model: Any, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    with torch.no_grad():
        out = model.generate(**inputs, **KWARGS)
    return out.sequences, tuple(out.scores)


def _same(a: tuple[torch.Tensor, tuple[torch.Tensor, ...]], b: tuple[torch.Tensor, tuple[torch.Tensor, ...]]) -> bool:
    return torch.equal(a[0], b[0]) and len(a[1]) == len(b[1]) and all(map(torch.equal, a[1], b[1]))


SCOPES: dict[str, Callable[[Any], AbstractContextManager[Any]]] = {
    "patched": lambda model: fastgen.patched([*DEFAULTS, "int8"]),
    "mode": lambda model: fastgen.mode("int8"),
    "mode-of-the-model": lambda model: fastgen.mode("int8", model=model),
}


@pytest.mark.parametrize("scope", list(SCOPES))
def test_an_int8_block_leaves_another_threads_calls_in_the_default_mode(scope: str) -> None:
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    default = _generate(model, inputs)
    with fastgen.patched([*DEFAULTS, "int8"]), fastgen.report() as alone:
        int8 = _generate(model, inputs)
    assert alone.fast_path("int8") and not _same(default, int8)  # the two modes differ on this model

    inside, done = threading.Event(), threading.Event()
    block_results: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []
    block_reports: list[fastgen.Report] = []
    errors: list[BaseException] = []

    def in_block() -> None:
        try:
            with SCOPES[scope](model), fastgen.report() as report:
                block_results.append(_generate(model, inputs))
                inside.set()
                while not done.is_set():  # keep the block busy while the other thread runs
                    block_results.append(_generate(model, inputs))
            block_reports.append(report)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            inside.set()

    thread = threading.Thread(target=in_block)
    thread.start()
    try:
        assert inside.wait(60)
        with fastgen.report() as here:
            others = [_generate(model, inputs) for _ in range(3)]
    finally:
        done.set()
        thread.join(60)
    assert not errors, errors
    assert len(block_results) >= 2  # the block ran while this thread generated
    assert all(_same(result, default) for result in others)
    assert "int8" not in here.ran and fastgen.current_mode() == "exact"
    assert all(_same(result, int8) for result in block_results)
    assert block_reports[0].fast_path("int8")


def test_unpatched_in_one_thread_leaves_another_threads_calls_patched() -> None:
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    inside, done = threading.Event(), threading.Event()
    seen: list[str] = []

    def upstream() -> None:
        with fastgen.unpatched():
            seen.append(fastgen.current_mode())
            inside.set()
            done.wait(60)
            seen.append(fastgen.current_mode())

    thread = threading.Thread(target=upstream)
    thread.start()
    try:
        assert inside.wait(60)
        with fastgen.report() as report:
            _generate(model, inputs)
    finally:
        done.set()
        thread.join(60)
    assert report.fast_path("dedup") and report.fast_path("beam")
    assert seen == ["off", "off"]


def test_a_mode_block_is_confined_to_its_asyncio_task() -> None:
    async def in_block(entered: asyncio.Event, leave: asyncio.Event) -> list[str]:
        with fastgen.mode("int8"):
            entered.set()
            await leave.wait()
            return [fastgen.current_mode(), str(registry.feature_enabled("int8"))]

    async def main() -> tuple[list[str], list[str]]:
        entered, leave = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(in_block(entered, leave))
        await entered.wait()
        here = [fastgen.current_mode(), str(registry.feature_enabled("int8"))]
        leave.set()
        return here, await task

    here, there = asyncio.run(main())
    assert here == ["exact", "False"] and there == ["int8", "True"]


def test_a_models_own_mode_holds_in_every_thread() -> None:
    """``fastgen.mode("int8", model=m)`` (a statement) is the model's, not the thread's: every thread's calls
    on ``m`` run in int8; other models keep the process-wide mode."""
    model, other = harness.tiny_hf_model("bart"), harness.tiny_hf_model("bart", seed=1)
    inputs = harness.tiny_inputs(model, batch=2)
    with fastgen.patched([*DEFAULTS, "int8"]):
        int8 = _generate(model, inputs)
    fastgen.mode("int8", model=model)
    try:
        results: dict[str, Any] = {}

        def elsewhere() -> None:
            with fastgen.report() as report:
                results["out"] = _generate(model, inputs)
            results["report"], results["other"] = report, fastgen.current_mode(other)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join(60)
        assert _same(results["out"], int8) and results["report"].fast_path("int8")
        assert results["other"] == "exact" and fastgen.current_mode(model) == "int8"
    finally:
        fastgen.mode(None, model=model)
    assert fastgen.current_mode(model) == "exact" and registry._state.model_rules == 0
