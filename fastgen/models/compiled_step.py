"""The lean decode step run from C++ (``fastgen_cpu.DecoderStep``, ``csrc/cpu/decoder_step.cpp``).

Why: on a small model the step's Python costs as much as its kernels. The lean step
(:mod:`fastgen.models.lean_step`) removed the module tree's glue but still calls ~30 ops per layer from
Python, each linear through its mode's dispatch. Here the decoder's tensors and each linear's op go into a
C++ program once per ``generate`` call, and every later step is one call: the same kernels in the same
order, so the logits are the Python step's bits (and so, in the exact mode, upstream's).

It serves where every op of the step is one it reproduces:

* the exact mode: each linear in the form its calibration settled on for the step's row count (``F.linear``
  or fastgen's ordered kernel with its order; a key still being calibrated or on trial keeps the Python step
  until it settles, and a new row count builds the program again), SDPA for attention;
* the ``int8`` mode: each decoder linear and the LM head on the op its first product kept (fastgen's own
  AMX or VNNI op, or oneDNN's product between fastgen's quantization and scaling passes), the activation
  fused into the scaling, fastgen's CPU attention where the Python step's attention takes it;
* the ``fast_gemm`` mode: each linear in the form its timing kept for the row count (oneDNN with the packed
  weight, MKL's packed sgemm, or the exact mode's settled form), fastgen's CPU attention as in ``int8``;

with no hooks on any module of the step, one activation kind, and a cross-attention mask that is absent or
one row per input. Anything else (the symmetric grid, fbgemm's int8 weights, a blocked exact
form, grouped K/V heads) keeps the Python lean step, which gives the same results; the report says which
step ran and why. ``FASTGEN_COMPILED_STEP=0`` turns it off.
"""

from __future__ import annotations

from typing import Any

import torch

from fastgen import _env
from fastgen.models.hooks import hooked
from fastgen.ops import cpu_attention

ENV = "FASTGEN_COMPILED_STEP"
# the C++ class's linear kinds (csrc/cpu/decoder_step.cpp)
_ATEN_LINEAR, _ORDERED, _PACKED, _MKL_PACKED = 0, 3, 4, 6
_INT8_KINDS = {"amx": 1, "vnni": 2, "onednn": 5}  # fastgen's own int8 ops; oneDNN's between fastgen's row passes
_ATTENTION_SDPA, _ATTENTION_KERNEL = 0, 1
NOT_CHOSEN = "an int8 weight before its first product"
NOT_SETTLED = "an exact linear whose calibration is not settled"


def switched_off() -> bool:
    return _env.switched_off(ENV)


def _class() -> Any:
    """``torch.classes.fastgen_cpu.DecoderStep`` when the CPU kernels are loaded (never builds them)."""
    from fastgen.ops import cpu_kernels

    if not cpu_kernels.loaded() and not cpu_kernels.available(build=False):
        return None
    try:
        return torch.classes.fastgen_cpu.DecoderStep
    except (AttributeError, RuntimeError):  # kernels built from sources without the class
        return None


def _linears(layer: Any) -> list[Any]:
    self_attn, cross = layer.self_attn, layer.encoder_attn
    return [
        self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.out_proj,
        cross.q_proj, cross.out_proj, layer.fc1, layer.fc2,
    ]  # fmt: skip


def _int8_op(module: Any, fused: dict[int, Any]) -> tuple[Any, ...] | str:
    """The C++ class's linear arguments for the int8 op ``module`` runs (activation fused), or why not."""
    from fastgen.ops import int8_linear
    from fastgen.optimizer import fused_activation, linear_modes

    if linear_modes.installed(module) != linear_modes.INT8.feature or not linear_modes._entered_here(module):
        return "a linear outside the int8 mode"
    prepared = linear_modes._int8_weights.get(module)
    if getattr(prepared, "_codes", None) is not None:
        return NOT_CHOSEN
    if prepared.kind not in _INT8_KINDS:
        return f"an int8 weight on the {prepared.kind} path"
    if int8_linear.GRID == "symmetric":
        return "the symmetric int8 grid"
    activation = 0
    entry = fused.get(id(module))
    if entry is not None:
        if not fused_activation.may_fuse(module, entry[0]):
            return "an activation that cannot be fused"
        activation = entry[1]
    bias = module.bias
    if bias is not None:
        bias = bias.detach().contiguous()
    kind = _INT8_KINDS[prepared.kind]
    return (kind, prepared.packed, bias, prepared.scale, prepared.col_sums, prepared.out_features, activation, 0, 0)


