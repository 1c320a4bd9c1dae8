"""The int8 backends a test may parametrize over on this machine, and the fixture that skips the ones whose
kernels can't run (``vnni`` and ``amx`` are listed from the CPU's flags, without building the CPU kernels at
collection). Import both names into a test module: ``from tests.int8_backends import BACKENDS, ready_backend``."""

import pytest

from fastgen.ops import int8_linear

BACKENDS = [
    "int_mm",
    *(["fbgemm"] if int8_linear._has_fbgemm() else []),
    *(["onednn"] if int8_linear._has_onednn() else []),
    *(["vnni"] if "avx512_vnni" in int8_linear.cpu_flags() else []),
    *(["amx"] if "amx_int8" in int8_linear.cpu_flags() else []),
]


@pytest.fixture(autouse=True)
def ready_backend(request):
    """Skips a test parametrized with a ``backend`` whose kernel can't run here."""
    params = getattr(request.node, "callspec", None)
    ready = {"vnni": int8_linear.has_vnni_kernel, "amx": int8_linear.has_amx_kernel}
    backend = params.params.get("backend") if params is not None else None
    if backend in ready and not ready[backend]():
        pytest.skip(f"no {backend} kernel here")
