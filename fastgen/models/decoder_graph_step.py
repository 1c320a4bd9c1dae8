"""A decoder-only model's decode step on static shapes, replayed as a CUDA graph.

Why: on a GPU a small decoder-only model's ``generate`` is bound by the host (GPT-2 small launches some
300 kernels per new token, each a few microseconds of work). A CUDA graph launches them with one call.

Unlike the encoder-decoder step (:mod:`fastgen.models.graph_step`), which re-states BART's layers, this
one runs the model's own ``forward``: only the cache and the inputs are made static, so every family
whose forward takes a 4-D mask and explicit positions (GPT-2, Llama, Qwen2, Mistral...) is served by
the same code, and the arithmetic is the model's.

- :class:`StaticLayer` holds a layer's K/V in buffers of the call's whole length ``(rows, heads,
  capacity, dim)``, the prompt copied in at the first decode step (the beam-shared prompt repeated per
  hypothesis: one copy, then no concatenation per step), free slots zero; ``update`` writes the step's
  K/V at a position held in a device tensor and returns the whole buffers;
- the step passes a 4-D boolean mask over the buffers (the call's 2-D attention mask, free slots
  False: a masked slot adds an exact zero) and explicit position ids, so neither the mask builder nor the
  position code reads the cache's length on the host.

A graph is captured per row count and replayed while the buffers are current; the capture's warm-up run
is the step's real computation. The beam reorder gathers the filled prefix in place (outside the graph).
Attention over the padded length reads the same numbers as upstream's over the filled prefix but may sum
them in another order on some backends, so scores can differ in the last bits (the tests measure it).
Anything the capture cannot take runs the same static step eagerly for the rest of the call (one report
line); inputs the step does not know give the cache back to upstream's layers and upstream's forward.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from fastgen.models._caches import hypothesis_rows
from fastgen.models.decoder_only import SharedPrefixLayer
from fastgen.models.graph_step import FULL_SHARE, GRAPHS_ENV, capture_attention, graphs_switched_off
from fastgen.models.hooks import hooked
from fastgen.models.lean_step import one_token_problem
from fastgen.optimizer import report

FEATURE = "lean_step"

#: ``config.model_type`` whose forward this step runs with static inputs (GPU tests compare each with upstream)
FAMILIES = frozenset({"gpt2", "llama", "qwen2", "qwen3"})

#: the longest call (prompt + new tokens) whose K/V are reserved whole; longer calls keep upstream's forward
MAX_CAPACITY = 4096

#: run the static step (uncaptured) on CPU tensors too: how the CPU tests check its arithmetic
STATIC_ON_CPU = False

#: model inputs the step knows (anything else: upstream's forward)
KNOWN_INPUTS = frozenset(
    {"input_ids", "cache", "past_key_values", "attention_mask", "position_ids", "use_cache", "logits_to_keep"}
)


def model_problem(model: Any) -> str | None:
    """Why ``model``'s decode steps cannot run on static buffers (None: they can)."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} (static decode step: {', '.join(sorted(FAMILIES))})"
    if model.training:
        return "training mode"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {config._attn_implementation!r} (the static step passes sdpa a boolean mask)"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "a sliding window"
    if getattr(config, "add_cross_attention", False):
        return "cross-attention"
    if getattr(model, "_compiled_call", None) is not None or getattr(model, "_compiled_call_impl", None) is not None:
        return "a compiled forward"
    if hooked(model):
        return "hooks on the model (its forward is called directly)"
    if hasattr(model, "_reorder_cache"):
        return "the model reorders its cache itself (_reorder_cache)"
    return None


