"""Exact fast linears for Transformers ``generate`` on CPU fp32 ("gemm").

The decode step of a CPU beam search spends about a third of its time in one GEMM: the output
embedding (``lm_head``, tied or not) over a few dozen hypotheses; the feed-forward products are
most of the rest. :func:`fastgen.ops.linear.exact_linear` runs each product in the form this CPU
does fastest among those that give ``F.linear``'s bits (calibrated per shape and row count on the
real input; a form is kept only where ``torch.equal`` holds).

How it is hooked: for the duration of one ``generate`` call (and only when the model's output
embedding is a plain ``nn.Linear`` with CPU fp32 weights) the head module and every other plain
``nn.Linear`` with CPU fp32 contiguous weights run ``exact_linear`` through
:mod:`fastgen.optimizer.exact_scope` (instance forwards removed when the call ends; under
``torch.compile`` they trace ``F.linear`` itself, with no graph break).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fastgen.ops import linear
from fastgen.optimizer import exact_scope, linear_modes, report
from fastgen.optimizer.exact_scope import exact_forwards, plain_linears
from fastgen.optimizer.registry import fallback

FEATURE = "gemm"


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
    if "forward" in head.__dict__ and not exact_scope.installed(head) and not linear_modes.installed(head):
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
    with exact_forwards([head, *plain_linears(model, skip=[head])]):
        report.note_ran(FEATURE, "linears in their fastest bit-identical forms")
        yield
    report.note_ran(FEATURE, f"forms chosen so far in this process: {linear.forms_summary()}")


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GenerationMixin.generate``: upstream's (or another feature's) call in the scope."""

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with exact_output_projection(self):
            return original(self, *args, **kwargs)

    return generate
