"""Declarations of the Transformers patches: strings only, so reading them imports nothing heavy."""

from fastgen.optimizer.registry import Patch

HF_VERSIONS = ">=5.15,<6"

PATCHES: list[Patch] = []
