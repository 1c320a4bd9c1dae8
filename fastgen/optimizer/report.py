"""Per-call reports: which fastgen features ran in a block of code, which fell back and why.

``with fastgen.report() as r: model.generate(...)`` collects what the hooks note while the block
runs (this thread / task only). Hooks note events through :func:`note_ran`, the registry's
``fallback`` / ``degraded`` and :func:`note_cache`; when no report is open each of these is one
``ContextVar`` read, so they cost nothing measurable outside a report. None of them may run inside
a model's forward under ``torch.compile`` (Dynamo cannot trace ``ContextVar.get``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator

_current: contextvars.ContextVar[Report | None] = contextvars.ContextVar("fastgen_report", default=None)


@dataclasses.dataclass
class Report:
    """What fastgen did inside a ``with fastgen.report()`` block.

    ``ran`` maps a feature to what it did (distinct descriptions, in order); ``fell_back`` lists
    ``(feature, reason)`` for every call that ran all of upstream's code; ``degraded`` lists
    ``(feature, reason)`` where a feature took a slower, still exact path for part of a call;
    ``cache_bytes_saved`` adds up the K/V bytes a deduplicated cache did not have to hold
    (measured when its ``generate`` call ended); ``counts`` adds up a feature's counters over the
    block (speculative decoding: calls, rows, steps, draft tokens proposed and accepted).
    """

    ran: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    fell_back: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    degraded: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    cache_bytes_saved: int = 0
    counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    _pending_caches: list[Callable[[], int]] = dataclasses.field(default_factory=list, repr=False)

    def fast_path(self, feature: str) -> bool:
        """True if ``feature`` ran at least once and never fell back in this block."""
        return feature in self.ran and not any(f == feature for f, _ in self.fell_back)

    def acceptance_rate(self, feature: str = "speculative") -> float | None:
        """Draft tokens accepted / proposed in this block, or None if none were proposed."""
        counts = self.counts.get(feature, {})
        return counts["accepted"] / counts["proposed"] if counts.get("proposed") else None

    def __str__(self) -> str:
        lines = [f"ran       {feature}: {'; '.join(what)}" for feature, what in self.ran.items()]
        for feature, counts in self.counts.items():
            rate = self.acceptance_rate(feature)
            shown = ", ".join(f"{name} {value:,}" for name, value in counts.items())
            lines.append(
                f"counted   {feature}: {shown}" + (f", acceptance rate {rate:.1%}" if rate is not None else "")
            )
        lines += [f"fell back {feature}: {reason}" for feature, reason in dict.fromkeys(self.fell_back)]
        lines += [f"degraded  {feature}: {reason}" for feature, reason in dict.fromkeys(self.degraded)]
        lines.append(f"cache bytes saved: {self.cache_bytes_saved:,}")
        return "\n".join(lines)


@contextlib.contextmanager
def report() -> Iterator[Report]:
    """Collect a :class:`Report` of every fastgen decision taken inside the block (this thread/task).

    Returns:
        The :class:`Report`, filled as the block runs (cache sizes settle when it ends).

    Example:
        ```python
        with fastgen.report() as r:
            model.generate(**inputs, num_beams=4)
        print(r)  # what ran, what fell back and why
        assert r.fast_path("dedup")
        ```
    """
    result = Report()
    token = _current.set(result)
    try:
        yield result
    finally:
        _current.reset(token)
        settle_caches(result)


def note_ran(feature: str, what: str) -> None:
    """Record that ``feature`` took its fast path (``what`` says how, briefly)."""
    current = _current.get()
    if current is not None:
        entries = current.ran.setdefault(feature, [])
        if what not in entries:
            entries.append(what)


def note_counts(feature: str, **counts: int) -> None:
    """Add ``counts`` to ``feature``'s counters in the open report."""
    current = _current.get()
    if current is not None:
        totals = current.counts.setdefault(feature, {})
        for name, value in counts.items():
            totals[name] = totals.get(name, 0) + value


def note_fallback(feature: str, reason: str) -> None:
    current = _current.get()
    if current is not None:
        current.fell_back.append((feature, reason))


def note_degraded(feature: str, reason: str) -> None:
    current = _current.get()
    if current is not None:
        current.degraded.append((feature, reason))


def note_cache(bytes_saved: Callable[[], int]) -> None:
    """Register a cache whose savings are measured when the ``generate`` call ends (it is empty now)."""
    current = _current.get()
    if current is not None:
        current._pending_caches.append(bytes_saved)


def settle_caches(current: Report | None = None) -> None:
    """Measure the caches registered so far (called at the end of ``generate`` and of the block)."""
    current = current or _current.get()
    if current is None:
        return
    while current._pending_caches:
        current.cache_bytes_saved += current._pending_caches.pop(0)()
