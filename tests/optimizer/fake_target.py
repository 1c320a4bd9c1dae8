"""A stand-in for an upstream module: the registry tests patch these attributes."""


def greet(name: str) -> str:
    return f"hello {name}"


class Processor:
    def __call__(self, x: int) -> int:
        return x + 1

    @staticmethod
    def expand(x: int, times: int = 2) -> list[int]:
        return [x] * times

    @classmethod
    def build(cls, x: int) -> tuple[type, int]:
        return cls, x


class Child(Processor):
    """Inherits ``__call__``: patching it must not leave a copy behind on disable."""
