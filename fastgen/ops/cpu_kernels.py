"""Finds, builds and loads fastgen's CPU kernels (``csrc/cpu/*.cpp``, ops ``torch.ops.fastgen_cpu.*``) once.

The kernels are plain loops left to the compiler's vectorizer, so the binary depends on the instruction
set it was compiled for. Where they come from, the first that fits:

1. **Prebuilt, in the wheel** (``fastgen/_cpu/fastgen_cpu_<isa>.so``): compiled when the wheel was built
   (``setup.py`` runs ``python -m fastgen.ops.cpu_kernels --prebuild DIR``) for AVX-512 with VNNI
   (``-march=x86-64-v4 -mavx512vnni``) and AVX2 (``-march=haswell``), picked by this CPU's
   ``/proc/cpuinfo`` flags. Its sidecar ``.json`` names the torch release, compile flags and source
   hash it was built from; one built for another torch release (C++ ABI) or other sources is skipped.
2. **A finished build in the cache** (``FASTGEN_CACHE``, default ``~/.cache/fastgen``), in a directory
   named by what determines the binary: the torch release, the compile flags, a hash of the sources and,
   for ``-march=native``, this CPU's flags (not the environment: two venvs with the same torch share it).
   It is loaded directly, without a lock, so a read-only cache (a container image) works.
3. **A JIT build** into that cache (``torch.utils.cpp_extension``, ``-march=native``), announced with one
   WARNING line. Builders of one directory queue on an ``flock`` that dies with its process, so a killed
   build blocks nothing; the ``lock`` file torch leaves behind then is removed. A HOME that can't be written
   falls back to a directory under the system's temp dir, and says so.
4. Otherwise the fast modes run torch's ops, after one WARNING with a short reason ("no C++ compiler found",
   "ninja not found", "cache directory not writable: PATH", "build failed: <the compiler's error>").

Only the opt-in fast modes build them (:func:`unavailable_reason`, :func:`available`); exact paths that may
use them call :func:`available` with ``build=False`` (prebuilt or cached kernels only, never a compile) or
:func:`loaded`. :func:`describe` says what is in use without building anything (``python -m fastgen.info``).

Environment: ``FASTGEN_CPU_KERNELS=0`` turns them off; ``FASTGEN_JIT=0`` forbids compiling (prebuilt and
cached kernels still load); ``FASTGEN_CPU_PREBUILT=0`` skips the wheel's kernels; ``FASTGEN_CPU_MARCH``
picks the build target (``native``, a gcc ``-march`` value such as ``haswell``, or ``avx2`` /
``avx512vnni`` for the wheel's targets).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from fastgen._log import origin
from fastgen.ops._ext import _CSRC, _release

try:
    import fcntl
except ImportError:  # not POSIX: builders don't queue (torch's own lock file still serializes them)
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("fastgen")

#: reductions may reassociate (a tree instead of a chain); no errno from libm; ``-fopenmp``: ATen's
#: ``at::parallel_for`` is inline OpenMP in torch's headers and runs serially in code built without it (every
#: kernel here had run on one thread whatever ``torch.set_num_threads`` said); linked with ``-fopenmp``, the
#: kernels share torch's own ``libgomp.so.1`` (one runtime, one thread count)
CFLAGS = [
    "-O3",
    "-fopenmp",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]
#: the CPU to vectorize for: ``native`` (this one); ``FASTGEN_CPU_MARCH=haswell`` builds the AVX2 path (tests)
MARCH_ENV = "FASTGEN_CPU_MARCH"
PREBUILT_ENV = "FASTGEN_CPU_PREBUILT"
#: the wheel's targets, best first: name -> (compile flags, /proc/cpuinfo flags the code needs to run)
TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512vnni": (
        ("-march=x86-64-v4", "-mavx512vnni"),
        ("avx2", "fma", "bmi2", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"),
    ),
    "avx2": (("-march=haswell",), ("avx2", "fma", "bmi2", "f16c")),
}
NAME = "fastgen_cpu_kernels"
#: how long a process waits for another one building the same directory before giving up
WAIT_FOR_BUILDER_S = 900.0
#: CPU seconds one source file takes to compile (torch's headers dominate; measured ~20-25 s per file)
SECONDS_PER_SOURCE = 20

OFF = frozenset({"0", "false", "no", "off"})

# where the wheel's prebuilt kernels and the sources live (tests point these at their own)
_PREBUILT_DIR = Path(__file__).resolve().parents[1] / "_cpu"
_SOURCE_DIR = _CSRC / "cpu"

_lock = threading.Lock()
_state: dict[str, str | None] = {}


def sources() -> list[Path]:
    return sorted(_SOURCE_DIR.glob("*.cpp"))


@functools.cache
def _cpu_flags() -> frozenset[str]:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _march() -> str:
    return os.environ.get(MARCH_ENV, "native").strip() or "native"


def _march_flags() -> tuple[str, ...]:
    march = _march()
    return TARGETS[march][0] if march in TARGETS else (f"-march={march}",)


def isa_for(flags: frozenset[str] | set[str]) -> list[str]:
    """The wheel's targets a CPU with these ``/proc/cpuinfo`` flags can run, best first."""
    return [isa for isa, (_, needs) in TARGETS.items() if set(needs) <= flags]


