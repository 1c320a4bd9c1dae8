"""What continuous batching needs to know per encoder-decoder family, in one table (:data:`ADAPTERS`).

The scheduler, the cache and the model calls are the same for every family; two things differ:

Cross-attention K/V
    A newcomer's cross K/V are projected once, as the family's own cross-attention module projects
    ``key_value_states``: BART-likes (``layers[i].encoder_attn``, ``k_proj``/``v_proj``, ``head_dim``)
    and T5-likes (``block[i].layer[1].EncDecAttention``, ``k``/``v``, ``key_value_proj_dim``; T5 has no
    query scaling and no position bias in cross-attention, which the module applies itself, as
    zeros). Scaling and bias live in the modules, so projecting K/V is all a family adapter does.

Each row's own position
    The stock decoder derives one position for all rows from the cache length; here every row is at
    its own position ``p`` (the count of tokens before the one it feeds). Per family, hooks installed
    for one decoder step give each row what that row would get decoding alone:

    - learned/sinusoidal ``nn.Embedding`` tables (BART, mBART, Marian, Pegasus): ``embed(p + offset)``;
    - M2M-100/NLLB's sinusoidal table indexed from the token ids: ``padding_idx + 1 + p``, and the
      zero ``padding_idx`` row where the token is the padding id (as upstream does for any pad token);
    - T5, mT5, UMT5's relative position bias: ``bias(k - p)`` for every key slot ``k`` of the row, in
      place of the bias of the common position, gathered from the stock bias (a row's slots past ``p``
      are masked, so what they read is never seen). T5 and mT5 compute it in the first layer and
      share it; UMT5 in every layer: wrapping the ``compute_bias`` of each module that has a bias table
      covers both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Projection = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _Restore:
    """Handle that puts back an instance attribute (like a hook's ``RemovableHandle``)."""

    def __init__(self, module: nn.Module, name: str, value: Any) -> None:
        self.previous = module.__dict__.get(name)
        self.module, self.name = module, name
        module.__dict__[name] = value

    def remove(self) -> None:
        if self.previous is None:
            self.module.__dict__.pop(self.name, None)
        else:
            self.module.__dict__[self.name] = self.previous


@dataclass(frozen=True)
class Adapter:
    """One family: its decoder's cross-attention modules, their K/V projection, and its per-row position hooks.

    ``row_positions(model, positions)`` installs the hooks and returns their handles; ``positions`` is a
    one-element list holding the ``(N,)`` int64 row positions, refilled by the caller before each step.
    """

    cross_attention: Callable[[Any], list[nn.Module]]
    project: Projection
    row_positions: Callable[[Any, list[torch.Tensor]], list[Any]]


# ----------------------------------------------------------------------------- cross-attention K/V


def _bart_cross_attention(model: Any) -> list[nn.Module]:
    return [layer.encoder_attn for layer in model.get_decoder().layers]


def _bart_project(module: nn.Module, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*states.shape[:-1], -1, module.head_dim)
    return module.k_proj(states).view(shape).transpose(1, 2), module.v_proj(states).view(shape).transpose(1, 2)


def _t5_cross_attention(model: Any) -> list[nn.Module]:
    return [block.layer[1].EncDecAttention for block in model.get_decoder().block]


def _t5_project(module: nn.Module, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*states.shape[:-1], -1, module.key_value_proj_dim)
    return module.k(states).view(shape).transpose(1, 2), module.v(states).view(shape).transpose(1, 2)


# ----------------------------------------------------------------------------- per-row positions


def _embedding_positions(model: Any, positions: list[torch.Tensor]) -> list[Any]:
    """``embed_positions`` is an ``nn.Embedding`` table (learned or fixed sinusoids) read at ``p + offset``."""
    module = model.get_decoder().embed_positions
    offset = getattr(module, "offset", 0)

    def hook(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return nn.Embedding.forward(mod, positions[0][:, None] + offset)

    return [module.register_forward_hook(hook)]


def _token_id_positions(model: Any, positions: list[torch.Tensor]) -> list[Any]:
    """M2M-100's table is read at ``padding_idx + 1 + p`` for a token, at ``padding_idx`` (zeros) for a pad.

    The stock forward runs first and grows the table to the common (largest) position, so every row's
    index is inside it.
    """
    module = model.get_decoder().embed_positions
    pad = module.padding_idx

    def hook(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        ids = args[0]  # (N, 1): the decoder calls embed_positions(input_ids, inputs_embeds, cache_length)
        index = torch.where(ids.ne(pad), positions[0][:, None] + (pad + 1), pad)
        return mod.weights.index_select(0, index.view(-1)).view(*ids.shape, -1).detach()

    return [module.register_forward_hook(hook)]


def _relative_bias_positions(model: Any, positions: list[torch.Tensor]) -> list[Any]:
    """Every decoder self-attention module with a bias table gets a ``compute_bias`` that returns ``(N, H, 1, K)``.

    The module's own ``compute_bias`` gives the bias of the common query position ``past`` (the widest
    row's), for keys ``0..K-1``, i.e. of relative positions ``j - past``; row ``r`` at position ``p``
    needs ``k - p`` at key ``k``, which is column ``k + past - p`` of it (``past >= p``). Gathering keeps
    upstream's bucketing untouched (T5's and UMT5's spell it differently); slots past ``p`` (masked)
    read the last column.
    """
    handles = []
    for block in model.get_decoder().block:
        module = block.layer[0].SelfAttention
        if not module.has_relative_attention_bias:
            continue

        def compute_bias(query_length, key_length, device=None, past_seen_tokens=0, stock=module.compute_bias):
            common = stock(query_length, key_length, device=device, past_seen_tokens=past_seen_tokens)[0, :, 0]
            rows = positions[0]
            shift = torch.arange(key_length, device=rows.device) + (past_seen_tokens - rows)[:, None]
            return common[:, shift.clamp(max=key_length - 1)].transpose(0, 1).unsqueeze(2)

        handles.append(_Restore(module, "compute_bias", compute_bias))
    return handles


_BART_LIKE = Adapter(_bart_cross_attention, _bart_project, _embedding_positions)
_T5_LIKE = Adapter(_t5_cross_attention, _t5_project, _relative_bias_positions)

#: ``config.model_type`` -> its adapter; the families continuous batching serves (every one tested
#: against ``generate`` on each input alone in tests/test_continuous_batching.py).
ADAPTERS: dict[str, Adapter] = {
    "bart": _BART_LIKE,
    "mbart": _BART_LIKE,
    "marian": _BART_LIKE,
    "pegasus": _BART_LIKE,
    "m2m_100": Adapter(_bart_cross_attention, _bart_project, _token_id_positions),
    "t5": _T5_LIKE,
    "mt5": _T5_LIKE,
    "umt5": _T5_LIKE,
}


def adapter(model: Any) -> Adapter:
    return ADAPTERS[model.config.model_type]
