"""Imported only inside a test: the target of a patch whose factory module imports it at its top."""


def compute(x: int) -> int:
    return x + 1
