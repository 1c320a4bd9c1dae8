"""A factory module that imports its patch's target before defining the factory (as a loop module
importing the module whose method it replaces): the import applies pending patches mid-way."""

from tests.optimizer import fake_circular_target


def make_compute(original):
    def compute(x: int) -> int:
        return -original(x)

    return compute


ORIGINAL = fake_circular_target.compute
