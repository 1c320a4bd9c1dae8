"""Switches read from the environment, one spelling for all of them."""

from __future__ import annotations

import os

_OFF = frozenset({"0", "false", "off", "no"})


def switched_off(name: str) -> bool:
    """Whether the on-by-default switch ``name`` is set to 0 / false / off / no (any case, spaces ignored)."""
    return os.environ.get(name, "1").strip().lower() in _OFF
