"""fastgen's beam search loop (feature ``beam``, on by default) against upstream's ``_beam_search``:
token-identical sequences and scores on every tiny family, batch 3 with padding, inputs finishing
at different steps; whole-call fallback with one warning naming the argument otherwise."""

from __future__ import annotations

import itertools
import logging
import sys
from collections import Counter
from typing import Any

import pytest
import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

import fastgen
from fastgen.optimizer import registry
from fastgen.optimizer.transformers import beam_search
from fastgen.optimizer.transformers.contract import CACHE
from tests import harness

pytestmark = harness.requires_feature("beam")

#: every default feature (the loop included), and the same without the loop
FEATURES = sorted(set(fastgen.known_features()) - registry.OPT_IN_FEATURES)
WITHOUT_LOOP = sorted(set(FEATURES) - {"beam"})

#: gain on the EOS row of the LM head: inputs then finish at different steps (asserted below where
#: the tiny model does so: t5 and gpt2 put too little mass on EOS to spread much).
EOS_GAIN = {
    "bart": 2.0,
    "mbart": 2.0,
    "marian": 2.0,
    "pegasus": 2.0,
    "t5": 3.0,
    "gpt2": 4.0,
    "llama": 4.0,
    "qwen2": 2.0,
    "m2m_100": 3.0,
    "mt5": 3.0,
    "umt5": 2.0,
    "whisper": 20.0,  # its tied head puts little mass on EOS
    "mistral": 3.0,
    "qwen3": 3.0,
    "gemma2": 2.0,
    "gemma3_text": 2.0,
    "phi3": 2.0,
}
assert set(EOS_GAIN) == set(harness.ENCODER_DECODER + harness.DECODER_ONLY), "every tiny family"
SPREAD = set(EOS_GAIN) - {"t5", "gpt2"}
#: tiny models none of whose inputs is frozen before the last step (asserted elsewhere that removal runs)
NO_EARLY_FREEZE = {"gpt2", "whisper"}

CASES: dict[str, dict[str, Any]] = {
    "lp0.5-early-ret3-norepeat": dict(
        num_beams=3, num_return_sequences=3, length_penalty=0.5, early_stopping=True, no_repeat_ngram_size=2
    ),
    "lp1-noearly-minnew": dict(num_beams=4, length_penalty=1.0, early_stopping=False, min_new_tokens=3),
    "lp1-early-encnorepeat-badwords-suppress-bos": dict(
        num_beams=3,
        early_stopping=True,
        encoder_no_repeat_ngram_size=2,
        bad_words_ids=[[7], [9]],
        suppress_tokens=[11],
        forced_bos_token_id=5,
    ),
    "lp1.5-never-ret2-eoslist": dict(
        num_beams=3, num_return_sequences=2, length_penalty=1.5, early_stopping="never", eos_token_id=[harness.EOS, 5]
    ),
}


#: the issue's grid: length_penalty x early_stopping x num_return_sequences (1 or M), each cell with one
#: of the supported processors in turn, so every processor meets every length penalty and stop rule
_PROCESSOR_SETS = {
    "norepeat": dict(no_repeat_ngram_size=2),
    "encnorepeat": dict(encoder_no_repeat_ngram_size=2),
    "badwords-suppress": dict(bad_words_ids=[[7], [9]], suppress_tokens=[11]),
    "forcedbos-forcedeos": dict(forced_bos_token_id=5, forced_eos_token_id=harness.EOS),
    "minlength": dict(min_new_tokens=5),
}
GRID: dict[str, dict[str, Any]] = {}
for _i, (_lp, _early, _ret) in enumerate(itertools.product((0.5, 1.0, 1.5), (True, False, "never"), (1, 3))):
    _name, _processors = list(_PROCESSOR_SETS.items())[_i % len(_PROCESSOR_SETS)]
    GRID[f"lp{_lp}-early{_early}-ret{_ret}-{_name}"] = dict(
        num_beams=3, num_return_sequences=_ret, length_penalty=_lp, early_stopping=_early, **_processors
    )


