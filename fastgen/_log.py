"""Name fastgen exactly once in each log line, whatever logging set-up prints it.

fastgen logs through ``logging.getLogger("fastgen")``. A configured handler (fairseq's
``"%(asctime)s | %(levelname)s | %(name)s | %(message)s"``, ``logging.basicConfig``'s
``"%(levelname)s:%(name)s:%(message)s"``) already prints the logger name, so a ``fastgen:`` in the
message would double it. Where nothing is configured, Python's last-resort handler prints the bare
message, and the prefix is the only sign of where the line comes from.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("fastgen")


def origin(tag: str = "") -> str:
    """The prefix for one message: ``"fastgen[tag]: "`` on the last-resort handler, else ``"[tag] "``."""
    if logger.hasHandlers():  # some handler will print the record, and with it, usually, the name
        return f"[{tag}] " if tag else ""
    return f"fastgen[{tag}]: " if tag else "fastgen: "
