"""Exact fast vocabulary projection for Transformers ``generate`` on CPU fp32 ("gemm").

The decode step of a CPU beam search spends about a third of its time in one GEMM: the output
embedding (``lm_head``, tied or not) over a few dozen hypotheses. :func:`fastgen.ops.linear.exact_linear`
runs that product in the form this CPU does fastest among those that give ``F.linear``'s bits.

How it is hooked: for the duration of one ``generate`` call (and only when the model's output
embedding is a plain ``nn.Linear`` with CPU fp32 weights) the head module gets an instance
``forward`` that calls ``exact_linear``; it is removed when the call ends, so the user's module is
left exactly as it was (picklable, no fastgen attribute). Nested and concurrent calls on the same
model share one installation (a counter). Why not patch ``nn.Linear.forward`` or
``F.linear``: that would change torch for every module of the process, not just this head.

Under ``torch.compile`` the installed ``forward`` runs ``F.linear`` itself (``exact_linear``
checks ``torch.compiler.is_compiling()`` before anything else), so a compiled forward traces
upstream's op with no graph break.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fastgen.ops.linear import exact_linear
from fastgen.optimizer import linear_modes, report
from fastgen.optimizer.registry import fallback

FEATURE = "gemm"

_lock = threading.Lock()
_installed: dict[int, int] = {}  # id(head) -> number of generate calls using the installed forward


def _exact_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through :func:`exact_linear` (same bits)."""
    return exact_linear(input, self.weight, self.bias)


def head_problem(model: Any) -> tuple[torch.nn.Linear | None, str | None]:
    """The model's output embedding and why it cannot take the exact fast form (None: it can)."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None, "the model has no output embeddings"
    if head is None:
        return None, "the model has no output embeddings"
    if type(head) is not torch.nn.Linear:  # allow-list: a subclass may compute its own way
        return None, f"output embeddings are {type(head).__name__}, not torch.nn.Linear"
    if "forward" in head.__dict__ and id(head) not in _installed and not linear_modes.installed(head):
        return None, "output embeddings carry their own instance forward"
    weight = head.weight
    if weight.device.type != "cpu":
        return None, f"output embeddings on {weight.device.type} (the exact GEMM forms are for CPU)"
    if weight.dtype != torch.float32:
        return None, f"output embeddings in {weight.dtype} (the exact GEMM forms are for float32)"
    if not weight.is_contiguous():
        return None, "output embedding weight is not contiguous"
    return head, None


@contextmanager
def exact_output_projection(model: Any) -> Iterator[None]:
    """Inside the block, ``model``'s output embedding runs :func:`exact_linear` (see module docstring)."""
    head, problem = head_problem(model)
    if head is not None and linear_modes.installed(head):
        yield  # an opt-in linear mode (fast_gemm, int8) serves this head already: its rounding, the user's choice
        return
    if head is None:
        fallback(FEATURE, problem or "no output embeddings")
        yield
        return
    with _lock:
        count = _installed.get(id(head), 0)
        if count == 0:
            head.forward = types.MethodType(_exact_forward, head)
        _installed[id(head)] = count + 1
    report.note_ran(FEATURE, "output projection in its fastest bit-identical form")
    try:
        yield
    finally:
        with _lock:
            _installed[id(head)] -= 1
            if _installed[id(head)] == 0:
                del _installed[id(head)]
                del head.forward


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GenerationMixin.generate``: upstream's (or another feature's) call in the scope."""

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with exact_output_projection(self):
            return original(self, *args, **kwargs)

    return generate
