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
    its own position ``p`` (the count of tokens before the one it feeds). Per family, hooks give each row
    what that row would get decoding alone. They are installed on a private copy of the model made for
    one ``generate_many`` call (:func:`private_copy`: the modules on the path to the hooked ones are
    shallow copies, every parameter and every other module is shared), never on the user's modules, so
    another thread's ``generate`` (``fastgen.unpatched()`` included) and a second ``generate_many`` on the
    same model see the stock modules, and nothing inside the forward reads a thread-local or a lock
    (DESIGN §8). The hooks:

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


@dataclass(frozen=True)
class Adapter:
    """One family: its decoder's cross-attention modules, their K/V projection, and its per-row position hooks.

    ``row_positions(model, positions)`` returns a private copy of ``model`` (:func:`private_copy`) whose
    decoder reads ``positions``, a one-element list holding the ``(N,)`` int64 row positions, refilled by
    the caller before each step. ``hooked(model)`` lists the modules it hooks.
    """

    cross_attention: Callable[[Any], list[nn.Module]]
    project: Projection
    row_positions: Callable[[Any, list[torch.Tensor]], nn.Module]
    hooked: Callable[[Any], list[nn.Module]]


# ----------------------------------------------------------------------------- private copies


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A second module object sharing every attribute (parameters, buffers, hooks) but its own ``__dict__``
    and child table, so replacing a child or an attribute of the copy leaves ``module`` untouched."""
    copy = object.__new__(type(module))
    copy.__dict__.update(module.__dict__)
    copy.__dict__["_modules"] = dict(module._modules)
    return copy


def module_paths(model: nn.Module, modules: list[nn.Module]) -> list[list[str]]:
    """Each module's path of child names from ``model`` (its first, as ``named_modules`` lists them)."""
    names = {}
    for name, module in model.named_modules():
        names.setdefault(id(module), name)
    return [names[id(module)].split(".") for module in modules]


def private_copy(model: nn.Module, modules: list[nn.Module]) -> tuple[nn.Module, list[nn.Module]]:
    """A copy of ``model`` in which ``modules`` and every module on the way to them are shallow copies
    (:func:`_shallow_copy`); returns it and the copies of ``modules``. A forward of the copy runs the same
    code on the same parameters as ``model``'s, except where the caller changes the copied modules."""
    root = _shallow_copy(model)
    copies: dict[int, nn.Module] = {}
    found = []
    for path in module_paths(model, modules):
        parent, original = root, model
        for name in path:
            original = original._modules[name]
            if id(original) not in copies:
                copies[id(original)] = _shallow_copy(original)
                parent._modules[name] = copies[id(original)]
            parent = copies[id(original)]
        found.append(parent)
    return root, found


def path_problem(model: nn.Module, hooked: Callable[[Any], list[nn.Module]]) -> str | None:
    """Why a private copy would not run the hooks on the modules ``hooked(model)`` lists: one of them or a
    module on the way to them (``model`` included) has an instance ``forward`` or a compiled call
    (``torch.compile``, another library's hook) bound to the original, which the copy would call; or one is
    shared, first reached by another path than the one the decoder takes."""
    modules = hooked(model)
    copy, copies = private_copy(model, modules)
    if any(found is not made for found, made in zip(hooked(copy), copies, strict=True)):
        return "a module the position hooks replace is shared with another part of the model"
    for path in module_paths(model, modules):
        module = model
        for depth in range(len(path) + 1):
            module = module._modules[path[depth - 1]] if depth else model
            if "forward" in module.__dict__ or getattr(module, "_compiled_call_impl", None) is not None:
                where = f"module {'.'.join(path[:depth])}" if depth else "the model"
                return f"{where} has its own forward (torch.compile or another library's hook)"
    return None


def _wrap_forward(module: nn.Module, hook: Callable[[nn.Module, tuple, torch.Tensor], torch.Tensor]) -> None:
    """Give the (private) ``module`` a forward that runs its class's forward, then ``hook`` on the output."""
    stock = type(module).forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        return hook(module, args, stock(module, *args, **kwargs))

    module.__dict__["forward"] = forward


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


