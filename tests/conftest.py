"""Shared fixtures: tiny seeded models (see tests/harness.py) and the gpu/slow markers."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when a ``@triton.jit`` function is defined: set it before any test
# imports a kernel, so kernels run under the interpreter on machines without CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests import harness

HAS_FAIRSEQ = importlib.util.find_spec("fairseq") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(params=harness.ENCODER_DECODER)
def encoder_decoder_model(request: pytest.FixtureRequest):
    return harness.tiny_hf_model(request.param)


@pytest.fixture(params=harness.DECODER_ONLY)
def decoder_only_model(request: pytest.FixtureRequest):
    return harness.tiny_hf_model(request.param)


@pytest.fixture(params=list(harness.HF_FAMILIES))
def hf_model(request: pytest.FixtureRequest):
    return harness.tiny_hf_model(request.param)


@pytest.fixture
def fairseq_transformer():
    if not HAS_FAIRSEQ:
        pytest.skip("fairseq is not installed")
    return harness.tiny_fairseq_transformer()
