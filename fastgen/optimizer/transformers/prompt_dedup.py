"""Generation hooks that keep a decoder-only prompt at one row per input ("dedup", FastSeq §4.1.1).

``generate`` with ``num_beams=M`` (or ``num_return_sequences=M`` when sampling) repeats the prompt
``M`` times, prefills it ``M`` times and reorders all ``M`` copies of its K/V at every step. For
the families of :data:`fastgen.models.decoder_only.PROMPT_SHARING_FAMILIES` three hooks change that:

1. ``GenerationMixin._prepare_cache_for_generation`` (shared with the encoder-decoder part, which
   hands decoder-only models to :func:`prepare_decoder_only_cache`) sees the decoding mode. For
   beam search, beam sampling and multi-sample sampling with the default dynamic cache it
   replaces the fresh ``DynamicCache`` by a :class:`~fastgen.models.decoder_only.SharedPrefixCache`;
   otherwise (assisted decoding, static/offloaded/quantized/user caches, prefill chunking,
   ``inputs_embeds``...) it leaves upstream's cache alone.
2. ``GenerationMixin._prefill`` runs the model once per input on such a cache: rows ``::M`` of
   ``input_ids`` and of the per-row inputs (attention mask, position ids, token types), which
   ``_expand_inputs_for_generation`` made identical within an input (checked), so the cache
   stores the prompt K/V at ``B`` rows. The outputs' per-row tensors (logits, and hidden states /
   attentions when asked for) are repeated back to ``B*M`` rows; ``model_kwargs`` is not touched,
   so the decoding loop continues on upstream's ``B*M`` inputs.
3. ``AttentionInterface.get_interface`` (shared too) wraps every attention function with
   :func:`~fastgen.models.decoder_only.prefix_attention`, which attends decode-step queries over
   the shared prefix plus each hypothesis' own suffix.

Numerics (fp32, CPU): the ``B``-row prefill gives bitwise the same K/V as upstream's ``B*M``-row
one at the tested shapes, but the LM head's GEMM over ``B`` instead of ``B*M`` rows rounds a few
logits differently (|diff| ~1e-6); decode steps differ from upstream's SDPA kernel by float
rounding as well. Tokens are identical in every tested case; scores agree to ~1e-6.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from fastgen.models.decoder_only import SharedPrefixCache, shared_prompt_problem
from fastgen.models.family_checks import shared_prompt_call_problem
from fastgen.optimizer import registry, report
from fastgen.optimizer.transformers.contract import CACHE, unknown_structure
from fastgen.optimizer.transformers.shared_modes import FEATURE, cache_problem, model_problem

#: Inputs that ``_expand_inputs_for_generation`` repeats per hypothesis and the prefill slices back.
PER_ROW_INPUTS = ("attention_mask", "position_ids", "token_type_ids")


def attention_ready() -> bool:
    """Whether the attention wrapper is in force for this call (checked by the cache on every update)."""
    return registry.active() and registry.feature_enabled(FEATURE)


def note_attention_fallback(reason: str) -> None:
    registry.degraded(FEATURE, f"shared-prompt attention over per-hypothesis K/V: {reason}")


def _attention_hook_installed() -> bool:
    from transformers.modeling_utils import AttentionInterface

    return bool(getattr(AttentionInterface.get_interface, "__fastgen_patched__", False))


#: Set to 1 to share decoder-only prompts on a GPU too (to measure it there; see :func:`gpu_problem`).
GPU_SWITCH = "FASTGEN_GPU_PROMPT_SHARING"


def gpu_problem(device: torch.device) -> str | None:
    """Decoder-only prompt sharing stays off on GPUs unless switched on: its decode-step attention (prefix
    and suffix attended apart, then merged) adds kernel launches to a step that is bound by launches on the
    GPU, and it measured 0.54x upstream there (gpt2 shape, beam 4, fp16, H200:
    ``benchmarks/results/gpt2-cuda-fp16.json``). On CPUs the shared prompt pays (2.6-4.9x)."""
    if device.type == "cpu" or os.environ.get(GPU_SWITCH, "").strip() == "1":
        return None
    return f"prompt sharing on {device.type} (measured slower than upstream on a GPU; {GPU_SWITCH}=1 turns it on)"


def _shared_prompt_call_problem(
    model: Any, generation_config: Any, model_kwargs: dict[str, Any], generation_mode: Any
) -> str | None:
    """Why this call keeps upstream's per-hypothesis prompt cache, or None. Asked before the cache exists."""
    problem = (
        gpu_problem(model.device)
        or shared_prompt_problem(model)
        or model_problem(model)
        or cache_problem(generation_config, model_kwargs, generation_mode)
    )
    problem = problem or shared_prompt_call_problem(model, generation_config)
    if problem is not None:
        return problem
    if generation_config.prefill_chunk_size is not None:
        return "prefill_chunk_size"
    if model_kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds"
    if not _attention_hook_installed():
        return "the attention hook (AttentionInterface.get_interface) is not applied"
    return None


