"""How fastgen's CPU kernels are found, built and loaded (:mod:`fastgen.ops.cpu_kernels`).

Loading registers ops in the process for good, so every load runs in a subprocess, on a tiny stand-in
source (one ``fastgen_cpu::attention`` op that returns its input: one compile, ~10 s of CPU, shared by the
tests through a module fixture) pointed to by the module's ``_SOURCE_DIR`` / ``_PREBUILT_DIR``. The loader
treats it as it treats ``csrc/cpu``: same cache key, flags, locks and messages.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from fastgen.ops import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]

TINY = """\
#include <ATen/core/Tensor.h>
#include <torch/library.h>
at::Tensor attention(const at::Tensor& x) { return x; }
TORCH_LIBRARY_FRAGMENT(fastgen_cpu, lib) { lib.def("attention(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(fastgen_cpu, CPU, lib) { lib.impl("attention", &attention); }
"""

# Loads the kernels as a fast mode would, then reports what happened as one JSON line.
SCRIPT = """\
import json, os, sys, time
from pathlib import Path
import torch
from fastgen.ops import cpu_kernels as k
k._SOURCE_DIR = Path(os.environ["TEST_SOURCES"])
k._PREBUILT_DIR = Path(os.environ.get("TEST_PREBUILT", "/nonexistent"))
before = k.describe()
start = time.monotonic()
reason = k.unavailable_reason()
seconds = time.monotonic() - start
ran = reason is None and torch.equal(torch.ops.fastgen_cpu.attention(torch.ones(3)), torch.ones(3))
print(json.dumps({"reason": reason, "ran": ran, "source": k._state.get("source"), "path": k._state.get("path"),
                  "before": before, "after": k.describe(), "seconds": seconds}))
"""

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None, reason="no c++/ninja")


def _clean_env(**overrides: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("FASTGEN_")}
    env.update(FASTGEN_DISABLE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.update(overrides)
    return env


def _load(env: dict[str, str], user: list[str] | None = None, timeout: float = 300) -> tuple[dict, str]:
    try:
        run = subprocess.run(
            [*(user or []), sys.executable, "-c", SCRIPT],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"loading the kernels did not finish in {timeout} s (a hang?): {exc.stderr}")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def _build_dir_name(sources: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The cache directory the subprocess will use for these sources (``-march=native``)."""
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernels, "_SOURCE_DIR", sources)
        patch.delenv(cpu_kernels.MARCH_ENV, raising=False)
        return cpu_kernels._build_name(cpu_kernels.build_facts(cpu_kernels._march_flags()))


def _world_readable_dir() -> Path:
    """A directory other users can read (pytest's tmp_path is private to its user)."""
    path = Path(tempfile.mkdtemp(prefix="fastgen-test-"))
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def shared():
    path = _world_readable_dir()
    sources = path / "sources"
    sources.mkdir()
    (sources / "tiny.cpp").write_text(TINY)
    for directory in (path, sources):
        directory.chmod(0o755)
    yield path
    for item in path.rglob("*"):  # the read-only copies, for a user chmod does stop
        if item.is_dir() and not item.is_symlink():
            item.chmod(0o755)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def stale_lock_build(shared):
    """One build with the situation a killed first build leaves: torch's ``lock`` file in the build
    directory; and a HOME that can't be written (``/dev/null``: not even root can create a directory
    below it), so the build goes to the temp-dir fallback."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        name = _build_dir_name(shared / "sources", monkeypatch)
    tmp = shared / "tmp"
    build_dir = tmp / f"fastgen-cache-{os.getuid()}" / "build" / name
    build_dir.mkdir(parents=True)
    (build_dir / "lock").write_text("")  # what torch's FileBaton leaves when its process is killed
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no c++/ninja to build with")
    result, stderr = _load(_clean_env(HOME="/dev/null", TMPDIR=str(tmp), TEST_SOURCES=str(shared / "sources")))
    return result, stderr, build_dir


def test_a_stale_lock_left_by_a_killed_build_does_not_hang_the_next_load(stale_lock_build):
    result, stderr, build_dir = stale_lock_build
    assert result["reason"] is None and result["ran"], (result, stderr)
    assert result["source"] == "new build (-march=native)"
    assert not (build_dir / "lock").exists()
    assert json.loads((build_dir / "build.json").read_text())["torch"] == torch.__version__.split("+")[0]


def test_a_build_says_so_in_one_line_and_an_unwritable_home_falls_back_to_the_temp_dir(stale_lock_build):
    result, stderr, build_dir = stale_lock_build
    assert "not built yet: the first fast-mode call builds them (~" in result["before"]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert any("cache directory not writable: /dev/null/.cache/fastgen; building in " in line for line in lines), stderr
    starts = [line for line in lines if "building CPU kernels for this CPU (once, ~" in line]
    assert len(starts) == 1 and str(build_dir) in starts[0], stderr
    assert "!! WARNING !!" not in stderr
    assert result["path"].startswith(str(build_dir))


def _read_only_copy(source: Path, target: Path) -> None:
    shutil.copytree(source, target)
    for path in sorted(target.rglob("*"), reverse=True):
        path.chmod(0o555 if path.is_dir() else 0o444)
    target.chmod(0o555)


def _as_user_who_cannot_write(directory: Path) -> list[str] | None:
    """The command prefix that runs as a user for whom ``directory`` is really read-only: this user when
    not root; else ``nobody`` through setpriv (root writes through chmod); None when neither works."""
    if os.getuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    probe = subprocess.run([*prefix, sys.executable, "-c", f"open({str(directory / 'probe')!r}, 'w')"], check=False)
    return prefix if probe.returncode != 0 else None


def test_a_finished_build_in_a_read_only_cache_loads_without_taking_a_lock(stale_lock_build, shared):
    _, _, build_dir = stale_lock_build
    cache = shared / "read-only-cache"
    _read_only_copy(build_dir.parents[1], cache)
    before = sorted(p.name for p in cache.rglob("*"))
    user = _as_user_who_cannot_write(cache / "build" / build_dir.name)
    if user is None:
        pytest.skip("running as root without setpriv: no user for whom chmod -w means read-only")
    env = _clean_env(HOME="/nonexistent", FASTGEN_CACHE=str(cache), TEST_SOURCES=str(shared / "sources"))
    env["TMPDIR"] = str(cache)  # no writable fallback either
    result, stderr = _load(env, user=user, timeout=120)
    assert result["reason"] is None and result["ran"], (result, stderr)
    assert result["source"] == "cached build (-march=native)" and result["path"].startswith(str(cache))
    assert "building" not in stderr and sorted(p.name for p in cache.rglob("*")) == before


@pytest.mark.parametrize("built_for", ["this torch", "another torch"])
def test_prebuilt_kernels_load_without_a_compiler_and_only_for_their_torch(stale_lock_build, shared, built_for):
    _, _, build_dir = stale_lock_build
    isas = cpu_kernels.isa_for(cpu_kernels._cpu_flags())
    if not isas:
        pytest.skip("this CPU runs none of the prebuilt targets")
    prebuilt = shared / f"prebuilt-{built_for.replace(' ', '-')}"
    prebuilt.mkdir()
    shutil.copy(build_dir / "fastgen_cpu_kernels.so", prebuilt / f"fastgen_cpu_{isas[0]}.so")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(cpu_kernels, "_SOURCE_DIR", shared / "sources")
        facts = cpu_kernels.build_facts(cpu_kernels.TARGETS[isas[0]][0])
    if built_for == "another torch":
        facts["torch"] = "2.0.0"
    (prebuilt / f"fastgen_cpu_{isas[0]}.json").write_text(json.dumps({**facts, "isa": isas[0]}))
    empty_bin = shared / f"bin-{built_for.replace(' ', '-')}"
    empty_bin.mkdir()
    env = _clean_env(
        PATH=str(empty_bin),  # no compiler, no ninja
        FASTGEN_CACHE=str(shared / "empty-cache"),
        TEST_SOURCES=str(shared / "sources"),
        TEST_PREBUILT=str(prebuilt),
    )
    result, stderr = _load(env, timeout=120)
    if built_for == "this torch":
        assert result["reason"] is None and result["ran"], (result, stderr)
        assert result["source"] == f"prebuilt {isas[0]} kernels" and result["path"].startswith(str(prebuilt))
        assert f"not loaded yet: prebuilt {isas[0]} kernels will load on first use" in result["before"]
        assert stderr.strip() == "", stderr
    else:
        running = torch.__version__.split("+")[0]
        assert result["reason"] == (
            f"prebuilt {isas[0]} kernels not used (built for torch 2.0.0, running {running}); "
            "no C++ compiler found (c++ is not on PATH; install g++ or set CXX)"
        )
        warnings = [line for line in stderr.splitlines() if line.strip()]
        assert len(warnings) == 1 and "CPU kernels unavailable (" in warnings[0], stderr
        assert "!! WARNING !!" not in stderr and "c++ -" not in stderr  # no banner, no command line


@needs_compiler
def test_a_failed_build_reports_the_compilers_error_line(shared):
    sources = shared / "broken"
    sources.mkdir()
    (sources / "broken.cpp").write_text("#error this kernel does not compile\n")
    env = _clean_env(FASTGEN_CACHE=str(shared / "broken-cache"), TEST_SOURCES=str(sources))
    result, stderr = _load(env, timeout=120)
    assert result["reason"] == "build failed: broken.cpp:1:2: error: #error this kernel does not compile", result
    assert "CPU kernels unavailable (build failed: broken.cpp:1:2: error:" in stderr
    assert "Error building extension" not in stderr


def test_no_compiler_is_said_in_words(shared):
    env = _clean_env(
        CXX="/nonexistent/c++", FASTGEN_CACHE=str(shared / "no-compiler-cache"), TEST_SOURCES=str(shared / "sources")
    )
    result, stderr = _load(env, timeout=120)
    assert result["reason"] == "no C++ compiler found (CXX=/nonexistent/c++)"
    assert result["before"] == "unavailable: no C++ compiler found (CXX=/nonexistent/c++)"
    assert "!! WARNING !!" not in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_the_cache_key_is_what_determines_the_binary_not_the_environment(tmp_path, monkeypatch):
    """Two environments with the same torch, flags and sources (here: copies in two places) share a build."""
    names = []
    for where in ("venv-a", "venv-b"):
        (tmp_path / where).mkdir()
        (tmp_path / where / "tiny.cpp").write_text(TINY)
        names.append(_build_dir_name(tmp_path / where, monkeypatch))
    assert names[0] == names[1] and names[0].startswith(f"cpu-torch{torch.__version__.split('+')[0]}-")
    (tmp_path / "venv-b" / "tiny.cpp").write_text(TINY + "// edited\n")
    assert _build_dir_name(tmp_path / "venv-b", monkeypatch) != names[0]

    monkeypatch.setattr(cpu_kernels, "_SOURCE_DIR", tmp_path / "venv-a")
    haswell = cpu_kernels.build_facts(("-march=haswell",))
    native = cpu_kernels.build_facts(("-march=native",))
    assert "cpu" in native and "cpu" not in haswell  # -march=native code must not move to another CPU kind
    assert cpu_kernels._build_name(haswell) != cpu_kernels._build_name(native)
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    assert cpu_kernels._build_name(cpu_kernels.build_facts(("-march=haswell",))) != cpu_kernels._build_name(haswell)
    monkeypatch.setenv(cpu_kernels.MARCH_ENV, "avx2")  # the wheel's target names give its flags
    assert cpu_kernels._march_flags() == ("-march=haswell",)


def test_the_prebuilt_target_follows_the_cpus_flags():
    vnni = {"avx2", "fma", "bmi2", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
    assert cpu_kernels.isa_for(vnni) == ["avx512vnni", "avx2"]
    assert cpu_kernels.isa_for(vnni - {"avx512_vnni"}) == ["avx2"]  # AVX-512 without VNNI (Skylake-X)
    assert cpu_kernels.isa_for({"avx2", "fma", "bmi2", "f16c"}) == ["avx2"]
    assert cpu_kernels.isa_for({"avx", "sse4_2"}) == []


def test_compiler_error_lines_are_picked_from_torchs_message():
    message = (
        "Error building extension 'fastgen_cpu_kernels': [1/3] c++ -MMD -MF attention.o.d -O3 -c "
        "/work/csrc/cpu/attention.cpp -o attention.o\nFAILED: attention.o\nc++ -MMD -MF attention.o.d -O3 -c x\n"
        "/work/csrc/cpu/attention.cpp:12:5: error: 'foo' was not declared in this scope\n"
        "   12 |     foo();\nninja: build stopped: subcommand failed.\n"
    )
    assert cpu_kernels.compiler_error(RuntimeError(message)) == (
        "attention.cpp:12:5: error: 'foo' was not declared in this scope"
    )
    assert cpu_kernels.compiler_error(RuntimeError("something else\nlast line")) == "last line"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fcntl locks")
def test_a_builders_lock_dies_with_its_process(tmp_path):
    """The lock builders queue on is an flock: a killed holder releases it (unlike torch's lock file)."""
    hold = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"
    )
    lock = tmp_path / "fastgen-build.lock"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        import fcntl

        handle = os.open(lock, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(handle)
    finally:
        holder.kill()
        holder.wait()
    with cpu_kernels._builder_lock(tmp_path):  # taken at once now that its holder is gone
        pass


def test_a_read_only_cache_permission_is_what_the_test_above_relies_on(shared):
    """chmod is no barrier to root: the read-only test runs its load as ``nobody`` (or as this user when not
    root) and checks first that a write there really fails."""
    target = shared / "probe-dir"
    target.mkdir()
    target.chmod(0o555)
    user = _as_user_who_cannot_write(target)
    if user is None:
        pytest.skip("running as root without setpriv")
    probe = subprocess.run([*user, sys.executable, "-c", f"open({str(target / 'x')!r}, 'w')"], capture_output=True)
    assert probe.returncode != 0 and b"PermissionError" in probe.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o555


@needs_compiler
def test_the_wheels_prebuild_step_makes_kernels_that_load_without_a_compiler(shared):
    """What setup.py runs at wheel-build time, on the tiny source: one target (AVX2, ``-march=haswell``)
    compiled, checked to load, copied with its sidecar; then loaded by a process with no compiler."""
    if "avx2" not in cpu_kernels.isa_for(cpu_kernels._cpu_flags()):
        pytest.skip("this CPU can't run the AVX2 target")
    out = shared / "wheel-cpu"
    command = [*cpu_kernels.run_from(ROOT), "--prebuild", str(out), "--isa", "avx2"]
    command += ["--sources", str(shared / "sources")]
    env = _clean_env(FASTGEN_CACHE=str(shared / "prebuild-cache"))
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    meta = json.loads((out / "fastgen_cpu_avx2.json").read_text())
    assert meta["cflags"] == [*cpu_kernels.CFLAGS, "-march=haswell"]
    assert meta["torch"] == torch.__version__.split("+")[0]
    empty_bin = shared / "bin-prebuild"
    empty_bin.mkdir()
    env = _clean_env(
        PATH=str(empty_bin),
        FASTGEN_CACHE=str(shared / "empty-cache-2"),
        FASTGEN_CPU_MARCH="haswell",  # the AVX2 target, whatever this CPU's best
        TEST_SOURCES=str(shared / "sources"),
        TEST_PREBUILT=str(out),
    )
    result, stderr = _load(env, timeout=120)
    assert result["reason"] is None and result["ran"] and result["source"] == "prebuilt avx2 kernels", (result, stderr)


def test_setup_runs_the_prebuild_step_from_its_own_tree():
    """setup.py spells ``run_from``'s command itself (it can't import fastgen): the two must agree."""
    code = cpu_kernels.run_from(ROOT)[2]
    setup = (ROOT / "setup.py").read_text()
    for statement in code.split("; "):
        assert statement in setup, statement
    assert '"--prebuild"' in setup and '"--sources"' in setup
