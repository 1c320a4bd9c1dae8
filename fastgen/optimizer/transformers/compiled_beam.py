"""A whole beam-search step as four native calls, for the approximate CPU modes on the lean C++ step.

Why: with the decoder step in C++ (:mod:`fastgen.models.compiled_step`), the Python around it became the
largest part of a small model's beam step: ``prepare_inputs_for_generation``, the lean step's checks of its
inputs, ``_update_model_kwargs_for_generation``, the candidates and bookkeeping wrappers, the cache's reorder
methods (a 7.9M-parameter BART, 64 rows, int8, one AMD EPYC core: ~20% of a ``generate`` call outside any
kernel). Once one step of the batch has shown that every part of it runs natively, the following steps call
the same four ops on the same tensors in the same order, and nothing else:

1. the program's decoder step (``DecoderStep.step``: K/V written in place at the step's position);
2. ``fastgen_cpu::log_softmax_top_k``, the fused candidates of :func:`fastgen.ops.beam_topk.approximate_top_k`;
3. ``fastgen_cpu::beam_update_``, upstream's bookkeeping (steps c-f), in place;
4. ``fastgen_cpu::reorder_rows_``, the self-attention cache's in-place reorder
   (:meth:`fastgen.models.growing_cache.GrowingLayer.reorder_cache`).

So the results are the loop's own. What the skipped machinery would do is known to be nothing in that state
(:meth:`CompiledBeamStep.after` checks it): the model inputs carry no per-step tensor, the cache shares its
cross-attention K/V across beams (no cross reorder), the encoder mask and row count stay until inputs leave
the batch, where the loop drops this object and the next step runs the long way (and may make a new one).
A step whose logits the fused candidates refuse (a NaN) is handed back to the loop with its logits.
``FASTGEN_COMPILED_BEAM=0`` turns it off (every step the long way).
"""

from __future__ import annotations

from typing import Any

import torch

from fastgen import _env
from fastgen.models.encoder_decoder import BeamSharedCrossAttentionCache
from fastgen.models.growing_cache import GrowingLayer
from fastgen.ops import reorder

ENV = "FASTGEN_COMPILED_BEAM"

#: model inputs ``_update_model_kwargs_for_generation`` extends each step (the short way would not)
PER_STEP_INPUTS = frozenset({"token_type_ids", "mm_token_type_ids", "decoder_position_ids", "decoder_attention_mask"})


def beam_update(
    update: tuple, candidates: tuple, running_sequences: torch.Tensor, state: tuple, cur_len: int, active: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fastgen_cpu::beam_update_`` (steps c-f, in place) on the loop's tensors: ``update`` the call's settings (end of
    sequence ids, length limit, prompt length, max length, length penalty, early-stopping code), ``candidates`` the
    step's (scores, beams, tokens), ``state`` the running scores and indices, the finished sequences, scores and
    indices, the finished flags and the early-stop flags. Returns the cache's reorder rows and the stop hits."""
    eos, limit, prompt_len, max_length, length_penalty, stopping = update
    return torch.ops.fastgen_cpu.beam_update_(
        *candidates, running_sequences, *state, eos, cur_len + 1 >= limit, cur_len, prompt_len, max_length,
        length_penalty, stopping, active,
    )  # fmt: skip


class CompiledBeamStep:
    """The rest of one batch's beam steps, each as the four calls of the module docstring."""

    def __init__(self, lean: Any, cache: BeamSharedCrossAttentionCache, beams_to_keep: int, update: tuple) -> None:
        self.program = lean._compiled.program
        self.mask = lean._encoder_mask
        self.cache = cache
        self.layers: list[GrowingLayer] = list(cache.self_attention_cache.layers)
        crosses = cache.cross_attention_cache.layers
        self.cross_keys = [layer.keys for layer in crosses]
        self.cross_values = [layer.values for layer in crosses]
        self.beams_to_keep = beams_to_keep
        self.update = update  # beam_update_'s settings: (eos ids, length limit, prompt length, max length, length
        # penalty, early stopping code)

    @classmethod
    def after(
        cls, model: Any, lean: Any, model_kwargs: dict[str, Any], rows: int, beams_to_keep: int, update: tuple
    ) -> CompiledBeamStep | None:
        """The short way for a batch of ``rows`` rows whose next step the lean step would run in its C++ program
        (the caller saw it run the last one, or asked :meth:`~fastgen.models.lean_step.LeanDecodeStep.compiled_ready`),
        with the fused candidates and the native bookkeeping (the caller knows); None where anything differs."""
        if _env.switched_off(ENV):
            return None
        compiled = lean._compiled
        if compiled is None or compiled.program is None or not compiled.approximate or compiled.retry:
            return None
        if lean._static is not None or hasattr(model, "_reorder_cache") or PER_STEP_INPUTS & model_kwargs.keys():
            return None
        caches = [model_kwargs[key] for key in ("cache", "past_key_values") if key in model_kwargs]
        if len(caches) != 1 or type(caches[0]) is not BeamSharedCrossAttentionCache:
            return None
        cache = caches[0]
        layers = cache.self_attention_cache.layers
        if not layers or any(type(layer) is not GrowingLayer or layer.pinned for layer in layers):
            return None
        parents = torch.empty(0, dtype=torch.int64)  # beam_update_'s reorder rows: int64, one per row
        if rows != layers[0].key_buffer.shape[1] or not reorder.possible(layers[0].key_buffer, parents):
            return None
        if not compiled.takes(rows, cache.cross_attention_cache.layers[0].keys, lean._encoder_mask, layers):
            return None
        return cls(lean, cache, beams_to_keep, update)

    def step(
        self,
        running_sequences: torch.Tensor,
        cur_len: int,
        state: tuple[torch.Tensor, ...],
        active: torch.Tensor,
    ) -> torch.Tensor | None:
        """One step on the loop's tensors, in place; None when it ran whole, else the logits the fused candidates
        refused (the decoder step ran: the loop goes on from them). ``state``: the running scores and indices,
        the finished sequences, scores and indices, the finished flags and the early-stop flags, as
        ``beam_update_`` takes them."""
        layers = self.layers
        length = layers[0].length
        for layer in layers:
            layer.reserve(1)
        ids = running_sequences[:, :, cur_len - 1].reshape(-1, 1)
        keys = [layer.key_buffer for layer in layers]
        values = [layer.value_buffer for layer in layers]
        logits = self.program.step(ids, length, keys, values, self.cross_keys, self.cross_values, self.mask)
        for layer in layers:
            layer.advance(1)
        scores, beams, tokens, ok = torch.ops.fastgen_cpu.log_softmax_top_k(
            logits[:, -1, :], state[0], self.beams_to_keep
        )
        if not bool(ok):
            return logits
        beam_idx, _ = beam_update(self.update, (scores, beams, tokens), running_sequences, state, cur_len, active)
        torch.ops.fastgen_cpu.reorder_rows_(keys + values, length + 1, beam_idx)
        return None