def eos_model(family: str):
    model = harness.tiny_hf_model(family)
    with torch.no_grad():
        model.get_output_embeddings().weight[harness.EOS] *= EOS_GAIN[family]
    return model


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {family: eos_model(family) for family in EOS_GAIN}


@pytest.fixture
def steps(monkeypatch) -> dict[str, int]:
    """Counts fastgen loop steps (0: the call went to upstream)."""
    counter = {"n": 0}
    original = beam_search.log_probs_top_k

    def counting(*args, **kwargs):
        counter["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(beam_search, "log_probs_top_k", counting)
    return counter


def finish_steps(model, inputs, sequences: torch.Tensor) -> set[int]:
    """Where each returned sequence's generated part ends: its first EOS, else the start of its trailing
    padding (Whisper's plain-tensor output drops the EOS); -1 for a sequence that ran to the end."""
    start = 1 if model.config.is_encoder_decoder else inputs["input_ids"].shape[1]
    ends = set()
    for row in sequences[:, start:].tolist():
        if harness.EOS in row:
            ends.add(row.index(harness.EOS))
            continue
        end = len(row)
        while end and row[end - 1] == harness.PAD:
            end -= 1
        ends.add(end if end < len(row) else -1)
    return ends


#: families the whole GRID runs on in CI: one per kind of model and cache (BART, T5's relative positions,
#: Whisper's audio encoder, GPT-2, Llama's grouped-query attention, Qwen3's sliding layers). The grid varies the
#: loop's own settings, which do not depend on the model; every family runs the four CASES in CI, which cover
#: each stop rule, length penalty, return count and processor of the grid. The other families' grid cells
#: (~25 s in all on CI's CPU) are marked slow.
GRID_FAMILIES_IN_CI = ("bart", "t5", "whisper", "gpt2", "llama", "qwen3")


@pytest.mark.parametrize(
    "family, case",
    harness.family_case_grid(EOS_GAIN, [*CASES, *GRID], lambda f, c: c not in GRID or f in GRID_FAMILIES_IN_CI),
)
def test_matches_upstream(models, steps, family, case):
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=3)
    kwargs = dict(CASES[case], max_new_tokens=14) if case in CASES else dict(GRID[case], max_new_tokens=10)
    reference, candidate = harness.assert_same_generation(model, inputs, features=FEATURES, **kwargs)
    assert steps["n"] > 0, "fastgen's loop did not run"
    assert torch.equal(reference.beam_indices, candidate.beam_indices)
    # On the same forwards (dedup's rounding included) the loop is upstream's arithmetic: bit for bit.
    with fastgen.patched(WITHOUT_LOOP):
        loop_off = model.generate(**inputs, output_scores=True, return_dict_in_generate=True, **kwargs)
    assert torch.equal(loop_off.sequences_scores, candidate.sequences_scores)
    assert all(torch.equal(a, b) for a, b in zip(loop_off.scores, candidate.scores, strict=True))
    if family in SPREAD and case == "lp0.5-early-ret3-norepeat":  # short-favouring: natural stops show
        assert len(finish_steps(model, inputs, reference.sequences)) >= 2, "inputs must finish at different steps"


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_plain_tensor_output(models, steps, family):
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=3)
    harness.assert_same_generation(
        model, inputs, features=FEATURES, return_dict_in_generate=False, num_beams=4, max_new_tokens=8
    )
    assert steps["n"] > 0


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(do_sample=True, top_k=10), "do_sample=True"),
        (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
        (dict(bad_words_ids=[[7, 8]]), "NoBadWordsLogitsProcessor with multi-token bad words"),
        (dict(output_attentions=True), "output_attentions=True"),
    ],
)
def test_unsupported_arguments_run_upstream_with_one_warning(models, steps, caplog, monkeypatch, kwargs, named):
    # the warning is once per process: forget earlier tests' (the CLI tests fall back for beam sampling too)
    monkeypatch.setattr(registry._state, "warned", set())
    model = models["bart"]
    inputs = harness.tiny_inputs(model, batch=3)
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        harness.assert_same_generation(model, inputs, features=FEATURES, num_beams=3, max_new_tokens=8, **kwargs)
    assert steps["n"] == 0
    assert any(named in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records)


