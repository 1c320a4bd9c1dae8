"""The approximate modes' feed-forward activation, fused into ``fc1``'s own op.

Why: BART-family layers compute ``activation_fn(fc1(x))``. In the int8 mode ``fc1``'s output already
goes through one pass (row scales and bias, :func:`fastgen.ops.int8_linear.int8_linear`); applying GELU
there instead of in a separate op saves a read and a write of the layer's widest buffer (bart-base's
encoder: 1024 x 3072 floats per layer, ~3.5 ms of a ~0.75 s int8 ``generate`` each, one core).

The ``fast_gemm`` mode fuses it too: MKL's packed form applies it in a pass of its own op
(``fastgen_cpu::mkl_packed_linear``), the other forms through torch's op in ``fc1``'s forward (the layer's own bits).

How, for one int8 or fast_gemm scope (:func:`fastgen.optimizer.linear_modes.mode_linears`): each layer of a known
class (:data:`LAYERS`, whose forward is exactly ``activation_fn(fc1(hidden_states))``) with an
activation of a known kind gets, for the length of the scope, an ``activation_fn`` that passes through
the one tensor its ``fc1`` just produced with the activation applied (remembered per thread) and applies
the original activation to anything else (another thread's call, an unexpected input). ``fc1`` fuses
only while neither it nor the layer's activation module has hooks (a hook must see what upstream's
``fc1`` returns and be called on the activation's input and output): a layer whose activation has hooks
at the start of the scope keeps it untouched, and a hook added on the stand-in during the scope stops the
fusion from the next call on. The original module is put back when the last scope over the model ends.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from fastgen.models.hooks import hooked
from fastgen.ops.int8_linear import GELU, RELU, SILU

#: layer classes whose forward is ``hidden_states = self.activation_fn(self.fc1(hidden_states))``
#: (checked against Transformers 5.23/5.24 sources)
LAYERS = frozenset(
    f"transformers.models.{package}.modeling_{package}.{prefix}{part}Layer"
    for package, prefix in (
        ("bart", "Bart"),
        ("mbart", "MBart"),
        ("marian", "Marian"),
        ("pegasus", "Pegasus"),
        ("m2m_100", "M2M100"),
        ("whisper", "Whisper"),
    )
    for part in ("Encoder", "Decoder")
)


_local = threading.local()


def activation_code(activation: Any) -> int | None:
    """The kernel's code (``int8_linear.ACTIVATIONS``) for an activation module, or None when it is not
    one the kernel computes exactly so."""
    name = f"{type(activation).__module__}.{type(activation).__qualname__}"
    if name == "transformers.activations.GELUActivation" and getattr(activation, "act", None) is F.gelu:
        return GELU
    if type(activation) is torch.nn.GELU and activation.approximate == "none":
        return GELU
    if type(activation) is torch.nn.ReLU:
        return RELU
    if type(activation) is torch.nn.SiLU or name == "transformers.activations.SiLUActivation":
        return SILU
    return None


def fusable_layers(model: torch.nn.Module, served: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, int]]:
    """The model's layers whose ``fc1`` is among ``served`` and whose activation can be fused."""
    served_ids = {id(module) for module in served}
    found = []
    for layer in model.modules():
        if f"{type(layer).__module__}.{type(layer).__qualname__}" not in LAYERS:
            continue
        fc1, activation = getattr(layer, "fc1", None), getattr(layer, "activation_fn", None)
        code = activation_code(activation)
        if fc1 is not None and id(fc1) in served_ids and code is not None and not hooked(activation):
            found.append((layer, code))
    return found


class PassThroughFused(torch.nn.Module):
    """Stands in for a layer's ``activation_fn`` during an int8 or fast_gemm scope (module docstring)."""

    def __init__(self, original: torch.nn.Module) -> None:
        super().__init__()
        self.original = original

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and getattr(_local, "fused", None) is x:
            _local.fused = None
            return x
        return self.original(x)


def remember_fused(output: torch.Tensor) -> torch.Tensor:
    """Mark ``output`` (an ``fc1`` result with its activation applied) for this thread's next activation."""
    _local.fused = output
    return output


def may_fuse(fc1: torch.nn.Module, layer: torch.nn.Module | None = None) -> bool:
    """No hooks that must see upstream's ``fc1`` output or the layer's activation (its stand-in and the
    original it wraps)."""
    if hooked(fc1):
        return False
    activation = getattr(layer, "activation_fn", None) if layer is not None else None
    if activation is not None and hooked(activation):
        return False
    original = getattr(activation, "original", None)
    return not (isinstance(original, torch.nn.Module) and hooked(original))
