"""Replacements for Hugging Face Transformers; declared in :mod:`.patches`."""