def test_on_by_default_and_can_be_left_out():
    with fastgen.patched():
        assert registry.feature_enabled("beam")
    with fastgen.patched(WITHOUT_LOOP):
        assert not registry.feature_enabled("beam")


def test_removal_needs_an_input_group_select_on_other_caches():
    """Plain caches drop hypothesis rows; fastgen's dedup caches select per input (INPUT_SELECT); others keep all."""
    from fastgen.models.decoder_only import SharedPrefixCache
    from fastgen.models.encoder_decoder import BeamSharedCrossAttentionCache

    class OtherCache(DynamicCache):
        pass

    plain = EncoderDecoderCache(DynamicCache(), DynamicCache())
    assert beam_search._removal_problem({CACHE: plain, "attention_mask": torch.ones(2, 3)}) is None
    shared = BeamSharedCrossAttentionCache.from_cache(plain)
    assert beam_search._removal_problem({CACHE: shared}) is None
    prefix = SharedPrefixCache(2, hypotheses=6, group_size=3, attention_ready=lambda: True)
    assert beam_search._removal_problem({CACHE: prefix}) is None
    assert "OtherCache has no input-group select" in beam_search._removal_problem({CACHE: OtherCache()})
    assert "model kwarg 'pixel_values'" in beam_search._removal_problem({"pixel_values": torch.ones(1)})


@pytest.fixture
def dropped(monkeypatch) -> dict[str, int]:
    """Counts inputs that left the batch early (stop check every step, so every early freeze shows)."""
    monkeypatch.setenv(beam_search.STOP_CHECK_ENV, "1")
    counter = {"n": 0}
    original = beam_search._drop_inputs

    def counting(model_kwargs, keep, batch, beams):
        counter["n"] += batch - len(keep)
        return original(model_kwargs, keep, batch, beams)

    monkeypatch.setattr(beam_search, "_drop_inputs", counting)
    return counter


@pytest.mark.parametrize("case", ["lp0.5-early-ret3-norepeat", "lp1-noearly-minnew"])
@pytest.mark.parametrize("family", list(EOS_GAIN))
def test_finished_inputs_leave_the_batch(models, steps, dropped, family, case):
    """Upstream's plain caches (no dedup): frozen inputs are dropped, results still token-identical."""
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=5)
    kwargs = dict(return_dict_in_generate=False, max_new_tokens=14, **CASES[case])
    harness.assert_same_generation(model, inputs, features=["beam"], **kwargs)
    assert steps["n"] > 0
    if family not in NO_EARLY_FREEZE and case.startswith("lp0.5"):
        assert dropped["n"] > 0, "no input left the batch"


def assert_still_shared(cache: Any, beams: int) -> int:
    """The cache a dedup call decoded with still shares its per-input rows; returns the inputs left in it."""
    from fastgen.models.decoder_only import SharedPrefixCache
    from fastgen.models.encoder_decoder import BeamSharedCrossAttentionCache

    if isinstance(cache, BeamSharedCrossAttentionCache):
        assert cache.group_size() == beams
        inputs = {layer.keys.shape[0] for layer in cache.cross_attention_cache.layers}
        hypotheses = {layer.keys.shape[0] for layer in cache.self_attention_cache.layers}
    else:
        assert isinstance(cache, SharedPrefixCache), type(cache)
        assert all(layer.prefix_keys is not None and layer.group_size() == beams for layer in cache.layers)
        inputs = {layer.prefix_keys.shape[0] for layer in cache.layers}
        hypotheses = {layer.keys.shape[0] for layer in cache.layers} | {layer.hypotheses for layer in cache.layers}
    assert len(inputs) == 1 and hypotheses == {next(iter(inputs)) * beams}, (inputs, hypotheses)
    return next(iter(inputs))


