"""Input lines for ``fastgen-generate-hf``: validation, and the length-sorted batch plan.

The plan is a pure function of the input file and the options, so a resumed or data-parallel run
forms exactly the batches an uninterrupted single-process run forms (same padding, same
per-batch seeds): inputs are cut into windows of ``window`` consecutive lines, each window's
valid lines are sorted by token count (longest first, ties in input order) and cut into batches.
A window is the unit that is written and resumed; a window without valid lines still gets one
empty batch, so every window is committed.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class InputLine:
    number: int  # 1-based, for messages
    text: str | None  # None when invalid
    problem: str | None = None
    ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Batch:
    key: int  # global batch number: the pipeline key and the sampling seed offset
    window: int
    indices: tuple[int, ...]  # 0-based input line indices
    last_in_window: bool


def read_lines(path: Path) -> list[InputLine]:
    """Every line of ``path`` (``\\n`` or ``\\r\\n`` ends; a leading UTF-8 byte-order mark dropped);
    invalid ones carry a reason."""
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)  # as the utf-8-sig codec reads it
    raw_lines = data.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()  # the file's final newline
    lines = []
    for number, raw in enumerate(raw_lines, start=1):
        raw = raw.removesuffix(b"\r")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            lines.append(
                InputLine(number, None, f"is not valid UTF-8 (byte {exc.start}: {raw[exc.start : exc.start + 4]!r})")
            )
            continue
        if "\x00" in text:
            lines.append(InputLine(number, None, "contains a NUL character"))
        elif not text.strip():
            lines.append(InputLine(number, None, "is empty"))
        else:
            lines.append(InputLine(number, text))
    return lines


def check_lengths(lines: list[InputLine], max_tokens: int) -> None:
    for line in lines:
        if line.text is not None and len(line.ids) > max_tokens:
            line.problem = f"has {len(line.ids)} tokens; the limit is {max_tokens} (--max-input-tokens)"
            line.text = None


def plan(lines: list[InputLine], batch_size: int, window: int) -> list[Batch]:
    batches: list[Batch] = []
    for w, start in enumerate(range(0, len(lines), window)):
        members = [i for i in range(start, min(start + window, len(lines))) if lines[i].text is not None]
        members.sort(key=lambda i: -len(lines[i].ids))  # stable: ties stay in input order
        chunks = [members[k : k + batch_size] for k in range(0, len(members), batch_size)] or [[]]
        for c, chunk in enumerate(chunks):
            batches.append(Batch(len(batches), w, tuple(chunk), c == len(chunks) - 1))
    return batches
