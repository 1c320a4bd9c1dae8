"""Batched speculative decoding: greedy identity with regular decoding, sampling in distribution,
fallbacks equal to upstream."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import fastgen
from fastgen.optimizer.transformers import speculative
from fastgen.optimizer.transformers.speculative import MODEL_FAMILIES
from tests.harness import requires_feature, tiny_hf_model, tiny_inputs

pytestmark = requires_feature("speculative")


def _noisy_copy(model, scale: float = 0.005, seed: int = 3):
    """A draft that agrees with ``model`` most of the time: the same weights plus small noise."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std().clamp(min=1e-3))
    return draft


def _family(model) -> str:
    return {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[type(model).__name__]


def _drafts(family: str, model):
    return {
        "self": model,
        "noisy": _noisy_copy(model),
        "independent": tiny_hf_model(family, seed=11, num_hidden_layers=1)
        if family != "gpt2"
        else tiny_hf_model(family, seed=11, n_layer=1),
    }


def _regular_greedy(model, inputs, **kwargs):
    with fastgen.unpatched():
        return model.generate(**inputs, do_sample=False, **kwargs)


@pytest.mark.parametrize("family", list(MODEL_FAMILIES))
def test_greedy_identical_to_regular_decoding_for_any_draft(family: str) -> None:
    model = tiny_hf_model(family)
    acceptance = {}
    for kind, draft in _drafts(family, model).items():
        accepted = drafted = 0
        for batch in (1, 2, 3, 5, 8):
            inputs = tiny_inputs(model, batch=batch, length=4 + 2 * batch, seed=batch)
            reference = _regular_greedy(model, inputs, max_new_tokens=24)
            assert len(set(reference[:, -24:].flatten().tolist())) > 3, "degenerate model output"
            with fastgen.patched(["speculative"]):
                got = model.generate(**inputs, assistant_model=draft, do_sample=False, max_new_tokens=24)
            assert torch.equal(reference, got), f"{kind} draft, batch {batch}:\n{reference}\n{got}"
            if batch == 1:
                continue  # upstream's own loop (fastgen leaves batch 1 alone)
            assert speculative.last_stats["steps"] > 0, "fastgen's loop did not run"
            accepted += speculative.last_stats["accepted"]
            drafted += speculative.last_stats["drafted"]
        acceptance[kind] = accepted / drafted
    # The drafts are what they claim to be: the same model agrees always, an independent one rarely.
    assert acceptance["self"] == 1.0
    assert acceptance["noisy"] > 0.5 > acceptance["independent"]


@pytest.mark.parametrize("family", list(MODEL_FAMILIES))
def test_greedy_rows_finishing_at_different_steps(family: str) -> None:
    model = tiny_hf_model(family)
    inputs = tiny_inputs(model, batch=6, length=10, seed=4)
    free = _regular_greedy(model, inputs, max_new_tokens=30, eos_token_id=None)
    # An EOS that some rows emit early and others late or never.
    eos = int(free[0, 10 + 5])
    reference = _regular_greedy(model, inputs, max_new_tokens=30, eos_token_id=eos)
    finished_at = [(row[10:] == eos).nonzero().flatten()[:1].tolist() for row in reference]
    assert len({tuple(f) for f in finished_at}) > 1, "rows should finish at different steps"
    for draft in (_noisy_copy(model), tiny_hf_model(family, seed=11)):
        with fastgen.patched(["speculative"]):
            got = model.generate(**inputs, assistant_model=draft, do_sample=False, max_new_tokens=30, eos_token_id=eos)
        assert torch.equal(reference, got)


@pytest.mark.parametrize("family", list(MODEL_FAMILIES))
@pytest.mark.parametrize("schedule", ["bass", "heuristic", "constant"])
def test_draft_schedules_keep_greedy_output(family: str, schedule: str) -> None:
    from transformers import GenerationConfig

    model = tiny_hf_model(family)
    inputs = tiny_inputs(model, batch=4, length=9)
    reference = _regular_greedy(model, inputs, max_new_tokens=20)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=20,
        pad_token_id=model.generation_config.pad_token_id,
        fastgen_draft_schedule=schedule,
        fastgen_draft_length=3,
    )
    with fastgen.patched(["speculative"]):
        got = model.generate(**inputs, assistant_model=_noisy_copy(model), generation_config=config)
    assert torch.equal(reference, got)


@pytest.mark.parametrize("family", list(MODEL_FAMILIES))
def test_prompt_lookup_greedy_identical(family: str) -> None:
    model = tiny_hf_model(family)
    for batch in (2, 4, 7):
        inputs = tiny_inputs(model, batch=batch, length=14, seed=batch)
        # Repeat a chunk of each prompt so that lookups find matches.
        inputs["input_ids"][:, -5:] = inputs["input_ids"][:, -10:-5]
        reference = _regular_greedy(model, inputs, max_new_tokens=24)
        with fastgen.patched(["speculative"]):
            got = model.generate(**inputs, prompt_lookup_num_tokens=4, do_sample=False, max_new_tokens=24)
        assert torch.equal(reference, got)
        assert speculative.last_stats["steps"] > 0


