"""What batched speculative decoding tells ``fastgen.report()``: that it ran, and how well drafts fared.

A user tuning the draft model or its length needs the rows decoded, the draft tokens proposed and
accepted, and so the acceptance rate; :class:`~fastgen.optimizer.report.Report` adds them up over
the calls of a block (``r.counts["speculative"]``, ``r.acceptance_rate("speculative")``).
"""

from __future__ import annotations

from typing import Any

from fastgen.optimizer import report


def record(feature: str, rows: int, prompt_lookup: bool, stats: dict[str, Any]) -> None:
    """Note one call of the batched loop (``stats``: its ``last_stats`` counters)."""
    how = "batched prompt lookup decoding" if prompt_lookup else "batched assisted decoding with a draft model"
    report.note_ran(feature, how)
    report.note_counts(
        feature,
        calls=1,
        rows=rows,
        steps=stats["steps"],
        proposed=stats["drafted"],
        accepted=stats["accepted"],
    )
