"""fairseq 0.12 ``SequenceGenerator`` beam search with fastgen's step (feature "beam").

Upstream's ``_generate`` spends, per step and outside the model, most of its time in one line:
``lprobs[lprobs != lprobs] = -inf`` — a full N×V comparison, then a boolean-mask ``index_put_``
(a ``nonzero`` over N×V, and a host sync on a GPU) to replace NaN log-probs that almost never exist.
``BeamSearch.step`` then adds the running scores out of place (a fresh N×V tensor) before its
``topk``. This loop keeps upstream's order of operations and results, and differs in two places:

- NaN → -inf with one in-place ``nan_to_num_`` (same values, ±inf kept; one pass, no sync);
- the step's ``lprobs + score`` and ``topk`` through :func:`fastgen.ops.beam_topk.log_probs_top_k`
  (in place on the one N×V buffer, then upstream's own ``torch.topk``: values and tie order are
  bit-identical; k = min(2·beam, beam·V − 1) and step 0 reads beam 0's rows, as ``BeamSearch.step``).

Everything else is upstream's, called where upstream calls it: the ensemble's encoder / decoder /
reorder methods (so the ``dedup`` feature's shared ``encoder_out`` and the ``ngram`` feature's
``NGramRepeatBlock`` apply unchanged), ``_prefix_tokens``, ``finalize_hypos``. Sentences whose
``beam`` hypotheses are finished leave the batch, as upstream does.

Scope: exact ``SequenceGenerator`` + ``EnsembleModel`` with one model, exact ``BeamSearch``, no LM
fusion, no constraints, a ``src_tokens`` source. Anything else runs upstream's ``generate`` /
``forward`` for the whole call, with one warning naming the reason.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from fastgen.ops.beam_topk import log_probs_top_k
from fastgen.optimizer import report
from fastgen.optimizer.registry import fallback, feature_enabled

FEATURE = "beam"
_CALL_ARGS = frozenset({"prefix_tokens", "constraints", "bos_token"})


def unsupported_reason(generator: Any, sample: Any, kwargs: dict[str, Any]) -> str | None:
    """Why this call must run upstream's loop, or None when fastgen's loop gives the same result."""
    from fairseq.search import BeamSearch
    from fairseq.sequence_generator import EnsembleModel, SequenceGenerator

    if type(generator) is not SequenceGenerator:
        return f"{type(generator).__name__} is not fairseq's SequenceGenerator (exact class)"
    if type(generator.model) is not EnsembleModel or generator.model.models_size != 1:
        return f"{type(generator.model).__name__} of {generator.model.models_size} models (one model only)"
    if type(generator.search) is not BeamSearch:
        return f"search {type(generator.search).__name__} is not fairseq's BeamSearch (exact class)"
    if generator.lm_model is not None:
        return "LM fusion (lm_model)"
    unknown = sorted(set(kwargs) - _CALL_ARGS)
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)}"
    if kwargs.get("constraints") is not None:
        return "constraints"
    net_input = sample.get("net_input") if isinstance(sample, dict) else None
    if not isinstance(net_input, dict) or not isinstance(net_input.get("src_tokens"), torch.Tensor):
        return "sample['net_input'] has no src_tokens tensor"
    return None


def _run(generator: Any, sample: Any, kwargs: dict[str, Any], upstream: Callable[[], Any]) -> Any:
    reason = unsupported_reason(generator, sample, kwargs)
    if reason is not None:
        fallback(FEATURE, reason)
        return upstream()
    report.note_ran(FEATURE, "fastgen's fairseq beam step")
    loop = _with_dedup() if feature_enabled("dedup") else beam_search
    with torch.no_grad():
        return loop(generator, sample, **kwargs)


@functools.cache
def _with_dedup() -> Callable[..., Any]:
    """This loop inside the ``dedup`` feature's ``_generate`` wrapper, as it wraps upstream's loop."""
    from fastgen.optimizer.fairseq import dedup

    return dedup.make_generate(beam_search)


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``SequenceGenerator.generate(models, sample, **kwargs)`` (fairseq-generate, hub)."""

    def generate(self: Any, models: Any, sample: Any, **kwargs: Any) -> Any:
        return _run(self, sample, kwargs, lambda: original(self, models, sample, **kwargs))

    return generate


