"""Opt-in fast, non-identical CPU linears for Transformers ``generate`` ("fast_gemm").

For one ``generate`` call every plain ``nn.Linear`` of the model with CPU fp32 weights (encoder,
decoder, output embeddings) runs on oneDNN with a pre-packed weight
(:mod:`fastgen.optimizer.fast_gemm_scope`, :mod:`fastgen.ops.fast_linear`). Outputs are *not*
bit-identical to upstream; that is why the feature is off by default (``registry.OPT_IN_FEATURES``).
The exact ``gemm`` feature steps aside for the output embeddings while this one serves them.
Transformers' ``Conv1D`` (GPT-2's linears) is packed from its transposed weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastgen.optimizer.fast_gemm_scope import FEATURE, installed, packable_linears, packed_linears

__all__ = ["FEATURE", "installed", "make_generate", "packable_linears", "packed_linears"]


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GenerationMixin.generate``: the call with the model's linears packed."""

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with packed_linears(self):
            return original(self, *args, **kwargs)

    return generate
