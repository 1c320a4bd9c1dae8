"""``packed_linear``: ``nn.Linear`` on oneDNN with a pre-packed weight — faster, *not* bit-identical.

Why: on CPUs where MKL's ``sgemm`` runs below the machine's speed (measured on an AMD EPYC: 1.7x to
2.6x slower than oneDNN for every linear of a BART-base decode step and encoder), oneDNN's JIT
kernels with the weight reordered once into their blocked layout (what Inductor's CPU freezing
pass does) give CTranslate2-like speed. The price is rounding: results differ from ``F.linear`` by a
few ulps (a different accumulation order), so greedy and beam outputs can diverge from upstream's
where two candidates are nearly tied. That is why this is the opt-in ``fast_gemm`` feature, and
why the exact ``gemm`` feature never uses it.

Which is faster depends on the CPU *and the shape* (on an AVX2-only EPYC oneDNN lost to MKL for
16 x 3072 -> 768 and for the encoder's 1024-row products, while winning for the vocabulary projection),
so nothing is assumed: at its first call each key (weight shape, row count, threads) is timed against the
exact mode's form of the product (:func:`fastgen.ops.linear.exact_linear`: ``F.linear``'s bits, in its
fastest calibrated form) on the real input (alternating rounds) and keeps the faster (:func:`choices`
shows the evidence). The mode is thus never slower than the exact mode by more than the timing noise, on
any CPU. The choice is made before the key's first result is returned, so two identical calls give
identical outputs (a choice made after some calls had run packed changed the logits of later calls by
~1e-5).

Memory: the packed weight is a second copy of every weight it serves, kept per module for the process
while the module lives and re-packed when the weight changes in any way, ``.data`` writes included
(:mod:`fastgen.ops.weight_cache`). :func:`packed_bytes` reports the total.

The packed form is ``torch.ops.mkldnn._linear_pointwise`` with a weight from
``torch.ops.mkldnn._reorder_linear_weight`` (the pair Inductor's freezing emits); when either is
missing or oneDNN is unavailable, :func:`unavailable` says why and callers run ``F.linear``. Where torch
carries MKL and fastgen's CPU kernels are loaded, the timing has a third form, ``"mkl"``: MKL's packed-B
sgemm (``fastgen_cpu::mkl_packed_linear``, the weight packed once as CTranslate2 packs it; on an Intel Xeon
15-18% faster than oneDNN's packed linear for a small BART's decoder products inside the step). Each copy is
made when its form first runs for the module; :func:`mkl_unavailable` says why MKL's is not offered, and
``FASTGEN_MKL_PACKED=0`` turns it off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from fastgen import _env
from fastgen.ops import cpu_kernels
from fastgen.ops.linear import MKL_ENV, exact_linear
from fastgen.ops.weight_cache import DerivedWeights, fingerprint

#: The call of a key that times it against the exact form (1: the first, so every result of the key comes
#: from one form; a later call would switch forms, and rounding, between identical calls).
CALIBRATE_AFTER = 1
#: Timing rounds (each times the exact and the packed form, which first alternating), after one untimed run of
#: each: a first run at a new shape pays oneDNN's kernel generation and cold caches (timed, it made the packed
#: form look 2-3x slower than it runs and kept MKL for 1024 -> 256 at 16 rows, where packed is 1.6x faster).
ROUNDS = 5
#: A round times each form over this many milliseconds of back-to-back calls (at most :data:`MAX_REPEATS`): one
#: call of a small product is a few tens of microseconds, less than the noise of timing it once.
ROUND_MS = 0.25
MAX_REPEATS = 8
#: Keys larger than this many multiply-adds are not timed (packed is kept): a long prefill.
MAX_CALIBRATION_MACS = 4e9

Key = tuple[int, int, int, int]
_lock = threading.Lock()
_choices: dict[Key, dict[str, float]] = {}  # key -> median ms per form ("packed", "mkl" where offered, "linear")
_seen: dict[Key, int] = {}


def is_conv1d(module: torch.nn.Module) -> bool:
    """Exactly Transformers' ``Conv1D`` (GPT-2's linears, weight ``(in, out)``), named without importing it."""
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__ == "transformers.pytorch_utils"


def out_in_weight(module: torch.nn.Module) -> torch.Tensor:
    """The module's weight as ``(out, in)`` (Conv1D stores ``(in, out)``)."""
    return module.weight.detach().t().contiguous() if is_conv1d(module) else module.weight.detach()


