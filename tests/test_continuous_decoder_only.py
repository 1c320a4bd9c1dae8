"""Continuous batching of decoder-only models (``fastgen.generate_many``) against ``generate`` on each input alone.

The oracle is upstream (``fastgen.unpatched()``) ``generate`` on one unpadded prompt. Tokens (prompt +
new tokens) must be equal; beam scores within a few ulps (the decode step's GEMMs see more rows than
the single-input run: ``tests/test_continuous_batching.py::test_gemm_row_count_changes_bits``). The
prefill runs the single-input call itself, so the first step's logits are equal bit for bit.

Prompts of 2..39 tokens, an EOS gain on the LM head so that inputs end at very different steps
(asserted, as is that different prompts give different continuations), and room for 3 inputs per
step, so inputs leave and newcomers join throughout.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

import fastgen
from fastgen.continuous import decoder_only, generate_many
from fastgen.continuous.scheduler import linear_scope
from fastgen.continuous.settings import DECODER_ONLY_FAMILIES, resolve
from tests import continuous_cases, harness
from tests.continuous_cases import alone, make_inputs
from tests.test_continuous_batching import CASES as ENCODER_DECODER_CASES

FAMILIES = DECODER_ONLY_FAMILIES
EOS_GAIN = {"gpt2": 4.0, "llama": 2.0, "qwen2": 2.0, "mistral": 2.0, "qwen3": 2.0}
#: the encoder-decoder case mix; ``max_length`` counts the prompt here, so it must exceed the longest one
CASES = {
    **ENCODER_DECODER_CASES,
    "beam2-min-new-forced-bos": dict(num_beams=2, min_new_tokens=4, forced_bos_token_id=7, max_length=52),
    "greedy-max-length-min-length": dict(num_beams=1, max_length=50, min_length=30),
}


def eos_model(family: str, attention: str = "sdpa"):
    return continuous_cases.eos_model(family, EOS_GAIN[family], attention=attention)


@pytest.fixture(scope="module")
def models():
    return {family: eos_model(family) for family in FAMILIES}


def assert_matches_alone(model, inputs, kwargs, results) -> list[list[int]]:
    """Tokens equal, beam scores within a few ulps; returns each input's first new tokens."""
    continuations = []
    for index, (ids, (sequences, scores)) in enumerate(zip(inputs, results, strict=True)):
        ref = alone(model, ids, kwargs)
        assert torch.equal(sequences, ref.sequences), f"input {index}: {sequences.tolist()} != {ref.sequences.tolist()}"
        if kwargs.get("num_beams", 1) > 1:
            torch.testing.assert_close(scores, ref.sequences_scores, rtol=1e-5, atol=1e-5)
        continuations.append(sequences[0, len(ids) :].tolist())
    return continuations


def assert_varied(continuations: list[list[int]]) -> None:
    lengths = [len(c) for c in continuations]
    assert max(lengths) >= 2 * min(lengths) and len(set(lengths)) >= 3, f"lengths should vary: {lengths}"
    assert len({tuple(c[:3]) for c in continuations}) >= len(continuations) // 2, "the model ignores its prompt"


def run(model, inputs, kwargs, batch_inputs: int = 3):
    rows = batch_inputs * kwargs.get("num_beams", 1)
    with fastgen.report() as rep:
        results = list(generate_many(model, inputs, batch_rows=rows, return_scores=True, **kwargs))
    assert "continuous" in rep.ran, rep.fell_back
    return results, rep


#: families the whole CASES mix runs on in CI: GPT-2's learned positions, Llama's rotary ones with grouped-query
#: attention, Qwen3's sliding layers. Qwen2 and Mistral (Llama's layout) run CASES_FOR_EVERY_FAMILY in CI, their
#: other cells are marked slow (~7 s in all).
ALL_CASES_IN_CI = ("gpt2", "llama", "qwen3")
CASES_FOR_EVERY_FAMILY = ("greedy", "beam3-ret2-lp0.7-ngram")


@pytest.mark.parametrize(
    "family, case",
    harness.family_case_grid(FAMILIES, CASES, lambda f, c: f in ALL_CASES_IN_CI or c in CASES_FOR_EVERY_FAMILY),
)
def test_matches_generate_alone(models, family, case):
    model, kwargs = models[family], CASES[case]
    inputs = make_inputs()
    results, _ = run(model, inputs, kwargs)
    assert_varied(assert_matches_alone(model, inputs, kwargs, results))


