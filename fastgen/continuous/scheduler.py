"""The continuous-batching scheduler: keep ``batch_rows`` decoder rows busy while a list of inputs is generated.

A static batch (``generate`` on length-sorted chunks, fastgen's shrinking beam loop included) gets
thinner as its inputs finish and waits for its longest one; a decoder step has a fixed cost (weights
streamed, per-op overhead) besides its per-row cost, which every thinned step pays for few rows (on
this project's 2-core CPU, one thread: BART d=384 about 16 ms at 4 rows and 67 ms at 64, bart-base 42
and 178 ms). Here, as soon as an input is done its rows leave and the next inputs of the queue take the
free slots: inputs are encoded ``batch_rows // beams`` at a time (right-padded) ahead of joining
(:class:`_Encoded`), their cross-attention K/V projected once and padded to the batch's widest, and
their first decoder step joins the running step. Results come out in input order.

Per input, every row does the arithmetic of ``generate`` on that input alone (module docs of
:mod:`.cache`, :mod:`.search`); the tests check tokens exactly and scores within a few ulps of the
step's logits.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fastgen.continuous import model as model_calls
from fastgen.continuous.cache import SlotCache
from fastgen.continuous.online import WAIT, Online, cancelled_positions, numbered
from fastgen.continuous.search import Finished, SearchState
from fastgen.continuous.settings import Settings
from fastgen.optimizer import registry, report
from fastgen.optimizer.linear_modes import int8_linears, packed_linears
from fastgen.optimizer.transformers.gemm import exact_output_projection

FEATURE = "continuous"
_GET_INTERFACE = "transformers.modeling_utils:AttentionInterface.get_interface"


def beams_can_share_cross_kv(model: Any) -> bool:
    """Whether fastgen's grouped attention (feature ``dedup``) serves one cross K/V row per input now."""
    from fastgen.models.encoder_decoder import shared_cross_attention_problem

    if not registry.active() or shared_cross_attention_problem(model) is not None:
        return False
    return any(row.target == _GET_INTERFACE and row.state == "applied" for row in registry.status())


def _feature_applied(feature: str) -> bool:
    return registry.active() and any(row.feature == feature and row.state == "applied" for row in registry.status())


def linear_features() -> tuple[bool, bool, bool]:
    """Whether ``int8``, ``fast_gemm`` and ``gemm`` are applied: read once per run (the registry's table is
    not free, and the scope is entered every step)."""
    return _feature_applied("int8"), _feature_applied("fast_gemm"), _feature_applied("gemm")


@contextlib.contextmanager
def linear_scope(
    model: Any, check_weights: bool = True, features: tuple[bool, bool, bool] | None = None
) -> Iterator[None]:
    """The GEMM forms ``generate`` runs under with fastgen on: ``gemm`` (exact output projection) and,
    when the user opted in, ``int8`` or ``fast_gemm`` (approximate linears). Those features hook
    ``generate``, which continuous batching does not call, so it enters their scopes itself, per step;
    ``check_weights`` (the weights' content against their int8/packed copies) on its first step only.
    ``features``: from :func:`linear_features` (read now when None)."""
    if id(model) in getattr(_held, "models", ()):
        yield  # this thread holds the scope over a run of steps (held_linear_scope)
        return
    int8, fast, exact = linear_features() if features is None else features
    with contextlib.ExitStack() as stack:
        if int8:
            stack.enter_context(int8_linears(model, check_weights))
        if fast:
            stack.enter_context(packed_linears(model, check_weights))
        if exact:
            stack.enter_context(exact_output_projection(model))
        yield


_held = threading.local()  # .models: ids of the models whose linear_scope this thread holds


@contextlib.contextmanager
def held_linear_scope(model: Any) -> Iterator[None]:
    """:func:`linear_scope` entered once for a run of steps on this thread; the loops' per-step entries inside
    are no-ops. For a thread that owns the model and steps loops back to back (fastgen-serve's engine): entering
    the scope walks the model's modules (on the serve benchmark's small BART about 4% of the engine's time when
    entered every step); the loops enter it per step because a caller may run the model between two results."""
    with linear_scope(model):
        held = _held.__dict__.setdefault("models", set())
        held.add(id(model))
        try:
            yield
        finally:
            held.discard(id(model))