@pytest.mark.parametrize("family", list(EOS_GAIN))
def test_inputs_leave_the_batch_with_the_dedup_caches_still_shared(models, steps, dropped, family):
    """dedup + ngram + beam: finished inputs leave, the shared cross-attention / prompt rows follow them."""
    from fastgen.optimizer.transformers.returned_cache import DEDUP_CACHES

    model = models[family]
    inputs = harness.tiny_inputs(model, batch=5)
    case = CASES["lp0.5-early-ret3-norepeat"]
    kwargs = dict(return_dict_in_generate=False, max_new_tokens=14, **case)
    with harness.recorded_caches(model) as caches:
        reference, _, report = harness.assert_same_generation(
            model, inputs, features=FEATURES, with_report=True, **kwargs
        )
    assert report.fast_path("dedup") and report.fast_path("beam") and not report.fell_back, str(report)
    assert steps["n"] > 0
    shared = [cache for cache in caches if isinstance(cache, DEDUP_CACHES)]
    assert len(shared) == 1, caches  # the patched call's (upstream's call records a plain one)
    left = assert_still_shared(shared[0], case["num_beams"])
    if family in SPREAD:
        assert len(finish_steps(model, inputs, reference)) >= 2, "inputs must finish at different steps"
    if family not in NO_EARLY_FREEZE:
        assert dropped["n"] > 0 and left < 5, "no input left the batch"
        assert "finished inputs left the batch" in report.ran["beam"]


@pytest.mark.parametrize("family", ["bart", "t5", "llama"])
def test_encoder_ngrams_follow_the_inputs_that_stay(models, steps, dropped, family):
    """After inputs leave, each hypothesis is still matched against its own prompt."""
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=5)
    case = CASES["lp1-early-encnorepeat-badwords-suppress-bos"]
    kwargs = dict(return_dict_in_generate=False, max_new_tokens=14, **case)
    harness.assert_same_generation(model, inputs, features=["beam", "ngram"], **kwargs)
    assert steps["n"] > 0 and dropped["n"] > 0


