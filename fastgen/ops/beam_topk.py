"""One beam-search step after the forward: log-softmax, mask-type bans, ``+ running score``, top-k over M·V.

HF 5.23 ``GenerationMixin._beam_search`` does, per step (B inputs × M beams, vocabulary V)::

    logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)      # N×V copy (N = B·M)
    log_probs = logits_processor(ids, log_softmax(logits, dim=-1))             # N×V, + a copy per processor
    log_probs = (log_probs.view(B, M, V) + running_scores[:, :, None]).view(B, M·V)   # N×V again
    values, flat = torch.topk(log_probs, k)        # k = max(2, 1 + len(eos)) · M   (_get_top_k_continuations)
    beam, token = flat // V, flat % V

fairseq 0.12 ``BeamSearch.step`` is the same selection: ``lprobs + scores[:, :, step - 1]`` viewed as
``bsz × (beam·V)`` and ``torch.topk(k=min(2·beam, beam·V - 1))`` (step 0: only beam 0's row, V
candidates), beam = index // V, token = index % V. Differences: fairseq's k is ``2·beam`` capped at
``beam·V - 1`` (HF's grows with the number of EOS ids and needs k <= M·V); fairseq normalises with its
own ``get_normalized_probs`` (log_softmax in fp32 too) and applies its bans to ``lprobs`` in place
before the add; step 0 restricts to beam 0 by slicing where HF gives beams 1..M-1 a score of -1e9.
This op takes k, the running scores and the rows as given, so both callers express their step.

Mask-type processors only (values go to -inf, nothing else changes): n-gram bans, the min-length
EOS ban, suppressed tokens, single-token bad words — passed as ``banned``; and HF's forced BOS/EOS
(every log-prob -inf except the forced ids, which become 0) — passed as ``forced``. Bans are applied
after the normalisation, as upstream does (the log-sum-exp counts banned tokens), and ``forced``
after bans (HF runs its n-gram / bad-words / min-length processors before the forced ones; a
suppressed token that is also forced is the one order this op cannot express: callers fall back).

Layers:
- torch reference (:func:`_reference`; the oracle and the CPU path): HF's own ops in HF's order, in
  place on one fresh N×V buffer (no extra copy, no per-processor copy, no N×V temporary for the add),
  so values are bit-identical to upstream's and indices identical, ties included: the final
  selection *is* ``torch.topk`` over the same B×(M·V) values.
- kernels (Triton :mod:`fastgen.ops.triton.beam_topk`, CUDA ``csrc/beam_topk.cu``): one pass over
  each hypothesis row in chunks, computing each chunk's max and sum of exponentials (combined
  online-softmax style) and the chunk's k best *banned-masked* logits — Amun's fused softmax + k-best
  (Algorithm 4) with LightSeq's retrieve-then-rerank (§2.2); then :func:`_merge_candidates` turns
  the few candidates into ``logit − max − log(sum) + score`` and merges the M beams of each input.
  Their tie rule is explicit: larger value first, equal values by smaller flat index ``beam·V +
  token``. Values agree with the reference to fp32 rounding of the normaliser (a few ulps).

Tie order of the reference (what ``torch.topk`` does on CPU, torch 2.13, measured in
``tests/ops/test_beam_topk.py``): for the sizes beam search uses (``k·64 <= M·V``) the CPU kernel
runs a partial sort — among equal values at the k-th place the smaller index is kept, but the order
*within* the returned tied values is the heap's, not index order. torch documents neither; the
reference therefore calls ``torch.topk`` itself, which is what keeps it identical to upstream.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch

from fastgen.ops import cpu_kernels
from fastgen.ops._dispatch import BACKENDS, TritonKernels, choose_backend, device_problem, without_cuda_device

__all__ = ["BACKENDS", "BeamTopK", "approximate_top_k", "available_backends", "beam_topk", "log_probs_top_k"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: most candidates a kernel keeps per chunk (each is one reduction round over the chunk)
KERNEL_MAX_K = 256


class BeamTopK(NamedTuple):
    """The k best continuations of each input: B×k each, best first."""

    scores: torch.Tensor  # float32: log-prob of the token + the beam's running score
    beams: torch.Tensor  # int64 in [0, M): which beam of the input it continues
    tokens: torch.Tensor  # int64 in [0, V)


# --------------------------------------------------------------------------------------------------
# torch reference: the oracle, and the CPU path
# --------------------------------------------------------------------------------------------------


def _apply_bans(log_probs: torch.Tensor, banned: torch.Tensor | None, forced: torch.Tensor | None) -> None:
    """Write -inf for every banned (row, token), then the forced ids (in place; see the module doc)."""
    if banned is not None:
        if banned.dtype == torch.bool:
            log_probs.masked_fill_(banned, float("-inf"))
        elif banned.dim() == 1:
            ids = banned[(banned >= 0) & (banned < log_probs.shape[1])]
            log_probs.index_fill_(1, ids.long(), float("-inf"))
        else:  # N×P ids per row; out-of-range entries are padding
            ids = banned.long()
            valid = (ids >= 0) & (ids < log_probs.shape[1])
            rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(ids)
            log_probs.index_put_((rows[valid], ids[valid]), torch.tensor(float("-inf"), dtype=log_probs.dtype))
    if forced is not None:
        log_probs.fill_(float("-inf"))
        log_probs.index_fill_(1, forced.long(), 0.0)


def log_probs_top_k(log_probs: torch.Tensor, beam_scores: torch.Tensor, k: int) -> BeamTopK:
    """Second half of the step for callers that own the N×V log-prob buffer (and ban in it themselves):
    adds the running scores in place and takes upstream's ``torch.topk`` over M·V.

    ``log_probs`` is N×V float32 and is overwritten; ``beam_scores`` is B×M float32.
    """
    batch, beams = beam_scores.shape
    vocab = log_probs.shape[1]
    grouped = log_probs.view(batch, beams, vocab)
    grouped.add_(beam_scores.unsqueeze(-1))  # elementwise, so bit-identical to HF's out-of-place add
    values, flat = top_k(grouped.view(batch, beams * vocab), k)
    return BeamTopK(values, torch.div(flat, vocab, rounding_mode="floor"), flat % vocab)


def approximate_top_k(logits: torch.Tensor, beam_scores: torch.Tensor, k: int) -> BeamTopK | None:
    """The step's k best continuations per input straight from the N×V float32 logits (no bans), for the
    approximate modes: fastgen's CPU kernel finds each row's best k logits and its log-sum-exp, and only those
    candidates get log-probs and scores (``csrc/cpu/beam_log_softmax.cpp``; ties by the smaller flat index).
    Values differ from upstream's by float rounding (the normaliser's exp and summation order). None where the
    kernel cannot serve (not loaded, not a CPU float32 call, a NaN or a row without a finite logit)."""
    if (
        logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or beam_scores.dtype != torch.float32
        or logits.dim() != 2
        or logits.shape[0] != beam_scores.numel()
        or not 1 <= k <= logits.numel()
        or not cpu_kernels.loaded()
        or not hasattr(torch.ops.fastgen_cpu, "log_softmax_top_k")
    ):
        return None
    values, beams, tokens, ok = torch.ops.fastgen_cpu.log_softmax_top_k(logits.contiguous(), beam_scores, k)
    return BeamTopK(values, beams, tokens) if bool(ok) else None


#: the largest k the top-k kernel serves (beam search asks for 2 x num_beams)
KERNEL_MAX_K = 32


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores, k)`` of a 2-D float32 CPU tensor, bit for bit; where fastgen's CPU kernels are
    loaded already (a fast mode built them) through ``topk_distinct``, which returns torch's result for
    every row whose best k + 1 values are distinct and hands the other rows back to ``torch.topk``.
    Measured on one loaded AMD EPYC core: 4 rows of 201,060 scores (bart-base, beam 4), 1.65 -> 0.14-0.18 ms.
    The kernel keeps its k best in a sorted list: at large k (3.5x slower than torch.topk at k = 1024) and on
    sorted rows it loses, so it serves only ``k <= KERNEL_MAX_K`` (beam search takes 2 x beams)."""
    if (
        scores.device.type != "cpu"
        or scores.dtype != torch.float32
        or scores.dim() != 2
        or not 1 <= k < scores.shape[1]
        or k > KERNEL_MAX_K
        or not scores.is_contiguous()
        or torch.compiler.is_compiling()
        or not cpu_kernels.loaded()
    ):
        return torch.topk(scores, k)
    values, indices, distinct = torch.ops.fastgen_cpu.topk_distinct(scores, k)
    if not bool(distinct.all()):
        tied = (~distinct).nonzero().squeeze(1)
        values[tied], indices[tied] = torch.topk(scores[tied], k)
    return values, indices


