"""Continuous batching for decoder-only models (gpt2, llama, qwen2, mistral, qwen3): prefill, join, decode.

A newcomer's prompt is prefilled alone, exactly as ``generate`` prefills that input alone (same
shapes: ``num_beams`` copies for beam search, no attention mask, positions ``0..len-1``, the model's
own ``DynamicCache`` and ``logits_to_keep=1``), so its first-token logits are upstream's bit for bit
(tested). Batching newcomers' prompts would need right padding and an explicit mask, which changes
the attention kernel's path and the GEMM shapes, so the first token's scores would only agree to a few
ulps; on a CPU a prompt is already a matrix of its length, so one call per prompt costs little.

The prompt's K/V are then copied into new :class:`~fastgen.continuous.cache.SlotLayer` rows at slots
``0..len-1`` (left aligned, as the layer keeps encoder-decoder rows), and the rows join the batch:
each step, every running row feeds its newest token through the model's own forward with

- ``position_ids`` ``(N, 1)``: the row's own position (rotary models and GPT-2's learned positions
  both read them);
- a 2-D attention mask ``(N, width)`` hiding each row's slots past its length; the slot layer reports
  ``width - 1`` past tokens, so the model's causal mask admits every slot and the 2-D mask decides;
- the slot cache, whose ``update`` writes each row's new K/V at its own position.

The newcomers' prefill logits and the running rows' step logits go through one
:class:`~fastgen.continuous.search.SearchState` step, which keeps per-input prompt lengths and
length limits (``max_new_tokens`` counts from each prompt).

Sliding-window layers (Mistral, Qwen3 with ``use_sliding_window``) measure the window from one query
position shared by the batch, so they are exact only while no input can outgrow the window: an input
whose length limit exceeds it is generated alone by ``generate`` (reported as ``degraded``; same
result). A prompt that already reaches its length limit is an error, as in ``generate``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from fastgen.continuous.cache import SlotLayer
from fastgen.continuous.online import WAIT, Online, cancelled_positions, numbered
from fastgen.continuous.scheduler import _as_ids, _next_seed, linear_features, linear_scope
from fastgen.continuous.search import Finished, SearchState
from fastgen.continuous.settings import Settings, cache_kwarg
from fastgen.optimizer import registry, report

FEATURE = "continuous"


class PromptSlotCache:
    """One :class:`~fastgen.continuous.cache.SlotLayer` per decoder layer, inside a ``DynamicCache`` the model reads."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [SlotLayer() for _ in range(num_layers)]
        self.cache = DynamicCache()
        self.cache.layers = list(self.layers)

    def set_positions(self, positions: torch.Tensor, width: int) -> None:
        for layer in self.layers:
            layer.positions, layer.width = positions, width

    def select(self, rows: torch.Tensor) -> None:
        """Keep (and reorder) rows: a beam reorder or finished inputs leaving."""
        for layer in self.layers:
            layer.select_rows(rows)

    def append(self, prompts_kv: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """New rows for the newcomers: ``prompts_kv[i][layer]`` is prompt ``i``'s K/V at that layer."""
        for index, layer in enumerate(self.layers):
            for kv in prompts_kv:
                layer.append_prefilled(*kv[index])


def sliding_window(config: Any) -> int | None:
    """The window of the model's sliding-window layers, or None when every layer attends to all positions."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def prefill(model: Any, prompt: torch.Tensor, copies: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    """The prompt's next-token logits ``(copies, V)`` (float32) and every layer's K/V ``(copies, H, len, D)``.

    The call ``generate`` makes for this input alone (``copies`` = its expanded beams).
    """
    length = prompt.shape[0]
    ids = prompt[None].expand(copies, length)
    positions = torch.arange(length, device=prompt.device)[None].expand(copies, length)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        return_dict=True,
        **{cache_kwarg(model): cache},
    )
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    if any(keys.shape[-2] != length for keys, _ in kv):
        raise RuntimeError("the prefill cache dropped prompt entries (sliding window); this input must run alone")
    return out.logits[:, -1, :].to(torch.float32), kv


def decode_step(model: Any, tokens: torch.Tensor, lengths: torch.Tensor, width: int, cache: PromptSlotCache):
    """Logits ``(N, V)`` (float32) of every row's newest token, at its own position ``lengths - 1``."""
    positions = lengths - 1
    cache.set_positions(positions, width)
    mask = (torch.arange(width, device=tokens.device) < lengths[:, None]).long()
    out = model(
        input_ids=tokens[:, None],
        attention_mask=mask,
        position_ids=positions[:, None],
        use_cache=True,
        logits_to_keep=1,
        return_dict=True,
        **{cache_kwarg(model): cache.cache},
    )
    return out.logits[:, -1, :].to(torch.float32)


def runs_alone(model: Any, settings: Settings, prompt_length: int) -> str | None:
    """Why an input cannot join the batch (it is then generated alone), or None."""
    limit = settings.length_limit(prompt_length)
    window = sliding_window(model.config)
    if window is not None and limit > window:
        return f"an input that can outgrow the sliding window ({window})"
    return None


def generate_alone(model: Any, index: int, ids: torch.Tensor, settings: Settings, kwargs: dict) -> Finished:
    """``generate`` on one input (the exact fallback for an input that cannot join the batch)."""
    call = dict(kwargs, return_dict_in_generate=True, output_scores=settings.num_beams > 1)
    out = model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), **call)
    scores = out.sequences_scores if settings.num_beams > 1 else None
    return Finished(index, out.sequences, scores)