def _source_hash() -> str | None:
    """sha256 over the sources' names and bytes (None: no sources here)."""
    files = sorted([*_SOURCE_DIR.glob("*.cpp"), *_SOURCE_DIR.glob("*.h")], key=lambda f: f.name)
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def build_facts(march_flags: tuple[str, ...]) -> dict[str, object]:
    """What determines the binary: torch release (C++ ABI), flags, sources; the CPU only for ``native``."""
    facts: dict[str, object] = {
        "torch": _release(torch.__version__),
        "cflags": [*CFLAGS, *march_flags],
        "sources": _source_hash(),
    }
    if any("native" in flag for flag in march_flags):
        facts["cpu"] = hashlib.sha256(" ".join(sorted(_cpu_flags())).encode()).hexdigest()[:16]
    return facts


def _build_name(facts: dict[str, object]) -> str:
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return f"cpu-torch{facts['torch']}-{key}"


def _cache_roots() -> list[Path]:
    """Where finished builds are looked for, and built: ``FASTGEN_CACHE`` or ``~/.cache/fastgen``, then the
    temp-dir fallback used when that can't be written."""
    env = os.environ.get("FASTGEN_CACHE", "").strip()
    if env:
        first = Path(env)
    else:
        try:
            first = Path.home() / ".cache" / "fastgen"
        except RuntimeError:  # no HOME and no passwd entry
            return [_temp_root()]
    return [first, _temp_root()]


def _temp_root() -> Path:
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"fastgen-cache-{uid}"


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            return True
    except OSError:
        return False


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _matches(meta: dict, facts: dict[str, object]) -> str | None:
    """Why a recorded build does not fit the running torch and sources (None: it fits)."""
    if meta.get("torch") != facts["torch"]:
        return f"built for torch {meta.get('torch')}, running {facts['torch']}"
    if meta.get("cflags") != facts["cflags"]:
        return f"built with flags {' '.join(map(str, meta.get('cflags') or []))}"
    if facts["sources"] is not None and meta.get("sources") != facts["sources"]:
        return "built from other sources"
    if meta.get("cpu") != facts.get("cpu"):
        return "built for another CPU"
    return None


def _prebuilt() -> tuple[list[tuple[str, Path]], list[str]]:
    """The wheel's kernels this CPU and torch can load, best first, and why others were passed over."""
    if os.environ.get(PREBUILT_ENV, "1").strip().lower() in OFF or not _PREBUILT_DIR.is_dir():
        return [], []
    if _march() == "native":
        wanted = isa_for(_cpu_flags())
    else:
        wanted = [isa for isa, (flags, _) in TARGETS.items() if flags == _march_flags()]
    found, skipped = [], []
    for isa in wanted:
        library, meta = _PREBUILT_DIR / f"fastgen_cpu_{isa}.so", _read_json(_PREBUILT_DIR / f"fastgen_cpu_{isa}.json")
        if not library.is_file() or meta is None:
            continue
        problem = _matches(meta, build_facts(TARGETS[isa][0]))
        if problem is None:
            found.append((f"prebuilt {isa} kernels", library))
        else:
            skipped.append(f"prebuilt {isa} kernels not used ({problem})")
    return found, skipped


def _finished_build(directory: Path, facts: dict[str, object]) -> Path | None:
    """The library of a complete build in ``directory`` (its ``build.json`` is written last), or None."""
    meta = _read_json(directory / "build.json")
    if meta is None or _matches(meta, facts) is not None:
        return None
    library = directory / str(meta.get("file", ""))
    return library if library.is_file() else None


