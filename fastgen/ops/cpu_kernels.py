"""Builds and loads fastgen's CPU kernels (``csrc/cpu/*.cpp``, ops ``torch.ops.fastgen_cpu.*``) once.

Why JIT: the kernels are plain loops left to the compiler's vectorizer, so they are built on the
machine that runs them (``-march=native``: AVX2 or AVX-512 as the CPU has), with
``torch.utils.cpp_extension`` (a few seconds on first use, cached per torch release and CPU under
``~/.cache/fastgen``). Only the opt-in fast modes use them (:mod:`fastgen.ops.cpu_attention`,
:mod:`fastgen.ops.int8_linear`); without a compiler or ninja, or with ``FASTGEN_JIT=0`` or
``FASTGEN_CPU_KERNELS=0``, those modes run torch's ops instead (:func:`unavailable_reason` says why).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from fastgen._log import origin
from fastgen.ops._ext import _CSRC, _release

logger = logging.getLogger("fastgen")

#: reductions may reassociate (a tree instead of a chain); no errno from libm
CFLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
#: the CPU to vectorize for: ``native`` (this one); ``FASTGEN_CPU_MARCH=haswell`` builds the AVX2 path (tests)
MARCH_ENV = "FASTGEN_CPU_MARCH"


def _march() -> str:
    return os.environ.get(MARCH_ENV, "native").strip() or "native"


OFF = frozenset({"0", "false", "no", "off"})

_lock = threading.Lock()
_state: dict[str, str | None] = {}


def sources() -> list[Path]:
    return sorted((_CSRC / "cpu").glob("*.cpp"))


def _build_dir() -> Path:
    """Per torch release and CPU (``-march=native`` code must not move to another CPU kind)."""
    flags = platform.processor()
    with contextlib.suppress(OSError):  # no /proc: the processor name
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    cpu = hashlib.sha256(f"{flags} {_march()}".encode()).hexdigest()[:12]
    root = Path(os.environ.get("FASTGEN_CACHE", Path.home() / ".cache" / "fastgen"))
    return root / "build" / f"torch{_release(torch.__version__)}-cpu-{cpu}"


def _disabled() -> str | None:
    if os.environ.get("FASTGEN_CPU_KERNELS", "1").strip().lower() in OFF:
        return "FASTGEN_CPU_KERNELS=0"
    if os.environ.get("FASTGEN_JIT", "1").strip().lower() in OFF:
        return "JIT builds are disabled (FASTGEN_JIT=0)"
    return None


def _load() -> str | None:
    """Build (or reuse) and load the library; None on success, else why not."""
    if hasattr(torch.ops, "fastgen_cpu") and hasattr(torch.ops.fastgen_cpu, "attention"):
        return None  # loaded already in this process
    files = sources()
    if not files:
        return f"no CPU kernel sources in {_CSRC / 'cpu'}"
    from torch.utils import cpp_extension

    build_dir = _build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("%sbuilding the CPU kernels into %s (first use only)", origin(), build_dir)
    with _ninja_on_path():
        cpp_extension.load(
            name="fastgen_cpu_kernels",
            sources=[str(f) for f in files],
            build_directory=str(build_dir),
            extra_cflags=[*CFLAGS, f"-march={_march()}"],
            is_python_module=False,
            verbose=False,
        )
    return None


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """The ``ninja`` wheel's binary on PATH for the build, where no other ninja is (a venv not activated)."""
    original = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError, AttributeError):
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, original])
    try:
        yield
    finally:
        os.environ["PATH"] = original


def unavailable_reason() -> str | None:
    """Why the CPU kernels can't run (None: they can). Builds them on the first call of the process."""
    disabled = _disabled()
    if disabled is not None:
        return disabled
    if "reason" not in _state:
        with _lock:
            if "reason" not in _state:
                try:
                    _state["reason"] = _load()
                except Exception as exc:  # compiler/ninja missing, build errors: torch's ops run instead
                    lines = str(exc).strip().splitlines()
                    _state["reason"] = f"CPU kernels unavailable ({type(exc).__name__}): " + " | ".join(lines[-3:])
                if _state["reason"] is not None:
                    logger.info("%s%s", origin(), _state["reason"])
    return _state["reason"]


def available() -> bool:
    return unavailable_reason() is None


def loaded() -> bool:
    """Whether the kernels are loaded in this process already (never builds them): for exact paths that
    may use them (same bits) but should not make the default mode compile anything."""
    return _state.get("reason", "not loaded") is None and _disabled() is None
