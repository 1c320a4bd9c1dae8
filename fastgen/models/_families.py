"""Shared by the family tables: class membership and the wording of "not supported" reasons."""

from __future__ import annotations

from collections.abc import Iterable


def is_subclass_of_any(cls: type, qualified_names: Iterable[str]) -> bool:
    """True when ``cls`` or a base of it is named (``module.QualName``) in ``qualified_names``.

    Names, not imported classes: a table must not import every model it lists.
    """
    names = frozenset(qualified_names)
    return any(f"{klass.__module__}.{klass.__qualname__}" in names for klass in cls.__mro__)


def unsupported_family(model_type: str, supported: Iterable[str]) -> str:
    """The one wording, for every table, of a family fastgen does not support."""
    return f"model type {model_type!r} is not supported yet (supported: {', '.join(supported)})"


def unsupported_attention(implementation: str | None, supported: Iterable[str]) -> str:
    """The one wording, for every table, of an attention implementation the fast path cannot run."""
    return f"attention implementation {implementation!r} (supported: {', '.join(sorted(supported))})"
