"""Opt-in approximate CPU linears for Transformers ``generate``: "fast_gemm" (fp32) and "int8".

For one ``generate`` call every plain ``nn.Linear`` of the model with CPU fp32 weights (encoder,
decoder, output embeddings; Transformers' ``Conv1D`` from its transposed weight) runs in the mode's
form (:mod:`fastgen.optimizer.linear_modes`): oneDNN with pre-packed weights, or int8. Outputs are
*not* bit-identical to upstream; that is why both features are off by default
(``registry.OPT_IN_FEATURES``). The exact ``gemm`` feature steps aside for the output embeddings
while a mode serves them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from fastgen.optimizer.linear_modes import int8_linears, packed_linears


def _scoped(original: Callable[..., Any], scope: Callable[[Any], AbstractContextManager[None]]) -> Callable[..., Any]:
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with scope(self):
            return original(self, *args, **kwargs)

    return generate


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GenerationMixin.generate`` ("fast_gemm"): the call with the linears packed."""
    return _scoped(original, packed_linears)


def make_int8_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GenerationMixin.generate`` ("int8"): the call with the linears in int8."""
    return _scoped(original, int8_linears)
