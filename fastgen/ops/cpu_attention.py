"""Decode-step attention on CPU for the opt-in fast modes: a few query rows over many keys, one pass.

Why: in a CPU beam-search step each input's ``beams x 1`` query rows attend over its encoder keys
(cross-attention, keys shared across the beams) and each hypothesis' one query over its own cache
(self-attention). Stock SDPA runs its flash kernel per (batch, head) pair with blocked GEMM calls
sized for long queries: on bart-base (beam 4, 256 source tokens, one core of an AMD EPYC) a
cross-attention call took ~620 us where reading its K/V once takes ~200 us, and a self-attention
call ~100 us for a few KB of work. The C++ kernel (``csrc/cpu/decode_attention.cpp``) reads each key
and value row once and is 1.5x (cross) and 2.3x (self) faster there.

It sums in another order than SDPA (results agree to float32 rounding, not bit for bit), so only
``fast_gemm`` and ``int8`` use it, never the default exact mode. It is built on first use with
``torch.utils.cpp_extension`` for the machine at hand (``-march=native``, a few seconds, cached
under ``~/.cache/fastgen``); without a compiler or ninja, with ``FASTGEN_JIT=0`` or
``FASTGEN_CPU_ATTENTION=0`` the stock attention runs (:func:`unavailable_reason` says why).

:func:`decode_attention_reference` is the same computation in torch, for the tests.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

from fastgen._log import origin
from fastgen.ops._ext import _CSRC, _release

logger = logging.getLogger("fastgen")

#: the compiler flags: vectorize for this CPU, let reductions reassociate (a tree instead of a chain)
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math"]  # fmt: skip
MAX_QUERY_ROWS = 16  # beyond this a GEMM-based kernel (SDPA's) is the better tool

_lock = threading.Lock()
_state: dict[str, object] = {}


def _source() -> Path:
    return _CSRC / "cpu" / "decode_attention.cpp"


def _build_dir() -> Path:
    """Per torch release and CPU (``-march=native`` code must not move to another CPU kind)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        flags = platform.processor()
    cpu = hashlib.sha256(flags.encode()).hexdigest()[:12]
    root = Path(os.environ.get("FASTGEN_CACHE", Path.home() / ".cache" / "fastgen"))
    return root / "build" / f"torch{_release(torch.__version__)}-cpu-{cpu}"


def _disabled() -> str | None:
    off = {"0", "false", "no", "off"}
    if os.environ.get("FASTGEN_CPU_ATTENTION", "1").strip().lower() in off:
        return "FASTGEN_CPU_ATTENTION=0"
    if os.environ.get("FASTGEN_JIT", "1").strip().lower() in off:
        return "JIT builds are disabled (FASTGEN_JIT=0)"
    return None


def _load() -> str | None:
    """Build (or reuse) and load the kernel; None on success, else why not."""
    if not hasattr(torch.ops, "fastgen_cpu") or not hasattr(torch.ops.fastgen_cpu, "decode_attention"):
        source = _source()
        if not source.is_file():
            return f"no kernel source at {source}"
        from torch.utils import cpp_extension

        build_dir = _build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        logger.info("%sbuilding the CPU attention kernel into %s (first use only)", origin(), build_dir)
        cpp_extension.load(
            name="fastgen_cpu_attention",
            sources=[str(source)],
            build_directory=str(build_dir),
            extra_cflags=CFLAGS,
            is_python_module=False,
            verbose=False,
        )
    return None


def unavailable_reason() -> str | None:
    """Why the kernel can't run (None: it can). Builds it on the first call of the process."""
    disabled = _disabled()
    if disabled is not None:
        return disabled
    if "reason" not in _state:
        with _lock:
            if "reason" not in _state:
                try:
                    _state["reason"] = _load()
                except Exception as exc:  # compiler/ninja missing, build errors: stock attention runs
                    lines = str(exc).strip().splitlines()
                    _state["reason"] = f"CPU attention kernel unavailable ({type(exc).__name__}): " + " | ".join(
                        lines[-3:]
                    )
                if _state["reason"] is not None:
                    logger.info("%s%s", origin(), _state["reason"])
    return _state["reason"]  # type: ignore[return-value]


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel takes these tensors (else the caller runs stock attention)."""
    if query.device.type != "cpu" or not (query.dtype == key.dtype == value.dtype == torch.float32):
        return False
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[2] > MAX_QUERY_ROWS:
        return False
    if key.shape[:2] != query.shape[:2] or value.shape[:3] != key.shape[:3] or key.shape[3] != query.shape[3]:
        return False  # grouped-query heads or odd shapes: SDPA handles them
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    if mask is not None:
        if mask.dim() != 4 or mask.device.type != "cpu" or mask.dtype not in (torch.bool, torch.float32):
            return False
        broadcasts = all(m in (1, t) for m, t in zip(mask.shape[:3], query.shape[:3], strict=True))
        if mask.shape[3] != key.shape[2] or not broadcasts:
            return False
    return unavailable_reason() is None


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` laid out ``(B, M, H, D)``; call :func:`supports` first."""
    return torch.ops.fastgen_cpu.decode_attention(query, key, value, mask, float(scale))


def decode_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The kernel's semantics in torch: a bool mask keeps True positions, a float mask is added; a row
    with every position masked out gives zeros (SDPA would give NaN there)."""
    scores = torch.matmul(query.double(), key.double().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return torch.matmul(weights, value.double()).to(query.dtype).transpose(1, 2)
