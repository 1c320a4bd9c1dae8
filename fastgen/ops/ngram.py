"""Block repeated n-grams: write ``-inf`` into the scores of every token that would repeat an n-gram.

Upstream does this per hypothesis in Python (fairseq's CPU path) or through an N×V mask and a full
copy of the scores (HF 5.x); both cost more than a decoding step on long rows or big vocabularies.
Here the banned (row, token) pairs are found by comparing the current prefix against every window of
the row, and only those entries of ``scores`` are written, in place.

Upstream, as read (HF 5.23, fairseq 0.12.3), and what this op does about it:
- HF ``NoRepeatNGramLogitsProcessor`` builds an N×(V+1) bool mask and returns a masked copy:
  O(N·V) traffic every step however few tokens are banned. It returns its input unchanged (the
  same object) while ``cur_len < n``. Ids >= V are skipped; a negative id in a matching window
  raises. Semantics are equal here; this op writes in place instead of copying.
- HF ``EncoderNoRepeatNGramLogitsProcessor`` maps hypothesis ``i`` to input ``i // (N // B)``,
  counts the whole input (padding too), bans every input id for n == 1 even at ``cur_len == 0``,
  raises on ids >= V and wraps negative ids to the end of the vocab. Equal here, except that ids
  outside [0, V) are never banned and N not a multiple of B raises at once.
- fairseq ``NGramRepeatBlock``: the CUDA kernel bans exactly what this op bans with
  ``length=step + 1`` (float32 scores and int64 tokens only; one thread per window and no launch
  check, so past 1024 windows the launch fails unreported by the op itself). The CPU fallback is
  handed the whole pad-filled buffer and takes its prefix from the buffer's end (pads), so it bans
  nothing (fairseq #4709/#5206); with n == 1 it bans nothing either, since ``row[-0:]`` is the
  whole row.

Layers: Triton kernel (:mod:`fastgen.ops.triton.ngram`) and CUDA kernel (``csrc/ngram.cu``, loaded
by :mod:`fastgen.ops._ext`) → the torch reference below (the oracle and the CPU path) → the public
functions :func:`ban_repeated_ngrams` and :func:`ban_encoder_ngrams` with their backend dispatch.
"""

from __future__ import annotations

from types import ModuleType

import torch

from fastgen.ops._dispatch import BACKENDS, TritonKernels, choose_backend, device_problem, without_cuda_device

__all__ = ["BACKENDS", "available_backends", "ban_encoder_ngrams", "ban_repeated_ngrams"]

_KERNEL_SCORE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KERNEL_TOKEN_DTYPES = (torch.int32, torch.int64)

Length = int | torch.Tensor | None


# --------------------------------------------------------------------------------------------------
# torch reference: the oracle, and the CPU path
# --------------------------------------------------------------------------------------------------


def _valid_lengths(length: Length, tokens: torch.Tensor) -> int | torch.Tensor:
    """Valid tokens per row clamped to [0, L]: one int for all rows, or an int64 tensor of N."""
    num_rows, width = tokens.shape
    if isinstance(length, torch.Tensor):
        return length.to(device=tokens.device, dtype=torch.int64).expand(num_rows).clamp(0, width)
    return width if length is None else min(max(int(length), 0), width)


