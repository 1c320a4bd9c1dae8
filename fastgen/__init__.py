"""fastgen: faster text generation for Hugging Face Transformers and fairseq, same outputs.

``import fastgen`` patches the installed frameworks (see :func:`status`); set
``FASTGEN_DISABLE=1`` to import without patching, ``FASTGEN_FEATURES=a,b`` to pick features.
``with fastgen.report() as r: ...`` says what ran, what fell back and why, and the cache saved.
"""

import os

import fastgen.optimizer.catalog  # noqa: F401  (declares the frameworks' patches to the registry)
from fastgen.optimizer.registry import (
    active,
    disable,
    enable,
    is_enabled,
    known_features,
    patched,
    status,
    unpatched,
)
from fastgen.optimizer.report import Report, report

__version__ = "0.1.0"
__all__ = [
    "Report",
    "active",
    "disable",
    "enable",
    "generate_many",
    "is_enabled",
    "known_features",
    "patched",
    "report",
    "status",
    "unpatched",
]


def generate_many(model, inputs, **kwargs):
    """Continuous batching over many inputs, results in input order (see :mod:`fastgen.continuous`).

    Feature ``continuous`` (listed by :func:`status`, selected as every feature); switched off, each input
    runs ``generate`` alone. Imported on first use: ``import fastgen`` must not import Transformers for
    fairseq-only users.
    """
    from fastgen.continuous import generate_many as _generate_many

    return _generate_many(model, inputs, **kwargs)


if os.environ.get("FASTGEN_DISABLE", "").strip().lower() not in {"1", "true", "yes"}:
    enable()
