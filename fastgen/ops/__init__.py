"""Kernels and their dispatch; imports torch only, never Transformers or fairseq."""