def _reference(
    logits: torch.Tensor,
    beam_scores: torch.Tensor,
    k: int,
    banned: torch.Tensor | None,
    forced: torch.Tensor | None,
) -> BeamTopK:
    # HF casts to float32 before the log-softmax (a copy even for float32); reading float32 logits
    # directly gives the same values, and log_softmax's output is the one N×V buffer of this step.
    log_probs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    _apply_bans(log_probs, banned, forced)
    return log_probs_top_k(log_probs, beam_scores.to(torch.float32), k)


# --------------------------------------------------------------------------------------------------
# kernels: per-chunk retrieval (kernel) + merge (torch, on k candidates per chunk)
# --------------------------------------------------------------------------------------------------


def chunk_size(vocab: int) -> int:
    """Vocabulary chunk per kernel program: enough chunks to fill a GPU for small N, few candidates."""
    return 1024 if vocab <= 16384 else 4096


def _merge_candidates(
    cand_values: torch.Tensor,
    cand_tokens: torch.Tensor,
    chunk_max: torch.Tensor,
    chunk_sum: torch.Tensor,
    mask: torch.Tensor | None,
    beam_scores: torch.Tensor,
    vocab: int,
    k: int,
) -> BeamTopK:
    """Rerank the kernels' candidates: N×C masked logits (token -1: no candidate) and each row's
    per-chunk max / sum of exp → B×k, ordered by value, then by smaller ``beam·V + token``.

    A row of -inf logits gives NaN log-probs, as ``log_softmax`` does upstream (NaN sorts first),
    except where banned: bans write -inf after the normalisation, so ``mask`` is looked up again.
    """
    batch, beams = beam_scores.shape
    row_max = chunk_max.amax(dim=1, keepdim=True)
    row_sum = (chunk_sum * torch.exp(chunk_max - row_max)).sum(dim=1, keepdim=True)
    values = (cand_values - row_max) - torch.log(row_sum)  # log_softmax's x - max - log(sum)
    values = values + beam_scores.reshape(-1, 1).to(torch.float32)
    present = cand_tokens >= 0
    if mask is not None:
        banned = mask.expand(cand_tokens.shape[0], vocab).gather(1, cand_tokens.clamp(min=0)) != 0
        present_and_allowed = present & ~banned
    else:
        present_and_allowed = present
    values = torch.where(present_and_allowed, values, torch.tensor(float("-inf"), device=values.device))
    beam_of_row = torch.arange(batch * beams, device=values.device).remainder(beams).unsqueeze(1)
    flat = torch.where(present, beam_of_row * vocab + cand_tokens, beams * vocab)  # absent: after every real one
    values, flat = values.reshape(batch, -1), flat.reshape(batch, -1)
    by_index = torch.argsort(flat, dim=1, stable=True)
    values, flat = values.gather(1, by_index), flat.gather(1, by_index)
    values, by_value = torch.sort(values, dim=1, descending=True, stable=True)
    values, flat = values[:, :k], flat.gather(1, by_value[:, :k])
    return BeamTopK(values, torch.div(flat, vocab, rounding_mode="floor"), flat % vocab)


