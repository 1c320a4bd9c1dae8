"""``fastgen_cpu::log_softmax_top_k`` behind :func:`fastgen.ops.beam_topk.approximate_top_k`.

What is asserted: against upstream's step (``log_softmax``, ``+ running score``, ``torch.topk`` over M·V),
the values agree to float rounding, every returned candidate is one of the k best up to that rounding, the
order is descending with equal values by the smaller flat index, and rows with a NaN, ``+inf`` or no finite
logit give None (the caller's ordinary path).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen.ops import beam_topk, cpu_kernels

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=str(cpu_kernels.unavailable_reason()))
TOLERANCE = 1e-4  # the normaliser's float rounding, on log-probs of magnitude < ~40


def _reference(logits, scores, k):
    batch, beams = scores.shape
    log_probs = torch.log_softmax(logits, dim=-1).view(batch, beams, -1) + scores.unsqueeze(-1)
    return log_probs.view(batch, -1), torch.topk(log_probs.view(batch, -1), k)


def _case(batch, beams, vocab, seed, grid=False):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch * beams, vocab, generator=generator) * 5
    if grid:
        logits = logits.round()
    scores = -torch.rand(batch, beams, generator=generator) * 10
    return logits, scores


@needs_kernels
@settings(max_examples=80, deadline=None)
@given(
    batch=st.integers(1, 4),
    beams=st.integers(1, 5),
    vocab=st.integers(2, 700),
    k_share=st.floats(0.0, 1.0),
    seed=st.integers(0, 10**6),
    grid=st.booleans(),
)
def test_matches_upstreams_step_to_rounding(batch, beams, vocab, k_share, seed, grid):
    logits, scores = _case(batch, beams, vocab, seed, grid)
    k = max(1, min(beams * vocab, round(k_share * min(2 * beams + 2, beams * vocab))))
    step = beam_topk.approximate_top_k(logits, scores, k)
    assert step is not None
    full, (best, _) = _reference(logits, scores, k)
    flat = step.beams * vocab + step.tokens
    assert step.scores.shape == step.beams.shape == step.tokens.shape == (batch, k)
    assert ((step.beams >= 0) & (step.beams < beams) & (step.tokens >= 0) & (step.tokens < vocab)).all()
    chosen = full.gather(1, flat)
    torch.testing.assert_close(step.scores, chosen, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(step.scores, best, rtol=0, atol=TOLERANCE)  # the k best values, in order
    for row in range(batch):
        assert len(set(flat[row].tolist())) == k  # distinct candidates
        values, indices = step.scores[row].tolist(), flat[row].tolist()
        for j in range(1, k):
            assert values[j - 1] > values[j] or (values[j - 1] == values[j] and indices[j - 1] < indices[j])


@needs_kernels
def test_same_candidates_as_upstream_on_separated_scores():
    """With every score well apart (no near-ties), the candidates are upstream's exactly."""
    logits, scores = _case(3, 4, 5000, seed=1)
    step = beam_topk.approximate_top_k(logits, scores, 8)
    _, (values, flat) = _reference(logits, scores, 8)
    assert (values[:, :-1] - values[:, 1:]).min() > 10 * TOLERANCE  # the case is separated: the check bites
    assert torch.equal(step.beams, flat // 5000) and torch.equal(step.tokens, flat % 5000)


@needs_kernels
@pytest.mark.parametrize("special", ["nan", "inf", "all -inf"])
def test_rows_it_cannot_serve_give_none(special):
    logits, scores = _case(2, 3, 300, seed=2)
    if special == "nan":
        logits[4, 17] = float("nan")
    elif special == "inf":
        logits[1, 5] = float("inf")
    else:
        logits[3] = float("-inf")
    assert beam_topk.approximate_top_k(logits, scores, 6) is None


@needs_kernels
def test_some_minus_inf_logits_are_fine():
    logits, scores = _case(2, 2, 64, seed=3)
    logits[:, ::2] = float("-inf")  # banned by the model itself: half the vocabulary
    step = beam_topk.approximate_top_k(logits, scores, 4)
    _, (values, _) = _reference(logits, scores, 4)
    torch.testing.assert_close(step.scores, values, rtol=0, atol=TOLERANCE)
    assert (step.tokens % 2 == 1).all()


def test_other_calls_are_not_served():
    logits, scores = _case(1, 2, 10, seed=4)
    assert beam_topk.approximate_top_k(logits.double(), scores, 2) is None
    assert beam_topk.approximate_top_k(logits[:1], scores, 2) is None  # rows != inputs x beams
