"""The per-step breakdown benchmark (benchmarks/beam_steps.py) on tiny models: its parts add up to the call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastgen
from benchmarks import beam_steps, report
from benchmarks.beam_loop import VARIANTS
from fastgen.optimizer.transformers.contract import CACHE
from tests import harness
from tests.harness import tiny_hf_model, tiny_inputs

NEW_TOKENS = 6


def _measure(model, inputs, variant: str, **kwargs) -> beam_steps.Recorder:
    features = VARIANTS[variant]
    scope = fastgen.unpatched() if features is None else fastgen.patched(features)
    recorder = beam_steps.Recorder()
    with scope, torch.inference_mode():
        recorder.time(lambda: model.generate(**inputs, **kwargs))
    return recorder


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_parts_add_up_to_the_generate_call(family):
    model = tiny_hf_model(family)
    inputs = tiny_inputs(model, batch=3)
    kwargs = dict(
        num_beams=3,
        no_repeat_ngram_size=2,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        return_dict_in_generate=True,
    )
    with beam_steps.instrumented(model):
        recorders = {variant: _measure(model, inputs, variant, **kwargs) for variant in VARIANTS}
    for variant, recorder in recorders.items():
        counts = beam_steps.call_counts(recorder)
        assert counts["forward"] == NEW_TOKENS, variant
        assert counts["encoder"] == (1 if family == "bart" else 0), variant
        assert counts["cache_reorder"] == NEW_TOKENS, variant  # one reorder per step, the last included
        # the default features decode on a deduplicated cache and fold it back for the caller
        assert counts["fold"] == (0 if variant == "upstream" else 1), variant
        for clock, result in beam_steps.breakdown(recorder).items():
            parts = result["parts"]
            assert all(seconds >= 0 for seconds in parts.values()), (variant, clock, parts)
            assert sum(parts.values()) == pytest.approx(result["total"], rel=1e-9, abs=1e-9), (variant, clock)
            assert parts["first_forward"] > 0 and parts["forwards"] > 0 and parts["beam_step"] > 0
            assert parts["cache_reorder"] > 0
            steps = result["per_step"]
            assert len(steps["forward"]) == len(steps["beam_step"]) == len(steps["cache"]) == NEW_TOKENS - 1
            in_loop = sum(steps["beam_step"])
            outside = result["beam_step_before_first_forward"] + result["beam_step_after_last_forward"]
            assert in_loop + outside == pytest.approx(parts["beam_step"], rel=1e-9, abs=1e-9)
    # the wrappers are gone afterwards
    assert model._forward_hooks == {} and model._forward_pre_hooks == {}
    for cls, names in beam_steps.cache_classes().items():
        for name in names:
            assert not hasattr(vars(cls)[name], "__wrapped__"), f"{cls.__name__}.{name}"


def test_every_cache_class_that_selects_or_reorders_is_wrapped():
    wrapped = {f"{cls.__name__}.{name}" for cls, names in beam_steps.cache_classes().items() for name in names}
    for name in (
        "Cache.reorder_cache",
        "EncoderDecoderCache.reorder_cache",
        "BeamSharedCrossAttentionCache.reorder_cache",
        "BeamSharedCrossAttentionCache.batch_select_inputs",
        "BeamSharedCrossAttentionCache.to_upstream",
        "SharedPrefixCache.batch_select_inputs",
        "SharedPrefixCache.to_upstream",
    ):
        assert name in wrapped


def test_removal_is_timed_as_cache_work():
    """A cache selecting inputs while the recorder runs lands in cache_removal, not in the beam step."""
    model = tiny_hf_model("bart")
    inputs = tiny_inputs(model, batch=2)
    with beam_steps.instrumented(model), torch.inference_mode():
        out = model.generate(**inputs, num_beams=2, max_new_tokens=3, return_dict_in_generate=True)
        cache = getattr(out, CACHE)
        recorder = beam_steps.Recorder()
        recorder.time(lambda: cache.batch_select_indices(torch.tensor([0, 1])))
    assert beam_steps.call_counts(recorder)["cache_removal"] == 1
    parts = beam_steps.breakdown(recorder)["thread_cpu"]["parts"]
    assert parts["cache_removal"] > 0


def test_profiler_names_costs_outside_the_forward():
    model = tiny_hf_model("bart")
    inputs = tiny_inputs(model, batch=2)
    profiled = beam_steps.Recorder(profile=True)
    with (
        beam_steps.instrumented(model),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile,
        fastgen.unpatched(),
        torch.inference_mode(),
    ):
        profiled.time(lambda: model.generate(**inputs, num_beams=2, max_new_tokens=4, min_new_tokens=4))
    costs = beam_steps.op_costs_outside_forward(profile)
    top = costs["top"]
    assert len(top) == 3
    assert all(entry["op"].startswith("aten::") and entry["part"] in ("beam_step", "cache_reorder") for entry in top)
    assert top[0]["self_cpu_ms"] >= top[1]["self_cpu_ms"] >= top[2]["self_cpu_ms"] > 0
    # what ran inside the forward (e.g. the decoder's linear layers) is not counted
    assert not any(entry["op"] in ("aten::addmm", "aten::mm", "aten::linear") for entry in top)
    by_part = costs["op_self_cpu_ms_by_part"]
    assert set(by_part) == {"beam_step", "cache_reorder"} and all(ms > 0 for ms in by_part.values())


def test_the_docs_breakdown_tables_are_the_committed_results():
    """The docs' breakdown tables are generated from the committed JSON when the site is built (no hand edits)."""
    page = (Path(__file__).parent.parent / "docs" / "benchmarks" / "beam-search.md").read_text()
    assert "<!-- generated:beam-steps -->" in page and "| part |" not in page
    assert list(report.RESULTS.glob("beam_steps-*.json")), "no committed beam_steps results"
    assert report.fill_generated(page).count("| part |") == len(list(report.RESULTS.glob("beam_steps-*.json")))


def test_removal_of_finished_inputs_is_cache_work_under_the_beam_loop():
    """Natural stops at different steps (EOS row of the head scaled, as in the beam loop tests): with ``beam``
    finished inputs leave the batch, timed as cache_removal; the parts still add up; same sequences."""
    model = tiny_hf_model("bart")
    with torch.no_grad():
        model.get_output_embeddings().weight[harness.EOS] *= 2.0
    inputs = tiny_inputs(model, batch=5)
    kwargs = dict(num_beams=3, no_repeat_ngram_size=2, max_new_tokens=14, return_dict_in_generate=False)
    sequences = {}
    with beam_steps.instrumented(model):
        for variant in ("upstream", "default+beam"):
            recorder = beam_steps.Recorder()
            features = VARIANTS[variant]
            scope = fastgen.unpatched() if features is None else fastgen.patched(features)
            with scope, torch.inference_mode():
                sequences[variant] = recorder.time(lambda: model.generate(**inputs, **kwargs))
            removals = beam_steps.call_counts(recorder)["cache_removal"]
            assert (removals > 0) == (variant == "default+beam"), (variant, removals)
            result = beam_steps.breakdown(recorder)["thread_cpu"]
            assert sum(result["parts"].values()) == pytest.approx(result["total"], rel=1e-9, abs=1e-9)
            assert (result["parts"]["cache_removal"] > 0) == (variant == "default+beam")
    assert torch.equal(sequences["upstream"], sequences["default+beam"])
    lengths = (sequences["upstream"] != harness.PAD).sum(dim=1)
    assert len(set(lengths.tolist())) >= 2, "inputs must stop at different steps"
