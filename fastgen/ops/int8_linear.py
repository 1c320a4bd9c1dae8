"""``int8_linear``: a CPU linear layer in int8 — weights per output channel, activations per row.

Why: a decode step on CPU is bound by its GEMMs, and int8 products run 3-7x faster than MKL's fp32
``sgemm`` on the CPUs measured (AVX-512 VNNI; see ``benchmarks/``). The scheme is CTranslate2's ``int8``
one with a finer activation grid:

* **weights**, once per module (cached, rebuilt when the weight changes: :mod:`fastgen.ops.weight_cache`):
  ``scale_w[n] = max|W[n, :]| / 127``, ``Wq = round(W / scale_w)`` in ``[-127, 127]``;
* **activations**, per call and per row, on the row's own asymmetric grid (:func:`row_grid`):
  ``lo = min(min x[m, :], 0)``, ``hi = max(max x[m, :], 0)``, ``scale_x[m] = (hi - lo) / 255``,
  ``zero[m] = round(-lo / scale_x[m])``, ``xq = clamp(round(x / scale_x) + zero, 0, 255) - zero``;
* ``y[m, n] = scale_x[m] * scale_w[n] * sum_k xq[m, k] * Wq[n, k] + b[n]`` (integer products, int32 sums).

Why asymmetric: CTranslate2's symmetric grid (``scale_x = max|x| / 127``, :data:`GRID` ``symmetric``, kept
for comparison) spends half its codes on values a one-signed row never takes. The inputs of a feed-forward
block's second product (after GELU or ReLU) are such rows; there the asymmetric grid's step is half as
large, elsewhere never larger (agreement with fp32 on a trained model: ``docs/benchmarks/trained.md``).
It costs one multiply-add per output: the product runs with zero point 0
and the scaling pass subtracts ``zero[m] * scale_w[n] * sum_k Wq[n, k]``.

A row of ``x`` holding a NaN or an infinity has no finite scale: every output of that row is NaN (fp32 gives
NaN or an infinity there; either way the row is lost), and the other rows are unaffected. That formula is
:func:`int8_linear_reference`. Two backends compute it with torch's own kernels:

* ``fbgemm`` (default where torch has it): ``torch.ops.quantized.linear_dynamic`` on a prepacked
  per-channel weight. Its activation quantization is per tensor, so each row is first divided by its
  own ``max|x[m, :]|`` (every row then spans ``[-1, 1]``) and the output rows multiplied back: per-row
  scales through a per-tensor kernel. fbgemm's 8-bit grid over ``[-1, 1]`` spans every row's range at
  once (zero point near 128), so it is about as fine as the symmetric grid, not the per-row asymmetric
  one: results differ from the reference by about one symmetric-grid step per element.
  On CPUs without VNNI fbgemm's ``u8 x s8`` pair sums can saturate int16, so activations use 7 bits there
  (``reduce_range``), as torch's own dynamic quantization does.
* ``onednn`` (where torch has ``onednn::qlinear_pointwise`` and the CPU has VNNI): the reference's ``u8``
  codes ``xq + zero`` (symmetric grid: ``xq + 128``), oneDNN's ``u8 x s8`` product with int32 sums, the
  weight scales applied by oneDNN and the row scales and zero points after: the reference's codes and
  integer sums, so it differs from it by float rounding only (and a code where ``x * (1 / scale)`` and
  ``x / scale`` round apart).
* ``vnni`` and ``amx`` (fastgen's CPU kernels, AVX-512 VNNI; AMX-INT8 tiles where the CPU and the OS give them):
  ``fastgen_cpu::int8_linear_vnni`` / ``int8_linear_amx`` quantize the rows, multiply (``vpdpbusd`` in registers,
  or ``tdpbusd`` on 16 x 64-byte tiles) with a weight packed once for both, and scale, in one call: the oneDNN
  path's codes, sums and scaling order, so the same bits (tested; the scaling pass is one compiled copy shared
  by all three). oneDNN's call costs ~30 us however small the product (Intel Xeon, Emerald Rapids, AMX):
  at 16 x 256 -> 256 it takes 42 us, the VNNI op 13, the AMX op 9; at bart-base's 16-row products the AMX op
  takes 20 / 111 / 126 us for 768 -> 768 / 3072 / 768 <- 3072 against oneDNN's 62 / 183 / 178 and the
  vocabulary projection 1.95 ms against 2.35; oneDNN keeps the encoder's 1024-row 3072-wide products (AMX
  op 0.7-1.0x). On an AMD EPYC core (AVX-512 VNNI, no AMX) the VNNI op takes 0.55-0.97x oneDNN's time at
  decode sizes (64 rows, 256 -> 256 up to 256 -> 6,000) and 1.0-1.06x on 480-row encoder products. So
  ``auto`` times the candidates on a weight's first product and keeps the fastest, oneDNN only by a margin
  (:func:`preferred_kind`).
* ``int_mm``: ``torch._int_mm`` (int8 x int8 -> int32; codes shifted by 128, the shift added back in int32)
  with the scaling in torch ops: the reference's arithmetic exactly, slower (measured), kept for torch
  builds without the quantized engine.

Where both fbgemm and oneDNN can run, each weight takes the faster for the products it serves, decided
at its first product (:func:`choose_kind`; then oneDNN against fastgen's ops, timed, where they run).
With fastgen's CPU kernels (the row quantization in one pass,
the row scales and bias in another: :mod:`fastgen.ops.cpu_kernels`) that is oneDNN for every product
(0.98-1.36x fbgemm from 16 x 768 x 768 to the 16-row LM head, 1.12-1.27x at 64 rows, AMD EPYC with
AVX-512 VNNI, 1 and 2 threads); without them, torch's seven passes around oneDNN's product made it lose on
a decode step's small products (0.76-0.92x fbgemm), so only large ones (the LM head, the encoder's
1024-row products: 1.05-1.56x) go to oneDNN. The weight is packed for that one backend only.

Not bit-identical to ``F.linear`` and not meant to be: the ``int8`` feature is opt-in.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from typing import Any

import torch

from fastgen.ops import cpu_kernels
from fastgen.ops.fast_linear import runs_packed

#: the activations ``matmul`` can apply: codes of ``fastgen_cpu::scale_rows_add_`` and their torch forms
GELU, RELU, SILU = 1, 2, 3
ACTIVATIONS = {GELU: torch.nn.functional.gelu, RELU: torch.nn.functional.relu, SILU: torch.nn.functional.silu}

#: ``FASTGEN_INT8_BACKEND=int_mm`` forces the slower exact-reference backend (tests, bisecting).
BACKEND_ENV = "FASTGEN_INT8_BACKEND"

#: The activation grid: ``asymmetric`` (each row's [min, max] in 255 steps, the default) or ``symmetric``
#: (``[-max|x|, max|x|]`` in 254 steps, CTranslate2's and this module's earlier scheme; kept for comparison:
#: ``FASTGEN_INT8_GRID=symmetric``, or set this attribute in-process).
GRID = os.environ.get("FASTGEN_INT8_GRID", "asymmetric").strip().lower()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _has_fbgemm() -> bool:
    engines = torch.backends.quantized.supported_engines
    return ("fbgemm" in engines or "x86" in engines) and hasattr(torch.ops.quantized, "linear_dynamic")


@functools.cache
def _has_onednn() -> bool:
    """oneDNN's quantized linear, on a CPU whose ``u8 x s8`` products do not saturate (VNNI)."""
    if not torch.backends.mkldnn.is_available() or not ({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags()):
        return False
    try:
        return hasattr(torch.ops.onednn, "qlinear_pointwise") and hasattr(torch.ops.onednn, "qlinear_prepack")
    except (AttributeError, RuntimeError):
        return False


def has_vnni_kernel() -> bool:
    """fastgen's fused VNNI op (``fastgen_cpu::int8_linear_vnni``) runs natively here: an AVX-512 VNNI CPU,
    the CPU kernels built for it, the asymmetric grid (the only one the op computes)."""
    if GRID == "symmetric" or "avx512_vnni" not in cpu_flags() or not cpu_kernels.available():
        return False
    native = getattr(torch.ops.fastgen_cpu, "int8_vnni_native", None)
    return native is not None and bool(native())


def has_amx_kernel() -> bool:
    """fastgen's AMX form of the op (``fastgen_cpu::int8_linear_amx``, same packing and bits) runs here: the VNNI
    op's conditions, AMX-INT8 in the CPU's flags, and the OS granted the tile state."""
    if not has_vnni_kernel() or "amx_int8" not in cpu_flags():
        return False
    ready = getattr(torch.ops.fastgen_cpu, "int8_amx_ready", None)
    return ready is not None and bool(ready())


#: fastgen's own int8 products by kind: the op that computes each (same arguments, same packing, same bits)
OWN_KINDS = {"vnni": "int8_linear_vnni", "amx": "int8_linear_amx"}


def backend() -> str:
    """The backend this process uses (see the module docstring): ``auto`` (per weight, measured), ``fbgemm``,
    ``onednn``, ``vnni`` or ``int_mm``."""
    forced = os.environ.get(BACKEND_ENV)
    available = {"fbgemm": _has_fbgemm(), "onednn": _has_onednn(), "int_mm": True}
    if forced == "vnni":
        available["vnni"] = has_vnni_kernel()
    if forced == "amx":
        available["amx"] = has_amx_kernel()
    if available.get(forced):
        return forced
    if _has_fbgemm():
        return "auto" if _has_onednn() else "fbgemm"
    return "onednn" if _has_onednn() else "int_mm"


#: Timed rounds of each candidate when a weight's first product chooses between oneDNN and fastgen's ops.
CHOICE_ROUNDS = 5

#: oneDNN is chosen over fastgen's own ops only where its median time is at most this fraction of theirs. Why:
#: a near tie is decided by timing noise (the LM head at 0.71 against 0.74 ms flipped in about one process in
#: ten, Intel Xeon, AMX, busy machine), and the own op is one call where oneDNN's path is three (quantize,
#: product, scale), so ties go to the own op. Both run inside the C++ decode step
#: (:mod:`fastgen.models.compiled_step`).
ONEDNN_MARGIN = 0.9

#: A product with at least this many outputs (rows x out features) goes to oneDNN under ``auto``.
ONEDNN_MIN_OUTPUTS = 1 << 18


def preferred_kind(choice_ms: dict[str, float]) -> str:
    """The kind to keep from the median times of oneDNN and fastgen's own ops: the fastest own op unless oneDNN
    beats it by :data:`ONEDNN_MARGIN`."""
    own = min((kind for kind in choice_ms if kind != "onednn"), key=choice_ms.__getitem__)
    return "onednn" if choice_ms["onednn"] <= ONEDNN_MARGIN * choice_ms[own] else own


def choose_kind(rows: int, out_features: int) -> str:
    """``auto``'s backend for a weight whose first product has ``rows`` rows (measured; module docstring).

    With fastgen's CPU kernels (:mod:`fastgen.ops.cpu_kernels`: quantization and scaling fused around the
    product) oneDNN is at least as fast for every product size measured; without them, only for large ones.
    """
    if cpu_kernels.available():
        return "onednn"
    return "onednn" if rows * out_features >= ONEDNN_MIN_OUTPUTS else "fbgemm"


def reduce_range() -> bool:
    """fbgemm's 7-bit activations, needed where its int16 pair sums can saturate (no VNNI)."""
    return "avx512_vnni" not in cpu_flags()


def unavailable() -> str | None:
    """Why this torch build cannot run int8 linears (None: it can)."""
    if backend() == "int_mm" and not hasattr(torch, "_int_mm"):
        return f"torch {torch.__version__} has neither the fbgemm quantized engine nor torch._int_mm"
    return None


#: Narrower products run upstream's op: ``torch._int_mm`` returns wrong sums for one input feature
#: (torch 2.13, checked in tests), and int8 cannot pay at such sizes anyway.
MIN_IN_FEATURES = 8


def module_problem(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot run in int8 (None: it can)."""
    weight, bias = module.weight, getattr(module, "bias", None)
    if weight.dim() != 2 or min(weight.shape) < MIN_IN_FEATURES:
        return f"weight of shape {tuple(weight.shape)} (int8 needs at least {MIN_IN_FEATURES} features each way)"
    if weight.device.type != "cpu":
        return f"weights on {weight.device.type} (the int8 kernels are for CPU)"
    if weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        return f"weights in {weight.dtype} (the int8 path quantizes float32 weights)"
    return None


def weight_scales(weight: torch.Tensor) -> torch.Tensor:
    """Per output channel ``max|W[n, :]| / 127`` (1 for an all-zero row, whose codes are then 0)."""
    scale = weight.abs().amax(dim=1) / 127
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq, scale_w)``: int8 codes ``(N, K)`` and float32 scales ``(N,)`` of a ``(N, K)`` weight."""
    scale = weight_scales(weight)
    codes = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


#: Floor of a row's ``max|x|``: an all-zero row divides by this (its codes stay 0) instead of by 0.
TINY = 1e-30


def _row_max(x2: torch.Tensor) -> torch.Tensor:
    """Each row's ``max|x[m, :]|`` (at least :data:`TINY`), shape ``(M, 1)``.

    A large input takes ``max(amax, -amin)``: no ``|x|`` temporary (an encoder's 1024 x 3072 one cost
    twice the two reductions, measured); a decode step's few rows take the two-op form.
    """
    if x2.numel() > 1 << 16:
        return torch.maximum(x2.amax(dim=1, keepdim=True), x2.amin(dim=1, keepdim=True).neg_()).clamp_min_(TINY)
    return x2.abs().amax(dim=1, keepdim=True).clamp_min_(TINY)


def _finite_rows(x2: torch.Tensor, row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(x2, row_max, lost)``: unchanged where every row is finite (``lost`` None: the usual case, one check
    of the M row maxima, which are NaN or infinite exactly for the rows holding a NaN or an infinity);
    otherwise those rows zeroed with scale 1 and ``lost`` their ``(M, 1)`` mask, to be NaN in the output."""
    if bool(torch.isfinite(row_max).all()):
        return x2, row_max, None
    lost = ~torch.isfinite(row_max)
    return x2.masked_fill(lost, 0.0), row_max.masked_fill(lost, 1.0), lost


def row_grid(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's asymmetric grid ``(scale, zero)``, both ``(M, 1)`` float32: ``lo = min(min x, 0)``,
    ``hi = max(max x, 0)``, ``scale = max(hi - lo, TINY) / 255``, ``zero = round(-lo / scale)``; a row holding
    a NaN or an infinity has a non-finite scale."""
    lo = x2.amin(dim=1, keepdim=True).clamp_max_(0.0)
    hi = x2.amax(dim=1, keepdim=True).clamp_min_(0.0)
    scale = (hi - lo).clamp_min_(TINY).div_(255)
    return scale, torch.round(-lo / scale)


def _asymmetric_codes(x2: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``clamp(round(x / scale) + zero, 0, 255)`` as float (exact small integers)."""
    return torch.round(x2 / scale).add_(zero).clamp_(0, 255)


def int8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, grid: str | None = None
) -> torch.Tensor:
    """The semantics (module docstring), in plain torch: integer products summed exactly in int64.
    ``grid``: ``asymmetric`` or ``symmetric`` (default: :data:`GRID`)."""
    codes, scale_w = quantize_weight(weight)
    x2 = x.reshape(-1, x.shape[-1])
    if (grid or GRID) == "symmetric":
        x2, row_max, lost = _finite_rows(x2, _row_max(x2))
        scale_x = row_max / 127
        xq = torch.round(x2 / scale_x).clamp_(-127, 127).to(torch.int64)
    else:
        scale_x, zero = row_grid(x2)
        x2, scale_x, lost = _finite_rows(x2, scale_x)
        zero = zero if lost is None else zero.masked_fill(lost, 0.0)
        xq = (_asymmetric_codes(x2, scale_x, zero) - zero).to(torch.int64)
    y = (xq @ codes.to(torch.int64).t()).to(torch.float32) * (scale_x * scale_w)
    if lost is not None:
        y = y.masked_fill(lost, float("nan"))
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class Int8Weight:
    """A weight prepared for one backend, plus what the forward needs (bias, shape, bytes).

    Kind ``auto`` keeps the int8 codes until the first product, then packs them for the backend
    :func:`choose_kind` picks for that product's rows and drops them (one int8 copy at any time).
    """

    def __init__(self, weight: torch.Tensor, kind: str) -> None:
        if weight.dim() != 2 or weight.shape[1] < MIN_IN_FEATURES:
            raise ValueError(f"int8 weights need (out, in >= {MIN_IN_FEATURES}), got {tuple(weight.shape)}")
        weight = weight.contiguous()  # a transposed view's codes would keep its strides, which oneDNN misreads
        self.out_features = weight.shape[0]
        self.packed: Any = None
        self._lock = threading.Lock()
        codes, scale = quantize_weight(weight)
        self._codes: tuple[torch.Tensor, torch.Tensor] | None = (codes, scale)
        #: each output's codes summed (exact int32) and times its scale: the asymmetric grid's zero point
        #: is taken out after a product computed with zero point 0
        self.code_sums = codes.sum(dim=1, dtype=torch.int32)
        self.col_sums = self.code_sums.to(torch.float32).mul_(scale)
        # a packed layout holds about as much as the codes; scales and the two sums: 3 floats per output
        self.nbytes = codes.numel() + 3 * scale.numel() * scale.element_size()
        self.kind = kind
        self.choice_ms: dict[str, float] | None = None  # the first product's timings, where it chose
        self._int_mm_codes: torch.Tensor | None = None  # own kinds under a symmetric grid switched in later
        if kind != "auto":
            self._pack(kind, None)

    def _pack(self, kind: str, rows: int | None) -> None:
        """Pack the codes for ``kind``; oneDNN lays the weight out for ``rows``-row products when told."""
        codes, scale = self._codes
        if kind == "fbgemm":
            with warnings.catch_warnings():  # torch >= 2.10 deprecates quantized tensors; the kernel is what we need
                warnings.simplefilter("ignore")
                quantized = torch._make_per_channel_quantized_tensor(
                    codes, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0
                )
                self.packed = torch.ops.quantized.linear_prepack(quantized, None)
            self.reduce_range = reduce_range()
        elif kind == "onednn":
            self.packed = torch.ops.onednn.qlinear_prepack(codes, None if rows is None else [rows, codes.shape[1]])
            self.scale = scale
            self._zero_points = torch.zeros(scale.shape, dtype=torch.long)
        elif kind in OWN_KINDS:
            self.packed = torch.ops.fastgen_cpu.pack_int8_vnni(codes)
            self.scale = scale
        elif kind == "int_mm":
            self.packed = codes.t().contiguous()  # (K, N) for torch._int_mm
            self.scale = scale
        else:
            raise ValueError(f"unknown int8 backend {kind!r}")
        self.kind, self._codes = kind, None

    def matmul(self, x2: torch.Tensor, bias: torch.Tensor | None = None, activation: int = 0) -> torch.Tensor:
        """``act(x2 @ W.T + bias)`` in int8 for a contiguous ``(M, K)`` float32 input; ``activation``: 0 none,
        1 GELU (erf), 2 ReLU, 3 SiLU (fused into the scaling pass where the CPU kernels run). Rows holding a
        NaN or an infinity come out NaN (module docstring); ``bias`` contiguous."""
        if self._codes is not None:
            with self._lock:
                if self._codes is not None:
                    self._first_product(x2, bias, activation)
        if self.kind in OWN_KINDS:
            if GRID == "symmetric":  # switched in-process after this weight chose an op of the other grid
                return self._symmetric_on_own_codes(x2, bias, activation)
            op = getattr(torch.ops.fastgen_cpu, OWN_KINDS[self.kind])
            return op(x2, self.packed, self.out_features, self.scale, self.col_sums, bias, activation)
        fused = self.kind != "int_mm" and cpu_kernels.available()
        if GRID != "symmetric" and self.kind != "fbgemm":
            return self._asymmetric(x2, bias, activation, fused)
        if self.kind == "onednn" and fused:  # quantization in one kernel, scales and bias in another
            codes, row_max = torch.ops.fastgen_cpu.quantize_rows_u8(x2)
            y = self._onednn(codes)
            return torch.ops.fastgen_cpu.scale_rows_add_(y, row_max.div_(127), bias, activation)
        x2, row_max, lost = _finite_rows(x2, _row_max(x2))  # fbgemm's own range check refuses a NaN
        y = self._torch_ops(x2, row_max, bias, activation, fused)
        return y if lost is None else y.masked_fill_(lost, float("nan"))

    def _first_product(self, x2: torch.Tensor, bias: torch.Tensor | None, activation: int) -> None:
        """Pack for ``auto``'s backend at the first product; where fastgen's own ops (VNNI, AMX) can run too, time
        them and oneDNN on this input (alternating rounds) and keep the fastest (:func:`preferred_kind`), then drop
        the codes. All give the same bits (same codes, sums and scaling order), so the choice moves no result."""
        kind = choose_kind(x2.shape[0], self.out_features)
        own = [k for k, ready in (("vnni", has_vnni_kernel), ("amx", has_amx_kernel)) if ready()]
        if kind != "onednn" or not own:
            self._pack(kind, x2.shape[0])
            self._codes = None
            return
        codes = self._codes
        self._pack("vnni", None)
        own_packed, self._codes = self.packed, codes
        self._pack("onednn", x2.shape[0])
        runs = {"onednn": lambda: self._asymmetric(x2, bias, activation, True)}
        for name in own:
            op = getattr(torch.ops.fastgen_cpu, OWN_KINDS[name])
            runs[name] = functools.partial(
                op, x2, own_packed, self.out_features, self.scale, self.col_sums, bias, activation
            )
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(CHOICE_ROUNDS):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        self.choice_ms = {name: sorted(t)[CHOICE_ROUNDS // 2] * 1e3 for name, t in times.items()}
        kept = preferred_kind(self.choice_ms)
        if kept != "onednn":
            self.kind, self.packed = kept, own_packed
        self._codes = None

    def _symmetric_on_own_codes(self, x2: torch.Tensor, bias: torch.Tensor | None, activation: int) -> torch.Tensor:
        """The symmetric grid for a weight packed for fastgen's ops (which compute the asymmetric one): the
        reference's arithmetic through ``torch._int_mm`` on the codes read back from the packing (kept once
        needed). Only a process that switches :data:`GRID` after the weight's first product comes here."""
        if self._int_mm_codes is None:
            k = x2.shape[1]
            codes = self.packed.permute(0, 2, 1, 3).reshape(-1, self.packed.shape[1] * 4)
            self._int_mm_codes = codes[: self.out_features, :k].t().contiguous()  # (K, N), as the int_mm kind
        x2, row_max, lost = _finite_rows(x2, _row_max(x2))
        scale_x = row_max / 127
        xq = torch.round(x2 / scale_x).clamp_(-127, 127).to(torch.int8)
        y = torch._int_mm(xq, self._int_mm_codes).to(torch.float32).mul_(scale_x * self.scale)
        if lost is not None:
            y.masked_fill_(lost, float("nan"))
        y = y if bias is None else y.add_(bias)
        return ACTIVATIONS[activation](y) if activation else y

    def _torch_ops(
        self, x2: torch.Tensor, row_max: torch.Tensor, bias: torch.Tensor | None, activation: int, fused: bool
    ) -> torch.Tensor:
        """:meth:`matmul` for finite rows around fbgemm's product, oneDNN's without the CPU kernels, or int_mm."""
        if self.kind == "fbgemm":
            y = torch.ops.quantized.linear_dynamic(x2 / row_max, self.packed, self.reduce_range)
            if fused:
                return torch.ops.fastgen_cpu.scale_rows_add_(y, row_max, bias, activation)
            y.mul_(row_max)
        elif self.kind == "onednn":
            with warnings.catch_warnings():  # rows over their max|x|, then one vectorised u8 pass
                warnings.simplefilter("ignore")
                codes = torch.quantize_per_tensor(x2 / row_max, 1 / 127, 128, torch.quint8).int_repr()
            y = self._onednn(codes).mul_(row_max / 127)
        else:
            scale_x = row_max / 127
            xq = torch.round(x2 / scale_x).clamp_(-127, 127).to(torch.int8)
            y = torch._int_mm(xq, self.packed).to(torch.float32).mul_(scale_x * self.scale)
        y = y if bias is None else y.add_(bias)
        return ACTIVATIONS[activation](y) if activation else y

    def _asymmetric(self, x2: torch.Tensor, bias: torch.Tensor | None, activation: int, fused: bool) -> torch.Tensor:
        """:meth:`matmul` on each row's asymmetric grid (:func:`row_grid`), on oneDNN or ``torch._int_mm``."""
        if fused:  # quantization in one kernel; scales, zero points and bias in another
            codes, scale, zero = torch.ops.fastgen_cpu.quantize_rows_u8_zp(x2)
            y = self._onednn(codes, 0)
            return torch.ops.fastgen_cpu.scale_rows_add_(y, scale, bias, activation, zero, self.col_sums)
        scale, zero = row_grid(x2)
        x2, scale, lost = _finite_rows(x2, scale)
        if lost is not None:
            zero = zero.masked_fill(lost, 0.0)
        codes = _asymmetric_codes(x2, scale, zero)
        if self.kind == "onednn":
            y = self._onednn(codes.to(torch.uint8), 0).sub_(zero * self.col_sums).mul_(scale)
        else:  # int_mm: s8 codes (shifted by 128), the shift and zero point added back in int32, exactly
            acc = torch._int_mm(codes.sub_(128).to(torch.int8), self.packed)
            acc += (128 - zero).to(torch.int32) * self.code_sums
            y = acc.to(torch.float32).mul_(scale * self.scale)
        if lost is not None:
            y.masked_fill_(lost, float("nan"))
        y = y if bias is None else y.add_(bias)
        return ACTIVATIONS[activation](y) if activation else y

    def _onednn(self, codes: torch.Tensor, zero_point: int = 128) -> torch.Tensor:
        """oneDNN's ``u8 x s8`` product of codes with ``zero_point``, the weight scales applied."""
        return torch.ops.onednn.qlinear_pointwise(
            codes, 1.0, zero_point, self.packed, self.scale, self._zero_points, None, 1.0, 0, torch.float32, "none",
            [], "",
        )  # fmt: skip


def prepare(weight: torch.Tensor) -> Int8Weight:
    """The weight quantized for this process's backend (``(N, K)``, float32, CPU)."""
    return Int8Weight(weight.detach(), backend())


#: Whether a call may take the int8 path: the same calls as the packed fp32 path (not traced, CPU fp32,
#: no autograd, 2+ dims, not empty).
runs_int8 = runs_packed


def int8_linear(x: torch.Tensor, prepared: Int8Weight, bias: torch.Tensor | None, activation: int = 0) -> torch.Tensor:
    """``act(x @ W.T + bias)`` with ``W`` int8-prepared (module docstring); ``x`` float32, any leading dims;
    ``activation`` as :meth:`Int8Weight.matmul`."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if bias is not None and not bias.is_contiguous():  # a strided parameter (a view of a larger tensor)
        bias = bias.contiguous()
    y = prepared.matmul(x2, bias, activation)
    return y.reshape(*x.shape[:-1], prepared.out_features)
