"""The per-call scope of the opt-in "fast_gemm" feature, shared by the Transformers and fairseq hooks.

:func:`packed_linears` gives every plain ``nn.Linear`` of a model with CPU fp32 weights an instance
``forward`` that runs :func:`fastgen.ops.fast_linear.packed_linear` (oneDNN with a pre-packed
weight) and removes them when the block ends, so the user's modules are left exactly as they were.
Nested and concurrent scopes over the same modules share one installation (a counter). Weights are
packed once per module and kept for the process (a second copy of the linear weights: the extra
bytes are noted in :func:`fastgen.report`). Under ``torch.compile`` the installed forwards run
``F.linear`` (upstream's op) without a graph break.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fastgen.ops import fast_linear
from fastgen.optimizer import report
from fastgen.optimizer.registry import fallback

FEATURE = "fast_gemm"

_lock = threading.Lock()
_installed: dict[int, int] = {}  # id(linear) -> number of generate calls using the installed forward


def _packed_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return fast_linear.packed_linear(self, input)


def _packed_conv1d_forward(self: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
    return fast_linear.packed_conv1d(self, input)


def is_conv1d(module: torch.nn.Module) -> bool:
    """Exactly Transformers' ``Conv1D`` (GPT-2's linears, weight ``(in, out)``), named without importing it."""
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__ == "transformers.pytorch_utils"


def installed(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is this feature's packed one right now (the gemm feature asks)."""
    return id(module) in _installed


def packable_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's plain ``nn.Linear`` (and Transformers ``Conv1D``) modules the packed path can serve."""
    chosen: dict[int, torch.nn.Linear] = {}
    for module in model.modules():
        if (type(module) is not torch.nn.Linear and not is_conv1d(module)) or id(module) in chosen:
            continue
        if "forward" in module.__dict__ and id(module) not in _installed:
            continue  # someone else's instance forward
        if fast_linear.module_problem(module) is None:
            chosen[id(module)] = module
    return list(chosen.values())


@contextmanager
def packed_linears(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s plain CPU fp32 linears run on oneDNN with packed weights."""
    problem = fast_linear.unavailable()
    modules = [] if problem else packable_linears(model)
    if not modules:
        fallback(FEATURE, problem or "no CPU float32 nn.Linear modules in the model")
        yield
        return
    with _lock:
        extra = sum(fast_linear.prepack(module, transposed=is_conv1d(module)) for module in modules)
        for module in modules:
            count = _installed.get(id(module), 0)
            if count == 0:
                forward = _packed_conv1d_forward if is_conv1d(module) else _packed_forward
                module.forward = types.MethodType(forward, module)
            _installed[id(module)] = count + 1
    report.note_ran(FEATURE, f"{len(modules)} linears on oneDNN with packed weights ({extra / 2**20:.0f} MiB)")
    try:
        yield
    finally:
        with _lock:
            for module in modules:
                _installed[id(module)] -= 1
                if _installed[id(module)] == 0:
                    del _installed[id(module)]
                    del module.forward