def run_continuous(
    model: Any,
    inputs: Iterable[Any],
    settings: Settings,
    batch_rows: int,
    share: bool | None = None,
    stats: dict[str, int] | None = None,
    seeds: Iterable[int] | None = None,
    online: Online | None = None,
) -> Iterator[Finished | None]:
    """Generate every input, yielding :class:`Finished` results in input order.

    ``online``: inputs that arrive while the loop runs (:mod:`fastgen.continuous.online`): results then
    leave as they finish, with ``None`` yielded at every step boundary.
    ``share``: one cross K/V row per input (None: when fastgen's grouped attention is installed).
    ``stats``: filled in place with ``steps`` (decoder forwards) and ``rows`` (rows summed over steps).
    ``seeds``: when sampling, each input's random-stream seed, in input order (needed then).
    """
    device = model.device
    beams = settings.rows_per_input  # beams, or samples per input when sampling
    slots = max(1, batch_rows // beams)
    share = beams_can_share_cross_kv(model) if share is None else share
    cross_rows = 1 if share or beams == 1 else beams  # cross K/V rows per input
    state = SearchState(settings, device)
    cache = SlotCache(model_calls.decoder_layers(model))
    decoder = model_calls.Decoder(model)  # per-row positions on a private copy of the model (this call only)
    encoder_lengths: list[int] = []  # per running input
    masks = _CrossMask(cross_rows)
    ahead = _Encoded()  # inputs encoded before they join (one encoder call per ``slots`` inputs)
    queue = numbered(inputs)
    seed_queue = iter(seeds) if seeds is not None else None
    features = linear_features()
    ready: dict[int, Finished] = {}
    next_out = 0
    stats = {} if stats is None else stats
    stats.update(steps=0, rows=0)
    report.note_ran(FEATURE, "continuous batching" + (" with shared cross-attention K/V" if cross_rows == 1 else ""))
    # Nothing stays switched on while the generator is suspended (the caller may run the model between
    # two results): no_grad is entered per step; the position hooks live on the call's private copy.
    # no_grad, not inference_mode: results are ordinary tensors, as generate returns them.
    checked = False  # the weights' int8/packed copies are checked on the first step only
    while True:
        keep = cancelled_positions(state.indices, online)
        if keep is not None:  # cancelled inputs leave at the step boundary, without a result
            _retire(state, cache, encoder_lengths, keep, beams, cross_rows)
            masks.stale = True
        # One scope for the newcomers' encoding and the step: entering it costs a walk over the model's
        # modules, which a server (a newcomer or two per step) paid once more per step.
        with torch.no_grad(), linear_scope(model, not checked, features):
            checked = True
            free = slots - len(state)
            ahead.waiting = False
            while free > 0 and (len(ahead) or (ahead.more and not ahead.waiting)):
                if not len(ahead):
                    ahead.encode_next(model, queue, slots, cross_rows, device, seed_queue)
                    continue
                taken = ahead.take(free)
                cache.add(len(taken.indices) * state.beams, taken.cross)
                encoder_lengths.extend(taken.lengths)
                state.add(taken.indices, taken.seeds)
                masks.stale = True
                free -= len(taken.indices)
            if len(state):
                order, done = _step(decoder, state, cache, encoder_lengths, masks, stats)
        if not len(state):
            if online is not None and ahead.more:
                yield None  # idle: nothing to run until an input arrives
                continue
            break
        with torch.no_grad():
            if online is not None and online.on_step is not None:
                online.on_step(state)
            if not any(done):
                if order is not None:
                    cache.reorder(order)
            else:
                for position, is_done in enumerate(done):
                    if is_done:
                        result = state.result(position)
                        ready[result.index] = result
                keep = [i for i, d in enumerate(done) if not d]
                _retire(state, cache, encoder_lengths, keep, beams, cross_rows, order)
                masks.stale = True
        if online is not None:
            yield from ready.values()
            ready.clear()
            yield None  # a step boundary
            continue
        while next_out in ready:
            yield ready.pop(next_out)
            next_out += 1


class _CrossMask:
    """The encoder mask of the running cross rows, rebuilt only when inputs join or leave (not every step)."""

    def __init__(self, cross_rows: int) -> None:
        self.cross_rows = cross_rows
        self.stale = True
        self.mask: torch.Tensor | None = None

    def get(self, encoder_lengths: list[int], width: int, device: torch.device) -> torch.Tensor:
        if self.stale:
            enc = torch.tensor(encoder_lengths, device=device).repeat_interleave(self.cross_rows)
            self.mask = (torch.arange(width, device=device) < enc[:, None]).long()
            self.stale = False
        return self.mask


class _Encoded:
    """Inputs encoded ahead of joining: up to ``slots`` per encoder call, taken a few at a time as rows free up.

    Why: with greedy search inputs finish one or two at a time, and encoding each handful of newcomers
    alone runs the encoder on one or two rows, at nearly the cost of a full batch (measured: the
    encoder took 25 % more CPU than static batches' on a small BART). Their cross K/V are projected in
    the same call and wait here (a few MB).
    """

    def __init__(self) -> None:
        self.more = True  # the queue may hold inputs
        self.waiting = False  # an online queue said WAIT since the last step
        self.indices: list[int] = []
        self.lengths: list[int] = []
        self.seeds: list[int] | None = None
        self.cross: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.start = 0  # inputs before this one have joined
        self.rows = 1  # cross rows per input

    def __len__(self) -> int:
        return len(self.indices) - self.start

    def encode_next(self, model: Any, queue: Iterator, count: int, cross_rows: int, device, seed_queue) -> None:
        """Encode the next ``count`` inputs of ``queue`` (one call) and project their cross K/V."""
        items = []
        for _ in range(count):
            item = next(queue, None)
            if item is None:
                self.more = False
                break
            if item is WAIT:
                self.waiting = True
                break
            items.append((item[0], _as_ids(item[1], item[0], device)))
        self.indices = [index for index, _ in items]
        self.lengths = [len(ids) for _, ids in items]
        self.seeds = None if seed_queue is None else [_next_seed(seed_queue, i) for i in self.indices]
        self.start, self.rows = 0, cross_rows
        self.cross = []
        if items:
            states, _ = model_calls.encode(model, [ids for _, ids in items], _pad_id(model))
            self.cross = model_calls.project_cross(model, states, cross_rows)

    def take(self, count: int) -> _Encoded:
        """The next ``count`` (or fewer) encoded inputs, their cross K/V cut to the widest of them (views)."""
        taken = _Encoded()
        stop = min(self.start + count, len(self.indices))
        taken.indices, taken.lengths = self.indices[self.start : stop], self.lengths[self.start : stop]
        taken.seeds = None if self.seeds is None else self.seeds[self.start : stop]
        rows, width = slice(self.start * self.rows, stop * self.rows), max(taken.lengths)
        taken.cross = [(k[rows, :, :width], v[rows, :, :width]) for k, v in self.cross]  # views: copied on join
        self.start = stop
        return taken


def _step(
    decoder: model_calls.Decoder,
    state: SearchState,
    cache: SlotCache,
    encoder_lengths: list[int],
    masks: _CrossMask,
    stats: dict,
) -> tuple[torch.Tensor | None, list[bool]]:
    """One decoder step of every running row and the search step after it: the cache rows' new order
    (beam search; applied by the caller, together with retirements: one copy) and which inputs are done."""
    device = state.device
    lengths = state.row_lengths()
    width = max(state.host_lengths)
    positions = lengths - 1
    cache.set_positions(positions, width)
    self_mask = (torch.arange(width, device=device) < lengths[:, None]).long()
    cross_mask = masks.get(encoder_lengths, cache.cross_width, device)
    logits = decoder.step(state.last_tokens(), positions, self_mask, cross_mask, cache)
    stats["steps"] += 1
    stats["rows"] += logits.shape[0]
    return state.step(logits)


def _as_ids(value: Any, index: int, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(value)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"input {index}: expected a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    return ids.to(device=device, dtype=torch.long)


def _next_seed(seeds: Iterator[int], index: int) -> int:
    seed = next(seeds, None)
    if seed is None:
        raise ValueError(f"input {index}: no seed left (give one seed per input)")
    return int(seed)


def _pad_id(model: Any) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


def _retire(
    state: SearchState,
    cache: SlotCache,
    encoder_lengths: list[int],
    keep: list[int],
    beams: int,
    cross_rows: int,
    order: torch.Tensor | None = None,
) -> None:
    """Drop the inputs not in ``keep`` (ascending running positions) everywhere; narrow the cross K/V to the
    widest input left.

    The running inputs that stay after the first ``len(keep)`` positions move into the holes the leavers left
    there, in order (the others keep their positions), so the cross K/V move only for those inputs
    (:meth:`SlotCache.move_cross`); the search state and the self-attention rows follow the same order, the
    latter in the copy that applies this step's beam ``order``."""
    count = len(keep)
    new_order, holes, movers = compaction(keep)
    device = state.device
    inputs = torch.tensor(new_order, dtype=torch.long, device=device)
    hyp_rows = (inputs[:, None] * beams + torch.arange(beams, device=device)).reshape(-1)
    if order is not None:
        hyp_rows = order.index_select(0, hyp_rows)
    state.remove(new_order)
    cache.reorder(hyp_rows)
    cache.move_cross(_rows(holes, cross_rows), _rows(movers, cross_rows), count * cross_rows)
    encoder_lengths[:] = [encoder_lengths[i] for i in new_order]
    cache.narrow_cross(max(encoder_lengths, default=0))


def compaction(keep: list[int]) -> tuple[list[int], list[int], list[int]]:
    """The running positions after a retirement that keeps positions ``keep`` (ascending): the new order (old
    positions), the positions before ``len(keep)`` that left (holes) and the kept ones past it (movers, one
    per hole, in order)."""
    count, kept = len(keep), set(keep)
    holes = [position for position in range(count) if position not in kept]
    movers = keep[count - len(holes) :]  # the survivors at positions >= count, ascending
    order = list(range(count))
    for hole, mover in zip(holes, movers, strict=True):
        order[hole] = mover
    return order, holes, movers


def _rows(inputs: list[int], per_input: int) -> list[int]:
    """The cross rows of running inputs ``inputs`` (``per_input`` rows each)."""
    return [index * per_input + row for index in inputs for row in range(per_input)]