def test_with_every_feature_enabled() -> None:
    """dedup, ngram and speculative together: dedup steps aside for assisted calls, the output is unchanged."""
    model = tiny_hf_model("gpt2")
    inputs = tiny_inputs(model, batch=4)
    reference = _regular_greedy(model, inputs, max_new_tokens=16)
    speculative.last_stats.clear()
    with fastgen.patched():
        got = model.generate(**inputs, assistant_model=_noisy_copy(model), do_sample=False, max_new_tokens=16)
    assert torch.equal(reference, got) and speculative.last_stats["steps"] > 0


def test_return_dict_carries_sequences() -> None:
    model = tiny_hf_model("llama")
    inputs = tiny_inputs(model, batch=3)
    reference = _regular_greedy(model, inputs, max_new_tokens=10)
    with fastgen.patched(["speculative"]):
        out = model.generate(
            **inputs, assistant_model=model, max_new_tokens=10, do_sample=False, return_dict_in_generate=True
        )
    assert torch.equal(out.sequences, reference)


# ------------------------------------------------------------------------------ fallbacks


def _upstream_and_patched(model, inputs, **kwargs):
    results = []
    for scope in (fastgen.unpatched(), fastgen.patched(["speculative"])):
        with scope:
            torch.manual_seed(0)
            try:
                results.append(model.generate(**inputs, **kwargs))
            except ValueError as exc:
                results.append(f"ValueError: {exc}")
    return results


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
        (dict(no_repeat_ngram_size=2), "NoRepeatNGramLogitsProcessor"),
        (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
        (dict(min_new_tokens=5), "MinLengthLogitsProcessor"),
        (dict(stop_strings=["x"]), None),  # upstream needs a tokenizer for this: same error both ways
    ],
)
def test_unsupported_calls_run_upstream(kwargs, reason, caplog) -> None:
    model = tiny_hf_model("gpt2")
    inputs = tiny_inputs(model, batch=3)
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        upstream, patched = _upstream_and_patched(
            model, inputs, assistant_model=_noisy_copy(model), max_new_tokens=8, **kwargs
        )
    assert isinstance(upstream, str) and upstream == patched  # upstream refuses batch > 1; so does the fallback
    if reason:
        assert reason in caplog.text


def test_batch_one_is_upstream_bit_for_bit() -> None:
    model = tiny_hf_model("qwen2")
    inputs = tiny_inputs(model, batch=1)
    for do_sample in (False, True):
        upstream, patched = _upstream_and_patched(
            model, inputs, assistant_model=_noisy_copy(model), max_new_tokens=12, do_sample=do_sample
        )
        assert torch.equal(upstream, patched)


def test_encoder_decoder_falls_back_with_reason(caplog) -> None:
    model = tiny_hf_model("bart")
    inputs = tiny_inputs(model, batch=2)
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        upstream, patched = _upstream_and_patched(model, inputs, assistant_model=tiny_hf_model("bart", seed=4))
    assert upstream == patched
    assert "encoder-decoder" in caplog.text


def test_sliding_window_falls_back_with_reason(caplog) -> None:
    model = tiny_hf_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    inputs = tiny_inputs(model, batch=2)
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        upstream, patched = _upstream_and_patched(model, inputs, assistant_model=model, max_new_tokens=4)
    assert upstream == patched
    assert "sliding-window" in caplog.text


def test_unpatched_refuses_batch_assisted() -> None:
    """The premise: upstream Transformers refuses what this feature adds."""
    model = tiny_hf_model("llama")
    with fastgen.unpatched(), pytest.raises(ValueError, match="batch_size = 1"):
        model.generate(**tiny_inputs(model, batch=2), assistant_model=model, max_new_tokens=3)


def test_readme_lists_the_supported_families() -> None:
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    claimed = re.search(r"<!-- families:speculative -->(.*?)<!-- /families -->", readme).group(1)
    assert {name.strip() for name in claimed.split(",")} == set(speculative.MODEL_FAMILIES)


@pytest.mark.parametrize("length, new_tokens", [(1, 10), (3, 1), (3, 2), (6, 3)])
def test_short_prompts_and_budgets(length: int, new_tokens: int) -> None:
    model = tiny_hf_model("llama")
    inputs = tiny_inputs(model, batch=3, length=length, padded=length > 2)
    reference = _regular_greedy(model, inputs, max_new_tokens=new_tokens)
    for extra in (dict(assistant_model=tiny_hf_model("llama", seed=3)), dict(prompt_lookup_num_tokens=3)):
        with fastgen.patched(["speculative"]):
            got = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, **extra)
        assert torch.equal(reference, got)
