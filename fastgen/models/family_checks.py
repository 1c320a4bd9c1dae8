"""Per-family quirks of the "dedup" families: what a family needs beyond the common path, or why a call is refused.

The common paths (:mod:`fastgen.models.encoder_decoder`, :mod:`fastgen.models.decoder_only`) hold for
every family in their tables; the functions here cover what differs, keyed on ``config.model_type``:

Encoder-decoder
    UMT5 and Whisper reshape freshly projected cross-attention K/V with the *query* batch
    (``view(batch_size, -1, heads, dim)``), which would fold ``B`` encoder rows into ``B*G``
    hypothesis rows wrongly. :func:`prime_cross_attention_cache` projects their cross K/V once per
    input before decoding (as their own projections would, at the encoder's batch) and marks the
    layers updated, so the modules read them from the cache and never project. Whisper's own
    ``generate`` splits a returned cache per row and decodes long-form audio in segments with
    timestamps; :func:`cross_attention_call_problem` hands those calls to upstream.

Decoder-only
    Sliding-window layers (Mistral, Phi-3, Qwen3 with ``use_sliding_window``, the local layers of
    Gemma 2/3) carry the window in the attention mask for sdpa and eager (the ``sliding_window``
    argument is only read by flash/flex kernels). While the whole sequence fits in the window
    (``max_length <= sliding_window``) upstream's sliding cache keeps every token and the window
    masks nothing, so the shared prompt is exact; a window that would cut into the prompt is
    refused per call (:func:`shared_prompt_call_problem`): upstream then attends over the window
    only, and the shared path would be slower. Logit soft-capping (Gemma 2) is exact on the eager
    path (:func:`fastgen.ops.attention.prefix_shared_attention` applies it as eager attention
    does). Bidirectional or chunked attention is refused (:func:`shared_prompt_family_problem`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

# ----------------------------------------------------------------------------- encoder-decoder

Projection = Callable[[torch.nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _umt5_cross_attention(model: Any) -> Iterator[torch.nn.Module]:
    for block in model.get_decoder().block:
        yield block.layer[1].EncDecAttention


def _umt5_project(module: torch.nn.Module, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``UMT5Attention``'s K/V projection, shaped with the encoder batch instead of the query batch."""
    shape = (states.shape[0], -1, module.n_heads, module.key_value_proj_dim)
    return module.k(states).view(shape).transpose(1, 2), module.v(states).view(shape).transpose(1, 2)


def _whisper_cross_attention(model: Any) -> Iterator[torch.nn.Module]:
    for layer in model.get_decoder().layers:
        yield layer.encoder_attn


def _whisper_project(module: torch.nn.Module, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``WhisperAttention``'s K/V projection, shaped with the encoder batch instead of the query batch."""
    shape = (states.shape[0], -1, module.num_heads, module.head_dim)
    keys = module.k_proj(states).view(shape).transpose(1, 2).contiguous()
    values = module.v_proj(states).view(shape).transpose(1, 2).contiguous()
    return keys, values


#: model_type -> (the decoder's cross-attention modules, their K/V projection) for the families whose
#: attention reshapes cross K/V with the query batch.
CROSS_KV_PRIMERS: dict[str, tuple[Callable[[Any], Iterator[torch.nn.Module]], Projection]] = {
    "umt5": (_umt5_cross_attention, _umt5_project),
    "whisper": (_whisper_cross_attention, _whisper_project),
}


def prime_cross_attention_cache(model: Any, cache: Any, model_kwargs: dict[str, Any]) -> None:
    """Fill ``cache``'s cross-attention layers at one row per input, for the families of :data:`CROSS_KV_PRIMERS`.

    Runs once per ``generate`` call, before decoding, on the encoder states step 1 kept at batch ``B``.
    """
    primer = CROSS_KV_PRIMERS.get(model.config.model_type)
    if primer is None:
        return
    modules, project = primer
    states = model_kwargs["encoder_outputs"].last_hidden_state
    with torch.no_grad():
        for module in modules(model):
            keys, values = project(module, states)
            cache.cross_attention_cache.update(keys, values, module.layer_idx)
            cache.is_updated[module.layer_idx] = True


def cross_attention_call_problem(model: Any, generation_config: Any) -> str | None:
    """Why this encoder-decoder call keeps upstream's per-hypothesis encoder states, or None."""
    if model.config.model_type != "whisper":
        return None
    if getattr(generation_config, "return_timestamps", False):
        return "Whisper timestamp or long-form decoding (return_timestamps)"
    return None


# ----------------------------------------------------------------------------- decoder-only

#: Layer types whose attention is plain causal or causal within a sliding window.
_CAUSAL_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def _layer_types(config: Any) -> list[str]:
    """Per-layer attention types as Transformers' ``DynamicCache`` infers them from the config."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * config.num_hidden_layers
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * config.num_hidden_layers
    return ["full_attention"] * config.num_hidden_layers


def shared_prompt_family_problem(model: Any) -> str | None:
    """Why this decoder-only model's attention cannot attend over a shared prompt, or None."""
    config = model.config
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention)"
    unknown = sorted(set(_layer_types(config)) - _CAUSAL_LAYER_TYPES)
    if unknown:
        return f"layer types {unknown} (supported: full and sliding-window causal attention)"
    return None


def shared_prompt_call_problem(model: Any, generation_config: Any) -> str | None:
    """Why this call must keep upstream's cache: a sliding window that would cut into the sequence."""
    config = model.config
    if "sliding_attention" not in _layer_types(config):
        return None
    window, length = config.sliding_window, generation_config.max_length
    if window is None or length is None or length > window:
        return (
            f"sliding window of {window} tokens is shorter than max_length {length}: upstream's cache keeps "
            "only the window, the shared prompt would attend over all of it"
        )
    return None
