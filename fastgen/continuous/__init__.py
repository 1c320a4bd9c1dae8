"""Continuous batching for greedy search, beam search and sampling, encoder-decoder and decoder-only (issue 19):
:func:`generate_many`."""

from fastgen.continuous.api import generate_many

__all__ = ["generate_many"]
