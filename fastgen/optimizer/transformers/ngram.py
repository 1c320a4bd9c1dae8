"""HF's n-gram logits processors on fastgen's n-gram op ("ngram").

``NoRepeatNGramLogitsProcessor`` builds an N×(V+1) bool mask every step and returns a masked copy;
``EncoderNoRepeatNGramLogitsProcessor`` loops over hypotheses in Python with ``.tolist()`` (a
host-device sync per hypothesis on a GPU). Both ``__call__`` are replaced by
:func:`fastgen.ops.ngram.ban_repeated_ngrams` / :func:`~fastgen.ops.ngram.ban_encoder_ngrams`, which
write only the banned entries. The encoder processor keeps only a dict of the prompt's n-grams, so
its ``__init__`` is wrapped to also keep a snapshot of the prompt ids for the op.

In place or a new tensor. Upstream returns its input itself while ``cur_len < n`` (decoder
processor) and a new tensor otherwise (the encoder processor always clones). The replacements do
the same: they ban into ``scores.clone()``, never into the caller's tensor. Writing in place would
change tensors that callers keep: ``GenerationMixin._sample`` hands ``next_token_logits`` to the
processors and then stores that same tensor as the raw logits (``output_logits=True``), and a
user's processor placed before ours, or a user calling the processor directly, may keep its input
too. ``_beam_search`` (a fresh ``log_softmax``) and ``_assisted_decoding`` (a view that is
overwritten with the result, raw logits cloned first) would be safe, but telling the callers apart
needs hooks on the decoding loops and a list of which processors keep what, for little: the copy is
what remains of the processor's cost at large N (CPU, 1 thread, ``benchmarks/results/ngram_op-cpu.json``:
N=512, V=50265: op 0.27 ms, patched processor 21 ms, upstream 35 ms), yet in generation the processor is
a small share of a step (bart-base shape, 16 hypotheses: 0.5% of ``generate`` upstream, 0.3% patched).

Calls the op would not answer exactly as upstream are handed back to upstream (and noted through
:func:`~fastgen.optimizer.registry.fallback`): shapes or dtypes upstream does not expect, token ids
where upstream raises or wraps (negative decoder ids on CPU; prompt ids outside ``[0, V)``), a
hypothesis count that is not a multiple of the prompt batch, a processor built while fastgen was
inactive or mutated after construction. On CUDA, negative decoder ids are not looked for: the check
would cost a host-device sync per step, and in ``generate`` such ids reach a processor only from a
prompt passed together with ``inputs_embeds`` (anywhere else they are embedded, and fail, first).
There upstream hits a device-side assert if one would be banned; the op bans nothing for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from fastgen.ops.ngram import ban_encoder_ngrams, ban_repeated_ngrams
from fastgen.optimizer import report
from fastgen.optimizer.registry import fallback

FEATURE = "ngram"
#: what the report says ran (fastgen's beam loop, which bans through the op itself, says the same)
RAN_NO_REPEAT = "no_repeat_ngram_size on fastgen's n-gram op"
RAN_ENCODER_NO_REPEAT = "encoder_no_repeat_ngram_size on fastgen's n-gram op"
_SNAPSHOT = "_fastgen_encoder_ngrams"


def _is_int_tensor(t: Any) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _common_problem(n: Any, input_ids: Any, scores: Any) -> str | None:
    """What both processors need from a call for the op to answer it exactly, or None.

    Reasons name no shapes: :func:`~fastgen.optimizer.registry.fallback` warns once per distinct reason.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return f"ngram_size {n!r} is not a positive integer"
    if not _is_int_tensor(input_ids) or not isinstance(scores, torch.Tensor) or not scores.dtype.is_floating_point:
        return "input_ids is not an integer tensor or scores is not a floating-point tensor"
    if input_ids.dim() != 2 or scores.dim() != 2 or input_ids.shape[0] != scores.shape[0]:
        return "input_ids and scores are not N×L and N×V with the same N"
    if input_ids.device != scores.device:
        return f"input_ids on {input_ids.device} but scores on {scores.device}"
    return None


def make_no_repeat_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``NoRepeatNGramLogitsProcessor.__call__`` (see the module docstring)."""

    def __call__(self: Any, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        n = self.ngram_size
        problem = _common_problem(n, input_ids, scores)
        if problem is None and input_ids.device.type == "cpu" and input_ids.numel() and int(input_ids.min()) < 0:
            problem = "negative token ids (upstream raises when one would be banned)"
        if problem is not None:
            fallback(FEATURE, f"NoRepeatNGramLogitsProcessor: {problem}")
            return original(self, input_ids, scores)
        if input_ids.shape[-1] < n:
            return scores  # upstream: no complete n-gram yet, the input itself
        report.note_ran(FEATURE, RAN_NO_REPEAT)
        return ban_repeated_ngrams(input_ids, scores.clone(), n)

    return __call__


@dataclasses.dataclass(frozen=True)
class _PromptSnapshot:
    """The prompt ids as upstream's ``__init__`` saw them, and what its n-gram dict was built for."""

    ids: torch.Tensor  # B×S, cloned: upstream's dict does not follow later in-place edits either
    ngram_size: int
    low: int  # smallest and largest id: upstream raises on ids >= V and wraps negative ones
    high: int


def make_encoder_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``EncoderNoRepeatNGramLogitsProcessor.__init__`` to keep the prompt ids for the op.

    Upstream still builds its n-gram dict: the fallback path and any reader of
    ``generated_ngrams`` need it. Reading the id range here (once per processor) keeps that check
    off the decoding loop.
    """

    def __init__(self: Any, encoder_ngram_size: int, encoder_input_ids: torch.LongTensor) -> None:
        original(self, encoder_ngram_size, encoder_input_ids)
        ids = encoder_input_ids
        if not _is_int_tensor(ids):
            return
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2:
            return
        low, high = (int(ids.min()), int(ids.max())) if ids.numel() else (0, -1)
        setattr(self, _SNAPSHOT, _PromptSnapshot(ids.clone(), encoder_ngram_size, low, high))

    return __init__


def _encoder_problem(self: Any, snapshot: _PromptSnapshot | None, input_ids: Any, scores: Any) -> str | None:
    if snapshot is None:
        return "processor was built while fastgen was inactive (no prompt snapshot)"
    problem = _common_problem(self.ngram_size, input_ids, scores)
    if problem is not None:
        return problem
    if self.ngram_size != snapshot.ngram_size or self.batch_size != snapshot.ids.shape[0]:
        return "ngram_size or batch_size changed after construction"
    if scores.shape[0] % snapshot.ids.shape[0] != 0:
        return "the number of hypotheses is not a multiple of the number of prompts"
    if snapshot.low < 0 or snapshot.high >= scores.shape[1]:
        return f"prompt ids outside [0, {scores.shape[1]}) (upstream raises or wraps them)"
    return None


def make_encoder_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``EncoderNoRepeatNGramLogitsProcessor.__call__`` (see the module docstring)."""

    def __call__(self: Any, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        snapshot: _PromptSnapshot | None = getattr(self, _SNAPSHOT, None)
        problem = _encoder_problem(self, snapshot, input_ids, scores)
        if problem is not None:
            fallback(FEATURE, f"EncoderNoRepeatNGramLogitsProcessor: {problem}")
            return original(self, input_ids, scores)
        assert snapshot is not None  # _encoder_problem checked it
        prompt = snapshot.ids.to(scores.device)
        report.note_ran(FEATURE, RAN_ENCODER_NO_REPEAT)
        return ban_encoder_ngrams(prompt, input_ids, scores.clone(), snapshot.ngram_size)

    return __call__
