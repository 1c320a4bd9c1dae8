"""Exact fast linears for fairseq's transformer on CPU fp32 ("gemm").

Two hooks: ``output_layer`` (below) for the vocabulary projection, and ``SequenceGenerator.generate``
(:func:`make_generate`), which for the call gives every other plain CPU fp32 ``nn.Linear`` of the
generator's models the exact forward of :mod:`fastgen.optimizer.exact_scope`.

``TransformerDecoderBase.output_layer`` projects the decoder features onto the vocabulary with
``self.output_projection`` (an ``nn.Linear``, shared with the embeddings or not). The replacement
runs the same product through :func:`fastgen.ops.linear.exact_linear`, which gives ``F.linear``'s
bits in the fastest form it measured on this CPU. Adaptive softmax, a projection that is not a
plain ``nn.Linear``, and calls off CPU fp32 go to upstream's method.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from fastgen.ops.linear import exact_linear
from fastgen.optimizer import linear_modes, report
from fastgen.optimizer.exact_scope import exact_forwards, plain_linears
from fastgen.optimizer.registry import fallback

FEATURE = "gemm"


def projection_problem(decoder: Any, features: torch.Tensor) -> str | None:
    """Why this ``output_layer`` call runs upstream's code, or None."""
    if getattr(decoder, "adaptive_softmax", None) is not None:
        return "adaptive softmax"
    projection = getattr(decoder, "output_projection", None)
    if type(projection) is not torch.nn.Linear:  # allow-list: a subclass may compute its own way
        return f"output_projection is {type(projection).__name__}, not torch.nn.Linear"
    if "forward" in projection.__dict__:
        return "output_projection carries its own instance forward"
    weight = projection.weight
    if weight.device.type != "cpu" or features.device.type != "cpu":
        return f"output projection on {weight.device.type} (the exact GEMM forms are for CPU)"
    if weight.dtype != torch.float32 or features.dtype != torch.float32:
        return f"output projection in {weight.dtype} (the exact GEMM forms are for float32)"
    return None


def make_output_layer(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``TransformerDecoderBase.output_layer`` (see module docstring)."""

    def output_layer(self: Any, features: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or linear_modes.installed(getattr(self, "output_projection", None)):
            return original(self, features)  # compiled: upstream's op; fast_gemm/int8: the mode's forward
        problem = projection_problem(self, features)
        if problem is not None:
            fallback(FEATURE, problem)
            return original(self, features)
        projection = self.output_projection
        report.note_ran(FEATURE, "output projection in its fastest bit-identical form")
        return exact_linear(features, projection.weight, projection.bias)

    return output_layer


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``SequenceGenerator.generate``: the models' other linears in their exact forms."""

    def generate(self: Any, models: Any, sample: Any, **kwargs: Any) -> Any:
        with ExitStack() as stack:
            for model in getattr(getattr(self, "model", None), "models", None) or models:
                heads = [getattr(getattr(model, "decoder", None), "output_projection", None)]
                stack.enter_context(exact_forwards(plain_linears(model, skip=[h for h in heads if h is not None])))
            return original(self, models, sample, **kwargs)

    return generate