class StaticLayer(DynamicLayer):
    """One layer's K/V in buffers of the call's whole length (module docstring), written at ``position``."""

    rows_are_hypotheses = True  # one row per hypothesis, as upstream's layers (the beam loop may select rows)

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, capacity: int, position: torch.Tensor, origin: Any,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device
        self.origin = origin  # the layer this one stands in for (given back, filled, when the call ends)
        self.position = position
        self.length = keys.shape[-2]
        if buffers is None:
            buffers = (
                keys.new_zeros((*keys.shape[:2], capacity, keys.shape[-1])),
                values.new_zeros((*values.shape[:2], capacity, values.shape[-1])),
            )
        self.key_buffer, self.value_buffer = buffers  # zero past the prompt
        self.key_buffer[:, :, : self.length] = keys
        self.value_buffer[:, :, : self.length] = values
        self._publish()

    def _publish(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    @property
    def rows(self) -> int:
        return self.key_buffer.shape[0]

    @property
    def capacity(self) -> int:
        return self.key_buffer.shape[2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.key_buffer.index_copy_(2, self.position, key_states)
        self.value_buffer.index_copy_(2, self.position, value_states)
        return self.key_buffer, self.value_buffer

    def advance(self) -> None:
        self.length += 1
        self._publish()

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """The filled prefix gathered in place: the buffers keep their addresses (a graph reads them there)."""
        index, end = beam_idx.to(self.key_buffer.device), self.length
        for buffer in (self.key_buffer, self.value_buffer):
            buffer[:, :, :end] = buffer[:, :, :end].index_select(0, index)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Fewer rows (inputs left): new buffers of that many rows (a new graph)."""
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        indices = indices.to(self.key_buffer.device)
        self.key_buffer = self.key_buffer.index_select(0, indices)
        self.value_buffer = self.value_buffer.index_select(0, indices)
        self._publish()

    def batch_select_inputs(self, keep: torch.Tensor, beams: int) -> None:
        self.batch_select_indices(hypothesis_rows(keep, beams))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise RuntimeError("a static decode layer is not repeated (the call's rows are fixed at its first step)")

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("a static decode layer is not cropped (assisted decoding keeps upstream's forward)")

    def given_back(self) -> Any:
        """The layer this one stood in for, holding the K/V as upstream lays them out (prompt per row)."""
        origin = self.origin
        if isinstance(origin, SharedPrefixLayer):
            origin.prefix_keys = origin.prefix_values = None  # materialised: a plain layer from here on
            origin.hypotheses = self.rows
        origin.keys, origin.values = self.keys.contiguous(), self.values.contiguous()
        return origin


def _length(cache: Any) -> int:
    """The cache's length (-2 for one it cannot tell: no mask matches it)."""
    try:
        return int(cache.get_seq_length())
    except Exception:  # not a cache of Transformers' API: the step refuses it when adopting
        return -2


def _per_row(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(layer, SharedPrefixLayer):
        return layer.per_hypothesis()
    return layer.keys, layer.values


class _Captured:
    def __init__(self, graph: Any, logits: torch.Tensor) -> None:
        self.graph, self.logits = graph, logits


class DecoderGraphStep:
    """The static decode step of one decoder-only ``generate`` call (module docstring); the interface of
    :class:`fastgen.models.lean_step.LeanDecodeStep` that the beam and sampling loops use."""

    ran_compiled = False

    def __init__(self, model: Any, length_limit: int, capture: bool = True, beams: int = 1) -> None:
        self.model = model
        self.length_limit = length_limit
        self.capture = capture
        self.beams = beams  # hypotheses per input (consecutive rows): beam search reorders only within them
        self.problem: str | None = None
        self._cache: DynamicCache | None = None
        self._layers: list[StaticLayer] = []
        self._stack: torch.Tensor | None = None  # (2 * layers, rows, heads, capacity, dim): every layer's K and V
        self._prompt = 0  # positions every hypothesis of an input holds alike (the prompt): no reorder moves them
        self._scratch: torch.Tensor | None = None  # the reorder's gather, reused (its size grows every step)
        self._inputs: dict[str, torch.Tensor] = {}  # the static ids, positions, mask and position of a row count
        self._graphs: dict[tuple, _Captured | None] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._stream = torch.cuda.Stream() if capture else None
        self.captures = 0
        self.capture_seconds = 0.0

    # --- the loops' interface -----------------------------------------------------------------------------
    def compiled_ready(self, model_inputs: dict[str, Any]) -> bool:
        return False

    def keep_inputs(self, keep: torch.Tensor, inputs: int, attention_mask: Any, rows: int) -> None:
        """Inputs left the batch: the cache's layers selected their rows already; the static inputs follow."""

    def keeps_rows(self, finished: int, rows: int) -> bool:
        """With graphs each row count costs a capture: inputs leave only once half the batch is done."""
        return self.capture and self.problem is None and 2 * finished < rows

    def finish(self) -> None:
        if self.captures:
            note = f"decode step: CUDA graphs ({self.captures} captured in {self.capture_seconds * 1000:.0f} ms)"
            report.note_ran(FEATURE, note)
        self._give_back()
        self._graphs.clear()
        self._inputs.clear()

    # --- the step ----------------------------------------------------------------------------------------
    def step(self, model_inputs: dict[str, Any]) -> tuple[torch.Tensor, Any] | None:
        """This step's logits ``(rows, 1, vocab)`` and the cache (None: upstream's forward runs it)."""
        if self.problem is not None:
            return None
        problem = self._inputs_problem(model_inputs)
        if problem is not None:
            if self._cache is not None:  # the call went somewhere this step does not follow: upstream from here
                self._stop(problem)
            return None
        cache = model_inputs.get("cache", model_inputs.get("past_key_values"))
        if self._cache is None:
            problem = self._adopt(cache)
            if problem is not None:
                self.problem = problem
                report.note_ran(FEATURE, f"decode step: upstream's forward ({problem})")
                return None
        layers = self._layers
        if layers[0].length + 1 > layers[0].capacity:
            self._stop("the length limit reached")
            return None
        ids = model_inputs["input_ids"]
        static = self._static_inputs(ids.shape[0], ids.device)
        length = layers[0].length
        static["ids"].copy_(ids)
        positions = model_inputs.get("position_ids")
        if positions is None:
            static["positions"].fill_(length)  # what the model's forward computes from the cache's length
        else:
            static["positions"].copy_(positions)
        mask = model_inputs.get("attention_mask")
        if mask is None:
            static["mask"][:, : length + 1] = True
        else:
            static["mask"][:, : length + 1].copy_(mask)
        static["position"].fill_(length)
        cache_key = "cache" if "cache" in model_inputs else "past_key_values"
        logits = self._run(static, cache, cache_key)
        for layer in layers:
            layer.advance()
        return logits, cache

    def _inputs_problem(self, model_inputs: dict[str, Any]) -> str | None:
        problem = one_token_problem(model_inputs, KNOWN_INPUTS, "input_ids")
        if problem is not None:
            return problem
        ids = model_inputs["input_ids"]
        if self.capture and (not ids.is_cuda or torch.cuda.is_current_stream_capturing()):
            return "inputs off the GPU"
        if model_inputs.get("logits_to_keep", 1) not in (0, 1):
            return "logits_to_keep other than the one position"
        positions = model_inputs.get("position_ids")
        if positions is not None and (not isinstance(positions, torch.Tensor) or positions.shape != ids.shape):
            return "position ids of another shape than the ids"
        cache = model_inputs.get("cache", model_inputs.get("past_key_values"))
        if self._cache is not None and cache is not self._cache:
            return "another cache object"
        if self._cache is not None and ids.shape[0] != self._layers[0].rows:
            return "rows that are not the cache's"
        mask = model_inputs.get("attention_mask")
        if mask is not None:
            length = self._layers[0].length if self._cache is not None else _length(cache)
            if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (ids.shape[0], length + 1):
                return "an attention mask that is not 2-D over the cache and the new token"
        return None

    def _adopt(self, cache: Any) -> str | None:
        """At the call's first decode step: the cache's layers become static ones holding the prompt per row."""
        if not isinstance(cache, DynamicCache) or not cache.layers:
            return f"cache {type(cache).__name__}"
        plain = (DynamicLayer, SharedPrefixLayer)
        if any(type(layer) not in plain or not layer.is_initialized for layer in cache.layers):
            return "cache layers that are not filled dynamic ones"
        pairs = [_per_row(layer) for layer in cache.layers]
        keys = pairs[0][0]
        if keys.dim() != 4 or any(k.shape[:3] != keys.shape[:3] for k, _ in pairs):
            return "cache layers of different shapes"
        capacity = self.length_limit
        if capacity > MAX_CAPACITY or capacity <= keys.shape[-2]:
            return f"a length limit of {capacity} positions (static buffers up to {MAX_CAPACITY})"
        if keys.is_cuda:
            per_position = sum(k.element_size() * k[:, :, :1].numel() + v.element_size() * v[:, :, :1].numel()
                               for k, v in pairs)  # fmt: skip
            if per_position * capacity > torch.cuda.mem_get_info(keys.device)[0] / FULL_SHARE:
                return "buffers of the whole length limit would take over a quarter of the free memory"
        position = torch.zeros(1, dtype=torch.long, device=keys.device)
        stacked = all(k.shape == keys.shape and v.shape == keys.shape for k, v in pairs)
        if stacked:  # every layer's K and V in one tensor: a step's beam reorder is one gather, not two per layer
            self._stack = keys.new_zeros((2 * len(pairs), *keys.shape[:2], capacity, keys.shape[-1]))
        self._layers = [
            StaticLayer(k, v, capacity, position, layer, self._stack[2 * i : 2 * i + 2].unbind() if stacked else None)
            for i, ((k, v), layer) in enumerate(zip(pairs, cache.layers, strict=True))
        ]
        cache.layers = list(self._layers)
        rows, prompt = keys.shape[0], keys.shape[-2]
        if stacked and self.beams > 1 and rows % self.beams == 0:
            # an input's hypotheses hold one prompt (the same tokens; a shared prefill repeated, or upstream's
            # prefill of each copy): made bit-equal here, so the beam reorder, which stays within an input, moves
            # only the generated positions
            grouped = self._stack[:, :, :, :prompt].unflatten(1, (rows // self.beams, self.beams))
            grouped[:, :, 1:] = grouped[:, :, :1]
            self._prompt = prompt
        if stacked:  # the cache's own row operations act on the stack (removed when the layers are given back)
            cache.reorder_cache = self._reorder_stack
            cache.batch_select_indices = self._select_stack_rows
            cache.batch_select_inputs = lambda keep, beams: self._select_stack_rows(hypothesis_rows(keep, beams))
        self._cache = cache
        report.note_ran(FEATURE, "decode step: static shapes" + (", CUDA graphs" if self.capture else ""))
        return None

    def _static_inputs(self, rows: int, device: torch.device) -> dict[str, torch.Tensor]:
        static = self._inputs
        if static.get("ids") is None or static["ids"].shape[0] != rows:
            capacity = self._layers[0].capacity
            static.update(
                ids=torch.zeros((rows, 1), dtype=torch.long, device=device),
                positions=torch.zeros((rows, 1), dtype=torch.long, device=device),
                mask=torch.zeros((rows, capacity), dtype=torch.bool, device=device),
                position=self._layers[0].position,
            )
        return static

    def _forward(self, static: dict[str, torch.Tensor], cache: Any, cache_key: str) -> torch.Tensor:
        """The model's own forward on the static inputs (its class's: not an instance forward the loop installed)."""
        model = self.model
        mask = static["mask"][:, None, None, :]
        out = type(model).forward(
            model, input_ids=static["ids"], attention_mask=mask, position_ids=static["positions"],
            use_cache=True, return_dict=True, **{cache_key: cache},
        )  # fmt: skip
        return out.logits

    def _run(self, static: dict[str, torch.Tensor], cache: Any, cache_key: str) -> torch.Tensor:
        layers = self._layers
        buffers = tuple((layer.key_buffer.data_ptr(), layer.value_buffer.data_ptr()) for layer in layers)
        key = (static["ids"].shape[0], buffers)
        if not self.capture:
            return self._forward(static, cache, cache_key)
        captured = self._graphs.get(key)
        if captured is not None:
            captured.graph.replay()
            return captured.logits.clone()  # the next replay overwrites the static output
        started = time.perf_counter()
        self._graphs = {}  # another row count: the old graphs are done
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), capture_attention():  # the real step; lazy initialisations outside the capture
            logits = self._forward(static, cache, cache_key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with (
                torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"),
                capture_attention(),
            ):
                static_logits = self._forward(static, cache, cache_key)
        except Exception as error:  # anything the capture cannot take: the same static step, eager
            self.capture = False
            reason = f"not capturable ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
            report.note_ran(FEATURE, f"decode step: static shapes, eager on the GPU ({reason})")
            torch.cuda.synchronize()
            return logits
        self._graphs[key] = _Captured(graph, static_logits)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        return logits

    def _reorder_stack(self, beam_idx: torch.LongTensor) -> None:
        """The beam reorder of every layer at once, in place: the generated positions gathered into a scratch
        buffer reserved once (no allocation of a new size each step) and copied back."""
        stack, start, end = self._stack, self._prompt, self._layers[0].length
        if end <= start:
            return
        moving = stack[:, :, :, start:end]
        if self._scratch is None or self._scratch.shape[1] != stack.shape[1]:
            self._scratch = stack.new_empty((*stack.shape[:3], stack.shape[3] - start, stack.shape[4]))
        gathered = self._scratch.view(-1)[: moving.numel()].view(moving.shape)
        torch.index_select(moving, 1, beam_idx.to(stack.device), out=gathered)
        moving.copy_(gathered)

    def _select_stack_rows(self, indices: torch.Tensor) -> None:
        """Fewer rows (inputs left): a new stack of the kept rows, the layers' buffers its views (a new graph)."""
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self._stack = self._stack.index_select(1, indices.to(self._stack.device))
        for i, layer in enumerate(self._layers):
            layer.key_buffer, layer.value_buffer = self._stack[2 * i : 2 * i + 2].unbind()
            layer._publish()

    def _stop(self, problem: str) -> None:
        self.problem = problem
        report.note_ran(FEATURE, f"decode step: upstream's forward from here on ({problem})")
        self._give_back()

    def _give_back(self) -> None:
        cache = self._cache
        if cache is not None:
            cache.layers = [layer.given_back() for layer in self._layers]
            for name in ("reorder_cache", "batch_select_indices", "batch_select_inputs"):
                cache.__dict__.pop(name, None)
        self._cache, self._layers, self._stack, self._scratch = None, [], None, None


def call_problem(model: Any) -> str | None:
    """Why this call's decode steps keep the model's forward (None: the static step serves them): it serves a
    decoder-only model of :data:`FAMILIES` on a GPU (or on a CPU under :data:`STATIC_ON_CPU`), graphs not off."""
    device = getattr(model, "device", None)
    if device is None or not (device.type == "cuda" or STATIC_ON_CPU):
        return f"a decoder-only model on {device} (the static step serves them on a GPU)"
    if graphs_switched_off():
        return f"{GRAPHS_ENV}=0"
    return model_problem(model)


def decode_step(model: Any, length_limit: int | None, beams: int = 1) -> DecoderGraphStep | None:
    """The static decode step for this call (:func:`call_problem`), else None (noted in the report where the model
    is the reason: the device or the switch are not news)."""
    problem = "no length limit" if length_limit is None else call_problem(model)
    if problem is not None:
        if model_problem(model) is not None:
            report.note_ran(FEATURE, f"decode step: upstream's forward ({problem})")
        return None
    return DecoderGraphStep(model, length_limit, capture=model.device.type == "cuda", beams=beams)