def _cached() -> list[tuple[str, Path]]:
    facts = build_facts(_march_flags())
    found = []
    for root in _cache_roots():
        library = _finished_build(root / "build" / _build_name(facts), facts)
        if library is not None:
            found.append((f"cached build ({' '.join(_march_flags())})", library))
    return found


def _ops_present() -> bool:
    return hasattr(torch.ops, "fastgen_cpu") and hasattr(torch.ops.fastgen_cpu, "attention")


def _load_library(library: Path) -> str | None:
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:  # undefined symbols: another torch; a truncated file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"{library} does not load with torch {torch.__version__}: {first[:200]}"
    if not _ops_present():
        return f"{library} holds no fastgen_cpu kernels"
    return None


def _disabled() -> str | None:
    if os.environ.get("FASTGEN_CPU_KERNELS", "1").strip().lower() in OFF:
        return "FASTGEN_CPU_KERNELS=0"
    return None


def _jit_disabled() -> bool:
    return os.environ.get("FASTGEN_JIT", "1").strip().lower() in OFF


def _load(build: bool) -> str | None:
    """Load prebuilt or cached kernels, else (``build``) compile them; None on success, else why not."""
    if _ops_present():
        _state.setdefault("source", "loaded in this process")
        return None
    prebuilt, notes = _prebuilt()
    for label, library in [*prebuilt, *_cached()]:
        problem = _load_library(library)
        if problem is None:
            _state["source"], _state["path"] = label, str(library)
            return None
        notes.append(problem)
    if not build:
        return "; ".join([*notes, "not built yet"])
    files = sources()
    if not files:
        return "; ".join([*notes, f"no CPU kernel sources in {_SOURCE_DIR}"])
    if _jit_disabled():
        return "; ".join([*notes, "JIT builds are disabled (FASTGEN_JIT=0)"])
    problem = _toolchain_problem()
    if problem is not None:
        return "; ".join([*notes, problem])
    facts = build_facts(_march_flags())
    roots = _cache_roots()
    root = next((r for r in roots if _writable(r / "build")), None)
    if root is None:
        return "; ".join([*notes, f"cache directory not writable: {roots[0]}"])
    if root != roots[0]:
        logger.warning(
            "%scache directory not writable: %s; building in %s instead (set FASTGEN_CACHE to keep the build)",
            origin(),
            roots[0],
            root,
        )
    problem = _build(root / "build" / _build_name(facts), files, facts)
    return None if problem is None else "; ".join([*notes, problem])


def _toolchain_problem() -> str | None:
    """What is missing to build (checked first: torch's own messages are a long banner or a command line)."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        where = f"CXX={compiler}" if "CXX" in os.environ else f"{compiler} is not on PATH; install g++ or set CXX"
        return f"no C++ compiler found ({where})"
    with _ninja_on_path():
        if shutil.which("ninja") is None:
            return "ninja not found (pip install ninja)"
    return None


def estimated_build_seconds(files: int | None = None) -> int:
    """A rough wall time for the JIT build here: ninja compiles the files in parallel, one per core."""
    files = len(sources()) if files is None else files
    jobs = max(1, min(os.cpu_count() or 1, files))
    return SECONDS_PER_SOURCE * max(1, math.ceil(files / jobs)) + 5


def _build(directory: Path, files: list[Path], facts: dict[str, object]) -> str | None:
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    with _builder_lock(directory):
        library = _finished_build(directory, facts)  # another process may have finished it while we waited
        if library is not None:
            _state["source"], _state["path"] = f"cached build ({' '.join(_march_flags())})", str(library)
            return _load_library(library)
        stale = directory / "lock"  # torch's; every builder holds our flock first, so this one is left over
        if stale.exists():
            logger.info("%sremoving the lock file of an interrupted build: %s", origin(), stale)
            stale.unlink(missing_ok=True)
        (directory / "build.json").unlink(missing_ok=True)
        (directory / f"{NAME}.so").unlink(missing_ok=True)  # a killed link may have left part of it
        logger.warning(
            "%sbuilding CPU kernels for this CPU (once, ~%d s) in %s ...",
            origin(),
            estimated_build_seconds(len(files)),
            directory,
        )
        start = time.monotonic()
        banner = _TorchBanner()
        torch_logger = logging.getLogger("torch.utils.cpp_extension")
        torch_logger.addFilter(banner)
        try:
            with _ninja_on_path():
                built = cpp_extension.load(
                    name=NAME,
                    sources=[str(f) for f in files],
                    build_directory=str(directory),
                    extra_cflags=list(facts["cflags"]),  # type: ignore[call-overload]
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False,
                    verbose=False,
                )
        except Exception as exc:  # compile errors, a failed load
            return f"build failed: {compiler_error(exc)}"
        finally:
            torch_logger.removeFilter(banner)
        seconds = time.monotonic() - start
        if banner.dropped:
            logger.info("%storch warned that %s may not match the compiler it was built with", origin(), banner.dropped)
        meta = {**facts, "file": Path(str(built)).name, "march": list(_march_flags()), "build_seconds": round(seconds)}
        _write_json(directory / "build.json", meta)
        _state["source"], _state["path"] = f"new build ({' '.join(_march_flags())})", str(built)
        logger.warning("%sbuilt the CPU kernels in %.0f s", origin(), seconds)
    return None


class _TorchBanner(logging.Filter):
    """Drops torch's many-line "!! WARNING !!" compiler banner during the build (one INFO line says it)."""

    dropped: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if "!! WARNING !!" in str(record.msg):
            self.dropped = str(record.args[0]) if record.args else "the compiler"
            return False
        return True


