"""``exact_linear``: ``F.linear`` on CPU fp32 in the fastest form that gives the same bits.

Two kinds of candidate forms, both kept only where they proved identical on the real input:

* **ordered** (fastgen's kernel ``fastgen_cpu::ordered_linear``, :mod:`fastgen.ops.cpu_kernels`): upstream's
  bits are an order of additions, not a library. On the CPUs measured so far MKL computes each output
  element as the bias plus, block after block of ``B`` consecutive ``k``, a sequential FMA chain over the
  block (B = 384 on an Intel Xeon, Emerald Rapids, with torch 2.13's MKL for most shapes at one thread; 192
  on an AMD EPYC; other shapes, thread counts and CPUs differ). The kernel computes exactly such chains,
  for any block length and the bias first or last, at AVX-512/AVX2 speed; the calibration tries every
  order in :data:`ORDER_BLOCKS` and keeps one only if it is ``torch.equal`` to ``F.linear`` (a 1-row or
  4-row product takes MKL's other paths and never matches: it keeps ``F.linear``).
  ``FASTGEN_EXACT_KERNEL=0`` turns this form off.
* **blocked**:

  at the row counts of a decode step (a few to a few dozen hypotheses) MKL's single
``sgemm`` for a tall weight (the vocabulary projection, 50k x 768) runs well below what the CPU
can do; the same product computed in column blocks of the weight (``out[:, j:j+b] = x @ w[j:j+b].T``)
is often faster, and — because each output element is still one dot product over the same ``K``
with the same kernel — usually identical bit for bit. "Usually" is not good enough, and which
block size is fastest depends on the CPU, so nothing here is assumed:

* a *key* (weight shape, bias or not, row count, thread count, the input's alignment) runs
  ``F.linear`` for its first :data:`CALIBRATE_AFTER` - 1 calls; the next call **calibrates**: it
  runs ``F.linear`` (whose result it returns), runs every candidate form on the same input, drops
  each one whose result is not ``torch.equal`` to ``F.linear``'s, times the rest against
  ``F.linear`` in alternating rounds, and keeps the fastest only if it beats ``F.linear`` by
  :data:`MIN_GAIN`; otherwise the key keeps ``F.linear``;
* a kept candidate is then **on trial**: the key's next :data:`TRIAL_CALLS` real calls alternate it with
  ``F.linear``, each timed where it runs (between the model's other work, with the caches as they really
  are), and it stays only if its median still beats ``F.linear``'s by ``MIN_GAIN``. The calibration times
  back-to-back repeats on warm caches; in a decode step the weight was just evicted by the other layers'
  (a 16-row product of a 256-wide model chose the ordered kernel at 0.025 ms against 0.027 and ran slower
  than MKL in the model). Both forms give the same bits, so switching changes no result;
* later calls with the key run the kept form. The choice is remembered for the process.

The ordered and blocked candidates never copy the weight (column blocks of a row-major ``(N, K)`` weight are
contiguous views). One more candidate does: **MKL's packed form** (``fastgen_cpu::mkl_packed_linear``, MKL's own
kernel on a weight packed once, so often ``F.linear``'s order of additions without the per-call packing), offered
for a weight that is an ``nn.Parameter`` where fastgen's kernels are loaded and torch exports MKL's packed sgemm,
and kept under the same rule (``torch.equal`` on the real input and on a random probe, then timed). Its packed
copy lives while the weight does, is checked against the weight's content once per ``generate`` call
(:func:`refresh_mkl_copies`, from the exact scope) and is given back where no key of its shape keeps the form.
``FASTGEN_MKL_PACKED=0`` leaves it out.

Anything but a plain CPU fp32 call (autograd, other dtypes or devices, non-contiguous input,
tracing under ``torch.compile``) runs ``F.linear`` itself: :func:`exact_linear` is then exactly
upstream's op.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from fastgen import _env
from fastgen.ops import cpu_kernels, weight_cache

#: Column block sizes tried by the calibration (those smaller than the weight's row count).
BLOCK_SIZES: tuple[int, ...] = (512, 1024, 2048, 4096)
#: A candidate must be at least this much faster than ``F.linear`` (median of the rounds) to be kept.
MIN_GAIN = 0.03
#: Timing rounds of the calibration (each round runs ``F.linear`` and every identical candidate once).
ROUNDS = 3
#: Weights with fewer output features than this always run ``F.linear`` (blocking cannot pay).
MIN_OUT_FEATURES = 2 * min(BLOCK_SIZES)
#: Skip calibrating products larger than this many multiply-adds (a prefill over thousands of rows):
#: the calibration would cost seconds and blocking gains little on tall inputs.
MAX_CALIBRATION_MACS = 2e9
#: Real calls of each form (the candidate and ``F.linear``, alternating) timed in place before a candidate the
#: calibration kept is final (0: kept at once).
TRIAL_CALLS = 12
#: Calls of a key that run ``F.linear`` before it is calibrated ("rent before you buy"): calibrating
#: costs about as much as this many calls (verification plus ROUNDS timed rounds of every form), so a
#: key used only a few times (a passing row count) never pays for it, and one that is used often has
#: spent at most as much as the calibration before the calibration starts paying back.
CALIBRATE_AFTER = 16

#: k-block lengths of the summation orders the calibration tries with the ordered kernel (each with the
#: bias added first and last); a block at least K long is one chain.
ORDER_BLOCKS: tuple[int, ...] = (64, 96, 128, 192, 256, 320, 384, 448, 512)
#: Columns of the weight the orders are first screened on (the kernel's columns are independent, so a
#: wrong order shows on a slice); the survivors are checked on the whole product.
SCREEN_COLUMNS = 48
#: ``FASTGEN_EXACT_KERNEL=0`` keeps the ordered kernel out of every calibration.
ORDERED_ENV = "FASTGEN_EXACT_KERNEL"
#: ``FASTGEN_MKL_PACKED=0``: no MKL packed-B candidate (here and in ``fast_gemm``)
MKL_ENV = "FASTGEN_MKL_PACKED"
BIAS_FIRST, BIAS_LAST = 0, 1

Key = tuple[int, int, bool, int, int, int, int]


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the calibration decided for one key, with its evidence (for reports and tests)."""

    form: str  # "linear", "blocked<size>" or "ordered<block>-bias-first|last"
    block: int | None
    times_ms: dict[str, float]  # median per candidate (identical ones only)
    not_identical: tuple[str, ...]  # candidates dropped because their bits differed
    order: tuple[int, int] | None = None  # the ordered kernel's (block, bias place)
    mkl: bool = False  # MKL's packed-B sgemm on the weight's packed copy
    # while the kept candidate is timed in place against F.linear; then the trial's medians of both
    trial: _Trial | None = dataclasses.field(default=None, compare=False)
    in_place_ms: dict[str, float] | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class _Trial:
    """Milliseconds of the real calls a candidate and ``F.linear`` served for one key, so far."""

    form: list[float] = dataclasses.field(default_factory=list)
    linear: list[float] = dataclasses.field(default_factory=list)


