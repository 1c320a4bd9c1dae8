"""``packed_linear``: ``nn.Linear`` on oneDNN with a pre-packed weight — faster, *not* bit-identical.

Why: on CPUs where MKL's ``sgemm`` runs below the machine's speed (measured on an AMD EPYC: 1.7x to
2.6x slower than oneDNN for every linear of a BART-base decode step and encoder), oneDNN's JIT
kernels with the weight reordered once into their blocked layout (what Inductor's CPU freezing
pass does) give CTranslate2-like speed. The price is rounding: results differ from ``F.linear`` by a
few ulps (a different accumulation order), so greedy and beam outputs can diverge from upstream's
where two candidates are nearly tied. That is why this is the opt-in ``fast_gemm`` feature, and
why the exact ``gemm`` feature never uses it.

Memory: the packed weight is a second copy of every weight it serves (about the model's linear
parameters again), kept per module for the process while the module lives and re-packed when the
weight changes (its version counter or storage). :func:`packed_bytes` reports the total.

The op used is ``torch.ops.mkldnn._linear_pointwise`` with a weight from
``torch.ops.mkldnn._reorder_linear_weight`` (the pair Inductor's freezing emits); when either is
missing or oneDNN is unavailable, :func:`unavailable` says why and callers run ``F.linear``.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F

_lock = threading.Lock()
#: module -> (weight version, weight data pointer, packed weight)
_packed: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, int, torch.Tensor]] = weakref.WeakKeyDictionary()


def unavailable() -> str | None:
    """Why this torch build cannot run the packed oneDNN linear (None: it can)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    ops = torch.ops.mkldnn
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(ops, name):
            return f"torch.ops.mkldnn.{name} is missing in torch {torch.__version__}"
    return None


def module_problem(module: torch.nn.Linear) -> str | None:
    """Why ``module`` cannot run packed (None: it can)."""
    weight, bias = module.weight, module.bias
    if weight.device.type != "cpu":
        return f"weights on {weight.device.type} (oneDNN packing is for CPU)"
    if weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        return f"weights in {weight.dtype} (the packed path is float32)"
    return None


def _packed_weight(module: torch.nn.Module, transposed: bool = False) -> torch.Tensor:
    """``module.weight`` (``(out, in)``; ``(in, out)`` when ``transposed``) packed for oneDNN, cached."""
    weight = module.weight
    stamp = (weight._version, weight.data_ptr())
    entry = _packed.get(module)
    if entry is None or entry[:2] != stamp:
        with _lock, torch.no_grad():
            source = weight.detach().t().contiguous() if transposed else weight.detach()
            packed = torch.ops.mkldnn._reorder_linear_weight(source)
            _packed[module] = (*stamp, packed)
            return packed
    return entry[2]


def runs_packed(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a call may take the packed path (not traced, CPU fp32, no autograd, 2+ dims)."""
    return not (
        torch.compiler.is_compiling()
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        or x.dim() < 2
    )


def packed_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` through oneDNN with the module's packed weight; ``F.linear`` where it cannot run.

    Falls back to ``F.linear`` under ``torch.compile`` tracing, with autograd, and for non-fp32 or
    non-CPU inputs, so the result is then upstream's exactly.
    """
    if not runs_packed(module.weight, x):
        return F.linear(x, module.weight, module.bias)
    return torch.ops.mkldnn._linear_pointwise(x, _packed_weight(module), module.bias, "none", [], "")


def packed_conv1d(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Transformers' ``Conv1D`` (GPT-2: ``x @ weight + bias``, weight ``(in, out)``) through oneDNN.

    Where the packed path cannot run, the module class's own ``forward`` (upstream's ``addmm``).
    """
    if not runs_packed(module.weight, x):
        return type(module).forward(module, x)
    packed = _packed_weight(module, transposed=True)
    return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")


def prepack(module: torch.nn.Module, transposed: bool = False) -> int:
    """Pack ``module``'s weight now (outside the timed decode loop); returns the packed copy's bytes."""
    packed = _packed_weight(module, transposed)
    return packed.numel() * packed.element_size()


def packed_bytes() -> int:
    """Bytes held by every packed weight alive in this process (the fast mode's extra memory)."""
    return sum(entry[2].numel() * entry[2].element_size() for entry in list(_packed.values()))


def forget_packed() -> None:
    """Drop every packed weight (tests; to give the memory back without dropping the modules)."""
    with _lock:
        _packed.clear()
