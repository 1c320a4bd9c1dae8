"""Continuous batching for encoder-decoder greedy and beam search (issue 19): :func:`generate_many`."""

from fastgen.continuous.api import generate_many

__all__ = ["generate_many"]
