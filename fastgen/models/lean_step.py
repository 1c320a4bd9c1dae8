"""One decode step of a BART-family decoder, without the module tree around it.

Why: on a small model the products are a minor part of a step; the rest is Python. Upstream's step for
one new token enters ~15 wrapped module calls per layer, rebuilds both attention masks, asks the cache
its length twice and assembles three output dataclasses (a 7.9M-parameter BART, 64 rows: ~2.4 ms of a
~13 ms step on one core). This step runs the same operations in the same order on the same tensors:
every linear, embedding, layer norm and activation is still called as its module (so fastgen's linear
modes and anything a user installed on a linear apply), attention goes through the function
``ALL_ATTENTION_FUNCTIONS`` hands upstream (fastgen's beam-shared K/V included), and the self-attention
cache grows through its own ``update``. Only the glue is gone: the layer, attention, decoder and model
``forward`` wrappers, the masks (computed once per call, where upstream recomputes equal ones each step),
dropout at ``p`` in eval mode (the identity) and the output objects. The logits are upstream's bit for
bit (``tests/models/test_lean_step.py`` compares them step by step and ``generate`` end to end).

Admitted by exact class (:data:`FAMILIES`): a subclass may compute its step differently. Anything
outside what this step reproduces (hooks on a skipped module, training mode, an attention implementation
other than SDPA, a decoder attention mask, a cache that is not the dynamic one, model inputs it does not
know) keeps upstream's forward for the whole call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fastgen.models.compiled_step import CompiledStep
from fastgen.models.graph_step import StaticStep, graphs_switched_off
from fastgen.models.growing_cache import GrowingLayer, grow_in_place, plain_layers
from fastgen.models.hooks import hooked
from fastgen.optimizer import report


@dataclasses.dataclass(frozen=True)
class Family:
    """What one family's step looks like around its layers (checked against Transformers 5.23/5.24)."""

    model: str  # the model class with the LM head, ``module.QualName``
    decoder: str
    layer: str
    attention: str
    positions: str  # "learned" (BART's, called with the ids) or "sinusoidal" (Marian's, called with the shape)
    scale_outside_embedding: bool  # Marian multiplies by ``embed_scale`` in the decoder, BART inside the embedding
    layernorm_embedding: bool
    pre_norm: bool  # mBART, Pegasus: each sublayer normalises its input, the decoder its output


def _family(package: str, prefix: str, model: str, positions: str, *flags: bool) -> Family:
    base = f"transformers.models.{package}.modeling_{package}."
    names = (base + model, base + f"{prefix}Decoder", base + f"{prefix}DecoderLayer", base + f"{prefix}Attention")
    return Family(*names, positions, *flags)


#: model class -> its family (flags: embedding scale outside the embedding, layernorm_embedding, pre-norm)
FAMILIES: dict[str, Family] = {
    f.model: f
    for f in (
        _family("bart", "Bart", "BartForConditionalGeneration", "learned", False, True, False),
        _family("marian", "Marian", "MarianMTModel", "sinusoidal", True, False, False),
        _family("mbart", "MBart", "MBartForConditionalGeneration", "learned", False, True, True),
        _family("pegasus", "Pegasus", "PegasusForConditionalGeneration", "sinusoidal", True, False, True),
    )
}

#: builds of the compiled step's program one call tries while a linear's op is not settled (then: the Python step)
MAX_PROGRAM_TRIES = 64

#: run the static step (uncaptured) on CPU tensors too: how the CPU tests check the CUDA-graph step's arithmetic
STATIC_ON_CPU = False

#: model inputs the step knows (anything else: upstream's forward)
KNOWN_INPUTS = frozenset(
    {"decoder_input_ids", "cache", "past_key_values", "attention_mask", "encoder_outputs", "use_cache"}
)


def _name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


#: the Transformers releases whose decoder step this one reproduces (compared bit for bit in the tests);
#: 5.23 and earlier build their masks and caches with other arguments
TESTED_TRANSFORMERS = (Version("5.24.0"), Version("5.26.0"))


