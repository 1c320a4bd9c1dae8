"""``exact_linear``: ``F.linear`` on CPU fp32 in the fastest form that gives the same bits.

Why: at the row counts of a decode step (a few to a few dozen hypotheses) MKL's single
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
* later calls with the key run the kept form. The choice is remembered for the process.

The candidates never copy the weight (column blocks of a row-major ``(N, K)`` weight are
contiguous views), so the feature costs no memory beyond the output it returns.

Anything but a plain CPU fp32 call (autograd, other dtypes or devices, non-contiguous input,
tracing under ``torch.compile``) runs ``F.linear`` itself: :func:`exact_linear` is then exactly
upstream's op.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

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
#: Calls of a key that run ``F.linear`` before it is calibrated ("rent before you buy"): calibrating
#: costs about as much as this many calls (verification plus ROUNDS timed rounds of every form), so a
#: key used only a few times (a passing row count) never pays for it, and one that is used often has
#: spent at most as much as the calibration before the calibration starts paying back.
CALIBRATE_AFTER = 16

Key = tuple[int, int, bool, int, int, int, int]


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the calibration decided for one key, with its evidence (for reports and tests)."""

    form: str  # "linear" or "blocked<size>"
    block: int | None
    times_ms: dict[str, float]  # median per candidate (identical ones only)
    not_identical: tuple[str, ...]  # candidates dropped because their bits differed


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


def unsupported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why this call runs ``F.linear`` itself (None: it can take the calibrated form)."""
    if torch.compiler.is_compiling():
        return "traced by torch.compile"
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(t.device.type != "cpu" for t in tensors):
        return "not on CPU"
    if any(t.dtype != torch.float32 for t in tensors):
        return "not float32"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "autograd"
    if x.dim() < 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return "shapes F.linear must judge"
    if not (x.is_contiguous() and weight.is_contiguous() and (bias is None or bias.is_contiguous())):
        return "non-contiguous tensors"
    if weight.shape[0] < MIN_OUT_FEATURES:
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
    candidates: dict[str, Callable[[], torch.Tensor]] = {}
    not_identical = []
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
    for _ in range(ROUNDS):
        for name, run in forms.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    medians = {name: _median(values) * 1e3 for name, values in times.items()}
    best = pick(medians)
    block = None if best == "linear" else int(best.removeprefix("blocked"))
    return Choice(best, block, medians, tuple(not_identical)), result


def choice_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Choice | None:
    """The remembered choice for this call's key, or None if it was never calibrated."""
    return _choices.get(_key(x, x.reshape(-1, x.shape[-1]), weight, bias))


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, bit for bit, in the form the calibration found fastest here.

    Semantics are ``F.linear``'s exactly (same bits, same shape); see the module docstring for how
    the form is chosen and which calls run ``F.linear`` itself.
    """
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
    if choice.block is None:
        return F.linear(x, weight, bias)
    return _blocked(x2, weight, bias, choice.block).reshape(*x.shape[:-1], weight.shape[0])


def forget_choices() -> None:
    """Drop every remembered choice (tests; a process whose thread count or load changed for good)."""
    with _lock:
        _choices.clear()
        _seen.clear()


def choices() -> dict[Key, Choice]:
    """A copy of the remembered choices (for ``fastgen.info``-style reports and tests)."""
    return dict(_choices)
