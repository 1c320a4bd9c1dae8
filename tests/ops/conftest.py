"""Op-test setup: run Triton kernels under the interpreter on machines without CUDA.

TRITON_INTERPRET is read when a ``@triton.jit`` function is defined, so it is set here, before any
test module imports a kernel (the ops import theirs lazily, on first use).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    # tests/conftest.py in main registers these too; registering twice is harmless.
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: too slow for CI (deselected there with -m 'not slow')")
