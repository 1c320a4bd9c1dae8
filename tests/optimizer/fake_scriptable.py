"""A scriptable stand-in for an upstream module (its forward reads a module global, ``torch``),
and a replacement factory for it."""

import torch


class Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, 2.0)


def plus_one(original):
    def forward(self, x):
        return original(self, x) + 1

    return forward