def _exact_op(module: Any, rows: int) -> tuple[Any, ...] | str:
    """The C++ class's linear arguments for what the exact mode runs for ``module`` at ``rows`` rows, or why not."""
    from fastgen.optimizer import exact_scope, linear_modes

    if type(module) is not torch.nn.Linear or linear_modes.installed(module) is not None:
        return "a linear outside the exact mode"
    exact = exact_scope.installed(module)
    if "forward" in module.__dict__ and not exact:
        return "a linear with a forward of its own"
    weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    if not exact:
        return (_ATEN_LINEAR, weight, bias, None, None, weight.shape[0], 0, 0, 0)
    return _settled_exact(weight, bias, rows, module.weight)


def _settled_exact(
    weight: torch.Tensor, bias: torch.Tensor | None, rows: int, parameter: torch.Tensor
) -> tuple[Any, ...] | str:
    """The form :func:`fastgen.ops.linear.exact_linear` settled on for a ``rows``-row step (``F.linear``, the
    ordered kernel with its order, or MKL's packed sgemm on ``parameter``'s copy), or why the program cannot run
    it yet."""
    from fastgen.ops import linear

    plain = (_ATEN_LINEAR, weight, bias, None, None, weight.shape[0], 0, 0, 0)
    choice = linear.settled_form(3, rows, weight, bias)
    if choice is None:
        return NOT_SETTLED
    if choice.mkl:  # exact_linear's own fallback where no copy can be made: F.linear, the same bits
        usable = linear.mkl_op() is not None and isinstance(parameter, torch.nn.Parameter)
        packed = linear.mkl_packed(parameter) if usable else None
        return plain if packed is None else (_MKL_PACKED, packed, bias, None, None, weight.shape[0], 0, 0, 0)
    dense = weight.is_contiguous() and (bias is None or bias.is_contiguous())
    if choice.order is None or not dense:  # exact_linear runs F.linear for a strided weight whatever the choice
        return plain if choice.block is None or not dense else "a blocked form of the exact linear"
    return (_ORDERED, weight, bias, None, None, weight.shape[0], 0, *choice.order)


def _packed_op(module: Any, rows: int, fused: dict[int, Any] | None = None) -> tuple[Any, ...] | str:
    """The C++ class's linear arguments for what ``fast_gemm`` runs for ``module`` at ``rows`` rows: oneDNN with the
    packed weight, MKL's packed sgemm, or the exact mode's settled form where its timing kept that, or why not."""
    from fastgen.ops import fast_linear
    from fastgen.optimizer import fused_activation, linear_modes

    if linear_modes.installed(module) != linear_modes.FAST_GEMM.feature or not linear_modes._entered_here(module):
        return "a linear outside the fast_gemm mode"
    if type(module) is not torch.nn.Linear:
        return "a linear of another class"
    weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    form = fast_linear.settled_form(weight, rows)
    if form is None:
        return NOT_SETTLED
    if form == "packed":
        return (_PACKED, fast_linear._packed.get(module), bias, None, None, weight.shape[0], 0, 0, 0)
    if form == "mkl":  # fc1's activation in the op's own pass where the Python step fuses it so
        entry = (fused or {}).get(id(module))
        activation = entry[1] if entry is not None and fused_activation.may_fuse(module, entry[0]) else 0
        packed = fast_linear._mkl_packed.get(module)
        return (_MKL_PACKED, packed, bias, None, None, weight.shape[0], activation, 0, 0)
    return _settled_exact(weight, bias, rows, module.weight)


#: the attention the lean step gets in the fast modes: fastgen's beam-shared K/V wrapper (whose calls take
#: fastgen's CPU attention there), maybe inside the shared-prompt wrapper (a no-op for these keys), around SDPA
_FASTGEN_SDPA = (
    ("attention_with_shared_prefix", "attention_with_shared_kv", "sdpa_attention_forward"),
    ("attention_with_shared_kv", "sdpa_attention_forward"),
)


