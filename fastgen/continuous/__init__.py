"""Continuous batching for encoder-decoder greedy search, beam search and sampling (issue 19): :func:`generate_many`."""

from fastgen.continuous.api import generate_many

__all__ = ["generate_many"]