def _prefix(
    tokens: torch.Tensor, n: int, lengths: int | torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The last n-1 valid tokens of every row (N×(n-1)), and which rows have that many (None: all do).

    Returns ``(None, None)`` when no row can have that many.
    """
    width = tokens.shape[1]
    if width < n - 1:
        return None, None
    if isinstance(lengths, int):
        return (tokens[:, lengths - n + 1 : lengths], None) if lengths >= n - 1 else (None, None)
    start = lengths - (n - 1)
    offsets = torch.arange(n - 1, device=tokens.device)
    index = (start.clamp(min=0).unsqueeze(1) + offsets).clamp(max=width - 1)
    return tokens.gather(1, index), start >= 0


def _window_matches(hay: torch.Tensor, prefix: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """bool R×W: window i of ``hay[:, :width]`` (its first n-1 tokens) equals ``prefix``.

    Comparing one shifted slice at a time keeps every temporary at R×W (an unfold + all() would
    materialise R×W×(n-1) and reduce it); for the usual n = 3 that is two compares and one and.
    """
    num_windows = width - n + 1
    match = hay[:, 0:num_windows] == prefix[:, 0:1]
    for k in range(1, n - 1):
        match &= hay[:, k : k + num_windows] == prefix[:, k : k + 1]
    return match


def _write_banned(
    scores: torch.Tensor,
    match: torch.Tensor,
    successors: torch.Tensor,
    row_of: torch.Tensor | None,
    sync_free: bool | None = None,
) -> None:
    """Set ``scores[r, successors[row_of[r], i]] = -inf`` wherever ``match[r, i]``, touching nothing else.

    ``successors`` holds, per window, the token that would complete its n-gram; ids outside
    ``[0, V)`` cannot be sampled and are never banned. ``row_of`` maps score rows to successor rows
    (encoder variant: beams share one input row); None is the identity.
    """
    if sync_free is None:
        sync_free = scores.device.type != "cpu"
    if sync_free:
        _write_banned_without_sync(scores, match, successors, row_of)
        return
    # On CPU the few matches are cheapest to gather explicitly (nonzero costs no device sync here).
    vocab = scores.shape[1]
    rows, cols = match.nonzero(as_tuple=True)
    banned = successors[rows if row_of is None else row_of[rows], cols]
    keep = (banned >= 0) & (banned < vocab)
    if not bool(keep.all()):
        rows, banned = rows[keep], banned[keep]
    scores.index_put_((rows, banned.long()), torch.tensor(float("-inf"), dtype=scores.dtype))


def _write_banned_without_sync(
    scores: torch.Tensor,
    match: torch.Tensor,
    successors: torch.Tensor,
    row_of: torch.Tensor | None,
) -> None:
    """Same result as the CPU branch of :func:`_write_banned`, with fixed shapes (no nonzero, no sync).

    Every window writes one entry. A scatter with repeated indices keeps an arbitrary write, so all
    writes to one (row, token) must agree: in a row with any ban, non-matching windows are redirected
    to the row's first banned token (writing -inf there too); in a row without bans every window
    writes its own entry's current value back. NaN scores are banned to -inf as upstream does.
    """
    vocab = scores.shape[1]
    succ = (successors if row_of is None else successors.index_select(0, row_of)).long()
    banned = match & (succ >= 0) & (succ < vocab)
    any_banned = banned.any(dim=1, keepdim=True)
    first = succ.gather(1, banned.to(torch.uint8).argmax(dim=1, keepdim=True))
    target = torch.where(banned | ~any_banned, succ, first).clamp(0, vocab - 1)
    neg_inf = torch.full((), float("-inf"), dtype=scores.dtype, device=scores.device)
    value = torch.where(any_banned, neg_inf, scores.gather(1, target))
    scores.scatter_(1, target, value)


def _ban_torch(
    hay: torch.Tensor,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    n: int,
    length: Length,
    decoder: bool,
    sync_free: bool | None = None,
) -> None:
    """Torch reference shared by both public functions (``decoder``: ``hay`` is ``tokens`` itself).

    ``sync_free`` picks the write strategy (default: nonzero on CPU, fixed shapes elsewhere).
    """
    num_rows = tokens.shape[0]
    if num_rows == 0:
        return
    lengths = _valid_lengths(length, tokens)
    prefix, prefix_ok = _prefix(tokens, n, lengths)
    if prefix is None:
        return
    if decoder:
        if isinstance(lengths, int):
            hay = hay[:, :lengths]  # one length for all rows: slice, so no window needs a mask
        num_windows = hay.shape[1] - n + 1
        if num_windows <= 0:
            return
        if n == 1:
            match = torch.ones(num_rows, num_windows, dtype=torch.bool, device=hay.device)
        else:
            match = _window_matches(hay, prefix, n, hay.shape[1])
        if isinstance(lengths, torch.Tensor):  # window i exists in row r iff i <= len_r - n
            match &= torch.arange(num_windows, device=hay.device) < (lengths - n + 1).unsqueeze(1)
        _write_banned(scores, match, hay[:, n - 1 :], None, sync_free)
        return

    num_windows = hay.shape[1] - n + 1
    if num_windows <= 0:
        return
    beams = num_rows // hay.shape[0]
    if n == 1:  # every input token, whatever the hypothesis (HF: the empty prefix always matches)
        match = torch.ones(num_rows, num_windows, dtype=torch.bool, device=hay.device)
    else:
        # B input rows, each compared with its `beams` hypotheses' prefixes: B×beams×W, no B×beams×S copy.
        grouped = prefix.view(hay.shape[0], beams, n - 1)
        match = hay[:, None, 0:num_windows] == grouped[:, :, 0:1]
        for k in range(1, n - 1):
            match &= hay[:, None, k : k + num_windows] == grouped[:, :, k : k + 1]
        match = match.view(num_rows, num_windows)
        if prefix_ok is not None:
            match &= prefix_ok.unsqueeze(1)
    row_of = torch.arange(num_rows, device=hay.device) // beams
    _write_banned(scores, match, hay[:, n - 1 :], row_of, sync_free)


# --------------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------------

_TRITON = TritonKernels("fastgen.ops.triton.ngram", "n-gram blocking")


def _load_cuda() -> ModuleType | None:
    from fastgen.ops import _ext

    return _ext.load()


def _unsupported(backend: str, hay: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> str | None:
    """Why ``backend`` cannot serve this call, or None when it can (xformers-style reasons)."""
    if backend == "torch":
        return None
    if scores.dtype not in _KERNEL_SCORE_DTYPES:
        return f"scores dtype {scores.dtype} (kernels take float32/float16/bfloat16)"
    if tokens.dtype not in _KERNEL_TOKEN_DTYPES or hay.dtype not in _KERNEL_TOKEN_DTYPES:
        return f"token dtype {tokens.dtype}/{hay.dtype} (kernels take int32/int64)"
    if scores.stride(1) != 1:
        return "scores rows are not contiguous"
    return device_problem(backend, scores.device.type, _load_cuda, _TRITON)


def _choose_backend(forced: str | None, hay: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> str:
    """The backend for this call, by the rule of :mod:`fastgen.ops._dispatch`."""
    return choose_backend(
        "n-gram blocking", forced, lambda backend: _unsupported(backend, hay, tokens, scores), scores.device.type
    )


def available_backends(device: str | torch.device = "cuda") -> dict[str, str | None]:
    """Each backend with None if it can run float32/int64 calls on ``device``, else the reason why not."""
    device = torch.device(device)
    if device.type == "cuda" and (missing := without_cuda_device()) is not None:
        return missing
    scores = torch.empty(1, 1, device=device)
    tokens = torch.empty(1, 1, dtype=torch.int64, device=device)
    return {backend: _unsupported(backend, tokens, tokens, scores) for backend in BACKENDS}


def _run(
    backend: str,
    hay: torch.Tensor,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    n: int,
    length: Length,
    decoder: bool,
) -> None:
    if backend == "torch":
        _ban_torch(hay, tokens, scores, n, length, decoder)
        return
    beams = tokens.shape[0] // hay.shape[0]
    lengths, scalar = _kernel_lengths(length, tokens)
    if backend == "cuda":
        ext = _load_cuda()
        assert ext is not None  # _unsupported() checked it
        if hay.dtype != tokens.dtype:
            hay = hay.to(tokens.dtype)
        ext.ngram_ban(hay, tokens, lengths, scalar, scores, n, beams, decoder)
        return
    kernels = _TRITON.load()
    assert kernels is not None
    kernels.ban_ngrams(hay, tokens, lengths, scalar, scores, n, beams, decoder)


def _kernel_lengths(length: Length, tokens: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """Kernels take either one int64 length per row or a scalar (clamped to the row width by them)."""
    if isinstance(length, torch.Tensor):
        lengths = length.to(device=tokens.device, dtype=torch.int64).expand(tokens.shape[0]).contiguous()
        return lengths, 0
    return None, tokens.shape[1] if length is None else int(length)


# --------------------------------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------------------------------


def _check(tokens: torch.Tensor, scores: torch.Tensor, n: int, length: Length, name: str) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"{name}: n has to be a positive integer, got {n!r}")
    if tokens.dim() != 2 or scores.dim() != 2 or tokens.shape[0] != scores.shape[0]:
        raise ValueError(
            f"{name}: expected tokens N×L and scores N×V, got {tuple(tokens.shape)} and {tuple(scores.shape)}"
        )
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"{name}: tokens must be an integer tensor, got {tokens.dtype}")
    if not scores.dtype.is_floating_point:
        raise TypeError(f"{name}: scores must be a floating-point tensor, got {scores.dtype}")
    if tokens.device != scores.device:
        raise ValueError(f"{name}: tokens on {tokens.device} but scores on {scores.device}")
    if isinstance(length, torch.Tensor) and length.numel() not in (1, tokens.shape[0]):
        raise ValueError(f"{name}: length must be a scalar or hold one value per row, got {tuple(length.shape)}")


def ban_repeated_ngrams(
    tokens: torch.Tensor,
    scores: torch.Tensor,
    n: int,
    length: Length = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Set ``scores[r, t] = -inf`` in place for every token ``t`` that would repeat an n-gram of row ``r``.

    Semantics (those of HF's ``NoRepeatNGramLogitsProcessor`` and of fairseq's ``NGramRepeatBlock``
    CUDA kernel): let ``T = tokens[r, :len_r]`` be the valid tokens of row ``r``. The n-gram prefix is
    the last n-1 tokens of ``T``; for every position ``i`` with ``0 <= i <= len_r - n`` and
    ``T[i : i+n-1] == prefix``, the token ``T[i+n-1]`` is banned. So ``len_r < n`` bans nothing and
    ``n == 1`` bans every token of ``T``. Token ids outside ``[0, V)`` are never banned (they cannot
    be sampled; HF skips ids >= V the same way). Entries that are not banned are not touched.

    Args:
        tokens: N×L int32/int64 — the hypotheses so far (decoder input ids / fairseq's token buffer).
        scores: N×V float (float32/float16/bfloat16 on the kernels) — modified in place and returned.
        n: the n-gram size, >= 1.
        length: valid tokens per row: None (all L), an int, or an int tensor of N (or one) values,
            clamped to [0, L]. fairseq needs it: its token buffer is padded past the current step and
            holds ``step + 1`` valid tokens, so call with ``length=step + 1``.
        backend: force ``"cuda"``, ``"triton"`` or ``"torch"`` (else ``FASTGEN_BACKEND``, else the
            fastest that can serve the call: CUDA extension → Triton → torch on CUDA, torch on CPU).
    """
    _check(tokens, scores, n, length, "ban_repeated_ngrams")
    if tokens.shape[0] == 0 or tokens.shape[1] < n:
        return scores
    _run(_choose_backend(backend, tokens, tokens, scores), tokens, tokens, scores, n, length, decoder=True)
    return scores


def ban_encoder_ngrams(
    input_tokens: torch.Tensor,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    n: int,
    length: Length = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Set ``scores[r, t] = -inf`` in place for every ``t`` that would complete an n-gram of the *input*.

    Semantics of HF's ``EncoderNoRepeatNGramLogitsProcessor``: hypothesis row ``r`` of N = B×beams
    belongs to input row ``b = r // (N // B)``. Its prefix is the last n-1 of its ``len_r`` valid
    tokens (rows with ``len_r < n-1`` ban nothing); for every ``i <= S - n`` with
    ``input_tokens[b, i : i+n-1] == prefix``, the token ``input_tokens[b, i+n-1]`` is banned. With
    ``n == 1`` every input token is banned, whatever ``len_r``. The whole input row counts, padding
    included, as upstream. Ids outside ``[0, V)`` are never banned.

    Args:
        input_tokens: B×S int32/int64 — the encoder (prompt) ids; N must be a multiple of B.
        tokens, scores, n, length, backend: as in :func:`ban_repeated_ngrams`.
    """
    _check(tokens, scores, n, length, "ban_encoder_ngrams")
    if input_tokens.dim() != 2 or input_tokens.dtype.is_floating_point or input_tokens.dtype == torch.bool:
        raise ValueError(f"ban_encoder_ngrams: input_tokens must be a B×S integer tensor, got {input_tokens.shape}")
    if input_tokens.shape[0] == 0 or tokens.shape[0] % input_tokens.shape[0] != 0:
        raise ValueError(
            f"ban_encoder_ngrams: {tokens.shape[0]} hypotheses are not a multiple of {input_tokens.shape[0]} inputs"
        )
    if input_tokens.device != scores.device:
        raise ValueError(f"ban_encoder_ngrams: input_tokens on {input_tokens.device} but scores on {scores.device}")
    if tokens.shape[0] == 0 or input_tokens.shape[1] < n:
        return scores
    chosen = _choose_backend(backend, input_tokens, tokens, scores)
    _run(chosen, input_tokens, tokens, scores, n, length, decoder=False)
    return scores
