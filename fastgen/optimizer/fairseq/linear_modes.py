"""Opt-in approximate CPU linears for fairseq's ``SequenceGenerator.generate``: "fast_gemm" and "int8".

For one ``generate`` call every plain ``nn.Linear`` of the generator's models with CPU fp32 weights
(attention projections, feed-forward layers, the output projection) runs in the mode's form
(:mod:`fastgen.optimizer.linear_modes`). Not bit-identical to upstream, hence off by default.
``generate`` is also the entry of fairseq-generate (``task.inference_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from fastgen.optimizer.linear_modes import int8_linears, packed_linears


def _scoped(original: Callable[..., Any], scope: Callable[[Any], AbstractContextManager[None]]) -> Callable[..., Any]:
    def generate(self: Any, models: Any, sample: Any, **kwargs: Any) -> Any:
        with ExitStack() as stack:
            for model in getattr(getattr(self, "model", None), "models", None) or models:
                stack.enter_context(scope(model))
            return original(self, models, sample, **kwargs)

    return generate


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``SequenceGenerator.generate`` ("fast_gemm"): its models' linears packed."""
    return _scoped(original, packed_linears)


def make_int8_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``SequenceGenerator.generate`` ("int8"): its models' linears in int8."""
    return _scoped(original, int8_linears)