def run_decoder_only(
    model: Any,
    inputs: Iterable[Any],
    settings: Settings,
    batch_rows: int,
    generate_kwargs: dict[str, Any],
    stats: dict[str, int] | None = None,
    seeds: Iterator[int] | None = None,
    online: Online | None = None,
) -> Iterator[Finished | None]:
    """Generate every input, yielding :class:`Finished` results in input order.

    ``seeds``: when sampling, each input's random-stream seed, in input order (needed then).
    ``online``: inputs that arrive while the loop runs (:mod:`fastgen.continuous.online`): results then
    leave as they finish, with ``None`` yielded at every step boundary.

    ``stats``: filled in place with ``steps`` (decode forwards), ``rows`` (rows summed over them) and
    ``prefills`` (prompt forwards).
    """
    slots = max(1, batch_rows // settings.rows_per_input)
    state = SearchState(settings, model.device)
    cache = PromptSlotCache(model.config.num_hidden_layers)
    queue = numbered(inputs)
    exhausted = False
    ready: dict[int, Finished] = {}
    next_out = 0
    stats = {} if stats is None else stats
    stats.update(steps=0, rows=0, prefills=0)
    features = linear_features()
    report.note_ran(FEATURE, "continuous batching (decoder-only)")
    checked = False  # the weights' int8/packed copies are checked on the first step only
    while True:
        keep = cancelled_positions(state.indices, online)
        if keep is not None:  # cancelled inputs leave at the step boundary, without a result
            _keep_inputs(state, cache, keep, None)
        newcomers: list[tuple[int, torch.Tensor, int | None]] = []
        while not exhausted and len(state) + len(newcomers) < slots:
            item = next(queue, None)
            if item is None:
                exhausted = True
                continue
            if item is WAIT:
                break
            seed = None if seeds is None else _next_seed(seeds, item[0])
            if (ids := _joining(model, settings, item, seed, generate_kwargs, ready)) is not None:
                newcomers.append((item[0], ids, seed))
        if len(state) or newcomers:
            with torch.no_grad(), linear_scope(model, not checked, features):  # generate's GEMM forms
                checked = True
                order, done = _step(model, state, cache, newcomers, stats)
                if online is not None and online.on_step is not None:
                    online.on_step(state)
                _retire(state, cache, order, done, ready)
        elif exhausted:
            break
        if online is not None:
            yield from ready.values()
            ready.clear()
            yield None  # a step boundary (or idle)
            continue
        while next_out in ready:
            yield ready.pop(next_out)
            next_out += 1
    while next_out in ready:
        yield ready.pop(next_out)
        next_out += 1


def _joining(
    model: Any,
    settings: Settings,
    item: tuple[int, Any],
    seed: int | None,
    kwargs: dict[str, Any],
    ready: dict[int, Finished],
) -> torch.Tensor | None:
    """The input's token ids if it joins the batch; else its result goes straight to ``ready`` (None)."""
    index, ids = item[0], _as_ids(item[1], item[0], model.device)
    limit = settings.length_limit(len(ids))
    if len(ids) >= limit:
        raise ValueError(
            f"input {index}: its {len(ids)} tokens reach max_length={limit} (generate raises for it too; "
            "set max_new_tokens)"
        )
    reason = runs_alone(model, settings, len(ids))
    if reason is None:
        return ids
    registry.degraded(FEATURE, f"{reason}: generated alone")
    with torch.no_grad(), torch.random.fork_rng(devices=[ids.device] if ids.device.type == "cuda" else []):
        if seed is not None:
            torch.manual_seed(seed)
        ready[index] = generate_alone(model, index, ids, settings, kwargs)
    return None


def _step(
    model: Any,
    state: SearchState,
    cache: PromptSlotCache,
    newcomers: list[tuple[int, torch.Tensor, int | None]],
    stats: dict[str, int],
) -> tuple[torch.Tensor | None, list[bool]]:
    """The running rows' decode step and the newcomers' prefills, then one search step over all rows: the
    cache rows' new order (beam search; applied by :func:`_retire`, with retirements, in one copy) and
    which inputs are done."""
    logits = []
    if len(state):
        width = max(state.host_lengths)
        logits.append(decode_step(model, state.last_tokens(), state.row_lengths(), width, cache))
        stats["steps"] += 1
        stats["rows"] += logits[-1].shape[0]
    prompts_kv = []
    for _, ids, _ in newcomers:
        first, kv = prefill(model, ids, state.beams)
        logits.append(first)
        prompts_kv.append(kv)
        stats["prefills"] += 1
    if newcomers:  # after the decode step, which reads only the running rows
        cache.append(prompts_kv)
        seeds = [seed for _, _, seed in newcomers] if state.s.do_sample else None
        state.add([index for index, _, _ in newcomers], seeds, [ids for _, ids, _ in newcomers])
    return state.step(torch.cat(logits) if len(logits) > 1 else logits[0])


def _retire(
    state: SearchState,
    cache: PromptSlotCache,
    order: torch.Tensor | None,
    done: list[bool],
    ready: dict[int, Finished],
) -> None:
    """Apply the beam ``order`` to the cache and, in the same copy, drop the finished inputs' rows (their
    results go to ``ready``)."""
    if not any(done):
        if order is not None:
            cache.select(order)
        return
    for position, is_done in enumerate(done):
        if is_done:
            result = state.result(position)
            ready[result.index] = result
    keep = [i for i, d in enumerate(done) if not d]
    _keep_inputs(state, cache, keep, order)


def _keep_inputs(state: SearchState, cache: PromptSlotCache, keep: list[int], order: torch.Tensor | None) -> None:
    """Keep only the running inputs at positions ``keep`` (after the beam ``order``, in the same copy)."""
    inputs = torch.tensor(keep, dtype=torch.long, device=state.device)
    rows = (inputs[:, None] * state.beams + torch.arange(state.beams, device=state.device)).reshape(-1)
    state.remove(keep)
    cache.select(rows if order is None else order.index_select(0, rows))
