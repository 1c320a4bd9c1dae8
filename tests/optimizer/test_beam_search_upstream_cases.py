"""Transformers' own beam search tests that cannot run offline here, on tiny models: fastgen's loop
(feature ``beam``) against upstream's ``_beam_search``.

``scripts/upstream_tests.py`` found no test whose outcome changes with ``beam`` on (README, upstream
test suites), but the beam tests of ``tests/generation/test_utils.py::GenerationIntegrationTests``
load Hub checkpoints and fail on both sides without a network, so they compare nothing. Each test
below keeps one of them (named in its docstring) with its ``generate`` arguments and its own
assertion, on a tiny seeded model instead of the checkpoint, and adds the token-for-token comparison
with upstream.
"""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import fastgen
from fastgen.optimizer import registry
from tests import harness

pytestmark = harness.requires_feature("beam")

#: every default feature, the loop included
FEATURES = sorted(set(fastgen.known_features()) - registry.OPT_IN_FEATURES)


def eos_model(family: str, gain: float) -> torch.nn.Module:
    """A tiny model whose LM head favours EOS by ``gain``, so that beams finish before the length limit."""
    model = harness.tiny_hf_model(family)
    with torch.no_grad():
        model.get_output_embeddings().weight[harness.EOS] *= gain
    return model


def assert_ran_fastgen_loop(report: fastgen.Report) -> None:
    assert report.fast_path("beam"), f"fastgen's loop did not serve the call:\n{report}"


def assert_transition_scores_add_up(model, output, atol: float = 1e-3) -> None:
    """Upstream's assertion: per-step transition scores add up to ``sequences_scores`` (length_penalty 0)."""
    transition = model.compute_transition_scores(output.sequences, output.scores, output.beam_indices)
    torch.testing.assert_close(transition.sum(dim=-1), output.sequences_scores, atol=atol, rtol=0)


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [
        # test_transition_scores_beam_search_encoder_decoder
        ("bart", dict(eos_token_id=None)),
        # test_transition_scores_beam_search_encoder_decoder_with_eos
        ("bart", dict()),
        # test_transition_scores_beam_search_decoder_only (the tokenizer's pad is its EOS there)
        ("gpt2", dict(eos_token_id=None, pad_token_id=harness.EOS)),
    ],
    ids=["enc-dec-no-eos", "enc-dec-eos", "decoder-only-no-eos"],
)
def test_transition_scores(family, kwargs):
    """``test_transition_scores_beam_search_*``: batch 2, padded, 4 beams, 2 returned, length_penalty 0."""
    model = eos_model(family, gain=2.0)
    inputs = harness.tiny_inputs(model, batch=2)
    generate = dict(max_length=10, num_beams=4, num_return_sequences=2, length_penalty=0.0, **kwargs)
    if not model.config.is_encoder_decoder:
        generate["max_length"] = inputs["input_ids"].shape[1] + 8  # the upstream prompts are ~2 tokens
    _, candidate, report = harness.assert_same_generation(
        model, inputs, features=FEATURES, with_report=True, **generate
    )
    assert_ran_fastgen_loop(report)
    assert_transition_scores_add_up(model, candidate)


def test_transition_scores_early_stopping():
    """``test_transition_scores_early_stopping`` (t5-small there): two equal inputs, forced EOS at the last
    step, 4 beams, 3 returned, length_penalty 0; transition scores add up exactly (numpy's default
    tolerance)."""
    model = harness.tiny_hf_model("t5")
    row = harness.tiny_inputs(model, batch=1, padded=False)["input_ids"]
    inputs = {"input_ids": row.repeat(2, 1)}
    _, candidate, report = harness.assert_same_generation(
        model,
        inputs,
        features=FEATURES,
        with_report=True,
        max_length=10,
        forced_eos_token_id=harness.EOS,
        num_beams=4,
        do_sample=False,
        num_return_sequences=3,
        length_penalty=0.0,
    )
    assert_ran_fastgen_loop(report)
    assert torch.equal(candidate.sequences[:3], candidate.sequences[3:]), "equal inputs, equal beams"
    assert (candidate.sequences[:, -1] == harness.EOS).all(), "the forced EOS ends every returned beam"
    assert_transition_scores_add_up(model, candidate, atol=1e-8 + 1e-5 * candidate.sequences_scores.abs().max())