@pytest.mark.parametrize("prefix_rows", [2, 6])  # shared per input, or a prefill that ran per hypothesis
def test_input_select_equals_a_row_select_of_upstreams_layout(prefix_rows):
    """Selecting inputs on a dedup cache gives, in upstream's layout, exactly upstream's row selection."""
    from fastgen.models._caches import hypothesis_rows
    from fastgen.models.decoder_only import SharedPrefixCache
    from fastgen.models.encoder_decoder import BeamSharedCrossAttentionCache

    torch.manual_seed(0)
    keep, beams = torch.tensor([1]), 3
    rows = hypothesis_rows(keep, beams)
    prefix = SharedPrefixCache(2, hypotheses=6, group_size=beams, attention_ready=lambda: True)
    for layer in range(2):
        prefix.update(torch.randn(prefix_rows, 2, 4, 8), torch.randn(prefix_rows, 2, 4, 8), layer)
        prefix.update(torch.randn(6, 2, 1, 8), torch.randn(6, 2, 1, 8), layer)
    cross = BeamSharedCrossAttentionCache(DynamicCache(), DynamicCache())
    for layer in range(2):
        cross.self_attention_cache.update(torch.randn(6, 2, 3, 8), torch.randn(6, 2, 3, 8), layer)
        cross.cross_attention_cache.update(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), layer)

    def upstream_tensors(cache):
        plain = cache.to_upstream()
        subs = [plain] if isinstance(plain, DynamicCache) else [plain.self_attention_cache, plain.cross_attention_cache]
        return [t for sub in subs for layer in sub.layers for t in (layer.keys, layer.values)]

    for cache in (prefix, cross):
        before = [tensor[rows] for tensor in upstream_tensors(cache)]
        cache.batch_select_inputs(keep, beams)
        after = upstream_tensors(cache)
        assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    layer = prefix.layers[0]
    if prefix_rows == 2:  # still one prompt row per input
        assert layer.prefix_keys.shape[0] == 1 and layer.group_size() == beams and layer.hypotheses == beams
    else:  # per-hypothesis prefill: folded, plain per-hypothesis rows
        assert layer.prefix_keys is None and layer.keys.shape[0] == beams
    assert cross.cross_attention_cache.layers[0].keys.shape[0] == 1 and cross.group_size() == beams


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gather"])
def test_inputs_leaving_keep_the_other_inputs_cross_rows(in_place, monkeypatch):
    """The kept inputs' cross-attention K/V move to the front of the same memory (a contiguous prefix) where the
    reorder op is loaded, else upstream's row select: the same tensors either way."""
    from fastgen.models._caches import hypothesis_rows
    from fastgen.models.encoder_decoder import BeamSharedCrossAttentionCache

    decided = harness.force_in_place_reorder(monkeypatch, in_place)
    torch.manual_seed(0)
    keep, beams = torch.tensor([0, 2, 3]), 2
    cache = BeamSharedCrossAttentionCache(DynamicCache(), DynamicCache())
    for layer in range(2):
        cache.self_attention_cache.update(torch.randn(8, 2, 3, 8), torch.randn(8, 2, 3, 8), layer)
        cache.cross_attention_cache.update(torch.randn(4, 2, 5, 8), torch.randn(4, 2, 5, 8), layer)
    crosses, selves = cache.cross_attention_cache.layers, cache.self_attention_cache.layers
    expected = [t[keep] for layer in crosses for t in (layer.keys, layer.values)]
    expected += [t[hypothesis_rows(keep, beams)] for layer in selves for t in (layer.keys, layer.values)]
    memory = crosses[0].keys.data_ptr()
    cache.batch_select_inputs(keep, beams)
    got = [t for layers in (crosses, selves) for layer in layers for t in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(got, expected, strict=True))
    assert (crosses[0].keys.data_ptr() == memory) is in_place and in_place in decided


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_dict_output_without_scores_or_cache_lets_inputs_leave(models, steps, dropped, family):
    """return_dict_in_generate=True: beam_indices come back in input order, upstream's numbering."""
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=5)
    case = CASES["lp0.5-early-ret3-norepeat"]
    kwargs = dict(return_dict_in_generate=True, output_scores=False, use_cache=False, max_new_tokens=14, **case)
    reference, candidate = harness.assert_same_generation(model, inputs, features=FEATURES, **kwargs)
    assert steps["n"] > 0 and dropped["n"] > 0
    assert torch.equal(reference.beam_indices, candidate.beam_indices)
    assert getattr(candidate, CACHE) is None and candidate.sequences_scores is None


@pytest.mark.parametrize("family", ["bart", "llama"])
@pytest.mark.parametrize("outputs", [dict(output_scores=True), dict(output_scores=False, use_cache=True)])
def test_dict_outputs_that_show_frozen_inputs_keep_every_input(models, steps, dropped, family, outputs):
    """Per-step scores (and sequences_scores) or a returned cache: every input stays, outputs as upstream's."""
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=5)
    kwargs = dict(return_dict_in_generate=True, max_new_tokens=14, **CASES["lp0.5-early-ret3-norepeat"], **outputs)
    reference, candidate = harness.assert_same_generation(model, inputs, features=FEATURES, **kwargs)
    assert steps["n"] > 0 and dropped["n"] == 0
    assert torch.equal(reference.beam_indices, candidate.beam_indices)
    if outputs["output_scores"] is False:  # the returned cache: upstream's class and layout, same K/V
        ref_cache, cand_cache = getattr(reference, CACHE), getattr(candidate, CACHE)
        assert type(ref_cache) is type(cand_cache)
        ref_layers = getattr(ref_cache, "self_attention_cache", ref_cache).layers
        cand_layers = getattr(cand_cache, "self_attention_cache", cand_cache).layers
        for ref, cand in zip(ref_layers, cand_layers, strict=True):
            torch.testing.assert_close(ref.keys, cand.keys, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(EOS_GAIN))
