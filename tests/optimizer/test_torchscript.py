"""``torch.jit.script`` of fairseq's ``SequenceGenerator`` with fastgen imported (fairseq's own
``test_ensemble_sequence_generator``).

TorchScript compiles the source of the methods it reaches. The patched methods are dispatchers whose
``__wrapped__`` is upstream's function and whose globals are upstream's module, so scripting compiles
fairseq's own code: the scripted generator gives the result it gives without fastgen, whatever
fastgen's state (enabled, ``unpatched()``, disabled, one feature), and leaves nothing half-built.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

import fastgen
from tests import harness
from tests.conftest import HAS_FAIRSEQ

fairseq_only = pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")

SETTINGS = dict(beam_size=2, no_repeat_ngram_size=2, max_len_b=10)  # as fairseq's own test


def _script_and_run(model: Any, dictionary: Any, sample: dict, save: bool = False) -> list:
    """Script a fresh generator (optionally save and load it, as fairseq's test does) and run it."""
    from fairseq.sequence_generator import SequenceGenerator

    scripted = torch.jit.script(SequenceGenerator([model], dictionary, **SETTINGS))
    if save:
        with tempfile.NamedTemporaryFile(suffix=".pt") as f:
            scripted.save(f.name)
            scripted = torch.jit.load(f.name)
    with torch.no_grad():
        return scripted({"net_input": sample["net_input"]})  # TorchScript: Dict[str, Dict[str, Tensor]]


def _assert_same(reference: list, candidate: list) -> None:
    for ref_hypos, cand_hypos in zip(reference, candidate, strict=True):
        assert len(ref_hypos) == len(cand_hypos)
        for ref, cand in zip(ref_hypos, cand_hypos, strict=True):
            assert torch.equal(ref["tokens"], cand["tokens"]), (ref["tokens"].tolist(), cand["tokens"].tolist())
            harness.assert_close_scores(ref["positional_scores"], cand["positional_scores"], "scripted", 1e-5, 1e-5)


@pytest.fixture
def setup():
    if not HAS_FAIRSEQ:
        pytest.skip("fairseq is not installed")
    model, dictionary = harness.tiny_fairseq_transformer()
    sample = harness.tiny_fairseq_sample(dictionary, batch=3, length=10)
    with fastgen.unpatched():  # upstream, eager: what scripting must reproduce
        upstream = harness.fairseq_generate(model, dictionary, sample, **SETTINGS)
    return model, dictionary, sample, upstream


def test_script_inside_unpatched(setup):
    model, dictionary, sample, upstream = setup
    with fastgen.patched(), fastgen.unpatched():
        scripted = _script_and_run(model, dictionary, sample)
    _assert_same(upstream, scripted)


def test_script_enabled_then_disabled_then_enabled(setup):
    """Was: "undefined value torch" pointing into the registry's dispatcher, then, after that failed
    attempt, "Can't redefine method: forward" even after ``fastgen.disable()``."""
    model, dictionary, sample, upstream = setup
    with fastgen.patched():
        first = _script_and_run(model, dictionary, sample, save=True)
    fastgen.disable()
    try:
        disabled = _script_and_run(model, dictionary, sample)
    finally:
        fastgen.enable()
    again = _script_and_run(model, dictionary, sample)
    for result in (first, disabled, again):
        _assert_same(upstream, result)


def test_script_with_only_ngram_is_upstream_not_a_mix(setup):
    """With only ``ngram`` selected, scripting used to succeed already, and still does: TorchScript
    compiles fairseq's own ``NGramRepeatBlock.forward`` (its CPU loop bans nothing), so the scripted
    generator equals upstream's; eager generation with fastgen blocks n-grams (README)."""
    model, dictionary, sample, upstream = setup
    with fastgen.patched(["ngram"]):
        scripted = _script_and_run(model, dictionary, sample)
        eager = harness.fairseq_generate(model, dictionary, sample, **SETTINGS)
    _assert_same(upstream, scripted)
    repeats = [harness.has_repeated_ngram(h["tokens"].tolist(), 2) for hypos in eager for h in hypos]
    assert not any(repeats)
    assert any(harness.has_repeated_ngram(h["tokens"].tolist(), 2) for hypos in scripted for h in hypos)


@fairseq_only
def test_dispatcher_still_dispatches():
    """The dispatcher runs on upstream's globals but only reads its closure: patched and unpatched calls."""
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    from fastgen.optimizer.fairseq import ngram as fairseq_ngram

    tokens = torch.tensor([[2, 7, 8, 9, 7, 8, 1, 1]])
    blocker = NGramRepeatBlock(3, use_extension=False)
    with fastgen.patched(["ngram"]):
        forward = NGramRepeatBlock.forward
        assert forward.__globals__ is NGramRepeatBlock.forward.__wrapped__.__globals__
        assert forward.__globals__ is not fairseq_ngram.__dict__
        patched = blocker(tokens, torch.zeros(1, 12), 1, 1, 5)
        with fastgen.unpatched():
            upstream = blocker(tokens, torch.zeros(1, 12), 1, 1, 5)
    assert patched.isinf().nonzero().tolist() == [[0, 9]] and not upstream.isinf().any()


def test_script_compiles_the_original_of_any_patch(monkeypatch):
    """Registry level, no fairseq: a patched ``forward`` that reads its module's globals scripts to the
    original in every state, while eager calls dispatch as usual."""
    from fastgen.optimizer import registry
    from fastgen.optimizer.registry import Patch
    from tests.optimizer import fake_scriptable as fs

    module = "tests.optimizer.fake_scriptable"
    patch = Patch("fake", f"{module}:Doubler.forward", f"{module}:plus_one", "torch", ">=2")
    was_enabled = registry.is_enabled()
    fastgen.disable()
    monkeypatch.setattr(registry, "declared_patches", lambda: [patch])
    x = torch.arange(3.0)
    try:
        fastgen.enable()
        assert torch.equal(fs.Doubler()(x), 2 * x + 1)
        with fastgen.unpatched():
            assert torch.equal(fs.Doubler()(x), 2 * x)
        assert torch.equal(torch.jit.script(fs.Doubler())(x), 2 * x)
        fastgen.disable()
        assert torch.equal(torch.jit.script(fs.Doubler())(x), 2 * x)
    finally:
        fastgen.disable()
        monkeypatch.undo()
        if was_enabled:
            fastgen.enable()
