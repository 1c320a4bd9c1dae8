"""Triton kernels. Importing this package does not import Triton; each kernel module does, lazily."""
