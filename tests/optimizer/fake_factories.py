"""Replacement factories for the registry tests: each receives the original and wraps it."""

from fastgen.optimizer import registry


def shout(original):
    def greet(name: str) -> str:
        return original(name).upper()

    return greet


def plus_hundred(original):
    def call(self, x: int) -> int:
        if x < 0:  # "unsupported" calls go back upstream
            registry.fallback("fake", "negative input")
            return original(self, x)
        return original(self, x) + 100

    return call


def triple(original):
    def expand(x: int, times: int = 2) -> list[int]:
        return original(x, times + 1)

    return expand


def tag_build(original):
    def build(cls, x: int):
        return original(cls, x), "patched"

    return build


def negate(original):
    def compute(x: int) -> int:
        return -original(x)

    return compute


def broken(original):
    raise RuntimeError("factory exploded")


def structure_unknown():
    """A ``Patch.requires`` check that finds the target's structure unknown."""
    return "fakepkg 9.9 is newer than fastgen knows; pin fakepkg==1.0 or upgrade fastgen"


def structure_known():
    return None


def broken_check():
    raise RuntimeError("boom")


def exclaim(original):
    def greet(name: str) -> str:
        return original(name) + "!"

    return greet
