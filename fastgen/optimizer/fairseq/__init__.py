"""Replacements for fairseq; declared in :mod:`.patches`. fairseq is imported only by the factories."""