_choices: dict[Key, Choice] = {}
_seen: dict[Key, int] = {}  # calls of a key not calibrated yet
_lock = threading.Lock()


def _blocked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block: int) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` computed in column blocks of ``block`` output features."""
    n = weight.shape[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    starts = list(range(0, n, block))
    if len(starts) > 1 and n - starts[-1] < block // 2:
        starts.pop()  # a narrow tail joins the previous block: BLAS takes other paths for a few columns
    for start, stop in zip(starts, [*starts[1:], n], strict=True):
        if bias is None:
            torch.mm(x, weight[start:stop].t(), out=out[:, start:stop])
        else:
            torch.addmm(bias[start:stop], x, weight[start:stop].t(), out=out[:, start:stop])
    return out


_background_load: list[threading.Thread] = []
_F32 = torch.float32
_loaded_op: dict[str, Callable[..., torch.Tensor]] = {}  # FASTGEN_EXACT_KERNEL's value -> the loaded op
_mkl_op: list[Callable[..., torch.Tensor] | None] = []  # once the kernels are loaded: MKL's packed op, or None


def ordered_kernel() -> Callable[..., torch.Tensor] | None:
    """``fastgen_cpu::ordered_linear`` when it can run now, else None (never waits for a compiler).

    Prebuilt or cached kernels load at once; otherwise their build starts once in a background thread
    (the exact mode runs ``F.linear`` meanwhile) and later calibrations use them.
    """
    setting = os.environ.get(ORDERED_ENV, "1")
    op = _loaded_op.get(setting)
    if op is not None:  # once loaded it stays: every later call asks only the setting
        return op
    if setting.strip().lower() in cpu_kernels.OFF:
        return None
    if not cpu_kernels.loaded() and not cpu_kernels.available(build=False):
        if not _background_load and cpu_kernels.can_build():
            thread = threading.Thread(target=cpu_kernels.unavailable_reason, name="fastgen-cpu-kernels", daemon=True)
            _background_load.append(thread)
            thread.start()
        return None
    ops = getattr(torch.ops, "fastgen_cpu", None)
    op = getattr(ops, "ordered_linear", None) if ops is not None else None
    if op is not None:
        _loaded_op[setting] = op
    return op


def mkl_op() -> Callable[..., torch.Tensor] | None:
    """``fastgen_cpu::mkl_packed_linear`` where it can run (the kernels loaded, torch exporting MKL's packed sgemm),
    else None (never builds or waits)."""
    if _env.switched_off(MKL_ENV):
        return None
    if not _mkl_op:
        if not cpu_kernels.loaded() and not cpu_kernels.available(build=False):
            return None  # not remembered: the kernels may load later in the process
        ops = torch.ops.fastgen_cpu
        available = hasattr(ops, "mkl_packed_linear") and bool(ops.mkl_sgemm_available())
        _mkl_op.append(ops.mkl_packed_linear if available else None)
    return _mkl_op[0]


#: weight (a Parameter) -> (its stamp, its content fingerprint, its MKL-packed copy); a copy lives as long as
#: its weight and is made only where a key's calibration proved the packed form identical and kept it
_mkl_copies: WeakIdKeyDictionary = WeakIdKeyDictionary()
_mkl_lock = threading.Lock()


def _mkl_source(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can hold a packed copy: a Parameter (the same object at every call, a weak key)."""
    return isinstance(weight, torch.nn.Parameter)


def mkl_packed(weight: torch.Tensor) -> torch.Tensor:
    """The MKL-packed copy of ``weight`` (a Parameter): made at first use, made again when the weight's stamp moved
    (a write through ``.data`` moves none: :func:`refresh_mkl_copies` compares the content once per call)."""
    entry = _mkl_copies.get(weight)
    if entry is None or entry[0] != weight_cache.stamp(weight):
        with _mkl_lock, torch.no_grad():
            packed = torch.ops.fastgen_cpu.mkl_pack_weight(weight.detach())
            entry = (weight_cache.stamp(weight), weight_cache.fingerprint(weight), packed)
            _mkl_copies[weight] = entry
    return entry[2]


def refresh_mkl_copies(weights: list[torch.Tensor]) -> None:
    """Compare each held copy with its weight's content, re-packing those that changed (the exact scope calls this
    once per ``generate`` call; weights without a copy cost a dictionary lookup)."""
    for weight in weights:
        entry = _mkl_copies.get(weight)
        if entry is not None and (
            entry[0] != weight_cache.stamp(weight) or entry[1] != weight_cache.fingerprint(weight)
        ):
            with _mkl_lock:
                del _mkl_copies[weight]
            mkl_packed(weight)


def mkl_bytes() -> int:
    """Bytes MKL allotted to the exact mode's packed copies (most of it never touched, see packed_sgemm.cpp)."""
    return sum(entry[2].numel() for entry in list(_mkl_copies.values()))


def _mkl_candidate(
    x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, reference: torch.Tensor
) -> Callable[[], torch.Tensor] | bool | None:
    """MKL's packed form for this call if it equals ``reference`` on the real input and on a random probe of the
    same shape (as the orders are checked); None where it is not offered, False where its bits differed."""
    op = mkl_op()
    if op is None or not _mkl_source(weight):
        return None
    packed = mkl_packed(weight)
    n = weight.shape[0]
    generator = torch.Generator().manual_seed(1)
    probe_x = torch.randn(x2.shape, generator=generator)
    probe_b = None if bias is None else torch.randn(bias.shape, generator=generator)

    def run() -> torch.Tensor:
        return op(x2, packed, n, bias)

    probe_reference = F.linear(probe_x, weight, probe_b)
    if torch.equal(run(), reference) and torch.equal(op(probe_x, packed, n, probe_b), probe_reference):
        return run
    return False


def _drop_unused_mkl_copy(weight: torch.Tensor) -> None:
    """Give back ``weight``'s copy where no key of its shape keeps the packed form."""
    if not any(c.mkl and k[1:3] == tuple(weight.shape) for k, c in list(_choices.items())):
        with _mkl_lock:
            _mkl_copies.pop(weight, None)


def _orders(weight: torch.Tensor, bias: torch.Tensor | None) -> list[tuple[int, int]]:
    """The distinct (block, bias place) orders for this weight (blocks >= K are one chain; no bias: one place)."""
    k = weight.shape[1]
    blocks = sorted({min(block, k) for block in ORDER_BLOCKS})
    places = (BIAS_FIRST,) if bias is None else (BIAS_FIRST, BIAS_LAST)
    return [(block, place) for block in blocks for place in places]


def _order_name(order: tuple[int, int]) -> str:
    return f"ordered{order[0]}-bias-{'first' if order[1] == BIAS_FIRST else 'last'}"


def _ordered_candidates(
    x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, reference: torch.Tensor
) -> tuple[dict[str, Callable[[], torch.Tensor]], list[str], dict[str, tuple[int, int]]]:
    """Orders whose kernel result equals ``reference``: screened on a column slice, then on the whole, then
    on a random probe of the same shape.

    The probe is why a choice may serve other weights of the shape: the real input can hide an order (a
    zero bias, BART's initial one, makes "bias first" and "bias last" alike; zeros in ``x`` shorten
    chains), a random input and bias of full width cannot.
    """
    op = ordered_kernel()
    if op is None:
        return {}, [], {}
    cols = min(SCREEN_COLUMNS, weight.shape[0])
    w_slice, b_slice = weight[:cols], None if bias is None else bias[:cols]
    generator = torch.Generator().manual_seed(0)
    probe_x = torch.randn(x2.shape, generator=generator)
    probe_b = None if bias is None else torch.randn(bias.shape, generator=generator)
    probe_reference = F.linear(probe_x, weight, probe_b)
    candidates: dict[str, Callable[[], torch.Tensor]] = {}
    orders: dict[str, tuple[int, int]] = {}
    not_identical = []
    for order in _orders(weight, bias):
        name = _order_name(order)
        run = (lambda o: lambda: op(x2, weight, bias, *o))(order)
        if (
            torch.equal(op(x2, w_slice, b_slice, *order), reference[:, :cols])
            and torch.equal(run(), reference)
            and torch.equal(op(probe_x, weight, probe_b, *order), probe_reference)
        ):
            candidates[name], orders[name] = run, order
        else:
            not_identical.append(name)
    return candidates, not_identical, orders


def _key(x: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Key:
    return (
        x.dim(),
        weight.shape[0],
        weight.shape[1],
        bias is not None,
        x2.shape[0],
        torch.get_num_threads(),
        x2.data_ptr() % 64,
    )


def _cheap_key(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Key | None:
    """:func:`_key` without the flattened view (None where it would not be one): most keys of a small model
    keep ``F.linear``, and their calls should pay a dictionary lookup, not every check of :func:`unsupported`."""
    shape = x.shape
    if len(shape) < 2 or weight.dim() != 2 or not shape[-1]:
        return None
    rows = x.numel() // shape[-1]
    return (
        len(shape),
        weight.shape[0],
        weight.shape[1],
        bias is not None,
        rows,
        torch.get_num_threads(),
        x.data_ptr() % 64,
    )


#: what a key without a choice reads as in the cheap lookup (not "linear": it goes the long way)
_NONE = Choice("none", None, {}, ())


def unsupported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why this call runs ``F.linear`` itself (None: it can take the calibrated form).

    Runs on every linear of every step: plain attribute tests only (a few microseconds matter on a small model).
    """
    if torch.compiler.is_compiling():
        return "traced by torch.compile"
    if not (x.is_cpu and weight.is_cpu and (bias is None or bias.is_cpu)):
        return "not on CPU"
    if x.dtype is not _F32 or weight.dtype is not _F32 or (bias is not None and bias.dtype is not _F32):
        return "not float32"
    grads = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if grads and torch.is_grad_enabled():
        return "autograd"
    if x.dim() < 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return "shapes F.linear must judge"
    if not (x.is_contiguous() and weight.is_contiguous() and (bias is None or bias.is_contiguous())):
        return "non-contiguous tensors"
    if weight.shape[0] < MIN_OUT_FEATURES and ordered_kernel() is None:
        return "too few output features to block"
    if x.numel() == 0:
        return "empty input"
    return None


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def pick(medians_ms: dict[str, float]) -> str:
    """The form to keep: the fastest identical candidate if it beats ``F.linear`` by ``MIN_GAIN``, else linear."""
    best = min(medians_ms, key=medians_ms.__getitem__)
    if best == "linear" or medians_ms[best] > medians_ms["linear"] * (1 - MIN_GAIN):
        return "linear"
    return best


def calibrate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Choice, torch.Tensor]:
    """Decide the form for ``x``'s key on ``x`` itself; returns the choice and ``F.linear(x, ...)``.

    The reference is ``F.linear`` on the caller's tensor as given (not a flattened copy), so a
    candidate is kept only if it reproduces exactly what upstream computes for this call.
    """
    result = F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    reference = result.reshape(x2.shape[0], weight.shape[0])
    candidates, not_identical, orders = _ordered_candidates(x2, weight, bias, reference)
    mkl = _mkl_candidate(x2, weight, bias, reference)
    if mkl is False:
        not_identical.append("mkl")
    elif mkl is not None:
        candidates["mkl"] = mkl
    for block in BLOCK_SIZES:
        if block >= weight.shape[0]:
            continue
        name = f"blocked{block}"
        run = (lambda b: lambda: _blocked(x2, weight, bias, b))(block)
        if torch.equal(run(), reference):
            candidates[name] = run
        else:
            not_identical.append(name)
    times: dict[str, list[float]] = {"linear": []} | {name: [] for name in candidates}
    forms = {"linear": lambda: F.linear(x, weight, bias)} | candidates
    for round_ in range(ROUNDS):  # every form has run once (the identity checks); which goes first alternates
        for name in forms if round_ % 2 == 0 else reversed(forms):
            start = time.perf_counter()
            forms[name]()
            times[name].append(time.perf_counter() - start)
    medians = {name: _median(values) * 1e3 for name, values in times.items()}
    best = pick(medians)
    block = int(best.removeprefix("blocked")) if best.startswith("blocked") else None
    trial = _Trial() if best != "linear" and TRIAL_CALLS > 0 else None
    choice = Choice(best, block, medians, tuple(not_identical), orders.get(best), best == "mkl", trial)
    if mkl is not None and best != "mkl":
        _drop_unused_mkl_copy(weight)
    return choice, result


def choice_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Choice | None:
    """The remembered choice for this call's key, or None if it was never calibrated."""
    return _choices.get(_key(x, x.reshape(-1, x.shape[-1]), weight, bias))


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, bit for bit, in the form the calibration found fastest here.

    Semantics are ``F.linear``'s exactly (same bits, same shape); see the module docstring for how
    the form is chosen and which calls run ``F.linear`` itself.
    """
    if not torch.compiler.is_compiling() and _choices.get(_cheap_key(x, weight, bias), _NONE).form == "linear":
        return F.linear(x, weight, bias)  # right for any call: the checks below only guard the other forms
    if unsupported(x, weight, bias) is not None:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    key = _key(x, x2, weight, bias)
    choice = _choices.get(key)
    if choice is None:
        if x2.shape[0] * weight.shape[0] * weight.shape[1] > MAX_CALIBRATION_MACS:
            return F.linear(x, weight, bias)
        seen = _seen[key] = _seen.get(key, 0) + 1
        if seen < CALIBRATE_AFTER:
            return F.linear(x, weight, bias)
        with _lock:  # one calibration per key, and not timed against another thread's
            choice = _choices.get(key)
            if choice is None:
                choice, result = calibrate(x, weight, bias)
                _choices[key] = choice
                return result
    if choice.trial is not None:
        return _on_trial(key, choice, x, x2, weight, bias)
    return _run(choice, x, x2, weight, bias)


def _run(
    choice: Choice, x: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if choice.order is not None:
        op = torch.ops.fastgen_cpu.ordered_linear
        return op(x2, weight, bias, *choice.order).reshape(*x.shape[:-1], weight.shape[0])
    if choice.mkl:  # another weight of the key's shape that is no Parameter: F.linear, the same bits
        op = mkl_op()
        if op is None or not _mkl_source(weight):
            return F.linear(x, weight, bias)
        return op(x, mkl_packed(weight), weight.shape[0], bias)
    if choice.block is None:
        return F.linear(x, weight, bias)
    return _blocked(x2, weight, bias, choice.block).reshape(*x.shape[:-1], weight.shape[0])


def _on_trial(
    key: Key, choice: Choice, x: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One real call of a key on trial: the candidate or ``F.linear`` (alternating), timed; the verdict after
    :data:`TRIAL_CALLS` of each."""
    trial = choice.trial
    use_form = len(trial.form) <= len(trial.linear)
    start = time.perf_counter()
    result = _run(choice, x, x2, weight, bias) if use_form else F.linear(x, weight, bias)
    (trial.form if use_form else trial.linear).append((time.perf_counter() - start) * 1e3)
    if len(trial.linear) >= TRIAL_CALLS:
        with _lock:
            if _choices.get(key) is choice:
                medians = {"linear": _median(trial.linear), choice.form: _median(trial.form)}
                kept = (
                    choice
                    if pick(medians) != "linear"
                    else Choice("linear", None, choice.times_ms, choice.not_identical)
                )
                _choices[key] = dataclasses.replace(kept, trial=None, in_place_ms=medians)
                if choice.mkl and not kept.mkl:
                    _drop_unused_mkl_copy(weight)
    return result


def settled_form(dim: int, rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> Choice | None:
    """The choice :func:`exact_linear` keeps from now on for a contiguous, 64-byte aligned ``dim``-D CPU fp32 input
    of ``rows`` rows (what a compiled step hands it), or None while it may still change (not calibrated yet, or
    on trial). A key that is never calibrated reads as ``F.linear``."""
    key = (dim, weight.shape[0], weight.shape[1], bias is not None, rows, torch.get_num_threads(), 0)
    choice = _choices.get(key)
    if choice is None:
        never = rows * weight.shape[0] * weight.shape[1] > MAX_CALIBRATION_MACS or (
            weight.shape[0] < MIN_OUT_FEATURES and ordered_kernel() is None
        )
        return _LINEAR if never else None
    return None if choice.trial is not None else choice


_LINEAR = Choice("linear", None, {}, ())


def forget_choices() -> None:
    """Drop every remembered choice and packed copy (tests; a process whose thread count or load changed for good)."""
    with _lock:
        _choices.clear()
        _seen.clear()
    with _mkl_lock:
        _mkl_copies.clear()


def choices() -> dict[Key, Choice]:
    """A copy of the remembered choices (for ``fastgen.info``-style reports and tests)."""
    return dict(_choices)


def forms_summary() -> str:
    """The forms the calibrations chose in this process, with how many keys each (for reports and info)."""
    counts: dict[str, int] = {}
    for choice in list(_choices.values()):
        counts[choice.form] = counts.get(choice.form, 0) + 1
    if not counts:
        return "no shape calibrated yet"
    return ", ".join(f"{form} x{n}" for form, n in sorted(counts.items(), key=lambda item: -item[1]))
