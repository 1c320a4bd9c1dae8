"""Speculative sampling keeps the main model's output distribution (a chi-square test on a tiny vocabulary).

Every row of one large batch gets the same prompt; the first generated token comes from the prefill,
the next ones from one speculative step (two drafts), so tokens 2 and 3 are produced by the
acceptance rule (accept / residual resample / bonus). Their joint frequencies are compared with the
exact probabilities of the main model, computed by enumerating every prefix.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import fastgen
from fastgen.optimizer.transformers import speculative
from tests.harness import requires_feature, tiny_hf_model

pytestmark = requires_feature("speculative")

VOCAB, ROWS = 8, 6000
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]


def _model(seed: int, **overrides):
    model = tiny_hf_model("llama", seed=seed, vocab_size=VOCAB, initializer_range=0.6, **overrides)
    model.generation_config.eos_token_id = None  # no row stops early: every row yields tokens 2 and 3
    return model


def _processed_probs(model, prefixes: torch.Tensor, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=prefixes).logits[:, -1].float()
    return (logits / temperature).softmax(-1)


def _exact_joint_of_tokens_2_and_3(model, temperature: float) -> torch.Tensor:
    """P(t2, t3) for the prompt, summed over t1: (VOCAB, VOCAB)."""
    prompt = torch.tensor([PROMPT])
    p1 = _processed_probs(model, prompt, temperature)[0]
    t1 = torch.arange(VOCAB)[:, None]
    p2 = _processed_probs(model, torch.cat([prompt.expand(VOCAB, -1), t1], 1), temperature)  # (t1, t2)
    t12 = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    p3 = _processed_probs(model, torch.cat([prompt.expand(VOCAB * VOCAB, -1), t12], 1), temperature)
    p3 = p3.view(VOCAB, VOCAB, VOCAB)  # (t1, t2, t3)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0).double()


def _chi_square_p_value(samples: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(samples[:, 0] * VOCAB + samples[:, 1], minlength=VOCAB * VOCAB).double()
    expected = expected.flatten() * len(samples)
    big = expected >= 5  # merge rare cells so the chi-square approximation holds
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    return float(chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("drafting", ["assistant", "prompt_lookup"])
def test_sampling_distribution_equals_main_model(drafting: str, temperature: float) -> None:
    from transformers import GenerationConfig

    model = _model(seed=0)
    draft = _model(seed=7, num_hidden_layers=1)
    exact = _exact_joint_of_tokens_2_and_3(model, temperature)
    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=None,
        top_p=None,
        max_new_tokens=4,
        pad_token_id=1,
        eos_token_id=None,
        fastgen_draft_length=2,
    )
    extra = dict(assistant_model=draft) if drafting == "assistant" else dict(prompt_lookup_num_tokens=2)
    torch.manual_seed(0)
    with fastgen.patched(["speculative"]):
        out = model.generate(input_ids=torch.tensor([PROMPT] * ROWS), generation_config=config, **extra)
    assert speculative.last_stats["steps"] > 0 and speculative.last_stats["accepted"] > 0
    p_value = _chi_square_p_value(out[:, len(PROMPT) + 1 : len(PROMPT) + 3], exact)
    assert p_value > 1e-4, f"sampled tokens are not distributed as the main model's (p = {p_value:.2e})"
    if drafting == "assistant":
        # Not vacuous: the draft's own distribution is far from the main model's, and rows rejected drafts.
        draft_exact = _exact_joint_of_tokens_2_and_3(draft, temperature)
        assert 0.5 * (draft_exact - exact).abs().sum() > 0.2
        assert speculative.last_stats["accepted"] < speculative.last_stats["drafted"]


def test_a_wrong_rule_fails_the_test() -> None:
    """Power check: samples of the draft model (what a broken acceptance rule would emit) are rejected."""
    model, draft = _model(seed=0), _model(seed=7, num_hidden_layers=1)
    torch.manual_seed(0)
    with fastgen.unpatched():
        out = draft.generate(
            input_ids=torch.tensor([PROMPT] * 2000),
            do_sample=True,
            top_k=None,
            max_new_tokens=3,
            pad_token_id=1,
            eos_token_id=None,
        )
    assert (
        _chi_square_p_value(out[:, len(PROMPT) + 1 : len(PROMPT) + 3], _exact_joint_of_tokens_2_and_3(model, 1.0))
        < 1e-6
    )
