"""The lean decode step on static shapes, replayed as a CUDA graph.

Why: on a GPU ``generate`` is bound by the host. bart-large's step launches ~450 kernels per new token
and keeps the GPU busy ~12% of the time; a CUDA graph launches the step's decoder kernels with one call.

A graph replays fixed kernels on fixed addresses, so the step must not change shape as the cache grows:

- the self-attention K/V stay in :class:`~fastgen.models.growing_cache.GrowingLayer`'s time-major
  buffers, reserved once to the call's length limit (or, for a long or memory-hungry limit, doubled from
  64 positions as the cache grows) and pinned there (the beam reorder copies back in place instead of
  swapping to spare buffers); the step writes its position with ``index_copy_`` at a
  position held in a device tensor, and attends over the whole buffer with a mask ``slot <= position``
  (free slots are zeroed once, so a masked slot contributes exactly nothing);
- positions are embedded from that device tensor; the cross-attention K/V and the encoder mask are the
  call's own tensors, fixed while its rows are.

A graph is captured per row count and capacity (either change means new buffers) and replayed while its
buffers are current. The capture's warm run is that step's real computation, so capturing costs about one step.
Attention over the padded length reads the same numbers as upstream's over the filled prefix but may sum
them in another order: the logits can differ from upstream's in the last bits (the tests measure it).
Anything the capture cannot take (a host synchronisation in a user's module, say) runs the lean step
eagerly for the rest of the call, noted once in the report.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fastgen import _env
from fastgen.models.growing_cache import GrowingLayer
from fastgen.optimizer import report

GRAPHS_ENV = "FASTGEN_CUDA_GRAPHS"

#: graphs one call keeps per row count and capacity (the buffers are pinned: a second means something else moved)
ROW_GRAPHS = 1
#: the whole length limit is reserved at once up to this many positions, if it takes at most 1/FULL_SHARE of the
#: free device memory; beyond, the buffers double from MIN_CAPACITY positions (a huge max_length stays cheap)
FULL_LIMIT = 1024
FULL_SHARE = 4
MIN_CAPACITY = 64


def capture_attention() -> Any:
    """The SDPA backends a captured step runs: torch's, without cuDNN's. cuDNN builds an execution plan for each
    new shape, and a call's static shapes are new ones: on an H200 (bart-large, 32 x 1024 -> 140, fp16) the graph
    variant's first call took 1.91x its warm one with cuDNN, 1.02x without, for 5% more warm time."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def graphs_switched_off() -> bool:
    """``FASTGEN_CUDA_GRAPHS=0`` (or false/off/no): the lean step runs eagerly on a GPU too."""
    return _env.switched_off(GRAPHS_ENV)


class _Captured:
    """One captured step: its static inputs and output."""

    def __init__(self, graph: Any, ids: torch.Tensor, position: torch.Tensor, logits: torch.Tensor) -> None:
        self.graph, self.ids, self.position, self.logits = graph, ids, position, logits


