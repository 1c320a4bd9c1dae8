"""Installs fastgen; ships its kernel sources, prebuilt CPU kernels where they can be built, and the CUDA
extension ``fastgen._C`` where it can be built.

- ``csrc/`` ships inside the package as ``fastgen/_csrc`` (a wheel has no source checkout): the JIT builds
  of :mod:`fastgen.ops._ext` (CUDA) and :mod:`fastgen.ops.cpu_kernels` (CPU) compile it on first use.
- Prebuilt CPU kernels: a wheel build compiles ``csrc/cpu/*.cpp`` for each target of
  ``fastgen.ops.cpu_kernels.TARGETS`` (AVX-512 VNNI, AVX2) with the same flags as the JIT build, checks each
  loads with the build environment's torch, and ships them as ``fastgen/_cpu/fastgen_cpu_<isa>.so`` with a
  ``.json`` naming that torch release; the wheel is then tagged for this platform (``py3-none-<platform>``).
  This needs torch in the build environment (``pip wheel --no-build-isolation .`` or
  ``python -m build --no-isolation``) and a C++ compiler; without them, or with
  ``FASTGEN_SKIP_CPU_PREBUILD=1``, the wheel is pure Python and the kernels are JIT-built on first use.
  Editable installs skip it (the JIT build serves a checkout).
- ``fastgen._C`` is built only with a CUDA-enabled torch and nvcc (``FASTGEN_SKIP_CUDA_BUILD=1`` skips it).
"""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import time

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))


def _prebuild_problem() -> str | None:
    """Why this build can't compile the prebuilt CPU kernels (None: it can try)."""
    if os.environ.get("FASTGEN_SKIP_CPU_PREBUILD") == "1":
        return "FASTGEN_SKIP_CPU_PREBUILD=1"
    if not sys.platform.startswith("linux"):
        return f"prebuilt kernels are built on Linux only (this is {sys.platform})"
    if importlib.util.find_spec("torch") is None:
        return "torch is not importable here (build with --no-build-isolation to include them)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler found ({compiler})"
    return None


class BuildPyWithSources(build_py):
    """Copies ``csrc/`` into the built package as ``fastgen/_csrc`` and adds the prebuilt CPU kernels."""

    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, "fastgen", "_csrc")
        os.makedirs(target, exist_ok=True)
        for source in sorted(glob.glob("csrc/*.cu") + glob.glob("csrc/*.h") + glob.glob("csrc/*.cpp")):
            shutil.copy(source, target)
        os.makedirs(os.path.join(target, "cpu"), exist_ok=True)
        for source in sorted(glob.glob("csrc/cpu/*.cpp") + glob.glob("csrc/cpu/*.h")):  # the CPU kernels
            shutil.copy(source, os.path.join(target, "cpu"))
        if not getattr(self, "editable_mode", False):
            self._prebuild_cpu_kernels(os.path.join(self.build_lib, "fastgen", "_cpu"))

    def _prebuild_cpu_kernels(self, out: str) -> None:
        """Never fails the build: a target that doesn't build is left out (the JIT build covers it)."""
        shutil.rmtree(out, ignore_errors=True)  # build/lib outlives a build: never ship an earlier one's kernels
        problem = _prebuild_problem()
        if problem is not None:
            print(f"fastgen: no prebuilt CPU kernels in this wheel: {problem}", file=sys.stderr)
            return
        start = time.monotonic()
        env = {**os.environ, "FASTGEN_DISABLE": "1"}
        # this tree's fastgen.ops.cpu_kernels.run_from(HERE): not an installed (e.g. editable) fastgen's
        code = (
            "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
            "sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith('__editable__')]; "
            "runpy.run_module('fastgen.ops.cpu_kernels', run_name='__main__', alter_sys=True)"
        )
        shipped = os.path.abspath(os.path.join(out, os.pardir, "_csrc", "cpu"))  # compiled and hashed as shipped
        command = [sys.executable, "-c", code, HERE, "--prebuild", os.path.abspath(out), "--sources", shipped]
        run = subprocess.run(command, cwd=HERE, env=env, check=False)
        built = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.so")))
        seconds = time.monotonic() - start
        message = f"fastgen: prebuilt CPU kernels {built or 'none'} ({seconds:.0f} s, exit {run.returncode})"
        print(message, file=sys.stderr)


class BdistWheelTagged(bdist_wheel):
    """A wheel holding prebuilt CPU kernels is platform-specific (``py3-none-linux_x86_64``): the kernels
    load through torch, not Python's C API, so any CPython 3 of that platform can use them."""

    def get_tag(self) -> tuple[str, str, str]:
        tag = super().get_tag()
        build_lib = self.get_finalized_command("build_py").build_lib
        if not glob.glob(os.path.join(build_lib, "fastgen", "_cpu", "*.so")):
            return tag
        pure, self.root_is_pure = self.root_is_pure, False
        try:
            platform = super().get_tag()[2]
        finally:
            self.root_is_pure = pure
        return "py3", "none", platform


def _cuda_extension() -> dict:
    """The ext_modules/cmdclass for fastgen._C, or nothing when this machine can't build it."""
    if os.environ.get("FASTGEN_SKIP_CUDA_BUILD") == "1":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        return {}
    sources = sorted(glob.glob("csrc/*.cu")) + sorted(glob.glob("csrc/*.cpp"))
    if not sources or torch.version.cuda is None or shutil.which("nvcc") is None:
        return {}
    ext = CUDAExtension("fastgen._C", sources, extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]})
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


options = _cuda_extension()
cmdclass = {**options.pop("cmdclass", {}), "build_py": BuildPyWithSources, "bdist_wheel": BdistWheelTagged}
setup(**options, cmdclass=cmdclass)
