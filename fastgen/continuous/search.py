"""Greedy and beam search over inputs that are at different steps: upstream's arithmetic, per input.

The state holds ``n`` running inputs with ``M`` hypothesis rows each (``M = 1`` for greedy). Every
quantity that upstream derives from the batch's one ``cur_len`` (length penalty, the early-stop
heuristic, min-length bans, the forced EOS step, the length limit) is per input here, as it is when
``generate`` runs that input alone. Beam search does the steps of fastgen's own loop
(:mod:`fastgen.optimizer.transformers.beam_search`, itself proven equal to upstream's
``_beam_search``): log-softmax, in-place bans, :func:`~fastgen.ops.beam_topk.log_probs_top_k`, the
running/finished merges and the heuristic, in the same order with the same operations; only the
scalars become per-input columns. Greedy does upstream ``_sample``'s argmax over processed logits.

Sampling does upstream ``_sample``'s multinomial step with ``R = num_return_sequences`` rows per input
(as ``generate`` expands them): the processors above, then Transformers' own warpers (temperature,
top-k, top-p, min-p, in upstream's order; each acts on every row alone, so one call over all rows
equals one call per input), softmax, and ``torch.multinomial`` on each input's ``(R, V)`` block with
that input's own ``torch.Generator``. A generator seeded ``S`` gives the stream the global generator
gives after ``torch.manual_seed(S)``, and ``multinomial`` draws from it exactly what it draws for the
same ``(R, V)`` block when ``generate`` runs the input alone, so an input's samples do not depend on
its batch neighbours. Rows that hit EOS keep drawing and are padded, as upstream's, until all ``R`` are
done.

Sequences are kept left-aligned in ``(rows, max_length)`` buffers filled with upstream's fill value, so
an input's finished hypotheses come out exactly as ``generate`` returns them for it alone.

Decoder-only models (:mod:`.decoder_only`): an input starts with its prompt instead of the decoder start
token, so its prompt length (upstream's ``decoder_prompt_len``) and its length limit (``max_length``,
derived from the prompt when ``max_new_tokens`` is set) are per-input columns too; encoder-decoder
inputs have prompt length 1 and the call's ``max_length``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from fastgen.continuous.settings import Settings
from fastgen.ops.beam_topk import log_probs_top_k
from fastgen.ops.ngram import ban_repeated_ngrams

NEG_INF = float("-inf")


@dataclass
class Finished:
    """One input's result: what ``generate`` returns for it alone (tokens), and beam search's scores."""

    index: int
    sequences: torch.Tensor  # (num_return_sequences, length)
    scores: torch.Tensor | None  # (num_return_sequences,) beam search's sequences_scores; None otherwise


def apply_processors(
    settings: Settings,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    scores: torch.Tensor,
    host_lengths: list[int],
    group: int,
    prompt_lengths: list[int] | None = None,
    limits: list[int] | None = None,
) -> None:
    """Upstream's supported processors in upstream's order, in place, each under its per-row length condition.

    ``tokens`` ``(N, L)`` left-aligned, ``lengths`` ``(N,)`` valid tokens per row, ``scores`` ``(N, V)``;
    ``host_lengths`` the same lengths per input (``group`` rows each) on the host, so that the bans and
    forced steps touch only the rows they apply to, and no N x V pass runs on steps where none does.
    ``prompt_lengths``/``limits``: per input (default: 1 and ``settings.max_length``, encoder-decoder).
    """
    eos = settings.eos_token_ids
    prompts = prompt_lengths or [1] * len(host_lengths)
    limits = limits or [settings.max_length] * len(host_lengths)
    if settings.no_repeat_ngram_size > 0:
        ban_repeated_ngrams(tokens, scores, settings.no_repeat_ngram_size, lengths)

    def rows(condition) -> torch.Tensor | None:
        """Rows of the inputs where ``condition(length, prompt_length, limit)`` holds."""
        chosen = [
            i * group + b
            for i, n in enumerate(host_lengths)
            if condition(n, prompts[i], limits[i])
            for b in range(group)
        ]
        return torch.tensor(chosen, dtype=torch.long, device=scores.device) if chosen else None

    if eos and settings.min_length > 0:
        _ban(scores, rows(lambda n, p, lim: n < settings.min_length), eos)
    if eos and settings.min_new_tokens > 0:
        _ban(scores, rows(lambda n, p, lim: n - p < settings.min_new_tokens), eos)
    if settings.forced_bos_token_id is not None:
        _force(scores, rows(lambda n, p, lim: n == 1), (settings.forced_bos_token_id,))
    if settings.forced_eos_token_ids:
        _force(scores, rows(lambda n, p, lim: n == lim - 1), settings.forced_eos_token_ids)


def _ban(scores: torch.Tensor, rows: torch.Tensor | None, ids: tuple[int, ...]) -> None:
    """``-inf`` at ``ids`` in ``rows`` (ids outside the vocabulary are never banned, as upstream's ``isin``)."""
    cols = [i for i in ids if 0 <= i < scores.shape[1]]
    if rows is not None and cols:
        cols_t = torch.tensor(cols, dtype=torch.long, device=scores.device)
        scores[rows[:, None], cols_t[None, :]] = NEG_INF


def _force(scores: torch.Tensor, rows: torch.Tensor | None, ids: tuple[int, ...]) -> None:
    """Upstream's forced step in ``rows``: ``-inf`` everywhere, 0 at ``ids``."""
    if rows is None:
        return
    scores.index_fill_(0, rows, NEG_INF)
    cols = torch.tensor(ids, dtype=torch.long, device=scores.device)
    scores[rows[:, None], cols[None, :]] = 0


def sampling_warpers(settings: Settings) -> list:
    """Upstream's warpers for ``do_sample`` with one beam, under upstream's conditions and in its order
    (``_get_logits_processor``; ``min_tokens_to_keep`` is 1 without beams)."""
    s, warpers = settings, []
    if s.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(s.temperature))
    if s.top_k is not None and s.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=s.top_k))
    if s.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=s.top_p))
    if s.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=s.min_p))
    return warpers