def _kernel_mask(banned: torch.Tensor | None, rows: int, vocab: int, device: torch.device) -> torch.Tensor | None:
    """Bans as the kernels read them: a uint8 mask with rows contiguous, 1×V when shared by every row."""
    if banned is None:
        return None
    if banned.dtype == torch.bool:
        mask = banned.reshape(1, vocab) if banned.dim() == 1 else banned
        if mask.shape[0] not in (1, rows):
            mask = mask.expand(rows, vocab)
        return mask.to(torch.uint8).contiguous()
    if banned.dim() == 1:
        mask = torch.zeros(1, vocab, dtype=torch.uint8, device=device)
        ids = banned[(banned >= 0) & (banned < vocab)].long()
        mask[0, ids] = 1
        return mask
    mask = torch.zeros(rows, vocab + 1, dtype=torch.uint8, device=device)
    ids = banned.long()
    ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)  # padding lands in a spare column
    mask.scatter_(1, ids, 1)
    return mask[:, :vocab].contiguous()


def _run_kernel(
    backend: str,
    logits: torch.Tensor,
    beam_scores: torch.Tensor,
    k: int,
    banned: torch.Tensor | None,
) -> BeamTopK:
    rows, vocab = logits.shape
    chunk = chunk_size(vocab)
    num_chunks = -(-vocab // chunk)
    device = logits.device
    cand_values = torch.empty(rows, num_chunks * k, dtype=torch.float32, device=device)
    cand_tokens = torch.empty(rows, num_chunks * k, dtype=torch.int64, device=device)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    chunk_sum = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    mask = _kernel_mask(banned, rows, vocab, device)
    if backend == "cuda":
        ext = _load_cuda()
        assert ext is not None  # _unsupported() checked it
        ext.beam_topk_retrieve(logits, mask, k, chunk, cand_values, cand_tokens, chunk_max, chunk_sum)
    else:
        kernels = _TRITON.load()
        assert kernels is not None
        kernels.retrieve(logits, mask, k, chunk, cand_values, cand_tokens, chunk_max, chunk_sum)
    return _merge_candidates(cand_values, cand_tokens, chunk_max, chunk_sum, mask, beam_scores, vocab, k)


# --------------------------------------------------------------------------------------------------
# backends (same rules as fastgen.ops.ngram)
# --------------------------------------------------------------------------------------------------

_TRITON = TritonKernels("fastgen.ops.triton.beam_topk", "beam top-k")


def _load_cuda() -> ModuleType | None:
    from fastgen.ops import _ext

    module = _ext.load()
    return module if module is not None and hasattr(module, "beam_topk_retrieve") else None


def _unsupported(backend: str, logits: torch.Tensor, k: int) -> str | None:
    """Why ``backend`` cannot serve this call, or None when it can."""
    if backend == "torch":
        return None
    if logits.dtype not in _KERNEL_DTYPES:
        return f"logits dtype {logits.dtype} (kernels take float32/float16/bfloat16)"
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        return "logits rows are not contiguous"
    if k > KERNEL_MAX_K:
        return f"k = {k} > {KERNEL_MAX_K}"
    return device_problem(backend, logits.device.type, _load_cuda, _TRITON)


def _choose_backend(forced_backend: str | None, logits: torch.Tensor, k: int) -> str:
    """The backend for this call, by the rule of :mod:`fastgen.ops._dispatch`."""
    problem = lambda backend: _unsupported(backend, logits, k)  # noqa: E731
    return choose_backend("beam top-k", forced_backend, problem, logits.device.type)


def available_backends(device: str | torch.device = "cuda") -> dict[str, str | None]:
    """Each backend with None if it can run float32 calls on ``device``, else the reason why not."""
    device = torch.device(device)
    if device.type == "cuda" and (missing := without_cuda_device()) is not None:
        return missing
    logits = torch.empty(1, 2, device=device)
    return {backend: _unsupported(backend, logits, 2) for backend in BACKENDS}


# --------------------------------------------------------------------------------------------------
# public function
# --------------------------------------------------------------------------------------------------


def _check(logits: torch.Tensor, beam_scores: torch.Tensor, k: int, banned, forced) -> None:
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"beam_topk: logits must be a floating N×V tensor, got {logits.dtype} {tuple(logits.shape)}")
    if beam_scores.dim() != 2 or beam_scores.numel() != logits.shape[0]:
        raise ValueError(
            f"beam_topk: beam_scores must be B×M with B·M = {logits.shape[0]} rows, got {tuple(beam_scores.shape)}"
        )
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= beam_scores.shape[1] * logits.shape[1]:
        raise ValueError(f"beam_topk: k must be an int in [1, M·V], got {k!r}")
    for name, t in (("banned", banned), ("forced", forced)):
        if t is not None and t.device != logits.device:
            raise ValueError(f"beam_topk: {name} on {t.device} but logits on {logits.device}")
    if banned is not None and banned.dtype.is_floating_point:
        raise TypeError("beam_topk: banned must be a bool mask or integer token ids")
    if banned is not None and banned.dtype == torch.bool and banned.shape[-1] != logits.shape[1]:
        raise ValueError(f"beam_topk: a bool ban mask must have V = {logits.shape[1]} columns")
    if banned is not None and banned.dtype != torch.bool and banned.dim() == 2 and banned.shape[0] != logits.shape[0]:
        raise ValueError("beam_topk: per-row banned ids must be N×P")
    if forced is not None and (forced.dim() != 1 or forced.dtype.is_floating_point or forced.dtype == torch.bool):
        raise ValueError("beam_topk: forced must be a 1-D tensor of token ids")


