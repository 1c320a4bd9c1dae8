"""The continuous batch's decode step for the BART family (bart, mbart, marian, pegasus) without the module tree.

Why: on a small model the products are not the whole step. Upstream's forward enters about 15 wrapped module
calls per layer and assembles output objects every step; fastgen's static ``generate`` skips them with
:class:`fastgen.models.lean_step.LeanDecodeStep`, and on the serve benchmark's BART (d_model 256, 3 decoder
layers, beam 4, 64 rows, one thread) it did 1.12x the inputs per second of ``generate_many`` for that alone.

This is that step's Python path with what a continuous batch differs in: every row at its own position (the
position table read at ``p + offset``, what the family's hook on the private copy returns,
:mod:`fastgen.continuous.families`), a 2-D self-attention mask (rows of different lengths: the causal mask is
built from it each step, as upstream builds it) and the slot cache (each row's K/V written at its own slot).
Same modules, same operations in the same order, the same attention function: the logits are those of the
model's forward bit for bit (``tests/test_continuous_lean.py``). Models the lean step does not reproduce
(:func:`fastgen.models.lean_step.model_problem`), ``FASTGEN_LEAN_STEP=0`` and feature ``lean_step`` off keep
the model's forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fastgen.continuous.cache import SlotCache
from fastgen.models.compiled_step import switched_off as compiled_step_off
from fastgen.models.lean_step import FAMILIES, model_problem
from fastgen.optimizer import registry
from fastgen.optimizer.transformers.beam_search import lean_step_switched_off


def problem(model: Any) -> str | None:
    """Why this call's steps keep the model's forward (None: :class:`LeanStep` serves them)."""
    if lean_step_switched_off():
        return "FASTGEN_LEAN_STEP=0"
    if not registry.active() or not any(r.feature == "lean_step" and r.state == "applied" for r in registry.status()):
        return "feature 'lean_step' is not applied"
    return model_problem(model)


class LeanStep:
    """The decode steps of one continuous call (the 4-D encoder mask is rebuilt only when inputs join or leave)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.family = FAMILIES[f"{type(model).__module__}.{type(model).__qualname__}"]
        self.decoder = model.get_decoder()
        self.attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.decoder.config._attn_implementation, None)
        self._cross: tuple[torch.Tensor, int, Any] | None = None  # (2-D mask, rows, its 4-D mask)
        self._programs: dict[int, Any] = {}  # rows -> the C++ program for steps of that many rows (None: Python)

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        self_mask: torch.Tensor,
        cross_mask: torch.Tensor,
        cache: SlotCache,
        states: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ``(N, V)`` (float32) of one token per row, row ``r`` at position ``positions[r]``; ``states``
        the encoder states' stand-in the masks read the shape of (:func:`fastgen.continuous.model.cache_states`)."""
        decoder, family, config = self.decoder, self.family, self.decoder.config
        ids = tokens.view(-1, 1)
        program = self._program(ids.shape[0], cache)
        if program is not None:  # the masks read only the shape, dtype and device of the embeddings
            embeds = torch.zeros((), dtype=states.dtype, device=states.device).expand(ids.shape[0], 1, states.shape[-1])
        else:
            embeds = decoder.embed_tokens(ids)
            if family.scale_outside_embedding:
                embeds = embeds * decoder.embed_scale
        self_attention = cache.cache.self_attention_cache
        mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=self_mask, cache=self_attention)
        cross = self._cross
        if cross is None or cross[0] is not cross_mask or cross[1] != ids.shape[0]:
            built = create_bidirectional_mask(
                config=config, inputs_embeds=embeds, attention_mask=cross_mask, encoder_hidden_states=states
            )
            cross = self._cross = (cross_mask, ids.shape[0], built)
        if program is not None:
            logits = self._compiled_step(program, ids, positions, mask, cross[2], cache)
            if logits is not None:
                return logits
            embeds = decoder.embed_tokens(ids)
            if family.scale_outside_embedding:
                embeds = embeds * decoder.embed_scale
        table = decoder.embed_positions
        hidden = embeds + nn.Embedding.forward(table, positions[:, None] + getattr(table, "offset", 0))
        if family.layernorm_embedding:
            hidden = decoder.layernorm_embedding(hidden)
        shape = hidden.shape[:-1]
        pre = family.pre_norm
        crosses = cache.cache.cross_attention_cache.layers
        for layer, slots, kv in zip(decoder.layers, cache.self_layers, crosses, strict=True):
            attention = layer.self_attn
            out = self._self_attention(layer.self_attn_layer_norm(hidden) if pre else hidden, attention, slots, mask)
            hidden = _residual(hidden, out, layer.self_attn_layer_norm, pre)
            attention = layer.encoder_attn
            normed = layer.encoder_attn_layer_norm(hidden) if pre else hidden
            out = self._attention(attention, attention.q_proj(normed), kv.keys, kv.values, cross[2], shape)
            hidden = _residual(hidden, out, layer.encoder_attn_layer_norm, pre)
            normed = layer.final_layer_norm(hidden) if pre else hidden
            hidden = _residual(hidden, layer.fc2(layer.activation_fn(layer.fc1(normed))), layer.final_layer_norm, pre)
        if pre:
            hidden = decoder.layer_norm(hidden)
        logits = self.model.lm_head(hidden) + self.model.final_logits_bias.to(hidden.device)
        return logits[:, -1, :].to(torch.float32)

    def _program(self, rows: int, cache: SlotCache) -> Any:
        """The C++ program (:class:`fastgen.models.compiled_step.CompiledStep`) for a step of ``rows`` rows, or None
        where the Python step runs it: the cache's first step (its buffers are made by the Python step) or a
        program that cannot run (the linears' forms not settled yet for this row count: built again at a later
        step). In the fast modes the program's attention is fastgen's CPU kernel, which the Python step's
        attention also runs for one query row per (row, head) with the 4-D self-attention mask
        (:func:`fastgen.ops.cpu_attention.supports`); :meth:`_compiled_step` checks the rest per step."""
        if compiled_step_off() or not all(layer.is_initialized for layer in cache.self_layers):
            return None
        if rows in self._programs:
            return self._programs[rows]
        from fastgen.models.compiled_step import CompiledStep

        built = CompiledStep(self, self.attend, rows)
        program = built if built.problem is None else None
        if program is not None or not built.retry:
            self._programs[rows] = program
        return program

    def _compiled_step(
        self, program: Any, ids: torch.Tensor, positions: torch.Tensor, mask: Any, cross_mask: Any, cache: SlotCache
    ) -> torch.Tensor | None:
        """The step's logits from the C++ program (``step_rows``: the Python step's ops in its order, the same
        kernels), or None where the program does not take this step's masks or cross K/V."""
        crosses = cache.cache.cross_attention_cache.layers
        rows = ids.shape[0]
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dtype in (torch.bool, torch.float32)):
            return None
        if program.approximate and mask is not None and not _kernel_takes_self_mask(mask, rows, cache):
            return None  # the Python step's attention would leave this one to SDPA
        if not program.takes(rows, crosses[0].keys, cross_mask):
            return None
        layers = cache.self_layers
        buffers = [layer.prepare(rows) for layer in layers]
        logits = program.program.step_rows(
            ids,
            positions,
            layers[0].width,
            [keys for keys, _ in buffers],
            [values for _, values in buffers],
            mask,
            [kv.keys for kv in crosses],
            [kv.values for kv in crosses],
            cross_mask,
        )
        return logits[:, -1, :].to(torch.float32)

    def _self_attention(self, hidden: torch.Tensor, attention: Any, slots: Any, mask: Any) -> torch.Tensor:
        shape = (*hidden.shape[:-1], -1, attention.head_dim)
        query = attention.q_proj(hidden)
        key = attention.k_proj(hidden).view(shape).transpose(1, 2)
        value = attention.v_proj(hidden).view(shape).transpose(1, 2)
        key, value = slots.update(key, value)
        return self._attention(attention, query, key, value, mask, hidden.shape[:-1])

    def _attention(self, attention: Any, query: torch.Tensor, key, value, mask: Any, shape) -> torch.Tensor:
        query = query.view((*shape, -1, attention.head_dim)).transpose(1, 2)
        out, _ = self.attend(attention, query, key, value, mask, dropout=0.0, scaling=attention.scaling)
        return attention.out_proj(out.reshape(*shape, -1).contiguous())


def _kernel_takes_self_mask(mask: torch.Tensor, rows: int, cache: SlotCache) -> bool:
    """Whether fastgen's CPU attention takes this self-attention mask for the step's rows (as
    :func:`fastgen.ops.cpu_attention.supports` decides for the Python step's call): 4-D, on the CPU, one row or
    all of them, every head, one query, the slots in use."""
    width = cache.self_layers[0].width
    return (
        mask.dim() == 4
        and mask.device.type == "cpu"
        and mask.shape[0] in (1, rows)
        and mask.shape[1] == 1
        and mask.shape[2] == 1
        and mask.shape[3] == width
    )


def _residual(hidden: torch.Tensor, out: torch.Tensor, norm: Any, pre: bool) -> torch.Tensor:
    """``hidden + out``, normalised after the sum where the layer is post-norm (BART, Marian)."""
    hidden = hidden + out
    return hidden if pre else norm(hidden)
