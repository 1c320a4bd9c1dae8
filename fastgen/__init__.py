"""fastgen: faster text generation for Hugging Face Transformers and fairseq, same outputs.

``import fastgen`` patches the installed frameworks (see :func:`status`) in mode ``exact``: every feature
but the opt-in ones, tokens equal to upstream's. One word picks another mode:

* for the process: ``FASTGEN_MODE=fast`` (or ``int8``) in the shell, ``fastgen.enable(mode="int8")``, or
  ``--mode int8`` on the command-line tools; single features on top of the defaults with
  ``fastgen.enable("+int8")`` / ``fastgen.enable("-speculative")`` (``FASTGEN_FEATURES=+int8``);
* for one block of this thread or task: ``with fastgen.mode("int8"): ...``;
* for one model: ``fastgen.mode("int8", model=model)`` (until changed; ``with`` it, for a block).

``FASTGEN_DISABLE=1`` imports without patching. ``with fastgen.report() as r: ...`` says what ran, what
fell back and why, and the cache saved.
"""

import os
from collections.abc import Iterable, Iterator
from typing import Any

import fastgen.optimizer.catalog  # noqa: F401  (declares the frameworks' patches to the registry)
from fastgen.optimizer import registry
from fastgen.optimizer.registry import (
    MODES,
    ModeScope,
    active,
    current_mode,
    disable,
    enable,
    is_enabled,
    known_features,
    mode,
    patched,
    status,
    unpatched,
)
from fastgen.optimizer.report import Report, report

__version__ = "0.1.0"
__all__ = [
    "MODES",
    "ModeScope",
    "Report",
    "active",
    "current_mode",
    "disable",
    "enable",
    "generate_many",
    "is_enabled",
    "known_features",
    "mode",
    "patched",
    "report",
    "status",
    "unpatched",
]


def generate_many(model: Any, inputs: Iterable[Any], **kwargs: Any) -> Iterator[Any]:
    """Continuous batching over many inputs, results in input order (see :mod:`fastgen.continuous`).

    Feature ``continuous`` (listed by :func:`status`, in every mode); switched off, each input runs
    ``generate`` alone. The mode is the one in force for ``model`` where ``generate_many`` is called (a
    :func:`mode` block, the model's own mode, or the process's), and holds for every result, however late
    it is read. Imported on first use: ``import fastgen`` must not import Transformers for fairseq-only users.

    Args:
        model: a Transformers model with ``generate``.
        inputs: the inputs, a 1-D sequence of token ids each.
        **kwargs: ``generate``'s settings (beams, lengths, sampling, no-repeat n-grams, ...), and
            ``batch_rows``, ``return_scores``, ``seed`` (see :func:`fastgen.continuous.generate_many`).

    Returns:
        The results in input order, each what ``generate`` returns for that input alone (a tensor of token ids).

    Example:
        ```python
        outputs = fastgen.generate_many(model, [ids_a, ids_b, ids_c], num_beams=4, max_new_tokens=64)
        ```
    """
    from fastgen.continuous import generate_many as _generate_many

    scope = registry.call_scope(model)
    with scope:
        results = _generate_many(model, inputs, **kwargs)
    return registry.each_in(scope, results)


if os.environ.get("FASTGEN_DISABLE", "").strip().lower() not in {"1", "true", "yes"}:
    enable()