def prepare_decoder_only_cache(
    original: Callable[..., Any],
    model: Any,
    generation_config: Any,
    model_kwargs: dict[str, Any],
    generation_mode: Any,
    batch_size: int,
    max_cache_length: int,
) -> Any:
    """Step 1 (see the module docstring): upstream's cache, replaced by a shared-prompt one when possible."""
    group = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    if group == 1:  # nothing repeated, nothing to share
        return original(model, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
    problem = _shared_prompt_call_problem(model, generation_config, model_kwargs, generation_mode)
    result = original(model, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
    if problem is None:
        upstream_cache = model_kwargs.get(CACHE)
        cache = SharedPrefixCache.from_cache(upstream_cache, batch_size * group, group, attention_ready)
        if cache is None:
            problem = f"the cache ({type(upstream_cache).__name__}) is not a plain empty DynamicCache"
            if upstream_cache is None:
                problem = unknown_structure(f"no cache in model_kwargs[{CACHE!r}]")
        else:
            cache.upstream_cache = upstream_cache  # put back if the prefill cannot share the prompt
            model_kwargs[CACHE] = cache
    if problem is not None:
        registry.fallback(FEATURE, problem)
    return result


def _repeats_within_groups(tensor: torch.Tensor, group: int) -> bool:
    rows = tensor.reshape(tensor.shape[0] // group, group, *tensor.shape[1:])
    return torch.equal(rows, rows[:, :1].expand_as(rows))


def _prefill_problem(
    cache: SharedPrefixCache,
    input_ids: torch.Tensor,
    generation_config: Any,
    model_kwargs: dict[str, Any],
    is_first_iteration: bool,
) -> str | None:
    group, rows = cache.hypotheses_per_input, input_ids.shape[0]
    if not is_first_iteration:
        return "not the first iteration"
    if generation_config.prefill_chunk_size is not None:
        return "prefill_chunk_size"
    if model_kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds"
    if rows != cache.layers[0].hypotheses or rows % group:
        return f"{rows} input rows where {cache.layers[0].hypotheses} were planned"
    per_row = [input_ids]
    for key, value in model_kwargs.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
            continue
        if key not in PER_ROW_INPUTS or value.dim() != 2:
            return f"per-row model input {key!r} of shape {tuple(value.shape)}"
        per_row.append(value)
    # One host sync per generate call: the expansion made these rows copies, but a model may expand differently.
    if not all(_repeats_within_groups(tensor, group) for tensor in per_row):
        return "the hypotheses of an input do not share one prompt"
    return None


def _repeat_rows(value: Any, group: int, batch: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value.repeat_interleave(group, dim=0) if value.dim() and value.shape[0] == batch else value
    if isinstance(value, tuple | list):
        return type(value)(_repeat_rows(item, group, batch) for item in value)
    return value


def make_prefill(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GenerationMixin._prefill`` (see module docstring, 2)."""

    def _prefill(
        self: Any,
        input_ids: torch.LongTensor,
        generation_config: Any,
        model_kwargs: dict[str, Any],
        is_first_iteration: bool = True,
    ) -> Any:
        cache = model_kwargs.get(CACHE)
        if not isinstance(cache, SharedPrefixCache) or cache.get_seq_length() > 0:
            return original(self, input_ids, generation_config, model_kwargs, is_first_iteration)
        problem = _prefill_problem(cache, input_ids, generation_config, model_kwargs, is_first_iteration)
        if problem is not None:
            # A fallback is whole: upstream's own (still empty) cache, upstream's prefill.
            model_kwargs[CACHE] = cache.upstream_cache
            registry.fallback(FEATURE, problem)
            return original(self, input_ids, generation_config, model_kwargs, is_first_iteration)
        report.note_ran(FEATURE, f"prompt K/V shared by {cache.hypotheses_per_input} hypotheses per input")
        report.note_cache(cache.bytes_saved)
        group = cache.hypotheses_per_input
        shared_kwargs = {
            key: value[::group] if key in PER_ROW_INPUTS and isinstance(value, torch.Tensor) else value
            for key, value in model_kwargs.items()
        }
        outputs = original(self, input_ids[::group], generation_config, shared_kwargs, is_first_iteration)
        batch = input_ids.shape[0] // group
        for key in list(outputs.keys()):
            if key != CACHE:
                outputs[key] = _repeat_rows(outputs[key], group, batch)
        return outputs

    return _prefill