@pytest.mark.parametrize("case", ["greedy", "beam4"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_eager_attention_matches_too(family, case):
    """The 2-D mask + per-row position_ids path with the eager attention (the others run sdpa)."""
    model, kwargs = eos_model(family, "eager"), CASES[case]
    inputs = make_inputs(8, seed=2)
    results, _ = run(model, inputs, kwargs)
    assert_matches_alone(model, inputs, kwargs, results)


@pytest.mark.parametrize("beams", [1, 3])
def test_prefill_is_upstreams_bit_for_bit(models, beams):
    model = models["llama"]
    for ids in make_inputs(4, seed=3):
        with torch.no_grad(), linear_scope(model):  # as generate_many runs it (fastgen's exact GEMM forms)
            logits, kv = decoder_only.prefill(model, ids, beams)
        ref = alone(model, ids, dict(num_beams=beams, max_new_tokens=1, output_logits=True))
        assert torch.equal(logits, ref.logits[0]) and kv[0][0].shape[-2] == len(ids)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),  # generate's default: 20 new tokens (max_length counts them from the prompt)
        dict(max_length=44),  # counts the prompt
        dict(max_length=30, max_new_tokens=9),  # max_new_tokens wins
        dict(num_beams=2, min_length=45, min_new_tokens=3, max_new_tokens=12),  # min_new_tokens wins
        dict(num_beams=2, early_stopping="never", length_penalty=1.5, max_new_tokens=12),
    ],
    ids=["default", "max-length", "max-length-and-new", "min-length-and-new", "never-lp-positive"],
)
def test_length_settings_per_prompt(models, kwargs):
    model = models["qwen2"]
    inputs = make_inputs(8, seed=9)
    results, _ = run(model, inputs, kwargs)
    assert_matches_alone(model, inputs, kwargs, results)


def test_generation_config_argument(models):
    model, config = models["gpt2"], GenerationConfig(max_length=50, num_beams=2, eos_token_id=harness.EOS)
    inputs = make_inputs(6, seed=10)
    results, _ = run(model, inputs, dict(generation_config=config))
    assert_matches_alone(model, inputs, dict(generation_config=config), results)


def test_prompt_reaching_max_length_is_an_error(models):
    """``generate`` raises for such a prompt; so does ``generate_many``, naming the input."""
    with pytest.raises(ValueError, match="Input length"):
        alone(models["llama"], torch.arange(3, 13), dict(max_length=10))
    with pytest.raises(ValueError, match="input 1: its 10 tokens reach max_length=10"):
        list(generate_many(models["llama"], [torch.arange(3, 6), torch.arange(3, 13)], max_length=10))


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_equals_generate_alone_under_each_inputs_seed(models, family):
    """Sampling (the continuous package's seeded streams): input ``i`` equals ``generate`` after
    ``torch.manual_seed(S + i)`` on its prompt alone, its ``num_return_sequences`` rows prefilled together."""
    model, seed = models[family], 100
    kwargs = dict(do_sample=True, top_k=20, temperature=0.9, num_return_sequences=2, max_new_tokens=16)
    inputs = make_inputs(6, seed=12)
    with fastgen.report() as rep:
        results = list(generate_many(model, inputs, batch_rows=4, seed=seed, **kwargs))
    assert "continuous" in rep.ran, rep.fell_back
    for index, (ids, sequences) in enumerate(zip(inputs, results, strict=True)):
        torch.manual_seed(seed + index)
        with fastgen.unpatched(), torch.inference_mode():
            ref = model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), **kwargs)
        assert torch.equal(sequences, ref), f"input {index}: {sequences.tolist()} != {ref.tolist()}"
    assert len({tuple(r[0, len(ids) :].tolist()) for r, ids in zip(results, inputs, strict=True)}) > 3


def test_batch_is_refilled(models):
    """Newcomers join while others run: more rows per step than one input has, fewer steps than one by one."""
    model, kwargs = models["llama"], CASES["beam4"]
    inputs = make_inputs(12, seed=2)
    settings, _ = resolve(model, kwargs)
    stats: dict[str, int] = {}
    list(decoder_only.run_decoder_only(model, inputs, settings, 16, kwargs, stats))
    alone_steps = sum(alone(model, ids, kwargs).sequences.shape[1] - len(ids) - 1 for ids in inputs)
    assert stats["prefills"] == len(inputs)
    assert stats["rows"] / stats["steps"] > 3 * kwargs["num_beams"] - 1, stats
    assert stats["steps"] < alone_steps / 2, (stats, alone_steps)


def test_inputs_that_outgrow_the_sliding_window_run_alone(models):
    """Qwen3's window (64) is measured from the batch's common query position: longer inputs run alone."""
    model, kwargs = models["qwen3"], dict(num_beams=2, max_new_tokens=40)
    inputs = make_inputs(6, seed=4)
    results, rep = run(model, inputs, kwargs)
    assert any("sliding window" in why for _, why in rep.degraded), rep.degraded
    assert_matches_alone(model, inputs, kwargs, results)