def _fastgen_sdpa(attend: Any) -> bool:
    names = []
    while attend is not None and len(names) < 8:
        names.append(getattr(getattr(attend, "__code__", None), "co_name", None))
        if names[-1] == "sdpa_attention_forward" and attend.__module__ != "transformers.integrations.sdpa_attention":
            return False
        attend = getattr(attend, "__wrapped__", None)
    return tuple(names) in _FASTGEN_SDPA


def _same_op(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two linear argument tuples name the same op on the same tensors."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is y:
            continue
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.layout == y.layout == torch.strided  # oneDNN's packed weights: the same object or not the same
                and x.data_ptr() == y.data_ptr()
                and x.shape == y.shape
                and x.stride() == y.stride()
                and x.dtype == y.dtype
            ):
                return False
        elif x != y:
            return False
    return True


class CompiledStep:
    """One ``generate`` call's C++ program, or the reason it cannot run (:attr:`problem`)."""

    def __init__(self, lean: Any, attend: Any, rows: int) -> None:
        self.program: Any = None
        self.head_dim = 0
        self.approximate = False
        self.rows: int | None = None  # the exact mode's program holds the forms calibrated for this many rows
        self.retry = False  # a linear has not settled its op yet: build again at the next step
        self._linears: list[Any] = []
        self._ops: list[tuple[Any, ...]] = []  # the arguments each linear was set with
        self.problem = self._build(lean, attend, rows)

    def _build(self, lean: Any, attend: Any, rows: int) -> str | None:
        from fastgen.optimizer import fused_activation, linear_modes

        if switched_off():
            return f"{ENV}=0"
        cls = _class()
        if cls is None:
            return "fastgen's CPU kernels are not loaded"
        model, decoder, family = lean.model, lean.decoder, lean.family
        if not _fastgen_sdpa(attend):
            return "attention other than fastgen's around SDPA"
        layers = list(decoder.layers)
        attentions = [m for layer in layers for m in (layer.self_attn, layer.encoder_attn)]
        approximate = [linear_modes.approximate_here(m) for m in attentions]
        if any(approximate) and not all(approximate):
            return "attention modules in different modes"
        approximate_mode = all(approximate)
        if approximate_mode and cpu_attention.unavailable_reason() is not None:
            return "fastgen's CPU attention is off"
        if any(getattr(a, "num_key_value_groups", 1) != 1 for a in attentions):
            return "grouped key/value heads"
        if len({(a.num_heads, a.head_dim, a.scaling) for a in attentions}) != 1:
            return "attention modules of different shapes"
        heads, head_dim, scaling = attentions[0].num_heads, attentions[0].head_dim, attentions[0].scaling
        self.head_dim = head_dim
        activations = {fused_activation.activation_code(getattr(layer.activation_fn, "original", layer.activation_fn))
                       for layer in layers}  # fmt: skip
        if len(activations) != 1 or None in activations:
            return "a feed-forward activation the program does not compute"
        embed = decoder.embed_tokens
        if type(embed) is torch.nn.Embedding and family.scale_outside_embedding:
            embed_scale = decoder.embed_scale
        elif type(embed).__name__.endswith("ScaledWordEmbedding") and not family.scale_outside_embedding:
            embed_scale = embed.embed_scale
        else:
            return f"token embedding {type(embed).__name__}"
        if not isinstance(embed_scale, (int, float)):
            return f"an embedding scale of type {type(embed_scale).__name__}"
        positions = decoder.embed_positions
        offset = getattr(positions, "offset", 0) if family.positions == "learned" else 0
        norms = [
            n
            for layer in layers
            for n in (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm)
        ]
        if family.layernorm_embedding:
            norms.insert(0, decoder.layernorm_embedding)
        if family.pre_norm:
            norms.append(decoder.layer_norm)
        if any(type(n) is not torch.nn.LayerNorm or n.weight is None or n.bias is None for n in norms):
            return "a layer norm without weight and bias"
        if len({n.eps for n in norms}) != 1 or any(tuple(n.normalized_shape) != (n.weight.shape[0],) for n in norms):
            return "layer norms of different kinds"
        linears = [lin for layer in layers for lin in _linears(layer)] + [model.lm_head]
        modules = [embed, positions, *norms, *linears, *(layer.activation_fn for layer in layers)]
        if any(hooked(m) for m in modules):
            return "hooks on a module of the step"
        int8 = approximate_mode and linear_modes.installed(linears[0]) == linear_modes.INT8.feature
        if int8:
            fused = linear_modes._fused_activations
            ops = [_int8_op(lin, fused) for lin in linears]
        elif approximate_mode:
            ops = [_packed_op(lin, rows, linear_modes._fused_activations) for lin in linears]
        else:
            ops = [_exact_op(lin, rows) for lin in linears]
        reason = next((op for op in ops if isinstance(op, str)), None)
        if reason is not None:
            self.retry = reason in (NOT_CHOSEN, NOT_SETTLED)
            return reason
        if int8 and any(ops[i][6] == 0 for i in range(6, len(ops) - 1, 8)):
            return "fc1 without its activation fused"
        tensors = [embed.weight, positions.weight]
        tensors += [t for n in norms for t in (n.weight, n.bias)]
        tensors.append(model.final_logits_bias)
        attention = _ATTENTION_KERNEL if approximate_mode else _ATTENTION_SDPA
        flags = [int(family.pre_norm), int(family.layernorm_embedding), offset, attention, activations.pop()]
        scalars = [float(embed_scale), float(norms[0].eps), float(scaling)]
        program = cls([len(layers), heads, head_dim, *flags], scalars, [t.detach() for t in tensors])
        for index, op in enumerate(ops):
            program.set_linear(index, *op)
        self.rows = None if int8 else rows  # the exact and fast_gemm forms were chosen per row count
        self._linears, self._ops = linears, ops
        self.approximate = approximate_mode
        self.program = program
        return None

    def retarget(self, rows: int) -> bool:
        """Point the program's linears at the forms settled for ``rows`` rows (the exact and fast_gemm forms are
        chosen per row count), re-setting only those that differ: as inputs leave the batch, a new row count
        mostly keeps every form, and building the program again cost ~1 ms each time. False where a form is not
        settled or not one the program runs (the caller builds anew, which says why)."""
        from fastgen.optimizer import linear_modes

        fused = linear_modes._fused_activations
        ops = [_packed_op(lin, rows, fused) if self.approximate else _exact_op(lin, rows) for lin in self._linears]
        if any(isinstance(op, str) for op in ops):
            return False
        for index, (now, then) in enumerate(zip(ops, self._ops, strict=True)):
            if not _same_op(now, then):
                self.program.set_linear(index, *now)
        self.rows, self._ops = rows, ops
        return True

    def takes(self, rows: int, cross_keys: torch.Tensor, mask: Any, self_layers: list[Any] | None = None) -> bool:
        """Whether the program runs this step as the Python step would: autograd off, every self-attention layer
        of one length, and a cross-attention the call's attention runs as the program does (in the fast modes
        fastgen's CPU attention must take ``rows // inputs`` query rows per input, as
        :func:`fastgen.ops.cpu_attention.supports` decides), with no mask or one row per input."""
        if torch.is_grad_enabled():  # the modes' own forwards run upstream's op under autograd
            return False
        if self_layers is not None and len({layer.length for layer in self_layers}) != 1:
            return False
        inputs, length = cross_keys.shape[0], cross_keys.shape[2]
        if not inputs or rows % inputs or cross_keys.stride(-1) != 1:
            return False
        if self.approximate and not cpu_attention.takes_rows(rows // inputs, self.head_dim):
            return False  # the Python step's attention would leave it to SDPA
        if mask is None:
            return True
        return (
            isinstance(mask, torch.Tensor)
            and mask.dim() == 4
            and mask.shape[0] in (1, inputs)
            and mask.shape[1] in (1, cross_keys.shape[1])
            and mask.shape[2] == 1
            and mask.shape[3] == length
            and mask.dtype in (torch.bool, torch.float32)
            and mask.device.type == "cpu"
        )

    def step(self, ids: torch.Tensor, self_layers: list[Any], cross_layers: list[Any], mask: Any) -> torch.Tensor:
        """The step's logits, for a step :meth:`takes` admitted; grows each self-attention layer by the step's
        position (its K/V written in place)."""
        length = self_layers[0].length  # one length for all: takes() said so
        for layer in self_layers:
            layer.reserve(1)
        logits = self.program.step(
            ids,
            length,
            [layer.key_buffer for layer in self_layers],
            [layer.value_buffer for layer in self_layers],
            [layer.keys for layer in cross_layers],
            [layer.values for layer in cross_layers],
            mask,
        )
        for layer in self_layers:
            layer.advance(1)
        return logits
