"""Batched speculative decoding steps that need no model: acceptance rules and prompt-lookup drafts.

Every function works on a whole batch at once (no Python loop over rows): row ``b`` has ``k``
draft tokens of which the first ``draft_lengths[b]`` are real (prompt lookup may find fewer than
``k``), and gets back its own number of accepted drafts ``n[b]`` plus the ``k + 1`` tokens it would
emit (``tokens[:, :n + 1]`` are the new tokens of each row: the accepted drafts and one token of the
main model's own, the correction or the bonus).

Imports torch only.
"""

from __future__ import annotations

import torch


def _leading_true(accept: torch.Tensor) -> torch.Tensor:
    """Number of leading True per row of a (B, k) bool tensor."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def _real_drafts(draft_lengths: torch.Tensor | None, k: int, device: torch.device) -> torch.Tensor | bool:
    if draft_lengths is None:
        return True
    return torch.arange(k, device=device) < draft_lengths[:, None]


def greedy_accept(
    drafts: torch.Tensor, main_scores: torch.Tensor, draft_lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: keep drafts while they equal the main model's argmax.

    ``drafts`` (B, k), ``main_scores`` (B, k + 1, V) processed scores of the main model after each
    prefix. Returns (n accepted drafts (B,), tokens (B, k + 1)); the tokens are the argmaxes, which
    equal the drafts wherever they were accepted, so the output is regular greedy decoding's.
    """
    chosen = main_scores.argmax(dim=-1)
    k = drafts.shape[1]
    accept = (drafts == chosen[:, :k]) & _real_drafts(draft_lengths, k, drafts.device)
    return _leading_true(accept), chosen


def sampled_match_accept(
    drafts: torch.Tensor, main_probs: torch.Tensor, draft_lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling without draft probabilities (prompt lookup): sample every position from the main
    model and keep drafts while they equal the samples. Each emitted token is a sample of the main
    model given the tokens before it, so the output distribution is the main model's."""
    batch, positions, vocab = main_probs.shape
    sampled = torch.multinomial(main_probs.reshape(-1, vocab), 1).view(batch, positions)
    k = drafts.shape[1]
    accept = (drafts == sampled[:, :k]) & _real_drafts(draft_lengths, k, drafts.device)
    return _leading_true(accept), sampled


def speculative_sampling_accept(
    drafts: torch.Tensor, draft_probs: torch.Tensor, main_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al.'s rule, per row: accept draft ``j`` with probability ``min(1, p_j(x)/q_j(x))``;
    at the first rejection sample from ``norm(max(0, p_j - q_j))``, after ``k`` acceptances sample the
    bonus token from ``p_k``. The emitted tokens are distributed as the main model's samples.

    ``drafts`` (B, k) were sampled from ``draft_probs`` (B, k, V); ``main_probs`` is (B, k + 1, V).
    """
    batch, k = drafts.shape
    p_draft = main_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    uniform = torch.rand(batch, k, device=drafts.device)
    n = _leading_true(uniform * q_draft < p_draft)  # u < p/q without dividing by q
    # Residual distribution at every position; at position k (no draft) q is 0, so it is p_k.
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])], dim=1)
    residual = (main_probs - q_padded).clamp_(min=0)
    at_n = residual.gather(1, n[:, None, None].expand(-1, 1, residual.shape[-1])).squeeze(1)
    p_at_n = main_probs.gather(1, n[:, None, None].expand(-1, 1, residual.shape[-1])).squeeze(1)
    total = at_n.sum(-1, keepdim=True)
    at_n = torch.where(total > 0, at_n, p_at_n)  # p == q exactly: the residual is empty, p is the answer
    correction = torch.multinomial(at_n, 1).squeeze(-1)
    tokens = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)
    tokens.scatter_(1, n[:, None], correction[:, None])
    return n, tokens


def prompt_lookup_drafts(
    tokens: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, k: int, max_ngram: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-lookup drafts per row (HF's ``PromptLookupCandidateGenerator`` rule, batched).

    Row ``b`` of ``tokens`` holds its sequence in columns ``[starts[b], ends[b])``. For the longest
    n-gram size (``max_ngram`` down to 1) whose last n tokens occur earlier in the row, take the first
    occurrence with a continuation and draft up to ``k`` tokens that followed it. Returns
    (drafts (B, k), draft_lengths (B,)); rows without a match get length 0.
    """
    batch, width = tokens.shape
    device = tokens.device
    drafts = tokens.new_zeros(batch, k)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    if k == 0:
        return drafts, lengths
    found = torch.zeros(batch, dtype=torch.bool, device=device)
    begin = torch.zeros(batch, dtype=torch.long, device=device)
    for n in range(min(max_ngram, width - 1), 0, -1):
        tail_cols = (ends[:, None] - n + torch.arange(n, device=device)).clamp_(min=0)
        tail = tokens.gather(1, tail_cols)
        windows = tokens.unfold(1, n, 1)  # (B, width - n + 1, n)
        where = torch.arange(windows.shape[1], device=device)
        match = (windows == tail[:, None, :]).all(-1)
        match &= (where >= starts[:, None]) & (where + n < ends[:, None])  # inside the row, continuation exists
        has = match.any(-1) & ~found & (ends - starts > n)
        first = match.long().argmax(-1)
        begin = torch.where(has, first + n, begin)
        found |= has
    cols = begin[:, None] + torch.arange(k, device=device)
    drafts = tokens.gather(1, cols.clamp_(max=width - 1))
    lengths = torch.where(found, (ends - begin).clamp(max=k), lengths)
    return drafts, lengths
