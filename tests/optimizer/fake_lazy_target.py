"""Imported only inside a test, after fastgen is enabled: exercises patch-on-import."""


def compute(x: int) -> int:
    return x * 10