def _embed_positions(model: Any) -> list[nn.Module]:
    return [model.get_decoder().embed_positions]


def _embedding_positions(model: Any, positions: list[torch.Tensor]) -> nn.Module:
    """``embed_positions`` is an ``nn.Embedding`` table (learned or fixed sinusoids) read at ``p + offset``."""
    root, (module,) = private_copy(model, _embed_positions(model))
    offset = getattr(module, "offset", 0)

    def hook(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return nn.Embedding.forward(mod, positions[0][:, None] + offset)

    _wrap_forward(module, hook)
    return root


def _token_id_positions(model: Any, positions: list[torch.Tensor]) -> nn.Module:
    """M2M-100's table is read at ``padding_idx + 1 + p`` for a token, at ``padding_idx`` (zeros) for a pad.

    The stock forward runs first and grows the table to the common (largest) position, so every row's
    index is inside it.
    """
    root, (module,) = private_copy(model, _embed_positions(model))
    pad = module.padding_idx

    def hook(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        ids = args[0]  # (N, 1): the decoder calls embed_positions(input_ids, inputs_embeds, cache_length)
        index = torch.where(ids.ne(pad), positions[0][:, None] + (pad + 1), pad)
        return mod.weights.index_select(0, index.view(-1)).view(*ids.shape, -1).detach()

    _wrap_forward(module, hook)
    return root


def _bias_modules(model: Any) -> list[nn.Module]:
    """The decoder self-attention modules that compute a relative position bias (T5: the first; UMT5: all)."""
    modules = (block.layer[0].SelfAttention for block in model.get_decoder().block)
    return [module for module in modules if module.has_relative_attention_bias]


def _relative_bias_positions(model: Any, positions: list[torch.Tensor]) -> nn.Module:
    """Every decoder self-attention module with a bias table gets a ``compute_bias`` that returns ``(N, H, 1, K)``.

    The module's own ``compute_bias`` gives the bias of the common query position ``past`` (the widest
    row's), for keys ``0..K-1``, i.e. of relative positions ``j - past``; row ``r`` at position ``p``
    needs ``k - p`` at key ``k``, which is column ``k + past - p`` of it (``past >= p``). Gathering keeps
    upstream's bucketing untouched (T5's and UMT5's spell it differently); slots past ``p`` (masked)
    read the last column.
    """
    root, modules = private_copy(model, _bias_modules(model))
    for module in modules:

        def compute_bias(query_length, key_length, device=None, past_seen_tokens=0, stock=module.compute_bias):
            common = stock(query_length, key_length, device=device, past_seen_tokens=past_seen_tokens)[0, :, 0]
            rows = positions[0]
            shift = torch.arange(key_length, device=rows.device) + (past_seen_tokens - rows)[:, None]
            return common[:, shift.clamp(max=key_length - 1)].transpose(0, 1).unsqueeze(2)

        module.__dict__["compute_bias"] = compute_bias
    return root


_BART_LIKE = Adapter(_bart_cross_attention, _bart_project, _embedding_positions, _embed_positions)
_T5_LIKE = Adapter(_t5_cross_attention, _t5_project, _relative_bias_positions, _bias_modules)

#: ``config.model_type`` -> its adapter; the families continuous batching serves (every one tested
#: against ``generate`` on each input alone in tests/test_continuous_batching.py).
ADAPTERS: dict[str, Adapter] = {
    "bart": _BART_LIKE,
    "mbart": _BART_LIKE,
    "marian": _BART_LIKE,
    "pegasus": _BART_LIKE,
    "m2m_100": Adapter(_bart_cross_attention, _bart_project, _token_id_positions, _embed_positions),
    "t5": _T5_LIKE,
    "mt5": _T5_LIKE,
    "umt5": _T5_LIKE,
}


def adapter(model: Any) -> Adapter:
    return ADAPTERS[model.config.model_type]