def test_stop_check_every_k_steps_changes_nothing(models, steps, monkeypatch, family):
    """Steps run past the last freeze (up to k - 1) and frozen inputs leaving up to k - 1 steps late
    leave every output equal; only the number of steps can grow."""
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=5)
    kwargs = dict(return_dict_in_generate=False, max_new_tokens=14, **CASES["lp0.5-early-ret3-norepeat"])
    counts = {}
    for every in ("1", "3", "4", "7"):
        monkeypatch.setenv(beam_search.STOP_CHECK_ENV, every)
        steps["n"] = 0
        harness.assert_same_generation(model, inputs, features=FEATURES, **kwargs)
        counts[every] = steps["n"]
    assert counts["1"] > 0 and all(n >= counts["1"] for n in counts.values()), counts
    if family == "marian":  # its inputs all freeze early: the lazy check does run steps past upstream's stop
        assert max(counts.values()) > counts["1"], counts


def test_stop_check_interval_setting(monkeypatch):
    monkeypatch.delenv(beam_search.STOP_CHECK_ENV, raising=False)
    assert beam_search.stop_check_interval("cuda") == beam_search.DEFAULT_STOP_CHECK_EVERY == 4
    assert beam_search.stop_check_interval(torch.device("cpu")) == 1  # a check costs nothing there
    monkeypatch.setenv(beam_search.STOP_CHECK_ENV, "8")
    assert beam_search.stop_check_interval("cpu") == beam_search.stop_check_interval("cuda") == 8
    for bad in ("0", "-2", "x"):
        monkeypatch.setenv(beam_search.STOP_CHECK_ENV, bad)
        with pytest.raises(ValueError, match=beam_search.STOP_CHECK_ENV):
            beam_search.stop_check_interval()