def test_padded_input_scores_as_alone():
    """``test_encoder_decoder_generate_attention_mask``: a padded input's 5 returned beams (5 beams,
    ``max_length`` 50, no EOS) score as when the input runs alone. Upstream's test gives no mask and
    expects ``generate`` to build it from the pad tokens; Transformers 5.23 builds one only for
    decoder-only models (``generate`` step 4), so the mask is given here."""
    model = harness.tiny_hf_model("bart")
    padded = {key: value.flip(0) for key, value in harness.tiny_inputs(model, batch=2).items()}  # padded row first
    assert not padded["attention_mask"][0].all(), "the first input must be padded"
    alone = {"input_ids": padded["input_ids"][:1, : int(padded["attention_mask"][0].sum())]}
    kwargs = dict(max_length=50, num_beams=5, num_return_sequences=5, eos_token_id=None)
    _, batched, batched_report = harness.assert_same_generation(
        model, padded, features=FEATURES, with_report=True, **kwargs
    )
    _, single, single_report = harness.assert_same_generation(
        model, alone, features=FEATURES, with_report=True, **kwargs
    )
    assert_ran_fastgen_loop(batched_report)
    assert_ran_fastgen_loop(single_report)
    assert (batched.sequences_scores[:5].sum() - single.sequences_scores.sum()).abs() < 5e-4


@pytest.mark.parametrize("return_dict_in_generate", [True, False], ids=["dict", "tensor"])
def test_batch_level_early_stop_heuristic(return_dict_in_generate):
    """``test_beam_search_early_stop_heuristic`` (#38778, OLMo-2 there): 10 beams, length_penalty 2,
    a batch of 1 and then a batch of 2 whose second prompt is longer; the early-stop heuristic is
    tracked per input. The tensor output takes fastgen's lazy stop check (no per-step scores to keep)."""
    model = eos_model("llama", gain=4.0)
    prompts = harness.tiny_inputs(model, batch=2, length=10)
    prompts = {key: value.flip(0) for key, value in prompts.items()}  # the short prompt (left-padded) first
    kwargs = dict(num_beams=10, max_new_tokens=24, length_penalty=2.0, return_dict_in_generate=return_dict_in_generate)
    if not return_dict_in_generate:
        kwargs["output_scores"] = False
    one = {"input_ids": prompts["input_ids"][:1, 2:], "attention_mask": prompts["attention_mask"][:1, 2:]}
    for inputs in (one, prompts):
        reference, _, report = harness.assert_same_generation(
            model, inputs, features=FEATURES, with_report=True, **kwargs
        )
        assert_ran_fastgen_loop(report)
        sequences = reference.sequences if return_dict_in_generate else reference
        generated = sequences[:, inputs["input_ids"].shape[1] :]
        assert (generated == harness.EOS).any(dim=-1).all(), "every input must stop on EOS, not the length limit"


class StopAtLength(StoppingCriteria):
    """``test_custom_stopping_criteria``'s ``DummyCriteria``: stop every hypothesis at a fixed length."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[-1] >= self.length, device=input_ids.device)


@pytest.mark.parametrize(("stop_at", "max_length", "expected_length"), [(6, 8, 6), (6, 5, 5)])
def test_custom_stopping_criterion_runs_upstream(stop_at, max_length, expected_length):
    """``test_custom_stopping_criteria`` / ``test_beam_search_advanced_stopping_criteria`` with beams: a
    stopping criterion fastgen's loop does not know sends the whole call to upstream's loop, and the
    length is the smaller of the criterion's and ``max_length`` (upstream's assertion)."""
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model, batch=2)
    criteria = StoppingCriteriaList([StopAtLength(stop_at)])
    _, candidate, report = harness.assert_same_generation(
        model,
        inputs,
        features=FEATURES,
        with_report=True,
        num_beams=3,
        max_length=max_length,
        stopping_criteria=criteria,
    )
    assert ("beam", "stopping criterion StopAtLength") in report.fell_back
    assert "beam" not in report.ran
    assert candidate.sequences.shape == (2, expected_length)
