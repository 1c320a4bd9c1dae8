"""Shared by the family tables: is a module class one of the supported attention classes?"""

from __future__ import annotations

from collections.abc import Iterable


def is_subclass_of_any(cls: type, qualified_names: Iterable[str]) -> bool:
    """True when ``cls`` or a base of it is named (``module.QualName``) in ``qualified_names``.

    Names, not imported classes: a table must not import every model it lists.
    """
    names = frozenset(qualified_names)
    return any(f"{klass.__module__}.{klass.__qualname__}" in names for klass in cls.__mro__)
