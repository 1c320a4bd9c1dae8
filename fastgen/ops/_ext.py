"""Loads the compiled kernels (``fastgen._C``) once, and says why when it can't.

Order: a prebuilt ``fastgen._C`` (from ``setup.py`` on a CUDA machine), else a JIT build of
``csrc/*.cu`` + ``csrc/bindings.cpp`` with ``torch.utils.cpp_extension.load`` into a cache dir. Nothing
here raises: an extension built for another torch (the classic "undefined symbol" after an upgrade)
or a failed build only makes :func:`load` return None and :func:`unavailable_reason` explain it,
and the ops fall back to Triton or torch.

Environment: ``FASTGEN_JIT=0`` disables the JIT build; ``FASTGEN_CACHE`` overrides the build cache
(default ``~/.cache/fastgen``).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from fastgen._log import origin

logger = logging.getLogger("fastgen")

# An installed wheel carries the sources as package data (setup.py copies csrc/ there); a checkout has csrc/.
_PACKAGED_CSRC = Path(__file__).resolve().parents[1] / "_csrc"
_CSRC = _PACKAGED_CSRC if _PACKAGED_CSRC.is_dir() else Path(__file__).resolve().parents[2] / "csrc"

_lock = threading.Lock()
_loaded = False
_module: ModuleType | None = None
_reason: str | None = None
_source: str | None = None  # "prebuilt" or "jit"


def _release(version: str) -> str:
    """'2.13.0+cu128' -> '2.13.0': the part that decides ABI compatibility of an extension."""
    match = re.match(r"\d+\.\d+\.\d+", version)
    return match.group(0) if match else version


def _cache_dir() -> Path:
    root = Path(os.environ.get("FASTGEN_CACHE", Path.home() / ".cache" / "fastgen"))
    tag = f"torch{_release(torch.__version__)}-cu{torch.version.cuda}"
    return root / "build" / tag


def _check_torch_version(module: ModuleType) -> str | None:
    built = getattr(module, "torch_version", None)
    running = _release(torch.__version__)
    if built is None:
        return f"fastgen._C reports no torch version (running {running}); rebuild it"
    if built != running:
        return f"fastgen._C was built for torch {built}, running {running}; reinstall fastgen to rebuild it"
    return None


def _import_prebuilt() -> tuple[ModuleType | None, str | None]:
    """The prebuilt module, or None and why; ``None, None`` when there is none to import."""
    try:
        module = importlib.import_module("fastgen._C")
    except ModuleNotFoundError as exc:
        if exc.name == "fastgen._C":
            return None, None
        return None, f"prebuilt fastgen._C failed to import: {exc}"
    except (ImportError, OSError) as exc:  # undefined symbols / wrong libtorch: built against another torch
        return None, f"prebuilt fastgen._C does not load with torch {torch.__version__} (built for another?): {exc}"
    mismatch = _check_torch_version(module)
    return (None, mismatch) if mismatch else (module, None)


def _jit_build() -> tuple[ModuleType | None, str | None]:
    if os.environ.get("FASTGEN_JIT", "1").strip().lower() in {"0", "false", "no", "off"}:
        return None, "no prebuilt fastgen._C and JIT builds are disabled (FASTGEN_JIT=0)"
    sources = [*sorted(_CSRC.glob("*.cu")), _CSRC / "bindings.cpp"]
    if not (_CSRC / "bindings.cpp").is_file():
        return None, f"no prebuilt fastgen._C and no sources to build it from ({_CSRC} is not a source checkout)"
    from torch.utils import cpp_extension

    cuda_home = cpp_extension.CUDA_HOME
    if shutil.which("nvcc") is None and not (cuda_home and Path(cuda_home, "bin", "nvcc").exists()):
        return None, "no prebuilt fastgen._C and no nvcc to build it (set CUDA_HOME or install the CUDA toolkit)"
    build_dir = _cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("%sbuilding the CUDA extension into %s (first use only)", origin(), build_dir)
    try:
        module = cpp_extension.load(
            name="fastgen_C",
            sources=[str(s) for s in sources],
            build_directory=str(build_dir),
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            verbose=False,
        )
    except Exception as exc:  # compiler errors surface as RuntimeError/CalledProcessError/OSError
        message = str(exc).strip().splitlines()
        tail = " | ".join(message[-5:]) if message else type(exc).__name__
        return None, f"JIT build of csrc/ failed ({type(exc).__name__}): {tail}"
    mismatch = _check_torch_version(module)
    return (None, mismatch) if mismatch else (module, None)


def _load_uncached() -> tuple[ModuleType | None, str | None, str | None]:
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is built without CUDA", None
    if not torch.cuda.is_available():
        return None, "no CUDA device", None
    module, reason = _import_prebuilt()
    if module is not None:
        return module, None, "prebuilt"
    if reason is not None:
        logger.warning("%s%s; trying a JIT build", origin(), reason)
    module, jit_reason = _jit_build()
    if module is not None:
        return module, None, "jit"
    return None, jit_reason if reason is None else f"{reason}; {jit_reason}", None


def load() -> ModuleType | None:
    """The compiled extension, or None (see :func:`unavailable_reason`). Tries once per process."""
    global _loaded, _module, _reason, _source
    if _loaded:
        return _module
    with _lock:
        if not _loaded:
            try:
                _module, _reason, _source = _load_uncached()
            except Exception as exc:  # never let a loader bug break generation
                _module, _reason, _source = None, f"unexpected error while loading: {type(exc).__name__}: {exc}", None
            if _module is None:
                # Expected on CPU-only machines; a real failure where a GPU is present deserves a warning.
                level = logging.WARNING if torch.cuda.is_available() else logging.INFO
                logger.log(level, "%scompiled kernels unavailable: %s", origin(), _reason)
            _loaded = True
    return _module


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None if it has not been called or succeeded)."""
    return _reason


def build_info() -> dict[str, Any]:
    """Facts for ``python -m fastgen.info``: what was loaded, from where, for which versions."""
    load()
    return {
        "available": _module is not None,
        "source": _source,
        "reason": _reason,
        "built_for_torch": getattr(_module, "torch_version", None),
        "cuda_runtime_version": getattr(_module, "cuda_runtime_version", None),
        "running_torch": torch.__version__,
        "running_cuda": torch.version.cuda,
        "sources": str(_CSRC) if _CSRC.is_dir() else None,
    }


def _reset_for_tests() -> None:
    global _loaded, _module, _reason, _source
    with _lock:
        _loaded, _module, _reason, _source = False, None, None, None
