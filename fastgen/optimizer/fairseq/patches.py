"""Declarations of the fairseq patches: strings only; fairseq is never imported here."""

from fastgen.optimizer.registry import Patch

FAIRSEQ_VERSIONS = ">=0.12.2,<0.13"

PATCHES: list[Patch] = []