class SearchState:
    """Running inputs of one decoding mode; rows are ``input * M + row`` (M beams, or samples when sampling)."""

    def __init__(self, settings: Settings, device: torch.device) -> None:
        self.s = settings
        self.device = device
        self.beams = settings.rows_per_input
        self.beam_search = settings.num_beams > 1
        self.indices: list[int] = []  # input index of each running input
        self.host_lengths: list[int] = []  # decoder length of each running input (host copy, no syncs)
        self.host_prompts: list[int] = []  # prompt length of each running input (1: the decoder start token)
        self.host_limits: list[int] = []  # length limit of each running input (prompt included)
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)
        self.prompt_lengths = torch.zeros(0, dtype=torch.long, device=device)
        self.limits = torch.zeros(0, dtype=torch.long, device=device)
        self.tokens = torch.zeros((0, settings.max_length), dtype=torch.long, device=device)
        m = self.beams
        self.running_scores = torch.zeros((0, m), device=device)
        self.keep = max(2, 1 + len(settings.eos_token_ids)) * m
        if settings.do_sample:
            self.warpers = sampling_warpers(settings)
            self.generators: list[torch.Generator] = []  # one random stream per running input
            self.unfinished = torch.zeros(0, dtype=torch.bool, device=device)  # per row, as upstream's
        if self.beam_search:
            self.seqs = torch.zeros((0, m, settings.max_length), dtype=torch.long, device=device)
            self.beam_scores = torch.zeros((0, m), device=device)
            self.finished = torch.zeros((0, m), dtype=torch.bool, device=device)
            self.fin_lengths = torch.zeros((0, m), dtype=torch.long, device=device)
            self.unsatisfied = torch.zeros((0, 1), dtype=torch.bool, device=device)
            self.top_mask = torch.cat([torch.ones(m, dtype=torch.bool), torch.zeros(self.keep - m, dtype=torch.bool)])
            self.top_mask = self.top_mask.to(device)
        self.eos = settings.eos_tensor(device)

    def __len__(self) -> int:
        return len(self.indices)

    # -- membership -----------------------------------------------------------------------------
    def add(
        self, indices: list[int], seeds: list[int] | None = None, prompts: list[torch.Tensor] | None = None
    ) -> None:
        """Newcomers at step 0: their prompt (default: the decoder start token), beam 0 live and the others at
        -1e9 (as upstream).

        When sampling, ``seeds`` seeds each newcomer's random stream (see the module docs)."""
        k, m = len(indices), self.beams
        if prompts is None:
            prompts = [torch.tensor([self.s.decoder_start_token_id], device=self.device)] * k
        prompt_lengths = [len(p) for p in prompts]
        limits = [self.s.length_limit(n) for n in prompt_lengths]
        self._widen(max(limits))
        length = self.tokens.shape[1]
        tokens = torch.full((k * m, length), self.s.fill_value, dtype=torch.long, device=self.device)
        for i, prompt in enumerate(prompts):
            tokens[i * m : (i + 1) * m, : len(prompt)] = prompt
        running = torch.zeros((k, m), device=self.device)
        running[:, 1:] = -1e9
        self.tokens = torch.cat([self.tokens, tokens])
        self.running_scores = torch.cat([self.running_scores, running])
        self.lengths = torch.cat([self.lengths, self._long(prompt_lengths)])
        self.prompt_lengths = torch.cat([self.prompt_lengths, self._long(prompt_lengths)])
        self.limits = torch.cat([self.limits, self._long(limits)])
        self.indices += indices
        self.host_lengths += prompt_lengths
        self.host_prompts += prompt_lengths
        self.host_limits += limits
        if self.s.do_sample:
            if seeds is None or len(seeds) != k:
                raise ValueError("sampling needs one seed per input")
            self.generators += [torch.Generator(device=self.device).manual_seed(seed) for seed in seeds]
            self.unfinished = torch.cat([self.unfinished, torch.ones(k * m, dtype=torch.bool, device=self.device)])
        if self.beam_search:
            self.seqs = torch.cat([self.seqs, tokens.view(k, m, length).clone()])
            self.beam_scores = torch.cat([self.beam_scores, torch.full((k, m), -1e9, device=self.device)])
            self.finished = torch.cat([self.finished, torch.zeros((k, m), dtype=torch.bool, device=self.device)])
            self.fin_lengths = torch.cat([self.fin_lengths, torch.zeros((k, m), dtype=torch.long, device=self.device)])
            self.unsatisfied = torch.cat([self.unsatisfied, torch.ones((k, 1), dtype=torch.bool, device=self.device)])

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _widen(self, length: int) -> None:
        """Grow the token buffers to ``length`` columns (a newcomer's limit can exceed everyone's so far)."""
        missing = length - self.tokens.shape[1]
        if missing <= 0:
            return
        fill = self.s.fill_value
        self.tokens = torch.nn.functional.pad(self.tokens, (0, missing), value=fill)
        if self.beam_search:
            self.seqs = torch.nn.functional.pad(self.seqs, (0, missing), value=fill)

    def remove(self, keep: list[int]) -> None:
        """Keep only the running inputs at positions ``keep``, in that order."""
        inputs = torch.tensor(keep, dtype=torch.long, device=self.device)
        rows = (inputs[:, None] * self.beams + torch.arange(self.beams, device=self.device)).reshape(-1)
        self.tokens = self.tokens.index_select(0, rows)
        self.running_scores = self.running_scores.index_select(0, inputs)
        self.lengths = self.lengths.index_select(0, inputs)
        self.prompt_lengths = self.prompt_lengths.index_select(0, inputs)
        self.limits = self.limits.index_select(0, inputs)
        self.indices = [self.indices[i] for i in keep]
        self.host_lengths = [self.host_lengths[i] for i in keep]
        self.host_prompts = [self.host_prompts[i] for i in keep]
        self.host_limits = [self.host_limits[i] for i in keep]
        if self.s.do_sample:
            self.generators = [self.generators[i] for i in keep]
            self.unfinished = self.unfinished.index_select(0, rows)
        if self.beam_search:
            for name in ("seqs", "beam_scores", "finished", "fin_lengths", "unsatisfied"):
                setattr(self, name, getattr(self, name).index_select(0, inputs))

    # -- per step -------------------------------------------------------------------------------
    def row_lengths(self) -> torch.Tensor:
        return self.lengths.repeat_interleave(self.beams)

    def last_tokens(self) -> torch.Tensor:
        """The token each row feeds this step (its newest), ``(N,)``."""
        rows = torch.arange(self.tokens.shape[0], device=self.device)
        return self.tokens[rows, self.row_lengths() - 1]

    def step(self, logits: torch.Tensor) -> tuple[torch.Tensor | None, list[bool]]:
        """Advance every input by one token. Returns the cache row order (beam reorder, or None) and
        which running inputs are done (one host sync)."""
        if self.s.do_sample:
            return None, self._sample_step(logits)
        if self.beams == 1:
            return None, self._greedy_step(logits)
        return self._beam_step(logits)

    def _greedy_step(self, logits: torch.Tensor) -> list[bool]:
        lengths = self.lengths
        apply_processors(
            self.s, self.tokens, lengths, logits, self.host_lengths, 1, self.host_prompts, self.host_limits
        )
        next_tokens = torch.argmax(logits, dim=-1)
        rows = torch.arange(len(self), device=self.device)
        self.tokens[rows, lengths] = next_tokens
        hits = lengths + 1 >= self.limits
        if self.eos.numel():
            hits = hits | torch.isin(next_tokens, self.eos)
        self.lengths = lengths + 1
        self.host_lengths = [n + 1 for n in self.host_lengths]
        return hits.tolist()

    def _sample_step(self, logits: torch.Tensor) -> list[bool]:
        """Upstream ``_sample``'s step per input: processors, warpers, softmax, one multinomial draw per row
        from the input's own stream; finished rows get the pad token (with an EOS) until all are done."""
        r, lengths = self.beams, self.row_lengths()
        apply_processors(
            self.s, self.tokens, lengths, logits, self.host_lengths, r, self.host_prompts, self.host_limits
        )
        for warper in self.warpers:
            logits = warper(self.tokens, logits)
        probs = torch.softmax(logits, dim=-1)
        blocks = zip(probs.split(r), self.generators, strict=True)
        draws = [torch.multinomial(block, 1, generator=generator) for block, generator in blocks]
        next_tokens = torch.cat(draws).squeeze(1)
        if self.eos.numel():
            next_tokens = torch.where(self.unfinished, next_tokens, self.s.pad_token_id)
            self.unfinished = self.unfinished & ~torch.isin(next_tokens, self.eos)
        rows = torch.arange(next_tokens.shape[0], device=self.device)
        self.tokens[rows, lengths] = next_tokens
        self.lengths = self.lengths + 1
        self.host_lengths = [n + 1 for n in self.host_lengths]
        done = ~self.unfinished.view(-1, r).any(dim=1) | (self.lengths >= self.limits)
        return done.tolist()

    def _beam_step(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
        s, m, n = self.s, self.beams, len(self)
        lengths = self.lengths  # decoder length before this token (upstream's cur_len)
        log_probs = torch.log_softmax(logits, dim=-1)
        apply_processors(
            s, self.tokens, self.row_lengths(), log_probs, self.host_lengths, m, self.host_prompts, self.host_limits
        )
        top = log_probs_top_k(log_probs, self.running_scores, self.keep)
        topk_log_probs = top.scores
        base = torch.arange(n, device=self.device)[:, None] * m
        source_rows = (base + top.beams).reshape(-1)  # (n*K) rows of self.tokens
        topk_tokens = self.tokens.index_select(0, source_rows)
        cols = lengths.repeat_interleave(self.keep)
        topk_tokens[torch.arange(n * self.keep, device=self.device), cols] = top.tokens.reshape(-1)
        hits = (lengths + 1 >= self.limits)[:, None].expand(n, self.keep)
        if self.eos.numel():
            hits = hits | torch.isin(top.tokens, self.eos)
        # e. running beams for the next step
        topk_running = topk_log_probs + hits.to(torch.float32) * -1.0e9
        next_idx = torch.topk(topk_running, k=m)[1]
        self.running_scores = topk_running.gather(1, next_idx)
        next_rows = (torch.arange(n, device=self.device)[:, None] * self.keep + next_idx).reshape(-1)  # of topk_tokens
        self.tokens = topk_tokens.index_select(0, next_rows)
        cache_rows = source_rows.index_select(0, next_rows)
        # f. finished beams: upstream's _update_finished_beams with per-input generated length
        generated = lengths + 1 - self.prompt_lengths  # upstream's cur_len + 1 - decoder_prompt_len
        did_finish = hits & self.top_mask[None, :]
        denominators = generated.to(torch.float64).pow(s.length_penalty).to(torch.float32)[:, None]
        candidate = topk_log_probs / denominators
        full = torch.all(self.finished, dim=-1, keepdim=True) & (s.early_stopping is True)
        candidate += full.to(torch.float32) * -1.0e9
        candidate += (~self.unsatisfied).to(torch.float32) * -1.0e9
        candidate += (~did_finish) * -1.0e9
        merged = torch.cat((self.beam_scores, candidate), dim=1)
        merged_idx = torch.topk(merged, k=m)[1]
        length = self.tokens.shape[1]
        merged_seqs = torch.cat((self.seqs, topk_tokens.view(n, self.keep, length)), dim=1)
        self.seqs = merged_seqs.gather(1, merged_idx[:, :, None].expand(n, m, length))
        self.beam_scores = merged.gather(1, merged_idx)
        merged_finished = torch.cat((self.finished, did_finish), dim=1)
        self.finished = merged_finished.gather(1, merged_idx)
        merged_lengths = torch.cat((self.fin_lengths, generated[:, None].expand(n, self.keep)), dim=1)
        self.fin_lengths = merged_lengths.gather(1, merged_idx)
        # the early-stop heuristic at the new length
        self.lengths = lengths + 1
        self.host_lengths = [k + 1 for k in self.host_lengths]
        if s.early_stopping == "never" and s.length_penalty > 0.0:
            best_length = self.limits - self.prompt_lengths
        else:
            best_length = self.lengths - self.prompt_lengths
        best_denominators = best_length.to(torch.float64).pow(s.length_penalty).to(torch.float32)[:, None]
        best_possible = self.running_scores[:, :1] / best_denominators
        worst_finished = torch.where(self.finished, torch.min(self.beam_scores, dim=1, keepdim=True)[0], -1.0e9)
        self.unsatisfied = self.unsatisfied & torch.any(best_possible > worst_finished, dim=-1, keepdim=True)
        done = ~self.unsatisfied[:, 0] | torch.all(hits, dim=1) | (self.lengths >= self.limits)
        if s.early_stopping is True:
            done = done | torch.all(self.finished, dim=1)
        return cache_rows, done.tolist()

    # -- results --------------------------------------------------------------------------------
    def result(self, position: int) -> Finished:
        """The result of running input ``position``, as ``generate`` returns it for that input alone."""
        index, r = self.indices[position], self.s.num_return_sequences
        if not self.beam_search:
            rows = self.tokens[position * self.beams : (position + 1) * self.beams, : self.host_lengths[position]]
            return Finished(index, rows.clone(), None)
        output_length = self.host_prompts[position] + int(self.fin_lengths[position, :r].max())
        return Finished(index, self.seqs[position, :r, :output_length].clone(), self.beam_scores[position, :r].clone())