def make_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``SequenceGenerator.forward(sample, prefix_tokens, bos_token)``."""

    def forward(self: Any, sample: Any, prefix_tokens: Any = None, bos_token: Any = None) -> Any:
        kwargs = {"prefix_tokens": prefix_tokens, "bos_token": bos_token}
        return _run(self, sample, kwargs, lambda: original(self, sample, prefix_tokens, bos_token))

    return forward


# -------------------------------------------------------------------------------------------- step


def _edit_log_probs(gen: Any, lprobs: torch.Tensor, step: int, max_len: int) -> None:
    """Upstream's edits before the prefix / min-length ones, in upstream's order, in place."""
    torch.nan_to_num_(lprobs, nan=-math.inf, posinf=math.inf, neginf=-math.inf)  # = lprobs[lprobs != lprobs] = -inf
    lprobs[:, gen.pad] = -math.inf
    lprobs[:, gen.unk] -= gen.unk_penalty
    if step >= max_len:  # only EOS may follow
        lprobs[:, : gen.eos] = -math.inf
        lprobs[:, gen.eos + 1 :] = -math.inf


def _candidates(lprobs: torch.Tensor, scores: torch.Tensor, step: int, bsz: int, beam: int):
    """``BeamSearch.step``: the 2·beam best (score, token, beam) per sentence; ``lprobs`` is overwritten."""
    vocab = lprobs.shape[1]
    if step == 0:  # every hypothesis is the same: beam 0's rows only; upstream adds nothing, + 0.0 keeps each value
        rows, running = lprobs.view(bsz, beam, vocab)[:, 0, :], scores.new_zeros(bsz, 1)
    else:
        rows, running = lprobs, scores.view(bsz, beam, -1)[:, :, step - 1]
    k = min(2 * beam, running.shape[1] * vocab - 1)  # -1 so that pad is never selected
    best = log_probs_top_k(rows, running, k)
    return best.scores, best.tokens, best.beams


def _keep_rows(tensor: torch.Tensor, keep: torch.Tensor, bsz: int) -> torch.Tensor:
    """The rows of the sentences in ``keep`` of a (bsz·beam)×… buffer."""
    return tensor.view(bsz, -1)[keep].view(keep.numel() * (tensor.shape[0] // bsz), *tensor.shape[1:])


def beam_search(
    gen: Any,
    sample: dict[str, Any],
    prefix_tokens: torch.Tensor | None = None,
    constraints: torch.Tensor | None = None,
    bos_token: int | None = None,
) -> list[list[dict[str, torch.Tensor]]]:
    """``SequenceGenerator._generate`` for the supported calls (module doc); same signature and result."""
    assert constraints is None
    model, beam = gen.model, gen.beam_size
    net_input = sample["net_input"]
    src_tokens = net_input["src_tokens"]
    if "src_lengths" in net_input:
        src_lengths = net_input["src_lengths"]
    else:
        src_lengths = (src_tokens.ne(gen.eos) & src_tokens.ne(gen.pad)).long().sum(dim=1)
    bsz, src_len = src_tokens.shape[:2]
    if gen.match_source_len:
        max_len = src_lengths.max().item()
    else:
        max_len = min(int(gen.max_len_a * src_len + gen.max_len_b), gen.max_len - 1)
    assert gen.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"
    device = src_tokens.device

    incremental_states: list[dict[str, Any]] = [{} for _ in range(model.models_size)]
    encoder_outs = model.forward_encoder(net_input)
    expand = torch.arange(bsz, device=device).repeat_interleave(beam)
    encoder_outs = model.reorder_encoder_out(encoder_outs, expand)

    scores = torch.zeros(bsz * beam, max_len + 1, dtype=torch.float32, device=device)  # +1 for EOS
    tokens = torch.full((bsz * beam, max_len + 2), gen.pad, dtype=torch.long, device=device)
    tokens[:, 0] = gen.eos if bos_token is None else bos_token
    attn: torch.Tensor | None = None
    finalized: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(bsz)]
    finished = [False] * bsz
    remaining = bsz
    cand_size = 2 * beam
    bbsz_offsets = (torch.arange(bsz, device=device) * beam).unsqueeze(1)
    cand_offsets = torch.arange(cand_size, device=device)
    reorder_state: torch.Tensor | None = None
    kept: torch.Tensor | None = None  # sentences kept at the last prune

    for step in range(max_len + 1):  # one extra step for EOS
        if reorder_state is not None:
            if kept is not None:  # rows of dropped sentences are gone: renumber the parents
                shift = kept - torch.arange(kept.numel(), device=kept.device)
                reorder_state.view(-1, beam).add_(shift.unsqueeze(-1) * beam)
            model.reorder_incremental_state(incremental_states, reorder_state)
            encoder_outs = model.reorder_encoder_out(encoder_outs, reorder_state)
        lprobs, avg_attn = model.forward_decoder(
            tokens[:, : step + 1], encoder_outs, incremental_states, gen.temperature
        )

        _edit_log_probs(gen, lprobs, step, max_len)
        if prefix_tokens is not None and step < prefix_tokens.size(1) and step < max_len:
            lprobs, tokens, scores = gen._prefix_tokens(step, lprobs, scores, tokens, prefix_tokens, beam)
        else:
            if step < gen.min_len:
                lprobs[:, gen.eos] = -math.inf
            if gen.token_indices_to_suppress is not None:
                lprobs[:, gen.token_indices_to_suppress] = -math.inf
        if avg_attn is not None:
            if attn is None:
                attn = torch.empty(bsz * beam, avg_attn.size(1), max_len + 2).to(scores)
            attn[:, :, step + 1].copy_(avg_attn)
        scores = scores.type_as(lprobs)
        if gen.should_set_src_lengths:
            gen.search.set_src_lengths(src_lengths)
        if gen.repeat_ngram_blocker is not None:
            lprobs = gen.repeat_ngram_blocker(tokens, lprobs, bsz, beam, step)
        cand_scores, cand_indices, cand_beams = _candidates(lprobs, scores, step, bsz, beam)
        cand_bbsz_idx = cand_beams + bbsz_offsets

        # Finish the hypotheses whose candidate among the first `beam` is EOS.
        eos_mask = cand_indices.eq(gen.eos) & cand_scores.ne(-math.inf)
        eos_bbsz_idx = torch.masked_select(cand_bbsz_idx[:, :beam], mask=eos_mask[:, :beam])
        finalized_sents: list[int] = []
        if eos_bbsz_idx.numel() > 0:
            eos_scores = torch.masked_select(cand_scores[:, :beam], mask=eos_mask[:, :beam])
            finalized_sents = gen.finalize_hypos(
                step, eos_bbsz_idx, eos_scores, tokens, scores, finalized, finished, beam, attn, src_lengths, max_len
            )
            remaining -= len(finalized_sents)
        assert remaining >= 0
        if remaining == 0 or (gen.search.stop_on_max_len and step >= max_len):
            break
        assert step < max_len, f"{step} < {max_len}"

        # Sentences with `beam` finished hypotheses leave the batch.
        if finalized_sents:
            keep_mask = torch.ones(bsz, dtype=torch.bool, device=device)
            keep_mask[finalized_sents] = False
            kept = torch.arange(bsz, device=device).masked_select(keep_mask)
            eos_mask, cand_beams = eos_mask[kept], cand_beams[kept]
            cand_scores, cand_indices = cand_scores[kept], cand_indices[kept]
            bbsz_offsets.resize_(kept.numel(), 1)
            cand_bbsz_idx = cand_beams + bbsz_offsets
            if prefix_tokens is not None:
                prefix_tokens = prefix_tokens[kept]
            src_lengths = src_lengths[kept]
            scores, tokens = _keep_rows(scores, kept, bsz), _keep_rows(tokens, kept, bsz)
            if attn is not None:
                attn = _keep_rows(attn, kept, bsz)
            bsz = kept.numel()
        else:
            kept = None

        # Continue with the first `beam` candidates that are not EOS. Upstream also tracks slots to
        # ignore ("cands_to_ignore"), which BeamSearch never sets: a beam adds at most one EOS to the
        # 2·beam distinct candidates, so at least `beam` of them are not EOS.
        active_mask = eos_mask.type_as(cand_offsets) * cand_size + cand_offsets[: eos_mask.size(1)]
        active_hypos = torch.topk(active_mask, k=beam, dim=1, largest=False).indices
        active_bbsz_idx = torch.gather(cand_bbsz_idx, dim=1, index=active_hypos).view(-1)

        tokens[:, : step + 1] = torch.index_select(tokens[:, : step + 1], dim=0, index=active_bbsz_idx)
        tokens.view(bsz, beam, -1)[:, :, step + 1] = torch.gather(cand_indices, dim=1, index=active_hypos)
        if step > 0:
            scores[:, :step] = torch.index_select(scores[:, :step], dim=0, index=active_bbsz_idx)
        scores.view(bsz, beam, -1)[:, :, step] = torch.gather(cand_scores, dim=1, index=active_hypos)
        if attn is not None:
            attn[:, :, : step + 2] = torch.index_select(attn[:, :, : step + 2], dim=0, index=active_bbsz_idx)
        reorder_state = active_bbsz_idx

    for sent, hypos in enumerate(finalized):  # best first; upstream's (unstable) sort, for its tie order
        _, order = torch.sort(torch.tensor([float(h["score"].item()) for h in hypos]), descending=True)
        finalized[sent] = [hypos[i] for i in order]
    return finalized
