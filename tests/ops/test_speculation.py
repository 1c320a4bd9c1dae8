"""Model-free pieces of batched speculative decoding: prompt-lookup drafts (HF's rule, batched),
greedy acceptance, and BASS's draft-length schedule."""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from fastgen.ops.speculation import greedy_accept, prompt_lookup_drafts
from fastgen.optimizer.transformers.draft_length import DraftLength


def test_prompt_lookup_matches_transformers_row_by_row() -> None:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 8, (n,), generator=g) for n in (5, 9, 14, 20, 2)]
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width + 3, dtype=torch.long)  # left padding, 3 free columns on the right
    starts = torch.tensor([width - len(r) for r in rows])
    for b, r in enumerate(rows):
        tokens[b, starts[b] : width] = r
    ends = torch.full((len(rows),), width)
    for ngram in (1, 2, 3):
        drafts, lengths = prompt_lookup_drafts(tokens, starts, ends, k=4, max_ngram=ngram)
        for b, r in enumerate(rows):
            hf = PromptLookupCandidateGenerator(num_output_tokens=4, max_matching_ngram_size=ngram, max_length=100)
            candidate, _ = hf.get_candidates(r[None])
            expected = candidate[0, len(r) :].tolist()
            assert drafts[b, : lengths[b]].tolist() == expected, (b, ngram)


def test_greedy_accept_counts_leading_matches() -> None:
    scores = torch.full((3, 4, 6), -1.0)
    best = torch.tensor([[1, 2, 3, 4], [1, 5, 3, 4], [0, 0, 0, 0]])
    scores.scatter_(2, best[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [5, 0, 0]])
    n, tokens = greedy_accept(drafts, scores, draft_lengths=torch.tensor([3, 3, 3]))
    assert n.tolist() == [3, 1, 0] and torch.equal(tokens, best)
    n, _ = greedy_accept(drafts, scores, draft_lengths=torch.tensor([2, 3, 3]))
    assert n.tolist() == [2, 1, 0]


def test_bass_schedule_is_algorithm_1() -> None:
    schedule = DraftLength()  # l0 = 7, l_incre = 2, l_mod = 10, l_limit = 32
    trace = []
    for accepted in (7, 9, 0, 0, 5, 3, 3):
        schedule.update(schedule.length, accepted)
        trace.append(schedule.length)
    # 7 -> 9 (all accepted) -> 11 -> 11-2-0=9 -> 9-1-1=7 -> max(7-1-1, 5)=5 -> max(5-1-1, 3)=3 -> 3+2=5 (all 3 accepted)
    assert trace == [9, 11, 9, 7, 5, 3, 5]
    capped = DraftLength(length=31)
    capped.update(31, 31)
    assert capped.length == 32


def test_heuristic_schedule_is_transformers_rule() -> None:
    schedule = DraftLength(schedule="heuristic", length=5)
    schedule.update(5, 5)
    assert schedule.length == 7
    schedule.update(7, 2)
    assert schedule.length == 6