def _pack(module: torch.nn.Module) -> tuple[torch.Tensor, int]:
    packed = torch.ops.mkldnn._reorder_linear_weight(out_in_weight(module))
    return packed, packed.numel() * packed.element_size()


_packed = DerivedWeights(_pack)


def _mkl_pack(module: torch.nn.Module) -> tuple[torch.Tensor, int]:
    packed = torch.ops.fastgen_cpu.mkl_pack_weight(out_in_weight(module))
    return packed, packed.numel()


_mkl_packed = DerivedWeights(_mkl_pack)


def mkl_unavailable() -> str | None:
    """Why the calibration does not offer MKL's packed sgemm here (None: it does)."""
    if _env.switched_off(MKL_ENV):
        return f"{MKL_ENV}=0"
    if not cpu_kernels.available(build=False) or not hasattr(torch.ops.fastgen_cpu, "mkl_packed_linear"):
        return "fastgen's CPU kernels (with the MKL packed linear) are not loaded"
    if not torch.ops.fastgen_cpu.mkl_sgemm_available():
        return f"torch {torch.__version__} exports no MKL packed sgemm"
    return None


def unavailable() -> str | None:
    """Why this torch build cannot run the packed oneDNN linear (None: it can)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    ops = torch.ops.mkldnn
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(ops, name):
            return f"torch.ops.mkldnn.{name} is missing in torch {torch.__version__}"
    return None


def module_problem(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot run packed (None: it can)."""
    weight, bias = module.weight, module.bias
    if weight.device.type != "cpu":
        return f"weights on {weight.device.type} (oneDNN packing is for CPU)"
    if weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        return f"weights in {weight.dtype} (the packed path is float32)"
    return None


def runs_packed(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a call may take the packed path (not traced, CPU fp32, no autograd, 2+ dims, not empty)."""
    return not (
        torch.compiler.is_compiling()
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        or x.dim() < 2
        or x.numel() == 0
    )


def _exact(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Upstream's bits in the exact mode's fastest form (``exact_linear``; Conv1D: its own forward)."""
    return type(module).forward(module, x) if is_conv1d(module) else exact_linear(x, module.weight, module.bias)


def _run_packed(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _packed.get(module), module.bias, "none", [], "")


def _run_mkl(module: torch.nn.Module, x: torch.Tensor, activation: int = 0) -> torch.Tensor:
    out_features = module.weight.shape[1] if is_conv1d(module) else module.weight.shape[0]
    return torch.ops.fastgen_cpu.mkl_packed_linear(x, _mkl_packed.get(module), out_features, module.bias, activation)


#: the activation codes (``int8_linear``'s GELU, RELU, SILU, which imports this module) as torch computes them:
#: what the layer's own activation would run
_TORCH_ACTIVATIONS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    1: torch.nn.functional.gelu,
    2: torch.nn.functional.relu,
    3: torch.nn.functional.silu,
}


def _run(form: str, module: torch.nn.Module, x: torch.Tensor, activation: int = 0) -> torch.Tensor:
    """``module(x)`` in ``form``, then the fused activation (MKL's form applies it in its own pass; the others
    through torch's op, the bits the layer's own activation would give)."""
    if form == "mkl":
        return _run_mkl(module, x, activation)
    y = _run_packed(module, x) if form == "packed" else _exact(module, x)
    return _TORCH_ACTIVATIONS[activation](y) if activation else y


def _kept(choice: dict[str, float]) -> str:
    """The fastest form of a timed key (the first listed on a tie: packed, mkl, linear)."""
    return min(choice, key=choice.__getitem__)


