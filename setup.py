"""Installs fastgen; builds the CUDA extension ``fastgen._C`` only where it can be built.

A CPU machine (no CUDA torch or no nvcc) installs the pure-Python package; on a GPU machine
without a prebuilt extension, :mod:`fastgen.ops._ext` JIT-builds the same sources on first use,
which is why ``csrc/`` ships inside the package as ``fastgen/_csrc`` (a wheel has no source checkout).
"""

import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithSources(build_py):
    """Copies ``csrc/`` into the built package as ``fastgen/_csrc`` for the JIT build of an installed wheel."""

    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, "fastgen", "_csrc")
        os.makedirs(target, exist_ok=True)
        for source in sorted(glob.glob("csrc/*.cu") + glob.glob("csrc/*.h") + glob.glob("csrc/*.cpp")):
            shutil.copy(source, target)
        os.makedirs(os.path.join(target, "cpu"), exist_ok=True)
        for source in sorted(glob.glob("csrc/cpu/*.cpp") + glob.glob("csrc/cpu/*.h")):  # CPU kernels, JIT-built
            shutil.copy(source, os.path.join(target, "cpu"))


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
cmdclass = {**options.pop("cmdclass", {}), "build_py": BuildPyWithSources}
setup(**options, cmdclass=cmdclass)