class StaticStep:
    """The static-shape decode step of one ``generate`` call (see the module docstring).

    ``capture=False`` runs the same static step eagerly (how the CPU tests check its arithmetic).
    """

    def __init__(self, lean: Any, length_limit: int, capture: bool = True) -> None:
        self.lean = lean
        self.length_limit = length_limit
        self.capture = capture
        self.problem: str | None = None  # set once the step gives up for this call
        self._graphs: dict[tuple, _Captured | None] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._stream = torch.cuda.Stream() if capture else None  # warm-up and capture on one side stream
        self.captures = 0
        self.capture_seconds = 0.0
        self._full: bool | None = None  # reserve the whole length limit (decided at the first step)

    def takes(self, ids: torch.Tensor, self_layers: list[Any]) -> bool:
        """Whether this step can run these inputs (a graph needs the step's tensors on one CUDA device)."""
        if self.problem is not None or torch.compiler.is_compiling():
            return False
        if self.capture and (not ids.is_cuda or torch.cuda.is_current_stream_capturing()):
            return False
        if not self_layers or any(type(layer) is not GrowingLayer for layer in self_layers):
            return False
        return self_layers[0].length + 1 <= self.length_limit

    def step(self, ids: torch.Tensor, self_layers: list[Any], crosses: list[Any], mask: Any, attend: Any) -> Any:
        """This step's logits ``(rows, 1, vocab)`` (None: this call's step runs eagerly from here on)."""
        capacity = self._capacity(self_layers)
        for layer in self_layers:
            layer.reserve(capacity - layer.length)  # a no-op while the buffers hold `capacity` positions
            if not layer.pinned:
                layer.pin()  # the beam reorder copies back in place: the buffers stay put
        position = self_layers[0].length
        if not self.capture:
            key = self._key(ids, self_layers, crosses, mask)
            if key not in self._graphs:  # new buffers: zero their free slots, as a capture does
                for layer in self_layers:
                    layer.clear_free()
                self._graphs = {key: None}
            logits = self._body(ids, ids.new_full((1,), position), self_layers, crosses, mask, attend)
        else:
            key = self._key(ids, self_layers, crosses, mask)
            captured = self._graphs.get(key)
            if captured is None:
                logits = self._capture(key, ids, position, self_layers, crosses, mask, attend)
                if logits is None:
                    return None
            else:
                captured.ids.copy_(ids)
                captured.position.fill_(position)
                captured.graph.replay()
                logits = captured.logits.clone()  # the next replay overwrites the static output
        for layer in self_layers:
            layer.advance(1)
        return logits

    def _capacity(self, self_layers: list[Any]) -> int:
        """Positions to hold in the buffers: the call's whole length limit where that is short and small beside
        the free memory (one capture per row count), else the next power of two of the length (the step then
        attends over at most twice what it needs, and captures again each time the buffers double)."""
        if self._full is None:
            layer = self_layers[0]
            keys = layer.key_buffer
            full = 2 * len(self_layers) * self.length_limit * keys[0].numel() * keys.element_size()
            free = torch.cuda.mem_get_info(keys.device)[0] if keys.is_cuda else full * FULL_SHARE
            self._full = self.length_limit <= FULL_LIMIT and full <= free / FULL_SHARE
        if self._full:
            return self.length_limit
        needed = self_layers[0].length + 1
        return min(self.length_limit, max(MIN_CAPACITY, 1 << (needed - 1).bit_length()))

    @staticmethod
    def _key(ids: torch.Tensor, self_layers: list[Any], crosses: list[Any], mask: Any) -> tuple:
        buffers = tuple((layer.key_buffer.data_ptr(), layer.value_buffer.data_ptr()) for layer in self_layers)
        cross = tuple((c.keys.data_ptr(), c.values.data_ptr(), tuple(c.keys.shape)) for c in crosses)
        return ids.shape, self_layers[0].key_buffer.shape, buffers, cross, id(mask)

    def _capture(
        self, key: tuple, ids: torch.Tensor, position: int, self_layers: list[Any], crosses: list[Any], mask: Any,
        attend: Any,
    ) -> torch.Tensor | None:  # fmt: skip
        """Run this step eagerly on static inputs (its real result), then capture it for the next ones."""
        started = time.perf_counter()
        # fewer rows or grown buffers: the old graphs are done
        self._graphs = {k: g for k, g in self._graphs.items() if k[:2] == key[:2]}
        moving = len(self._graphs) >= ROW_GRAPHS
        for layer in self_layers:
            layer.clear_free()
        static_ids, static_position = ids.clone(), ids.new_full((1,), position)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), capture_attention():  # lazy initialisations happen outside the capture
            logits = self._body(static_ids, static_position, self_layers, crosses, mask, attend)
        torch.cuda.current_stream().wait_stream(side)
        if moving:  # a cache that reallocates its tensors every step (no dedup, say): a graph per step would lose
            self.problem = "the cache's tensors move between steps"
            report.note_ran("lean_step", f"decode step: eager on the GPU ({self.problem})")
            return logits
        graph = torch.cuda.CUDAGraph()
        try:
            with (
                torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"),
                capture_attention(),
            ):
                static_logits = self._body(static_ids, static_position, self_layers, crosses, mask, attend)
        except Exception as error:  # anything the capture cannot take: eager from here on
            self.problem = f"not capturable ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
            report.note_ran("lean_step", f"decode step: eager on the GPU ({self.problem})")
            torch.cuda.synchronize()
            return logits
        self._graphs[key] = _Captured(graph, static_ids, static_position, static_logits)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        return logits

    def _body(
        self, ids: torch.Tensor, position: torch.Tensor, self_layers: list[Any], crosses: list[Any], mask: Any,
        attend: Any,
    ) -> torch.Tensor:  # fmt: skip
        """The lean step's operations with the position a tensor: every shape fixed by the buffers."""
        lean = self.lean
        decoder, family = lean.decoder, lean.family
        embeds = decoder.embed_tokens(ids)
        if family.scale_outside_embedding:
            embeds = embeds * decoder.embed_scale
        if family.positions == "learned":
            positions = decoder.embed_positions(ids, 0, position_ids=position).to(embeds.device)
        else:
            positions = decoder.embed_positions(tuple(embeds.shape[:-1]), 0, position_ids=position)
        hidden = embeds + positions
        if family.layernorm_embedding:
            hidden = decoder.layernorm_embedding(hidden)
        capacity = self_layers[0].key_buffer.shape[0]
        visible = (torch.arange(capacity, device=ids.device) <= position).view(1, 1, 1, capacity)
        input_shape = hidden.shape[:-1]
        pre = family.pre_norm
        for layer, own, cross in zip(decoder.layers, self_layers, crosses, strict=True):
            attention = layer.self_attn

            def self_attention(x: torch.Tensor, module: Any, _: Any, own: Any = own) -> torch.Tensor:
                shape = (*input_shape, -1, module.head_dim)
                query = module.q_proj(x).view(shape).transpose(1, 2)
                own.key_buffer.index_copy_(0, position, module.k_proj(x).view(shape).transpose(0, 1))
                own.value_buffer.index_copy_(0, position, module.v_proj(x).view(shape).transpose(0, 1))
                keys, values = own.key_buffer.permute(1, 2, 0, 3), own.value_buffer.permute(1, 2, 0, 3)
                out, _ = attend(module, query, keys, values, visible, dropout=0.0, scaling=module.scaling)
                return module.out_proj(out.reshape(*input_shape, -1).contiguous())

            def cross_attention(x: torch.Tensor, module: Any, _: Any, cross: Any = cross) -> torch.Tensor:
                query = module.q_proj(x).view((*input_shape, -1, module.head_dim)).transpose(1, 2)
                out, _ = attend(module, query, cross.keys, cross.values, mask, dropout=0.0, scaling=module.scaling)
                return module.out_proj(out.reshape(*input_shape, -1).contiguous())

            hidden = _residual(hidden, layer.self_attn_layer_norm, pre, self_attention, attention)
            hidden = _residual(hidden, layer.encoder_attn_layer_norm, pre, cross_attention, layer.encoder_attn)
            hidden = _residual(hidden, layer.final_layer_norm, pre, _feed_forward, layer)
        if pre:
            hidden = decoder.layer_norm(hidden)
        model = lean.model
        return model.lm_head(hidden) + model.final_logits_bias.to(hidden.device)


def _feed_forward(x: torch.Tensor, layer: Any, _: Any) -> torch.Tensor:
    return layer.fc2(layer.activation_fn(layer.fc1(x)))


def _residual(hidden: torch.Tensor, norm: Any, pre: bool, run: Any, module: Any) -> torch.Tensor:
    """As the lean step's sublayer: normalise the input (pre-norm) or the sum (post-norm)."""
    out = run(norm(hidden) if pre else hidden, module, None)
    hidden = hidden + out
    return hidden if pre else norm(hidden)
