"""Online admission for the continuous-batching loops: inputs that arrive while the loop runs (a server).

``generate_many`` knows its inputs in advance: its loops (:func:`~fastgen.continuous.scheduler.run_continuous`,
:func:`~fastgen.continuous.decoder_only.run_decoder_only`) pull the next input when rows free up and stop
when the iterable ends. A server's inputs come at random moments, so with an :class:`Online` passed to
those loops:

- the ``inputs`` iterator may yield :data:`WAIT`: "nothing now, ask again at the next step boundary";
  the loop then runs the rows it has (or, with none, yields control) and polls again after the step;
- results leave as soon as they finish, not in input order, and the loop yields ``None`` after every
  step (and while idle), so the caller regains control at each step boundary: to feed new inputs, step
  another loop, or stop;
- inputs whose index is in :attr:`Online.cancelled` leave at the next step boundary, without a result,
  freeing their rows (a client that disconnected);
- :attr:`Online.on_step` sees the search state after each step (before finished inputs leave): the
  running inputs' newest tokens, for streaming.

Indices count the inputs the iterator yielded (``WAIT`` not counted), from 0, as ``enumerate`` would.
Nothing else changes: a row does the same arithmetic whether its input arrived early or late.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


class _Wait:
    def __repr__(self) -> str:
        return "WAIT"


#: what an online ``inputs`` iterator yields when it has no input now but may have one later
WAIT: Any = _Wait()


@dataclass
class Online:
    """The hooks of one online loop (see the module docs). The caller mutates :attr:`cancelled` between
    two steps (same thread); the loop discards each index it drops."""

    cancelled: set[int] = field(default_factory=set)
    on_step: Callable[[Any], None] | None = None  # called with the SearchState after each search step


def numbered(inputs: Iterable[Any]) -> Iterator[Any]:
    """``enumerate(inputs)`` that passes :data:`WAIT` through uncounted."""
    index = 0
    for item in inputs:
        if item is WAIT:
            yield WAIT
            continue
        yield index, item
        index += 1


def cancelled_positions(indices: list[int], online: Online | None) -> list[int] | None:
    """The running positions to keep when some running inputs were cancelled (None: none were); the
    cancelled indices found are discarded from ``online.cancelled``."""
    if online is None or not online.cancelled:
        return None
    dropped = [index for index in indices if index in online.cancelled]
    if not dropped:
        return None
    online.cancelled.difference_update(dropped)
    return [position for position, index in enumerate(indices) if index not in set(dropped)]