def _time_into(run: Callable[[], torch.Tensor], times: list[float], repeats: int = 1) -> None:
    """Append the milliseconds one call of ``run`` takes, averaged over ``repeats`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    times.append((time.perf_counter() - start) * 1e3 / repeats)


def _calibrate(key: Key, module: torch.nn.Module, x: torch.Tensor, activation: int = 0) -> torch.Tensor:
    """Time packed against upstream's op on ``x``; remember the medians; return the kept form's result."""
    forms = {"packed": lambda: _run_packed(module, x)}
    if mkl_unavailable() is None:
        forms["mkl"] = lambda: _run_mkl(module, x)
    forms["linear"] = lambda: _exact(module, x)
    times: dict[str, list[float]] = {form: [] for form in forms}
    first: list[float] = []
    for run in forms.values():
        _time_into(run, first)
    repeats = max(1, min(MAX_REPEATS, int(ROUND_MS / max(max(first), 1e-3))))
    for round_ in range(ROUNDS):
        for form in forms if round_ % 2 == 0 else reversed(forms):
            _time_into(forms[form], times[form], repeats)
    choice = _choices[key] = {form: sorted(values)[len(values) // 2] for form, values in times.items()}
    return _run(_kept(choice), module, x, activation)


def packed_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` on oneDNN with the module's packed weight where that is the faster form here.

    Runs upstream's bits (``exact_linear``, or Conv1D's own ``forward``) under ``torch.compile`` tracing, with
    autograd, for non-fp32 or non-CPU inputs, and for keys whose timing found it faster.
    """
    if not runs_packed(module.weight, x):
        return _exact(module, x)
    return faster_form(module, x)


def faster_form(module: torch.nn.Module, x: torch.Tensor, activation: int = 0) -> torch.Tensor:
    """``module(x)`` in the form timed faster for its key (packed until timed), for a call
    :func:`runs_packed` admits (the caller has checked); ``activation``: the layer's activation code, applied to the
    result (an ``fc1`` whose activation the scope fuses)."""
    rows = x.numel() // x.shape[-1]
    key = (*module.weight.shape, rows, torch.get_num_threads())
    choice = _choices.get(key)
    if choice is None:
        seen = _seen[key] = _seen.get(key, 0) + 1
        if seen < CALIBRATE_AFTER or rows * module.weight.numel() > MAX_CALIBRATION_MACS:
            return _run("packed", module, x, activation)
        with _lock:
            if key not in _choices:
                return _calibrate(key, module, x, activation)
            choice = _choices[key]
    return _run(_kept(choice), module, x, activation)


def settled_form(weight: torch.Tensor, rows: int) -> str | None:
    """The form :func:`faster_form` keeps from now on for ``rows``-row calls on ``weight`` ("packed", "mkl" or
    "linear", the exact mode's form), or None while its timing is still to come. A key never timed reads as packed."""
    choice = _choices.get((*weight.shape, rows, torch.get_num_threads()))
    if choice is None:
        return "packed" if rows * weight.numel() > MAX_CALIBRATION_MACS else None
    return _kept(choice)


def prepack(module: torch.nn.Module) -> int:
    """Check the packed copies ``module`` holds against its weight's content (once per call: a ``.data`` write moves
    no stamp), rebuilding any that changed; returns their bytes. A copy is made when its form first runs, so a
    module holds only the forms its keys use."""
    if not (_packed.holds(module) or _mkl_packed.holds(module)):
        return 0
    digest = fingerprint(module.weight)  # one pass over the weight for both copies
    return _packed.refresh_held(module, digest) + _mkl_packed.refresh_held(module, digest)


def packed_bytes() -> int:
    """Bytes held by every packed weight alive in this process (the fast mode's extra memory)."""
    return _packed.total_bytes() + _mkl_packed.total_bytes()


def choices() -> dict[Key, dict[str, float]]:
    """The timed keys: median milliseconds of the packed and the exact form (key "linear"; reports, tests)."""
    return dict(_choices)


def forget_packed(keep_choices: bool = False) -> None:
    """Drop every packed weight and, unless ``keep_choices``, every timing (tests; to give the memory back)."""
    _packed.clear()
    _mkl_packed.clear()
    if not keep_choices:
        with _lock:
            _choices.clear()
            _seen.clear()