def model_problem(model: Any) -> str | None:
    """Why ``model``'s decode step must stay upstream's (None: the lean step reproduces it)."""
    installed = Version(transformers.__version__)
    if not TESTED_TRANSFORMERS[0] <= installed < TESTED_TRANSFORMERS[1]:
        return f"Transformers {transformers.__version__} (the lean step reproduces the decode step of 5.24 and 5.25)"
    family = FAMILIES.get(_name(model))
    if family is None:
        return "not a model class the lean step reproduces"
    if model.training:
        return "training mode"
    decoder = model.get_decoder()
    if _name(decoder) != family.decoder:
        return f"decoder class {_name(decoder)}"
    if getattr(decoder.config, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {decoder.config._attn_implementation!r} (the lean step runs sdpa)"
    if getattr(model, "_compiled_call", None) is not None or getattr(model, "_compiled_call_impl", None) is not None:
        return "a compiled forward"
    skipped = [model, model.model, decoder]
    for layer in decoder.layers:
        if _name(layer) != family.layer:
            return f"decoder layer class {_name(layer)}"
        for attention in (layer.self_attn, layer.encoder_attn):
            if _name(attention) != family.attention:
                return f"attention class {_name(attention)}"
            skipped.append(attention)
        skipped.append(layer)
    if any(hooked(m) for m in skipped):
        return "hooks on a module whose forward the lean step skips"
    return None


def _sublayer(hidden: torch.Tensor, norm: Any, pre: bool, run: Any, module: Any, step: tuple) -> torch.Tensor:
    """``residual + run(x)`` around one sublayer, normalised where upstream's layer does it: the input
    (pre-norm: mBART, Pegasus) or the sum (post-norm: BART, Marian). Same ops, same order, same bits."""
    out = run(norm(hidden) if pre else hidden, module, step)
    hidden = hidden + out
    return hidden if pre else norm(hidden)


def _project_cross(
    cache: EncoderDecoderCache, attention: Any, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's cross-attention K/V of the encoder states, stored in the cache as ``BartAttention`` stores them."""
    kv_shape = (*states.shape[:-1], -1, attention.head_dim)
    key = attention.k_proj(states).view(kv_shape).transpose(1, 2)
    value = attention.v_proj(states).view(kv_shape).transpose(1, 2)
    key, value = cache.cross_attention_cache.update(key, value, attention.layer_idx, kwargs={})
    cache.is_updated[attention.layer_idx] = True
    return key, value


def one_token_problem(model_inputs: dict[str, Any], known: frozenset[str], ids_name: str) -> str | None:
    """Why these model inputs are not a one-token decode step over a cache with inputs among ``known`` (None: they
    are); ``ids_name``: the token ids' key."""
    unknown = set(model_inputs) - known
    if unknown:
        return f"model inputs {sorted(unknown)}"
    ids = model_inputs.get(ids_name)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
        return "not a one-token decode step"
    if not model_inputs.get("use_cache"):
        return "no cache"
    return None


def _shared_first_rows(ids: torch.Tensor, inputs: int) -> int:
    """How many consecutive rows of a first step share one input and one token (beam search's hypotheses before
    they differ): the rows per input where they all do, else 1."""
    rows = ids.shape[0]
    if inputs <= 0 or rows % inputs or rows == inputs:
        return 1
    grouped = ids.reshape(inputs, rows // inputs)
    return rows // inputs if bool((grouped == grouped[:, :1]).all()) else 1


def _feed_forward(hidden: torch.Tensor, layer: Any, step: tuple) -> torch.Tensor:
    return layer.fc2(layer.activation_fn(layer.fc1(hidden)))


class LeanDecodeStep:
    """The decode step of one ``generate`` call (masks are computed at its first step and kept).

    ``step(model_inputs)`` returns ``(logits, cache)`` with ``logits`` of shape ``(rows, 1, vocab)``, equal to
    ``model(**model_inputs).logits`` and leaving the cache as that call would.
    """

    def __init__(self, model: Any, length_limit: int | None = None) -> None:
        self.model = model
        self.length_limit = length_limit  # the call's longest decoder sequence (the CUDA-graph step's capacity)
        self.family = FAMILIES[_name(model)]
        self.decoder = model.get_decoder()
        self._encoder_mask_for: tuple[Any, int] | None = None
        self._encoder_mask: Any = None
        self._self_mask_checked = False
        self._grown: list[Any] = []  # self-attention caches whose layers grow in place
        self._compiled: CompiledStep | None = None  # the call's C++ program, once every linear has chosen its op
        self._compiled_noted = False
        self._compiled_tries = 0
        self._static: StaticStep | None = None  # the CUDA-graph step (GPU), made at the first step it can serve
        self.ran_compiled = False  # whether the last step() ran in the C++ program (a later one of the call)

    def finish(self) -> None:
        """Give the caches this step grew upstream's plain layers back (the call is over)."""
        static = self._static
        if static is not None and static.captures:
            note = f"decode step: CUDA graphs ({static.captures} captured in {static.capture_seconds * 1000:.0f} ms)"
            report.note_ran("lean_step", note)
        self._static = None  # its graphs and their memory pool go now, not at the next garbage collection
        for cache in self._grown:
            plain_layers(cache)
        self._grown.clear()

    @staticmethod
    def _one_token_problem(model_inputs: dict[str, Any]) -> str | None:
        """What every step the lean step runs needs: known inputs, one new token, a cache, encoder states."""
        problem = one_token_problem(model_inputs, KNOWN_INPUTS, "decoder_input_ids")
        if problem is not None:
            return problem
        if getattr(model_inputs.get("encoder_outputs"), "last_hidden_state", None) is None:
            return "no encoder states"
        return None

    @classmethod
    def inputs_problem(cls, model_inputs: dict[str, Any]) -> str | None:
        """Why these model inputs need upstream's forward (None: the step can run them)."""
        problem = cls._one_token_problem(model_inputs)
        if problem is not None:
            return problem
        cache = model_inputs.get("cache", model_inputs.get("past_key_values"))
        if not isinstance(cache, EncoderDecoderCache):
            return "not an encoder-decoder cache"
        if not cache.self_attention_cache.layers or any(
            type(layer) not in (DynamicLayer, GrowingLayer) or not layer.is_initialized
            for layer in cache.self_attention_cache.layers
        ):
            return "a self-attention cache that is not a filled dynamic one"
        crosses = cache.cross_attention_cache.layers
        if not crosses or any(not cache.is_updated.get(i) for i in range(len(crosses))):
            return "cross-attention K/V not cached yet"
        return None

    @classmethod
    def first_step_problem(cls, model_inputs: dict[str, Any]) -> str | None:
        """Why these inputs are not a call's first decode step the lean step can run (None: they are): one token,
        a cache, nothing cached yet in either attention, encoder states (upstream's first forward then computes
        the cross-attention K/V and fills both caches; so does :meth:`_first_step`, with the same calls)."""
        problem = cls._one_token_problem(model_inputs)
        if problem is not None:
            return problem
        cache = model_inputs.get("cache", model_inputs.get("past_key_values"))
        if not isinstance(cache, EncoderDecoderCache) or type(cache.self_attention_cache) is not DynamicCache:
            return "not an encoder-decoder cache over a dynamic one"
        layers = [*cache.self_attention_cache.layers, *cache.cross_attention_cache.layers]
        if any(type(layer) is not DynamicLayer or layer.is_initialized for layer in layers):
            return "a cache that holds K/V already (or layers of another kind)"
        if any(cache.is_updated.values()):
            return "cross-attention K/V marked as cached"
        return None

    def _first_step(self, model_inputs: dict[str, Any]) -> tuple[torch.Tensor, EncoderDecoderCache] | None:
        """The call's first decode step as upstream's forward computes it: both caches start empty, each layer's
        cross-attention projects the encoder states and stores them (``is_updated``), as ``BartAttention`` does."""
        ids = model_inputs["decoder_input_ids"]
        cache: EncoderDecoderCache = model_inputs.get("cache", model_inputs.get("past_key_values"))
        embeds, hidden = self._embed(ids, 0)
        if self._masks(embeds, cache, model_inputs) is not None:
            return None
        decoder = self.decoder
        if self.family.layernorm_embedding:
            hidden = decoder.layernorm_embedding(hidden)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(decoder.config._attn_implementation, None)
        states = model_inputs["encoder_outputs"].last_hidden_state
        compiled = self._compiled_first_step(ids, cache, states, attend)
        if compiled is not None:
            return compiled, cache
        step = (cache.self_attention_cache, cache, attend, hidden.shape[:-1], states)
        pre = self.family.pre_norm
        for layer in decoder.layers:
            hidden = _sublayer(hidden, layer.self_attn_layer_norm, pre, self._self_attention, layer.self_attn, step)
            cross = layer.encoder_attn
            hidden = _sublayer(hidden, layer.encoder_attn_layer_norm, pre, self._first_cross_attention, cross, step)
            hidden = _sublayer(hidden, layer.final_layer_norm, pre, _feed_forward, layer, step)
        if pre:
            hidden = decoder.layer_norm(hidden)
        model = self.model
        return model.lm_head(hidden) + model.final_logits_bias.to(hidden.device), cache

    def _first_cross_attention(self, hidden: torch.Tensor, attention: Any, step: tuple) -> torch.Tensor:
        _, cache, attend, input_shape, states = step
        query = attention.q_proj(hidden).view((*input_shape, -1, attention.head_dim)).transpose(1, 2)
        if cache.is_updated.get(attention.layer_idx):  # projected already (_compiled_first_step, then no program)
            cross = cache.cross_attention_cache.layers[attention.layer_idx]
            key, value = cross.keys, cross.values
        else:
            key, value = _project_cross(cache, attention, states)
        out, _ = attend(attention, query, key, value, self._encoder_mask, dropout=0.0, scaling=attention.scaling)
        return attention.out_proj(out.reshape(*input_shape, -1).contiguous())

    def _grow(self, self_cache: DynamicCache) -> None:
        """The call's self-attention cache writes its K/V in place from here on (growing_cache), once."""
        if not any(self_cache is grown for grown in self._grown):
            grow_in_place(self_cache)
            self._grown.append(self_cache)

    def _compiled_first_step(
        self, ids: torch.Tensor, cache: EncoderDecoderCache, states: torch.Tensor, attend: Any
    ) -> torch.Tensor | None:
        """The first step's logits from the C++ program where one serves already (a later call of the model: every
        linear has chosen its op), else None. The cross-attention K/V are projected here, with the calls the Python
        step makes, and the self-attention cache starts empty in place; a step the program then does not take runs
        in Python on those caches (same bits either way: the program reproduces the Python step)."""
        if ids.is_cuda or STATIC_ON_CPU or torch.is_grad_enabled():
            return None
        compiled = self._compiled_step(attend, ids.shape[0])
        if compiled is None:
            return None
        for layer in self.decoder.layers:
            _project_cross(cache, layer.encoder_attn, states)
        crosses = cache.cross_attention_cache.layers
        group = 1
        if compiled.rows is None and compiled.takes(ids.shape[0], crosses[0].keys, self._encoder_mask):
            group = _shared_first_rows(ids, crosses[0].keys.shape[0])  # the program would take every row: one each
        attention = self.decoder.layers[0].self_attn
        empty = states.new_empty((ids.shape[0] // group, attention.num_heads, 0, attention.head_dim))
        self_cache = cache.self_attention_cache
        for index in range(len(self.decoder.layers)):
            self_cache.update(empty, empty, index)
        self._grow(self_cache)
        if not compiled.takes(ids.shape[0] // group, crosses[0].keys, self._encoder_mask, self_cache.layers):
            if group > 1:  # the step of every row after all: the cache starts empty at their width
                for layer in self_cache.layers:
                    layer.batch_repeat_interleave(group)
            return None
        if group == 1:
            return compiled.step(ids, self_cache.layers, crosses, self._encoder_mask)
        # one row per input, as CTranslate2's first beam step: each row's ops depend on that row alone (int8's
        # per-row codes and exact integer sums, row-wise norms, one attention query row per input), so the copies
        # are the bits every hypothesis would compute (tests/models/test_compiled_step.py compares them)
        logits = compiled.step(ids[::group], self_cache.layers, crosses, self._encoder_mask)
        for layer in self_cache.layers:
            layer.batch_repeat_interleave(group)
        return logits.repeat_interleave(group, dim=0)

    def _embed(self, ids: torch.Tensor, cache_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the token embeddings, embeddings + positions), as the family's decoder computes them."""
        decoder, family = self.decoder, self.family
        embeds = decoder.embed_tokens(ids)
        if family.scale_outside_embedding:
            embeds = embeds * decoder.embed_scale
        position_ids = torch.arange(1, device=embeds.device) + cache_length
        if family.positions == "learned":
            positions = decoder.embed_positions(ids, cache_length, position_ids=position_ids).to(embeds.device)
        else:
            positions = decoder.embed_positions(tuple(embeds.shape[:-1]), cache_length, position_ids=position_ids)
        return embeds, embeds + positions

    def keep_inputs(self, keep: torch.Tensor, inputs: int, attention_mask: Any, rows: int) -> None:
        """Inputs left the batch (``keep``: the others of the ``inputs``, ascending; ``attention_mask``: theirs;
        ``rows``: the rows now). The encoder mask's kept rows are what ``create_bidirectional_mask`` makes of the kept
        inputs' attention mask (it builds each input's row from that input's mask alone), where padding remains;
        without padding it gives None, which the next step asks it for."""
        mask, seen = self._encoder_mask, self._encoder_mask_for
        if seen is None or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
            return
        if not isinstance(attention_mask, torch.Tensor) or mask.shape[0] != inputs:  # one mask row per input
            return
        kept = mask.index_select(0, keep.to(mask.device))
        if bool(kept.all()):
            return
        self._encoder_mask, self._encoder_mask_for = kept, (attention_mask, rows)

    def _masks_stale(self, rows: int, encoder_mask: Any) -> bool:
        """Whether :meth:`_masks` has work: the call's first step, a new encoder mask or fewer rows."""
        seen = self._encoder_mask_for
        return not self._self_mask_checked or seen is None or seen[0] is not encoder_mask or seen[1] != rows

    def _masks(self, embeds: torch.Tensor, cache: EncoderDecoderCache, model_inputs: dict[str, Any]) -> str | None:
        config = self.decoder.config
        if not self._self_mask_checked:
            rows = embeds.shape[0]
            ones = torch.ones(rows, cache.get_seq_length() + 1, device=embeds.device)
            mask = create_causal_mask(
                config=config, inputs_embeds=embeds, attention_mask=ones, cache=cache.self_attention_cache
            )
            if mask is not None:  # upstream's SDPA path skips it for one query and no padding; otherwise theirs
                return "a self-attention mask"
            self._self_mask_checked = True
        encoder_mask = model_inputs.get("attention_mask")
        if self._masks_stale(embeds.shape[0], encoder_mask):
            self._encoder_mask = create_bidirectional_mask(
                config=config,
                inputs_embeds=embeds,
                attention_mask=encoder_mask,
                encoder_hidden_states=model_inputs["encoder_outputs"].last_hidden_state,
            )
            self._encoder_mask_for = (encoder_mask, embeds.shape[0])
        return None

    @staticmethod
    def _self_attention(hidden: torch.Tensor, attention: Any, step: tuple) -> torch.Tensor:
        self_cache, _, attend, input_shape = step[:4]
        shape = (*input_shape, -1, attention.head_dim)
        query = attention.q_proj(hidden).view(shape).transpose(1, 2)
        key = attention.k_proj(hidden).view(shape).transpose(1, 2)
        value = attention.v_proj(hidden).view(shape).transpose(1, 2)
        key, value = self_cache.update(key, value, attention.layer_idx, kwargs={})
        out, _ = attend(attention, query, key, value, None, dropout=0.0, scaling=attention.scaling)
        return attention.out_proj(out.reshape(*input_shape, -1).contiguous())

    def _cross_attention(self, hidden: torch.Tensor, attention: Any, step: tuple) -> torch.Tensor:
        _, cross_cache, attend, input_shape = step
        query = attention.q_proj(hidden).view((*input_shape, -1, attention.head_dim)).transpose(1, 2)
        cross = cross_cache.layers[attention.layer_idx]
        mask, scaling = self._encoder_mask, attention.scaling
        out, _ = attend(attention, query, cross.keys, cross.values, mask, dropout=0.0, scaling=scaling)
        return attention.out_proj(out.reshape(*input_shape, -1).contiguous())

    def _compiled_step(self, attend: Any, rows: int) -> CompiledStep | None:
        """The C++ program of this call when it can serve (built at the first step where every linear has
        settled its op, again when the exact mode's row count changes; why it cannot is noted once)."""
        compiled = self._compiled
        retry = compiled is not None and compiled.retry and self._compiled_tries < MAX_PROGRAM_TRIES
        moved = compiled is not None and compiled.rows is not None and compiled.rows != rows
        if moved and compiled.program is not None and compiled.retarget(rows):
            moved = False
        if compiled is None or retry or moved:
            compiled = self._compiled = CompiledStep(self, attend, rows)
            self._compiled_tries += 1
            if not compiled.retry and not self._compiled_noted:
                what = "compiled (C++)" if compiled.program is not None else f"Python ({compiled.problem})"
                report.note_ran("lean_step", f"decode step: {what}")
                self._compiled_noted = True
        return compiled if compiled.program is not None else None

    def keeps_rows(self, finished: int, rows: int) -> bool:
        """Whether the beam loop should keep ``finished`` of its ``rows`` inputs in the batch: with CUDA graphs
        each new row count costs a capture, so inputs leave only once half the batch is done."""
        static = self._static
        return static is not None and static.capture and static.problem is None and 2 * finished < rows

    def _static_step(self, ids: torch.Tensor) -> StaticStep | None:
        """The CUDA-graph step of this call on a GPU (None: on a CPU, without a length limit, or switched off)."""
        if self._static is None and self.length_limit is not None and (ids.is_cuda or STATIC_ON_CPU):
            if graphs_switched_off():
                return None
            self._static = StaticStep(self, self.length_limit, capture=ids.is_cuda)
            report.note_ran("lean_step", "decode step: static shapes" + (", CUDA graphs" if ids.is_cuda else ""))
        return self._static

    def _ready(self, model_inputs: dict[str, Any]) -> tuple[torch.Tensor, EncoderDecoderCache, Any] | None:
        """What a later step needs before it computes: the masks for its rows, the self-attention cache growing in
        place, the attention function. Returns (ids, cache, attention) (None: upstream's forward, for the masks)."""
        ids = model_inputs["decoder_input_ids"]
        cache: EncoderDecoderCache = model_inputs.get("cache", model_inputs.get("past_key_values"))
        if self._masks_stale(ids.shape[0], model_inputs.get("attention_mask")):
            # the masks read only the embeddings' shape, dtype and device (upstream's prepare_inputs passes such
            # a stand-in too): no embedding lookup each time inputs leave the batch
            weight = self.decoder.embed_tokens.weight
            embeds = torch.empty((ids.shape[0], ids.shape[1], 0), dtype=weight.dtype, device=weight.device)
            if self._masks(embeds, cache, model_inputs) is not None:
                return None
        self._grow(cache.self_attention_cache)
        return ids, cache, ALL_ATTENTION_FUNCTIONS.get_interface(self.decoder.config._attn_implementation, None)

    def _program_taking(self, ids: torch.Tensor, cache: EncoderDecoderCache, attend: Any) -> CompiledStep | None:
        """The C++ program where it takes this step (None: the Python step runs it)."""
        compiled = self._compiled_step(attend, ids.shape[0])
        layers = cache.self_attention_cache.layers
        if compiled is None or any(type(layer) is not GrowingLayer for layer in layers):
            return None
        crosses = cache.cross_attention_cache.layers
        return compiled if compiled.takes(ids.shape[0], crosses[0].keys, self._encoder_mask, layers) else None

    def compiled_ready(self, model_inputs: dict[str, Any]) -> bool:
        """Whether :meth:`step` would run these inputs in the C++ program, with the masks and the program made ready
        as it makes them: for a caller that then calls the program's step itself (the compiled beam step)."""
        if self.inputs_problem(model_inputs) is not None:
            return False
        ready = self._ready(model_inputs)
        if ready is None or self._static_step(ready[0]) is not None:
            return False
        return self._program_taking(*ready) is not None

    def step(self, model_inputs: dict[str, Any]) -> tuple[torch.Tensor, EncoderDecoderCache] | None:
        """The logits of this step (None: run upstream's forward instead, the inputs being outside the step)."""
        self.ran_compiled = False
        if self.inputs_problem(model_inputs) is not None:
            if self.first_step_problem(model_inputs) is None:
                return self._first_step(model_inputs)
            return None
        ready = self._ready(model_inputs)
        if ready is None:
            return None
        ids, cache, attend = ready
        cache_length = cache.get_seq_length()
        self_cache, cross_cache = cache.self_attention_cache, cache.cross_attention_cache
        static = self._static_step(ids)
        if static is not None and static.takes(ids, self_cache.layers):
            logits = static.step(ids, self_cache.layers, cross_cache.layers, self._encoder_mask, attend)
            if logits is not None:
                return logits, cache
        compiled = self._program_taking(ids, cache, attend)
        if compiled is not None:
            self.ran_compiled = True
            return compiled.step(ids, self_cache.layers, cross_cache.layers, self._encoder_mask), cache
        decoder = self.decoder
        _, hidden = self._embed(ids, cache_length)
        if self.family.layernorm_embedding:
            hidden = decoder.layernorm_embedding(hidden)
        input_shape = hidden.shape[:-1]
        pre = self.family.pre_norm
        step = (self_cache, cross_cache, attend, input_shape)
        for layer in decoder.layers:
            cross = layer.encoder_attn
            hidden = _sublayer(hidden, layer.self_attn_layer_norm, pre, self._self_attention, layer.self_attn, step)
            hidden = _sublayer(hidden, layer.encoder_attn_layer_norm, pre, self._cross_attention, cross, step)
            hidden = _sublayer(hidden, layer.final_layer_norm, pre, _feed_forward, layer, step)
        if pre:
            hidden = decoder.layer_norm(hidden)
        model = self.model
        logits = model.lm_head(hidden) + model.final_logits_bias.to(hidden.device)  # some without .to(): same bits
        return logits, cache
