"""Resumable output: a text file written in whole units plus a sidecar index, both fsync'd.

A *unit* is what the CLIs commit at once (fairseq: one batch's lines; HF: one window of input
lines). ``commit`` appends the unit's text to the output, fsyncs it, then appends one JSON record
(the unit's key and the output's byte length after it) to ``<output>.fastgen-index`` and fsyncs
that. After a kill, the index's last complete record says how many bytes of the output are valid:
``--resume`` truncates the output there (dropping a half-written unit) and skips the recorded
units, so the finished file has no duplicates and no gaps.

An existing output is never touched before the run succeeds: the journal writes
``<output>.partial`` (and its index), created at the first commit, and renames both into place
when it is finished. A failure (bad argument, crash, Ctrl-C) leaves the old output as it was;
``--resume`` continues from the ``.partial`` file (or from a copy of a finished output).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

INDEX_SUFFIX = ".fastgen-index"
PARTIAL_SUFFIX = ".partial"


class ResumeError(RuntimeError):
    """An output cannot be resumed (no index, other arguments, truncated file)."""


def index_path(output: Path) -> Path:
    return output.with_name(output.name + INDEX_SUFFIX)


def partial_path(output: Path) -> Path:
    """Where a run writes ``output`` until it is finished."""
    return output.with_name(output.name + PARTIAL_SUFFIX)


def exists(output: Path) -> bool:
    """True if ``output`` or an unfinished run's ``.partial`` of it is on disk."""
    return output.exists() or partial_path(output).exists()


def _fsync(handle: Any) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def read_index(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """The header, the complete records, and the byte length of the index's valid prefix."""
    data = path.read_bytes()
    header: dict[str, Any] | None = None
    records: list[dict[str, Any]] = []
    valid = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # torn last write
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            break
        if header is None:
            header = entry
        else:
            records.append(entry)
        valid += len(line)
    if header is None:
        raise ResumeError(f"{path} has no header; delete it and the output to start over")
    return header, records, valid


class Journal:
    """An output file and its index, opened fresh or for resuming."""

    def __init__(self, output: Path, header: dict[str, Any], resume: bool) -> None:
        self.output = Path(output)
        self.work = partial_path(self.output)
        self.index = index_path(self.work)
        self.header = header
        self.records: list[dict[str, Any]] = []
        self._out: Any = None
        self._idx: Any = None
        self.offset = 0
        copied = resume and not self.work.exists() and self.output.exists()
        if copied:
            self._copy_finished()
        if resume and self.work.exists():
            try:
                self._reopen(header)
            except ResumeError:
                if copied:  # leave no copy of a finished output behind
                    self.work.unlink()
                    self.index.unlink()
                raise

    def _copy_finished(self) -> None:
        """Resume from a copy of a finished output, so the output itself stays as it is until the end."""
        if not index_path(self.output).exists():
            raise ResumeError(
                f"cannot resume {self.output}: it has no {index_path(self.output).name} (not written by fastgen, "
                "or its index was removed); delete the output or run without --resume"
            )
        shutil.copyfile(index_path(self.output), self.index)
        shutil.copyfile(self.output, self.work)

    def _open_fresh(self) -> None:
        if self._out is not None:
            return
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(self.work, "wb")  # noqa: SIM115 - closed in close()
        self._idx = open(self.index, "wb")  # noqa: SIM115
        self._idx.write((json.dumps(self.header) + "\n").encode())
        _fsync(self._out)
        _fsync(self._idx)
        self.offset = 0

    def _reopen(self, header: dict[str, Any]) -> None:
        if not self.index.exists():
            raise ResumeError(
                f"cannot resume {self.work}: it has no {self.index.name} (not written by fastgen, or its "
                "index was removed); delete it or run without --resume"
            )
        old_header, records, _ = read_index(self.index)
        if old_header != header:
            changed = sorted(k for k in set(header) | set(old_header) if header.get(k) != old_header.get(k))
            raise ResumeError(
                f"cannot resume {self.output}: it was written with different settings ({', '.join(changed)}); "
                "delete it or run without --resume"
            )
        records = [r for r in records if "unit" in r]  # a trailer record is rewritten at the end
        end = records[-1]["end"] if records else 0
        size = self.work.stat().st_size
        if size < end:
            raise ResumeError(f"cannot resume {self.work}: it has {size} bytes but its index says {end} were written")
        self._out = open(self.work, "r+b")  # noqa: SIM115
        self._out.truncate(end)
        self._out.seek(end)
        _fsync(self._out)
        # Rewrite the index without a torn line or a trailer record; replace it atomically.
        tmp = self.index.with_name(self.index.name + ".tmp")
        with open(tmp, "wb") as handle:
            for entry in [old_header, *records]:
                handle.write((json.dumps(entry) + "\n").encode())
            _fsync(handle)
        os.replace(tmp, self.index)
        self._idx = open(self.index, "ab")  # noqa: SIM115
        self.offset = end
        self.records = records

    @property
    def done_units(self) -> set[int]:
        return {r["unit"] for r in self.records}

    def commit(self, unit: int, text: str, **extra: Any) -> None:
        """Append one unit's text (whole lines) and its index record, each fsync'd."""
        self._open_fresh()
        data = text.encode("utf-8")
        self._out.write(data)
        _fsync(self._out)
        self.offset += len(data)
        record = {"unit": unit, "start": self.offset - len(data), "end": self.offset, **extra}
        self._idx.write((json.dumps(record) + "\n").encode())
        _fsync(self._idx)
        self.records.append(record)

    def finish(self, trailer: str = "") -> None:
        """Append text that follows every unit (fairseq's score line) and put the output in place."""
        self._open_fresh()
        if trailer:
            data = trailer.encode("utf-8")
            self._out.write(data)
            _fsync(self._out)
            self.offset += len(data)
            self._idx.write((json.dumps({"trailer": True, "end": self.offset}) + "\n").encode())
            _fsync(self._idx)
        self.close()

    def close(self) -> None:
        """Finish a complete run: the ``.partial`` file and its index replace the output and its index."""
        self._open_fresh()
        for handle in (self._out, self._idx):
            if not handle.closed:
                handle.close()
        os.replace(self.work, self.output)
        os.replace(self.index, index_path(self.output))


def iter_unit_texts(output: Path) -> Iterator[tuple[dict[str, Any], str]]:
    """Every committed unit of a journal with its text, in file order."""
    _, records, _ = read_index(index_path(output))
    with open(output, "rb") as handle:
        for record in records:
            if "unit" not in record:
                continue
            handle.seek(record["start"])
            yield record, handle.read(record["end"] - record["start"]).decode("utf-8")


def merge_parts(parts: list[Path], output: Path, trailer: str = "") -> None:
    """Write the units of several journals (one per rank) to ``output`` in unit order, atomically."""
    units: list[tuple[int, str]] = []
    for part in parts:
        units.extend((record["unit"], text) for record, text in iter_unit_texts(part))
    units.sort(key=lambda item: item[0])
    keys = [key for key, _ in units]
    if len(set(keys)) != len(keys):
        raise RuntimeError(f"parts {parts} share a unit; they come from different runs")
    tmp = output.with_name(output.name + ".merging")
    with open(tmp, "w", encoding="utf-8", newline="") as handle:
        for _, text in units:
            handle.write(text)
        handle.write(trailer)
        _fsync(handle)
    os.replace(tmp, output)
