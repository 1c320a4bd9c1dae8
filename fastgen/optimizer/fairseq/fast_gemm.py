"""Opt-in fast, non-identical CPU linears for fairseq's ``SequenceGenerator.generate`` ("fast_gemm").

For one ``generate`` call every plain ``nn.Linear`` of the generator's models with CPU fp32 weights
(attention projections, feed-forward layers, the output projection) runs on oneDNN with a
pre-packed weight (:mod:`fastgen.optimizer.fast_gemm_scope`). Not bit-identical to upstream, hence
off by default. ``generate`` is also the entry of fairseq-generate (``task.inference_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from fastgen.optimizer.fast_gemm_scope import packed_linears


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``SequenceGenerator.generate``: the call with its models' linears packed."""

    def generate(self: Any, models: Any, sample: Any, **kwargs: Any) -> Any:
        with ExitStack() as stack:
            for model in getattr(getattr(self, "model", None), "models", None) or models:
                stack.enter_context(packed_linears(model))
            return original(self, models, sample, **kwargs)

    return generate