def compiler_error(exc: BaseException) -> str:
    """The compiler's first error line of a failed build (path shortened), else the message's last line."""
    text = str(exc)
    output = getattr(exc, "output", None)
    if isinstance(output, bytes):
        text += "\n" + output.decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror\b", line) and not line.startswith("FAILED:")]
    line = next((e for e in errors if ": error:" in e or "fatal error" in e), errors[0] if errors else None)
    line = line if line is not None else (lines[-1] if lines else type(exc).__name__)
    line = re.sub(r"(?:[^\s:]*/)+([^/\s:]+:\d+)", r"\1", line)  # /long/path/attention.cpp:12 -> attention.cpp:12
    return line[:240]


def _write_json(path: Path, data: dict) -> None:
    """Written whole or not at all: readers take ``build.json`` as the sign of a finished build."""
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=".build-", suffix=".json")
    with os.fdopen(handle, "w") as out:
        json.dump(data, out, indent=1, sort_keys=True)
    os.replace(tmp, path)


@contextlib.contextmanager
def _builder_lock(directory: Path) -> Iterator[None]:
    """One builder per directory; the kernel drops an flock when its process dies, so none goes stale."""
    if fcntl is None:
        yield
        return
    handle = os.open(directory / "fastgen-build.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("%swaiting for another process building fastgen's CPU kernels in %s", origin(), directory)
            deadline = time.monotonic() + WAIT_FOR_BUILDER_S
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"another process has been building in {directory} for over {WAIT_FOR_BUILDER_S:.0f} s"
                        ) from None
                    time.sleep(0.5)
        yield
    finally:
        os.close(handle)


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


def _resolve(build: bool) -> str | None:
    if "reason" in _state:
        return _state["reason"]
    if not build and "lookup" in _state:
        return _state["lookup"]
    with _lock:
        if "reason" in _state:
            return _state["reason"]
        try:
            reason = _load(build)
        except Exception as exc:  # never let the loader break generation: torch's ops run instead
            reason = f"unexpected {type(exc).__name__}: {exc}"
        if build or reason is None:
            _state["reason"] = reason
            if reason is not None:  # a switch the user set is said quietly; anything else, visibly
                level = logging.INFO if reason.endswith("(FASTGEN_JIT=0)") else logging.WARNING
                logger.log(level, "%sCPU kernels unavailable (%s); torch's ops run instead", origin(), reason)
        else:
            _state["lookup"] = reason
    return reason


def unavailable_reason() -> str | None:
    """Why the CPU kernels can't run (None: they can). Loads them, building them if need be, on the first
    call of the process; the reason is also logged once as a WARNING."""
    disabled = _disabled()
    if disabled is not None:
        return disabled
    return _resolve(build=True)


def can_build() -> bool:
    """Whether a JIT build could run here (switches, sources, compiler and ninja; checked once per process),
    without building: the exact mode starts a background build only then, so a machine without a compiler
    never hears of it."""
    if "can_build" not in _state:
        ok = _disabled() is None and not _jit_disabled() and bool(sources()) and _toolchain_problem() is None
        _state["can_build"] = "yes" if ok else None
    return _state["can_build"] is not None


def available(build: bool = True) -> bool:
    """Whether the kernels can run; ``build=False`` loads prebuilt or cached ones but never compiles."""
    if _disabled() is not None:
        return False
    return _resolve(build) is None


