"""Per-call scopes of the opt-in linear modes, shared by the Transformers and fairseq hooks.

Two modes swap the linears of a model for one ``generate`` call:

* ``fast_gemm``: fp32 on oneDNN with pre-packed weights (:mod:`fastgen.ops.fast_linear`);
* ``int8``: int8 weights per output channel, activations per row (:mod:`fastgen.ops.int8_linear`).

:func:`mode_linears` gives every plain ``nn.Linear`` (and Transformers ``Conv1D``) of the model with
CPU fp32 weights an instance ``forward`` of the mode and removes them when the block ends, so the
user's modules are left exactly as they were. Nested and concurrent scopes over the same modules share
one installation (a counter), and the installed forwards serve only the threads inside a scope (another
thread's call on the same model meanwhile runs upstream's op); a module already taken by the other
mode is left to it (so with both features on, the one entered first serves: int8, whose hook wraps
fast_gemm's). On entry each
module's derived weight is checked against the weight's content and rebuilt if it changed in any
way (:mod:`fastgen.ops.weight_cache`), once per call. Under ``torch.compile`` the installed forwards
run upstream's op without a graph break.
"""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from fastgen.cli import heap
from fastgen.ops import fast_linear, int8_linear
from fastgen.ops.fast_linear import is_conv1d
from fastgen.ops.weight_cache import DerivedWeights
from fastgen.optimizer import exact_scope, fused_activation, report
from fastgen.optimizer.registry import fallback

__all__ = [
    "FAST_GEMM",
    "INT8",
    "approximate_here",
    "installed",
    "int8_linears",
    "is_conv1d",
    "mode_linears",
    "packed_linears",
]


@dataclasses.dataclass(frozen=True)
class LinearMode:
    """What a mode needs: its feature name, availability, per-module check, forward, weight preparation."""

    feature: str
    what: str  # for the report: "on packed weights (oneDNN or MKL)"
    unavailable: Callable[[], str | None]
    module_problem: Callable[[torch.nn.Module], str | None]
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    prepare: Callable[[torch.nn.Module], int]  # refresh the derived weight now; its bytes


def _int8_prepare(module: torch.nn.Module) -> tuple[int8_linear.Int8Weight, int]:
    prepared = int8_linear.prepare(fast_linear.out_in_weight(module))
    return prepared, prepared.nbytes


_int8_weights = DerivedWeights(_int8_prepare)


def _int8_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not int8_linear.runs_int8(module.weight, x) or not _entered_here(module):
        return type(module).forward(module, x)
    activation = _fused_activations.get(id(module))
    if activation is not None and fused_activation.may_fuse(module, activation[0]):  # the activation, in one pass
        y = int8_linear.int8_linear(x, _int8_weights.get(module), module.bias, activation[1])
        return fused_activation.remember_fused(y)
    return int8_linear.int8_linear(x, _int8_weights.get(module), module.bias)


def _packed_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not fast_linear.runs_packed(module.weight, x) or not _entered_here(module):
        return type(module).forward(module, x)
    activation = _fused_activations.get(id(module))
    if activation is not None and fused_activation.may_fuse(module, activation[0]):  # MKL's form: in its own pass
        return fused_activation.remember_fused(fast_linear.faster_form(module, x, activation[1]))
    return fast_linear.faster_form(module, x)


def int8_bytes() -> int:
    """Bytes held by every int8 weight copy alive in this process (the int8 mode's extra memory)."""
    return _int8_weights.total_bytes()


def forget_int8() -> None:
    """Drop every int8 weight copy (tests; to give the memory back)."""
    _int8_weights.clear()


FAST_GEMM = LinearMode(
    "fast_gemm",
    "on packed weights (oneDNN or MKL)",
    fast_linear.unavailable,
    fast_linear.module_problem,
    _packed_forward,
    fast_linear.prepack,
)
INT8 = LinearMode(
    "int8",
    f"in int8 ({int8_linear.backend()})",
    int8_linear.unavailable,
    int8_linear.module_problem,
    _int8_forward,
    _int8_weights.refresh,
)

_lock = exact_scope.FORWARDS_LOCK  # one lock for every forward fastgen installs (another thread's exact call)
#: id(fc1) -> (its layer, activation code) while an int8 scope fuses the layer's activation into fc1
_fused_activations: dict[int, tuple[torch.nn.Module, int]] = {}
_installed: dict[int, tuple[str, int]] = {}  # id(linear) -> (feature, generate calls using its forward)
_threads: dict[int, dict[int, int]] = {}  # id(linear) -> {thread that entered a scope over it: how many times}


def _entered_here(module: torch.nn.Module) -> bool:
    """Whether this thread is inside a scope over ``module``: another thread's plain (or ``unpatched()``)
    call on the same model meanwhile runs upstream's op. Read only outside ``torch.compile`` tracing (the
    forwards check ``runs_*`` first, which is False while tracing)."""
    return threading.get_ident() in _threads.get(id(module), ())


def installed(module: torch.nn.Module | None) -> str | None:
    """The feature whose forward ``module`` runs right now, or None (the gemm feature asks)."""
    entry = _installed.get(id(module)) if module is not None else None
    return entry[0] if entry else None


