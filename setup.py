"""Installs fastgen; builds the CUDA extension ``fastgen._C`` only where it can be built.

A CPU machine (no CUDA torch or no nvcc) installs the pure-Python package; on a GPU machine
without a prebuilt extension, :mod:`fastgen.ops._ext` JIT-builds the same sources on first use.
"""

import glob
import os
import shutil

from setuptools import setup


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


setup(**_cuda_extension())