def test_host_reads_in_the_loop_are_the_stop_checks(models, steps, monkeypatch):
    """Every tensor -> host read made by the loop's own code (what syncs on a GPU) is one ``tolist()``
    per stop check (every k steps); the removal of finished inputs works from that list. Besides:
    upstream's one fill-value test before the loop, and the ban ids read once per call."""
    reads: list[tuple[str, str]] = []
    for name in ("__bool__", "__int__", "__float__", "item", "tolist", "nonzero", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename == beam_search.__file__:
                reads.append((_name, frame.f_code.co_name))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    monkeypatch.setenv(beam_search.STOP_CHECK_ENV, "4")
    model = models["bart"]
    inputs = harness.tiny_inputs(model, batch=5)
    case = CASES["lp0.5-early-ret3-norepeat"]
    kwargs = dict(return_dict_in_generate=False, max_new_tokens=14, bad_words_ids=[[7]], **case)
    with fastgen.patched(FEATURES), fastgen.report() as report:
        model.generate(**inputs, **kwargs)
    assert "finished inputs left the batch" in report.ran["beam"]
    checks = reads.count(("tolist", "_beam_search"))
    assert 0 < checks <= steps["n"] // 4
    before_the_loop = [("__bool__", "_beam_search"), ("tolist", "_prepare_processors")]  # fill value; bad word
    assert reads == before_the_loop + [("tolist", "_beam_search")] * checks, reads


def _loop_ops(model, inputs, **kwargs) -> tuple[Counter, Counter]:
    """The aten ops the loop runs between the first and the last forward, outside the forwards: the
    outermost ones counted by name, and those that read a device value on the host (syncs on a GPU)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    forward = model.forward

    def marked_forward(*args, **kw):
        with record_function("test::forward"):
            return forward(*args, **kw)

    model.forward = marked_forward
    try:
        with fastgen.patched(FEATURES), profile(activities=[ProfilerActivity.CPU]) as prof:
            model.generate(**inputs, **kwargs)
    finally:
        del model.forward
    events = list(prof.events())
    forwards = [event for event in events if event.name == "test::forward"]
    assert len(forwards) == kwargs["max_new_tokens"]
    start, end = forwards[0].time_range.start, forwards[-1].time_range.end
    outermost, syncs = Counter(), Counter()
    for event in events:
        if not (start <= event.time_range.start < end) or not event.name.startswith("aten::"):
            continue
        parents = []
        parent = event.cpu_parent
        while parent is not None:
            parents.append(parent.name)
            parent = parent.cpu_parent
        if "test::forward" in parents:
            continue
        if event.name in _SYNCING_OPS:
            syncs[event.name] += 1
        if not any(name.startswith("aten::") for name in parents):
            outermost[event.name] += 1
    return outermost, syncs


#: aten ops that copy a device value to the host (they wait for the device on a GPU)
_SYNCING_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero", "aten::masked_select"}


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_the_step_runs_a_fixed_number_of_ops_and_no_sync(models, monkeypatch, family):
    """Outside the forward, a step runs the same ops for any B and M, none of them a host sync, when no
    stop check falls in the run (k larger than the steps). The n-gram op runs its GPU write path (fixed
    shapes; on CPU it gathers its few matches with ``nonzero``, which costs nothing there)."""
    from fastgen.ops import ngram

    monkeypatch.setenv(beam_search.STOP_CHECK_ENV, "1000")
    # the CPU-only top-k kernel checks its rows for ties on the host (free on a CPU): this test is about
    # the loop's device-agnostic ops, so it runs torch.topk as on a GPU
    monkeypatch.setenv("FASTGEN_CPU_KERNELS", "0")
    write = ngram._write_banned
    monkeypatch.setattr(ngram, "_write_banned", lambda *args: write(*args[:4], sync_free=True))
    model = models[family]
    processors = dict(no_repeat_ngram_size=2, bad_words_ids=[[7]], suppress_tokens=[11], min_new_tokens=4)
    counts = []
    for batch, beams in ((2, 2), (4, 5)):
        inputs = harness.tiny_inputs(model, batch=batch)
        kwargs = dict(num_beams=beams, max_new_tokens=8, **processors)
        outermost, syncs = _loop_ops(model, inputs, **kwargs)
        assert not syncs, syncs
        counts.append(outermost)
    assert counts[0] == counts[1], set(counts[0].items()) ^ set(counts[1].items())
    assert sum(counts[0].values()) > 0


#: architectures outside fastgen's tiny families (no dedup for them): the loop, on by default, serves
#: them too, so it must equal upstream there as well: ALiBi (Bloom), a state cache (Mamba), FSMT, LED
_SEQ2SEQ_SIZES = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    decoder_start_token_id=harness.EOS,
)
_OTHER_ARCHITECTURES = {
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32),
    ),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=32, n_layer=2, n_head=4)),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(hidden_size=32, num_hidden_layers=2, state_size=8)),
    "fsmt": (
        "FSMTConfig",
        "FSMTForConditionalGeneration",
        dict(
            src_vocab_size=harness.VOCAB,
            tgt_vocab_size=harness.VOCAB,
            **_SEQ2SEQ_SIZES,
            langs=["en", "de"],
        ),
    ),
    "led": (
        "LEDConfig",
        "LEDForConditionalGeneration",
        dict(
            **_SEQ2SEQ_SIZES,
            max_encoder_position_embeddings=64,
            max_decoder_position_embeddings=64,
            attention_window=8,
        ),
    ),
}


@pytest.mark.parametrize("architecture", list(_OTHER_ARCHITECTURES))
def test_other_architectures_equal_upstream(steps, architecture):
    import transformers

    config_class, model_class, config = _OTHER_ARCHITECTURES[architecture]
    tokens = dict(
        vocab_size=harness.VOCAB,
        pad_token_id=harness.PAD,
        bos_token_id=harness.BOS,
        eos_token_id=harness.EOS,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**tokens, **config)).eval()
    with torch.no_grad():  # wide random weights: peaked, input-dependent distributions
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    inputs = harness.tiny_inputs(model, batch=3)
    case = CASES["lp0.5-early-ret3-norepeat"]
    reference, _, report = harness.assert_same_generation(
        model, inputs, features=FEATURES, with_report=True, max_new_tokens=10, **case
    )
    assert steps["n"] > 0 and report.fast_path("beam"), str(report)
    assert len({tuple(row) for row in reference.sequences.tolist()}) > 1, "degenerate model"
