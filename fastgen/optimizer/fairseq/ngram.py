"""fairseq ``NGramRepeatBlock.forward`` on fastgen's n-gram op ("ngram").

Upstream has two paths. With its CUDA extension built and a GPU present it bans, for each
hypothesis, the successor of every earlier occurrence of the last n-1 valid tokens (of the
``step + 1`` valid tokens of fairseq's padded buffer). Otherwise its Python fallback runs, and that
one is broken: it is handed the whole pad-filled ``tokens`` buffer and takes the "last n-1 tokens"
from the buffer's end, which holds padding, so it bans nothing (fairseq #4709, #5206); n-gram
blocking silently does nothing on CPU, or on a GPU without the extension.

The replacement calls :func:`fastgen.ops.ngram.ban_repeated_ngrams` with ``length=step + 1`` on
every device: the CUDA kernel's semantics everywhere, sync-free on a GPU, vectorized on CPU. On CPU
this changes fairseq's output on purpose: hypotheses no longer repeat n-grams, as
``--no-repeat-ngram-size`` promises. Like upstream it writes into ``lprobs`` in place and returns
it (fairseq's own contract: "expected to be updated in place"). Token ids outside ``[0, V)`` (which
fairseq's dictionary cannot produce) are never banned.

n = 1 is the one place where the CUDA kernel's semantics are not kept. Position 0 of fairseq's buffer
holds the start token (EOS, or ``bos_token``), which the model did not generate; the kernel counts it
as a 1-gram and bans it, so EOS is ``-inf`` at every step, no hypothesis can finish and
``SequenceGenerator`` fails ``assert step < max_len`` (on a GPU with fairseq's extension too). Here
n = 1 bans the tokens at positions ``1 .. step`` (every generated or forced-prefix token, each once);
for n >= 2 the start token only ever appears as context of a window, exactly as in the kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastgen.ops.ngram import ban_repeated_ngrams
from fastgen.optimizer.registry import fallback

FEATURE = "ngram"


def _problem(n: Any, tokens: Any, lprobs: Any, bsz: Any, beam_size: Any, step: Any) -> str | None:
    """Why the op cannot answer this call as upstream's CUDA path would, or None (no shapes: warned once each)."""
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return f"no_repeat_ngram_size {n!r} is not a positive integer"
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (bsz, beam_size, step)):
        return "bsz, beam_size and step are not Python ints"
    if not isinstance(tokens, torch.Tensor) or not isinstance(lprobs, torch.Tensor):
        return "tokens or lprobs is not a tensor"
    if tokens.dim() != 2 or lprobs.dim() != 2 or not lprobs.dtype.is_floating_point:
        return f"tokens / lprobs are not N×L and N×V floats (lprobs {lprobs.dtype})"
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        return f"tokens dtype {tokens.dtype}"
    if tokens.shape[0] != bsz * beam_size or lprobs.shape[0] != bsz * beam_size:
        return "row counts differ from bsz * beam_size (upstream asserts)"
    if tokens.device != lprobs.device:
        return f"tokens on {tokens.device} but lprobs on {lprobs.device}"
    return None


def make_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``NGramRepeatBlock.forward(tokens, lprobs, bsz, beam_size, step)``."""

    def forward(self: Any, tokens: torch.Tensor, lprobs: torch.Tensor, bsz: int, beam_size: int, step: int) -> Any:
        n = self.no_repeat_ngram_size
        problem = _problem(n, tokens, lprobs, bsz, beam_size, step)
        if problem is not None:
            fallback(FEATURE, f"NGramRepeatBlock: {problem}")
            return original(self, tokens, lprobs, bsz, beam_size, step)
        if n == 1:  # the start token at position 0 is not a generated token (module docstring)
            return ban_repeated_ngrams(tokens[:, 1:], lprobs, 1, length=step)
        return ban_repeated_ngrams(tokens, lprobs, n, length=step + 1)

    return forward
