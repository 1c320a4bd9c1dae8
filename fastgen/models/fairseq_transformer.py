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


def _allowed_classes() -> tuple[frozenset[type], frozenset[type], frozenset[type]]:
    """(encoders, decoders, decoder layers) whose handling of ``encoder_out`` the tests prove equal.

    Exact classes, not ``isinstance``: a subclass may read per-beam encoder state its own way
    (fairseq's pointer-generator decoder reads ``encoder_out["src_tokens"]`` once per beam).
    """
    from fairseq.models.transformer import (
        TransformerDecoder,
        TransformerDecoderBase,
        TransformerEncoder,
        TransformerEncoderBase,
    )
    from fairseq.modules.transformer_layer import TransformerDecoderLayer, TransformerDecoderLayerBase

    return (
        frozenset({TransformerEncoderBase, TransformerEncoder}),
        frozenset({TransformerDecoderBase, TransformerDecoder}),
        frozenset({TransformerDecoderLayerBase, TransformerDecoderLayer}),
    )


def unsupported_reason(models: Sequence[Any]) -> str | None:
    """Why these models cannot share encoder outputs across beams, or None when they can.

    Admitted: fairseq's own Transformer encoder, decoder and decoder layers (exact classes), with
    fairseq's ``MultiheadAttention`` as cross-attention, and without the options that read
    ``encoder_out`` once per beam: ``cross_self_attention`` concatenates it with each beam's
    decoder states. (Alignment output, ``--print-alignment``, comes from
    ``SequenceGeneratorWithAlignment``, which the caller already leaves to upstream.)
    """
    from fairseq.modules import MultiheadAttention

    encoders, decoders, layers = _allowed_classes()
    for model in models:
        name = type(model).__name__
        encoder, decoder = getattr(model, "encoder", None), getattr(model, "decoder", None)
        if type(encoder) not in encoders:
            return f"{name}: encoder {type(encoder).__name__} is not fairseq's TransformerEncoder (exact class)"
        if type(decoder) not in decoders:
            return f"{name}: decoder {type(decoder).__name__} is not fairseq's TransformerDecoder (exact class)"
        decoder_layers = list(getattr(decoder, "layers", []))
        if any(type(layer) not in layers for layer in decoder_layers):
            return f"{name}: a decoder layer is not fairseq's TransformerDecoderLayer (exact class)"
        if getattr(decoder, "cross_self_attention", False) or any(
            getattr(layer, "cross_self_attention", False) for layer in decoder_layers
        ):
            return f"{name}: cross_self_attention reads the encoder output once per beam"
        modules = cross_attention_modules(model)
        if not modules or any(type(m) is not MultiheadAttention for m in modules):
            return f"{name}: cross-attention is not fairseq's MultiheadAttention"
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
