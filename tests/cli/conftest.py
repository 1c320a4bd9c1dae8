"""Fixtures shared by the CLI test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli import fairseq_setup


@pytest.fixture(scope="session")
def fairseq_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny fairseq setup (fairseq_setup.build: preprocess, train, upstream outputs; ~35 s) built once for
    test_generate_fairseq.py and test_generate_fairseq_errors.py; the tests only read it."""
    return fairseq_setup.build(tmp_path_factory.mktemp("fairseq"))