def _planted(model, bug: str):
    """A forward pre-hook that breaks the decode step: common positions, or no padding mask."""

    def hook(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            if bug == "positions":
                kwargs["position_ids"] = torch.full_like(kwargs["position_ids"], kwargs["attention_mask"].shape[1] - 1)
            else:
                kwargs["attention_mask"] = None
        return args, kwargs

    return model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("bug", ["positions", "mask"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_planted_bug_is_caught(models, family, bug):
    model, kwargs = models[family], CASES["greedy"]
    inputs = make_inputs(8, seed=5)
    handle = _planted(model, bug)
    try:
        results = list(generate_many(model, inputs, batch_rows=4, **kwargs))
    finally:
        handle.remove()
    wrong = [i for i, ids in enumerate(inputs) if not torch.equal(results[i], alone(model, ids, kwargs).sequences)]
    assert wrong, f"the comparison should see the planted bug ({bug})"


@pytest.mark.parametrize(
    "family, kwargs, reason",
    [
        ("llama", dict(num_beams=2, repetition_penalty=1.3, max_new_tokens=5), "repetition_penalty"),
        ("gpt2", dict(do_sample=True, num_beams=2, max_new_tokens=5), "beam sampling"),
        ("gemma2", dict(max_new_tokens=5), "gemma2"),
    ],
)
def test_fallbacks_warn_once_and_equal_generate(models, caplog, family, kwargs, reason):
    """Unsupported calls run ``generate`` on each input alone (issue 24: were static left-padded batches,
    whose rows kept the pads), with one warning."""
    model = models.get(family) or harness.tiny_hf_model(family)
    inputs = make_inputs(4, seed=6)
    fastgen.optimizer.registry._state.warned.clear()
    with caplog.at_level(logging.WARNING, logger="fastgen"), fastgen.report() as rep:
        torch.manual_seed(0)
        results = list(generate_many(model, inputs, batch_rows=2 * kwargs.get("num_beams", 1), **kwargs))
    assert any(f == "continuous" and reason in why for f, why in rep.fell_back), rep.fell_back
    assert len([r for r in caplog.records if reason in r.getMessage()]) == 1
    torch.manual_seed(0)  # sampling: S drawn once from the global generator, input i alone under seed S + i
    start = int(torch.randint(0, 2**62, ()).item()) if kwargs.get("do_sample") else None
    for index, ids in enumerate(inputs):
        if start is not None:
            torch.manual_seed(start + index)
        assert torch.equal(results[index], alone(model, ids, kwargs).sequences)


def test_batched_prefill_would_not_be_bit_exact(models):
    """Why newcomers are prefilled one at a time: right-padded together (2-D mask), their logits differ in
    the last bits from the single-prompt prefill that ``generate`` runs (the one-at-a-time prefill is equal:
    ``test_prefill_is_upstreams_bit_for_bit``)."""
    model = models["llama"]
    prompts = make_inputs(4, seed=8)
    width = max(len(p) for p in prompts)
    ids, mask = torch.full((len(prompts), width), harness.PAD), torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)], mask[row, : len(prompt)] = prompt, 1
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(width)[None].expand_as(ids))
        alone_logits = torch.cat([decoder_only.prefill(model, prompt, 1)[0] for prompt in prompts])
    together = torch.stack([out.logits[row, len(p) - 1] for row, p in enumerate(prompts)])
    torch.testing.assert_close(together, alone_logits, rtol=1e-5, atol=1e-5)
    if torch.equal(together, alone_logits):
        pytest.skip("this CPU's kernels happen to give the same bits batched")


def test_readme_lists_the_served_decoder_only_families():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    match = re.search(r"<!-- families:continuous-decoder-only -->(.*?)<!-- /families -->", readme)
    assert match, "README has no decoder-only continuous-batching family list"
    assert {name.strip() for name in match.group(1).split(",")} == set(DECODER_ONLY_FAMILIES)


def test_results_stream_in_input_order(models):
    """The first result comes before the rest are generated, and every result is its own input's."""
    model, kwargs = models["mistral"], CASES["greedy"]
    inputs = make_inputs(6, seed=11)
    stream = generate_many(model, inputs, batch_rows=2, **kwargs)
    assert torch.equal(next(stream), alone(model, inputs[0], kwargs).sequences)
    rest = list(stream)
    assert [r[0, : len(ids)].tolist() for r, ids in zip(rest, inputs[1:], strict=True)] == [
        ids.tolist() for ids in inputs[1:]
    ]
