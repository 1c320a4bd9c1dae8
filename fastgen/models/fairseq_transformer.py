"""fairseq encoder-decoder models whose cross-attention can share one encoder output per input.

fairseq 0.12's ``MultiheadAttention`` already attends B·M beam queries to B cached keys
(its ``kv_bsz != bsz`` einsum path, FastSeq's "beamable" attention) and skips reordering
cross-attention buffers when its ``beam_size`` is set; upstream switches this on for BART only.
This module says which models can use it and sets/restores that ``beam_size``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any


def cross_attention_modules(model: Any) -> list[Any]:
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    return [attn for layer in layers if (attn := getattr(layer, "encoder_attn", None)) is not None]


def unsupported_reason(models: Sequence[Any]) -> str | None:
    """Why these models cannot share encoder outputs across beams, or None when they can."""
    from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase
    from fairseq.modules import MultiheadAttention

    for model in models:
        if not isinstance(getattr(model, "encoder", None), TransformerEncoderBase):
            return f"{type(model).__name__}: encoder is not a fairseq TransformerEncoder"
        if not isinstance(getattr(model, "decoder", None), TransformerDecoderBase):
            return f"{type(model).__name__}: decoder is not a fairseq TransformerDecoder"
        modules = cross_attention_modules(model)
        if not modules or any(type(m) is not MultiheadAttention for m in modules):
            return f"{type(model).__name__}: cross-attention is not fairseq's MultiheadAttention"
    return None


def already_beamable(models: Sequence[Any]) -> bool:
    """True when upstream already shares encoder outputs across beams (fairseq's BART sets this up)."""
    return any(getattr(m, "beam_size", 1) != 1 for model in models for m in cross_attention_modules(model))


@contextlib.contextmanager
def beamable_cross_attention(models: Sequence[Any], beam_size: int) -> Iterator[None]:
    """Set ``beam_size`` on every cross-attention for one generation, then restore it."""
    modules = [m for model in models for m in cross_attention_modules(model)]
    previous = [m.beam_size for m in modules]
    for m in modules:
        m.beam_size = beam_size
    try:
        yield
    finally:
        for m, size in zip(modules, previous, strict=True):
            m.beam_size = size
