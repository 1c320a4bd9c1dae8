"""The three model calls of continuous batching: encode a newcomer, project its cross K/V, one decoder step.

Each newcomer is encoded alone (no padding: its encoder states are those of ``generate`` on it alone;
on a CPU the encoder of one input is already a matrix of its length, so batching newcomers would buy
little there) and its cross-attention K/V are projected once, as the model's own cross-attention
modules project them. The decoder step then runs every running row at once through the model's own
forward, with:

- the :class:`~fastgen.continuous.cache.SlotCache`, whose self-attention layers write each row's K/V at
  its own position;
- a 2-D decoder mask that hides the slots past each row's length, and the encoder mask that hides the
  cross K/V padding;
- the family's hooks (:mod:`fastgen.continuous.families`) that give every row its own position (the
  stock decoder derives one position, the cache length, for all rows), installed on a private copy of
  the model for the call (:class:`Decoder`), so no other call or thread sees them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutput

from fastgen.continuous.cache import SlotCache
from fastgen.continuous.families import adapter
from fastgen.continuous.settings import cache_kwarg


def decoder_layers(model: Any) -> int:
    """How many decoder layers (one self- and one cross-attention cache layer each) the model has."""
    return len(adapter(model).cross_attention(model))


def encode(model: Any, inputs: list[torch.Tensor], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The newcomers' encoder states ``(B, S, d)`` in one call, right-padded, and their ``(B, S)`` mask.

    Right padding keeps every real token at the position it has alone; the mask hides the padding
    (and ``generate`` on one input passes an all-ones mask, which is what one unpadded row gets).
    """
    width = max(len(ids) for ids in inputs)
    ids = torch.full((len(inputs), width), pad_token_id, dtype=torch.long, device=inputs[0].device)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(inputs):
        ids[row, : len(tokens)], mask[row, : len(tokens)] = tokens, 1
    states = model.get_encoder()(input_ids=ids, attention_mask=mask, return_dict=True).last_hidden_state
    return states, mask


def project_cross(model: Any, states: torch.Tensor, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every decoder layer's cross-attention K/V of ``states`` ``(B, S, d)``, as ``(B * rows, H, S, D)`` each.

    The projection is the one the attention module runs on ``key_value_states`` (the family's
    :class:`~fastgen.continuous.families.Adapter`); ``rows > 1`` repeats each input's K/V for its
    hypotheses when the beams cannot share them.
    """
    family = adapter(model)
    out = []
    for module in family.cross_attention(model):
        keys, values = family.project(module, states)
        if rows > 1:
            keys, values = keys.repeat_interleave(rows, 0), values.repeat_interleave(rows, 0)
        out.append((keys.contiguous(), values.contiguous()))
    return out


def row_positions(model: Any, positions: list[torch.Tensor]) -> torch.nn.Module:
    """A private copy of ``model`` (parameters shared) whose decoder puts every row at its own position
    ``positions[0][row]`` (the family's hooks); ``positions`` is a one-element list refilled before each forward."""
    return adapter(model).row_positions(model, positions)


class Decoder:
    """The decoder steps of one ``generate_many`` call: the lean step (:mod:`fastgen.continuous.lean`) where it
    serves the model, else the model's forward on a private copy of the model made once per call.

    The position hooks live on the copy only: thread-safe and re-entrant without any state read inside
    the forward (the user's modules are never changed, not even between two steps)."""

    def __init__(self, model: Any) -> None:
        from fastgen.continuous import lean

        self._positions = [torch.zeros(0, dtype=torch.long)]
        self.lean = lean.LeanStep(model) if lean.problem(model) is None else None
        self.model = row_positions(model, self._positions) if self.lean is None else model

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        self_mask: torch.Tensor,
        cross_mask: torch.Tensor,
        cache: SlotCache,
    ) -> torch.Tensor:
        """:func:`decoder_step` with every row at its own ``positions[row]``."""
        if self.lean is not None:
            rows, width = cross_mask.shape
            states = cache_states(tokens.device, rows, width, self.model.config.d_model, self.model.dtype)
            return self.lean.step(tokens, positions, self_mask, cross_mask, cache, states)
        self._positions[0] = positions
        return decoder_step(self.model, tokens, self_mask, cross_mask, cache)


def decoder_step(
    model: Any,
    tokens: torch.Tensor,
    self_mask: torch.Tensor,
    cross_mask: torch.Tensor,
    cache: SlotCache,
) -> torch.Tensor:
    """Logits ``(N, V)`` (float32) of one token per row. ``cross_mask`` is ``(R, S)``, R the cross rows."""
    rows, width = cross_mask.shape
    hidden = model.config.d_model
    # Only its shape is read (the cross K/V come from the cache, marked updated): a stride-0 view.
    states = cache_states(tokens.device, rows, width, hidden, model.dtype)
    outputs = model(
        encoder_outputs=BaseModelOutput(last_hidden_state=states),
        attention_mask=cross_mask,
        decoder_input_ids=tokens.view(-1, 1),
        decoder_attention_mask=self_mask,
        use_cache=True,
        return_dict=True,
        **{cache_kwarg(model): cache.cache},
    )
    return outputs.logits[:, -1, :].to(torch.float32)


def cache_states(device: torch.device, rows: int, width: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((), device=device, dtype=dtype).expand(rows, width, hidden)
