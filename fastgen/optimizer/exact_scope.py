"""The exact ``gemm`` feature's per-call scope, shared by the Transformers and fairseq hooks.

For one ``generate`` call the chosen ``nn.Linear`` modules get an instance ``forward`` that runs
:func:`fastgen.ops.linear.exact_linear` (``F.linear``'s bits, in the fastest form calibrated here); it
is removed when the call ends, so the user's modules are left exactly as they were (picklable, no
fastgen attribute). Nested and concurrent calls share one installation (a counter). Why not patch
``nn.Linear.forward`` or ``F.linear``: that would change torch for every module of the process.
Under ``torch.compile`` the forward runs ``F.linear`` itself (``exact_linear`` checks first).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from fastgen.ops import linear
from fastgen.ops.linear import exact_linear

_lock = threading.Lock()
_installed: dict[int, int] = {}  # id(linear) -> number of calls using the installed forward


def _exact_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through :func:`exact_linear` (same bits)."""
    return exact_linear(input, self.weight, self.bias)


def installed(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs the exact forward right now."""
    return id(module) in _installed


def plain_linears(model: torch.nn.Module, skip: Iterable[torch.nn.Module] = ()) -> list[torch.nn.Linear]:
    """The model's plain CPU fp32 contiguous ``nn.Linear`` modules that another exact form may serve and
    that no one else has a forward on: every width where fastgen's ordered kernel is loaded, else those
    with ``linear.MIN_OUT_FEATURES`` outputs (narrower ones always run ``F.linear`` then, and a forward
    of ours there would only add its checks to every call: measured slower on a small model)."""
    chosen: dict[int, torch.nn.Linear] = {id(module): module for module in skip}
    found: list[torch.nn.Linear] = []
    ordered = linear.ordered_kernel() is not None  # fastgen's ordered kernel serves any width
    for module in model.modules():
        if type(module) is not torch.nn.Linear or id(module) in chosen:
            continue
        if "forward" in module.__dict__ and not installed(module):
            continue  # someone else's instance forward (an opt-in linear mode's included)
        weight, bias = module.weight, module.bias
        if weight.dim() != 2 or (weight.shape[0] < linear.MIN_OUT_FEATURES and not ordered):
            continue
        tensors = (weight,) if bias is None else (weight, bias)
        if all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
            chosen[id(module)] = module
            found.append(module)
    return found


@contextmanager
def exact_forwards(modules: list[torch.nn.Linear]) -> Iterator[None]:
    """Inside the block, ``modules`` run :func:`exact_linear`."""
    with _lock:
        for module in modules:
            count = _installed.get(id(module), 0)
            if count == 0:
                module.forward = types.MethodType(_exact_forward, module)
            _installed[id(module)] = count + 1
    try:
        yield
    finally:
        with _lock:
            for module in modules:
                _installed[id(module)] -= 1
                if _installed[id(module)] == 0:
                    del _installed[id(module)]
                    del module.forward