def beam_topk(
    logits: torch.Tensor,
    beam_scores: torch.Tensor,
    k: int,
    *,
    banned: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
    backend: str | None = None,
) -> BeamTopK:
    """The k best ``log_softmax(logits)[row, token] + beam_scores[row]`` over the M·V continuations of
    each input (HF ``_beam_search`` step b–c, fairseq ``BeamSearch.step``'s topk), with bans as -inf.

    Args:
        logits: N×V (N = B·M, beams of one input adjacent), any float dtype; normalised in float32.
            Not modified.
        beam_scores: B×M running scores (float32; HF's ``running_beam_scores``).
        k: continuations kept per input, 1 <= k <= M·V (HF: ``max(2, 1 + len(eos)) · M``).
        banned: tokens whose log-prob becomes -inf after the normalisation: a bool mask N×V, 1×V or
            V (True = banned); or int ids, 1-D (banned in every row) or N×P (per row; ids outside
            [0, V) are padding).
        forced: 1-D token ids; when given every row's log-probs become -inf except these, which
            become 0 (HF's forced BOS/EOS step), after the bans.
        backend: force ``"cuda"``, ``"triton"`` or ``"torch"`` (else ``FASTGEN_BACKEND``, else the
            fastest that can serve the call; on CPU the torch reference, identical to upstream).

    Returns:
        :class:`BeamTopK` of B×k tensors, best first. The torch path orders ties exactly as
        upstream's ``torch.topk``; kernels order them by smaller ``beam·V + token`` (module doc).
    """
    _check(logits, beam_scores, k, banned, forced)
    chosen = _choose_backend(backend, logits, k)
    if chosen == "torch" or forced is not None:
        # A forced step is one constant row per hypothesis (once per generation): the reference is exact.
        return _reference(logits, beam_scores, k, banned, forced)
    return _run_kernel(chosen, logits, beam_scores, k, banned)
