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
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from fastgen.ops import linear
from fastgen.ops.linear import exact_linear

#: Guards every instance ``forward`` fastgen installs on a user's module, the exact ones here and the linear
#: modes' (:mod:`fastgen.optimizer.linear_modes`): calls of different modes may run on one model at once
#: in different threads, and each install/removal must see the others'.
FORWARDS_LOCK = threading.RLock()
_lock = FORWARDS_LOCK
_installed: dict[int, int] = {}  # id(linear) -> number of calls using the installed forward
#: Per model: whether the ordered kernel was loaded when its linears were last chosen. A compiled forward
#: guards on which linears carry an instance forward (``___dict_contains('forward', ...)``), so once the model
#: is compiled the set must not grow when the kernel's background build finishes later in the process.
_ordered_for: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(model: torch.nn.Module) -> bool:
    """Transformers' ``generate`` compiled the model (``compile_config``, static cache) or the user did."""
    return getattr(model, "_compiled_call", None) is not None or getattr(model, "_compiled_call_impl", None) is not None


def _exact_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through :func:`exact_linear` (same bits)."""
    return exact_linear(input, self.weight, self.bias)


def installed(module: torch.nn.Module) -> bool:
    """Whether a call uses ``module``'s exact forward right now (a linear mode's forward may sit on top of it
    meanwhile, for its thread's call: :func:`exact_forward` is put back when that call ends)."""
    return id(module) in _installed


def exact_forward(module: torch.nn.Module) -> types.MethodType:
    """The exact instance forward of ``module`` (to install, under :data:`FORWARDS_LOCK`)."""
    return types.MethodType(_exact_forward, module)


def _ours(module: torch.nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is _exact_forward


def plain_linears(model: torch.nn.Module, skip: Iterable[torch.nn.Module] = ()) -> list[torch.nn.Linear]:
    """The model's plain CPU fp32 contiguous ``nn.Linear`` modules that another exact form may serve and
    that no one else has a forward on: every width where fastgen's ordered kernel is loaded, else those
    with ``linear.MIN_OUT_FEATURES`` outputs (narrower ones always run ``F.linear`` then, and a forward
    of ours there would only add its checks to every call: measured slower on a small model)."""
    chosen: dict[int, torch.nn.Linear] = {id(module): module for module in skip}
    found: list[torch.nn.Linear] = []
    ordered = linear.ordered_kernel() is not None  # fastgen's ordered kernel serves any width
    if _compiled(model) and model in _ordered_for:
        ordered = _ordered_for[model]  # keep the set the compiled graph was traced with
    _ordered_for[model] = ordered
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
    taken: list[torch.nn.Linear] = []
    with _lock:
        for module in modules:
            count = _installed.get(id(module), 0)
            if count == 0:
                if "forward" in module.__dict__:
                    continue  # another thread's linear mode took it since it was chosen: its forward serves
                module.forward = exact_forward(module)
            _installed[id(module)] = count + 1
            taken.append(module)
    linear.refresh_mkl_copies([module.weight for module in taken])  # a .data write since the last call
    try:
        yield
    finally:
        with _lock:
            for module in taken:
                _installed[id(module)] -= 1
                if _installed[id(module)] == 0:
                    del _installed[id(module)]
                    if _ours(module):  # else a linear mode's forward sits on top: it removes itself
                        del module.forward
