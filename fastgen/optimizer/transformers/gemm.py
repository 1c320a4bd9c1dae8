"""Exact fast linears for Transformers ``generate`` on CPU fp32 ("gemm").

The decode step of a CPU beam search spends about a third of its time in one GEMM: the output
embedding (``lm_head``, tied or not) over a few dozen hypotheses; the feed-forward products are
most of the rest. :func:`fastgen.ops.linear.exact_linear` runs each product in the form this CPU
does fastest among those that give ``F.linear``'s bits (calibrated per shape and row count on the
real input; a form is kept only where ``torch.equal`` holds).

How it is hooked: for the duration of one ``generate`` call (and only when the model's output
embedding is a plain ``nn.Linear`` with CPU fp32 weights) the head module and every other plain
``nn.Linear`` with CPU fp32 contiguous weights get an instance ``forward`` that calls
``exact_linear``; it is removed when the call ends, so the user's modules are left exactly as they
were (picklable, no fastgen attribute). Nested and concurrent calls on the same
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


def _other_linears(model: Any, head: torch.nn.Linear) -> list[torch.nn.Linear]:
    """The model's other plain CPU fp32 ``nn.Linear`` modules that no one else has a forward on."""
    chosen: dict[int, torch.nn.Linear] = {}
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module is head or id(module) in chosen:
            continue
        if "forward" in module.__dict__ and id(module) not in _installed:
            continue  # someone else's instance forward (an opt-in linear mode's included)
        weight, bias = module.weight, module.bias
        tensors = (weight,) if bias is None else (weight, bias)
        if all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
            chosen[id(module)] = module
    return list(chosen.values())


@contextmanager
def exact_output_projection(model: Any) -> Iterator[None]:
    """Inside the block, ``model``'s output embedding and its other plain CPU fp32 linears run
    :func:`exact_linear` (see module docstring)."""
    head, problem = head_problem(model)
    if head is not None and linear_modes.installed(head):
        yield  # an opt-in linear mode (fast_gemm, int8) serves this head already: its rounding, the user's choice
        return
    if head is None:
        fallback(FEATURE, problem or "no output embeddings")
        yield
        return
    modules = [head, *_other_linears(model, head)]
    with _lock:
        for module in modules:
            count = _installed.get(id(module), 0)
            if count == 0:
                module.forward = types.MethodType(_exact_forward, module)
            _installed[id(module)] = count + 1
    report.note_ran(FEATURE, "linears in their fastest bit-identical forms")
    try:
        yield
    finally:
        with _lock:
            for module in modules:
                _installed[id(module)] -= 1
                if _installed[id(module)] == 0:
                    del _installed[id(module)]
                    del module.forward


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GenerationMixin.generate``: upstream's (or another feature's) call in the scope."""

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with exact_output_projection(self):
            return original(self, *args, **kwargs)

    return generate