_heap_tuned: list[bool] = []  # whether the first scope of the process has asked for the malloc thresholds


def _keep_freed_memory_once() -> None:
    """The first fast-mode call of a process keeps freed buffers in the heap (:mod:`fastgen.cli.heap`)."""
    if not _heap_tuned:
        _heap_tuned.append(heap.keep_freed_memory())


def approximate_linear(module: torch.nn.Module) -> bool:
    """Whether this thread runs ``module`` (a linear) in ``fast_gemm`` or ``int8`` right now."""
    return installed(module) in (FAST_GEMM.feature, INT8.feature) and _entered_here(module)


def approximate_here(module: torch.nn.Module) -> bool:
    """Whether this thread runs one of ``module``'s own linears in ``fast_gemm`` or ``int8`` right now: the
    user asked for approximate arithmetic there, so the attention around them may be approximate too."""
    return any(approximate_linear(child) for child in module.children())


def _candidates(model: torch.nn.Module, mode: LinearMode) -> tuple[list[torch.nn.Module], bool]:
    """The modules ``mode`` can serve, and whether any was skipped because the other mode has it."""
    chosen: dict[int, torch.nn.Module] = {}
    taken = False
    for module in model.modules():
        if (type(module) is not torch.nn.Linear and not is_conv1d(module)) or id(module) in chosen:
            continue
        owner = installed(module)
        if owner not in (None, mode.feature):
            taken = True
            continue
        if "forward" in module.__dict__ and owner is None and not exact_scope.installed(module):
            continue  # someone else's instance forward (the exact one: this mode's goes on top, for its call)
        if mode.module_problem(module) is None:
            chosen[id(module)] = module
    return list(chosen.values()), taken


def packable_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's plain ``nn.Linear`` / ``Conv1D`` modules the packed fp32 path can serve."""
    return _candidates(model, FAST_GEMM)[0]


def _still_free(module: torch.nn.Module, mode: LinearMode) -> bool:
    """Whether ``module`` can still take ``mode``'s forward (another thread may have installed one since)."""
    owner = installed(module)
    if owner is not None:
        return owner == mode.feature
    return "forward" not in module.__dict__ or exact_scope.installed(module)


@contextmanager
def mode_linears(model: torch.nn.Module, mode: LinearMode, check_weights: bool = True) -> Iterator[None]:
    """Inside the block, ``model``'s plain CPU fp32 linears run ``mode``'s forward.

    ``check_weights``: compare each derived weight with the weight's content on entry (once per
    ``generate``); a loop that enters the scope per step passes it on its first step only.
    """
    problem = mode.unavailable()
    modules, taken = ([], False) if problem else _candidates(model, mode)
    if not modules:
        if not taken:  # all taken by the other mode: nothing to say, that mode serves them
            fallback(mode.feature, problem or "no CPU float32 nn.Linear modules in the model")
        yield
        return
    thread = threading.get_ident()
    with _lock:
        modules = [module for module in modules if _still_free(module, mode)]  # as of now, under the lock
        _keep_freed_memory_once()
        if check_weights:
            extra = sum(mode.prepare(module) for module in modules)
            report.note_ran(mode.feature, f"{len(modules)} linears {mode.what} ({extra / 2**20:.0f} MiB)")
        fusable = {id(layer.fc1): (layer, code) for layer, code in fused_activation.fusable_layers(model, modules)}
        for module in modules:
            feature, count = _installed.get(id(module), (mode.feature, 0))
            if count == 0:
                module.forward = types.MethodType(mode.forward, module)
                if id(module) in fusable:
                    layer, _ = _fused_activations[id(module)] = fusable[id(module)]
                    layer.activation_fn = fused_activation.PassThroughFused(layer.activation_fn)
            _installed[id(module)] = (feature, count + 1)
            threads = _threads.setdefault(id(module), {})
            threads[thread] = threads.get(thread, 0) + 1
    try:
        yield
    finally:
        with _lock:
            for module in modules:
                feature, count = _installed[id(module)]
                threads = _threads[id(module)]
                threads[thread] -= 1
                if not threads[thread]:
                    del threads[thread]
                if count == 1:
                    del _installed[id(module)], _threads[id(module)]
                    if exact_scope.installed(module):  # another thread's exact call still runs on it
                        module.forward = exact_scope.exact_forward(module)
                    else:
                        del module.forward
                    fused = _fused_activations.pop(id(module), None)
                    if fused is not None:
                        fused[0].activation_fn = fused[0].activation_fn.original
                else:
                    _installed[id(module)] = (feature, count - 1)


def packed_linears(model: torch.nn.Module, check_weights: bool = True) -> AbstractContextManager[None]:
    """``fast_gemm``'s scope: the model's CPU fp32 linears on packed weights (oneDNN or MKL)."""
    return mode_linears(model, FAST_GEMM, check_weights)


def int8_linears(model: torch.nn.Module, check_weights: bool = True) -> AbstractContextManager[None]:
    """``int8``'s scope: the model's CPU fp32 linears in int8."""
    return mode_linears(model, INT8, check_weights)