def loaded() -> bool:
    """Whether the kernels are loaded in this process already (never builds them): for exact paths that
    may use them (same bits) but should not make the default mode compile anything."""
    return _state.get("reason", "not loaded") is None and _disabled() is None


def describe() -> str:
    """What is in use, or would be, without building anything (for ``python -m fastgen.info``)."""
    disabled = _disabled()
    if disabled is not None:
        return f"off ({disabled})"
    if "reason" in _state:
        reason = _state["reason"]
        if reason is None:
            return f"loaded: {_state.get('source')} ({_state.get('path')})"
        return f"unavailable: {reason}"
    prebuilt, notes = _prebuilt()
    ready = [*prebuilt, *_cached()]
    if ready:
        label, library = ready[0]
        return f"not loaded yet: {label} will load on first use ({library})"
    if _jit_disabled():
        problem: str | None = "no prebuilt kernels for this CPU and torch, and JIT builds are disabled (FASTGEN_JIT=0)"
    elif not sources():
        problem = f"no prebuilt kernels for this CPU and torch, and no sources in {_SOURCE_DIR}"
    else:
        problem = _toolchain_problem()
    if problem is not None:
        return "unavailable: " + "; ".join([*notes, problem])
    return "; ".join(
        [
            *notes,
            f"not built yet: the first fast-mode call builds them (~{estimated_build_seconds()} s); "
            "python -m fastgen.info --build builds them now",
        ]
    )


def _prebuild(out: Path, isa: str) -> int:
    """Compiles the kernels for one wheel target, checks they load here, and copies them to ``out``."""
    flags, needs = TARGETS[isa]
    missing = sorted(set(needs) - _cpu_flags())
    if missing:
        print(f"{isa}: skipped, this CPU lacks {' '.join(missing)} (can't check the build loads)", file=sys.stderr)
        return 3
    os.environ[MARCH_ENV] = isa
    os.environ[PREBUILT_ENV] = "0"
    os.environ.pop("FASTGEN_JIT", None)
    os.environ.pop("FASTGEN_CPU_KERNELS", None)
    reason = unavailable_reason()
    if reason is not None:
        print(f"{isa}: not built: {reason}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_state["path"], out / f"fastgen_cpu_{isa}.so")  # type: ignore[arg-type]
    _write_json(out / f"fastgen_cpu_{isa}.json", {**build_facts(flags), "isa": isa, "needs": list(needs)})
    print(f"{isa}: fastgen_cpu_{isa}.so ({_state['source']})", file=sys.stderr)
    return 0


def run_from(root: Path) -> list[str]:
    """The command that runs this module from the ``fastgen`` package under ``root``, whatever fastgen the
    interpreter would import (an editable install's finder comes before ``sys.path``): a wheel built from an
    sdist compiles and hashes the sdist's sources with the sdist's flags."""
    code = (
        "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
        "sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith('__editable__')]; "
        "runpy.run_module('fastgen.ops.cpu_kernels', run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code, str(root)]


def _main(argv: list[str]) -> int:
    """``python -m fastgen.ops.cpu_kernels --prebuild DIR [--isa NAME] [--sources DIR]``: the wheel's kernels.

    Each target is built in its own process (a process can load one copy of the ops); exit status 0 when
    at least one target was built.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fastgen.ops.cpu_kernels")
    parser.add_argument("--prebuild", type=Path, required=True, help="directory for fastgen_cpu_<isa>.so/.json")
    parser.add_argument("--isa", choices=sorted(TARGETS), help="one target (default: each in a subprocess)")
    parser.add_argument("--sources", type=Path, help="the kernel sources to compile (default: the package's)")
    args = parser.parse_args(argv)
    if args.sources is not None:  # the copy that ships beside the kernels: what the runtime hashes
        global _SOURCE_DIR
        _SOURCE_DIR = args.sources.resolve()
    if args.isa is not None:
        return _prebuild(args.prebuild, args.isa)
    built = 0
    for isa in TARGETS:
        start = time.monotonic()
        command = [*run_from(Path(__file__).resolve().parents[2]), "--prebuild", str(args.prebuild), "--isa", isa]
        command += ["--sources", str(_SOURCE_DIR)]
        run = subprocess.run(command, check=False)
        built += run.returncode == 0
        print(f"{isa}: {time.monotonic() - start:.0f} s", file=sys.stderr)
    return 0 if built else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(_main(sys.argv[1:]))
