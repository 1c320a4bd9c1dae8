"""The one backend rule every op with kernels follows (DESIGN.md §3).

Dispatch order on CUDA tensors: compiled CUDA extension → Triton → torch; on CPU: torch (Triton
too under ``TRITON_INTERPRET=1`` when asked for). An explicit ``backend=`` is strict: a call it
cannot serve raises, because forcing is for measuring and bisecting. ``FASTGEN_BACKEND`` is a
process-wide preference: a call it cannot serve takes the default, with one warning per reason.
An op supplies only ``problem(backend) -> reason | None`` for its own arguments; this module
adds the device and availability checks and the choice.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from types import ModuleType

import torch

from fastgen._log import origin

BACKENDS = ("cuda", "triton", "torch")

_logger = logging.getLogger("fastgen")
_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        _logger.warning("%s%s", origin(), message)


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "yes", "on"}


class TritonKernels:
    """A Triton kernel module imported on first use (``import fastgen`` must not pay for Triton).

    An import failure means "not this backend", never a crash: it is reported once and kept as
    :attr:`reason`.
    """

    def __init__(self, module: str, op: str) -> None:
        self.module_name, self.op = module, op
        self.module: ModuleType | None = None
        self.reason: str | None = None
        self.tried = False

    def load(self) -> ModuleType | None:
        if not self.tried:
            self.tried = True
            try:
                self.module = importlib.import_module(self.module_name)
            except Exception as exc:  # any import failure means "not this backend", never a crash
                self.reason = f"Triton kernels failed to import: {type(exc).__name__}: {exc}"
                _logger.warning("%s%s skips the Triton backend: %s", origin(), self.op, self.reason)
        return self.module


def device_problem(
    backend: str, device_type: str, cuda_module: Callable[[], ModuleType | None], triton: TritonKernels
) -> str | None:
    """Why ``backend`` cannot run on ``device_type`` at all (its op's own limits aside), or None."""
    if backend == "torch":
        return None
    if backend == "cuda":
        if device_type != "cuda":
            return f"tensors on {device_type}, not CUDA"
        if cuda_module() is None:
            from fastgen.ops import _ext

            return f"CUDA extension unavailable: {_ext.unavailable_reason() or 'built without this op'}"
        return None
    if backend == "triton":
        if device_type != "cuda" and not (device_type == "cpu" and triton_interpreted()):
            return f"tensors on {device_type} (Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1)"
        if triton.load() is None:
            return triton.reason
        return None
    return f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})"


def choose_backend(op: str, forced: str | None, problem: Callable[[str], str | None], device_type: str) -> str:
    """``forced`` if given (raises if it cannot serve the call), else ``FASTGEN_BACKEND`` if it can
    (one warning per reason otherwise), else CUDA extension → Triton on CUDA tensors, torch otherwise."""
    if forced is not None:
        reason = problem(forced)
        if reason is not None:
            raise RuntimeError(f"{op}: backend {forced!r} cannot run this call: {reason}")
        return forced
    preferred = os.environ.get("FASTGEN_BACKEND", "").strip().lower() or None
    if preferred is not None:
        reason = problem(preferred) if preferred in BACKENDS else "unknown backend"
        if reason is None:
            return preferred
        warn_once(f"{op}: FASTGEN_BACKEND={preferred!r} cannot run this call ({reason}); using the default")
    if device_type == "cuda":
        for backend in ("cuda", "triton"):
            if problem(backend) is None:
                return backend
    return "torch"


def without_cuda_device() -> dict[str, str | None] | None:
    """``available_backends`` for a CUDA request on a machine without one (None: there is one)."""
    if torch.cuda.is_available():
        return None
    from fastgen.ops import _ext

    _ext.load()
    return {"cuda": _ext.unavailable_reason() or "no CUDA device", "triton": "no CUDA device", "torch": None}
