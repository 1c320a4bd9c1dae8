"""The asynchronous pipeline keeps submission order, fails loudly, and the journal resumes whole units."""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fastgen.cli.journal import Journal, ResumeError, index_path, merge_parts
from fastgen.cli.pipeline import AsyncPipeline, PipelineError, make_executor


def _slow_square(x: int) -> int:
    time.sleep(random.random() * 0.01)
    return x * x


def test_commits_in_submission_order_when_workers_finish_out_of_order():
    committed: list[tuple[int, int]] = []
    finished: list[int] = []

    def postprocess(x: int) -> int:
        time.sleep(0.02 if x % 3 == 0 else 0.001)  # every third batch finishes late
        finished.append(x)
        return x * x

    with AsyncPipeline(lambda x: x, postprocess, lambda k, r: committed.append((k, r)), ThreadPoolExecutor(4)) as p:
        for key in range(30):
            p.submit(key, key)
    assert committed == [(k, k * k) for k in range(30)]
    assert finished != sorted(finished), "the workers should have finished out of order"


@pytest.mark.parametrize("serial", [True, False])
def test_serial_and_async_paths_give_the_same_commits(serial):
    committed: list[tuple[int, int]] = []
    with AsyncPipeline(lambda x: x + 1, _slow_square, lambda k, r: committed.append((k, r)), serial=serial) as p:
        for key in range(10):
            p.submit(key, key)
    assert committed == [(k, (k + 1) ** 2) for k in range(10)]


def _boom(x: int) -> int:
    if x == 3:
        raise ValueError("bad batch 3")
    return x


def test_a_failing_post_process_stops_the_run():
    committed: list[int] = []
    pipeline = AsyncPipeline(lambda x: x, _boom, lambda k, r: committed.append(k), ThreadPoolExecutor(2))
    with pytest.raises(PipelineError, match="bad batch 3"), pipeline:
        for key in range(50):
            pipeline.submit(key, key)
            time.sleep(0.001)
    assert committed == [0, 1, 2]


def _die(x: int) -> int:
    if x == 2:
        os._exit(1)  # a worker process killed mid-batch
    return x


def test_a_crashed_worker_process_fails_the_run_loudly():
    committed: list[int] = []
    pipeline = AsyncPipeline(lambda x: x, _die, lambda k, r: committed.append(k), make_executor(1, "process"))
    with pytest.raises(PipelineError, match="worker died"), pipeline:
        for key in range(20):
            pipeline.submit(key, key)
            time.sleep(0.01)
    assert committed == [0, 1]


def test_journal_resume_drops_a_torn_unit_and_a_torn_index_line(tmp_path):
    out = tmp_path / "out.txt"
    journal = Journal(out, {"run": 1}, resume=False)
    journal.commit(0, "a\nb\n")
    journal.commit(1, "c\n")
    journal.close()
    with open(out, "ab") as handle:
        handle.write(b"half a li")  # killed while writing unit 2
    with open(index_path(out), "ab") as handle:
        handle.write(b'{"unit": 2, "st')  # ... and its index record
    journal = Journal(out, {"run": 1}, resume=True)
    assert journal.done_units == {0, 1}
    journal.commit(2, "d\n")
    journal.finish("end\n")
    assert out.read_text() == "a\nb\nc\nd\nend\n"
    # resuming a finished journal rewrites only its trailer
    journal = Journal(out, {"run": 1}, resume=True)
    assert journal.done_units == {0, 1, 2}
    journal.finish("end\n")
    assert out.read_text() == "a\nb\nc\nd\nend\n"


def test_journal_refuses_other_settings_and_foreign_files(tmp_path):
    out = tmp_path / "out.txt"
    Journal(out, {"beam": 4}, resume=False).close()
    with pytest.raises(ResumeError, match="different settings"):
        Journal(out, {"beam": 5}, resume=True)
    foreign = tmp_path / "foreign.txt"
    foreign.write_text("x\n")
    with pytest.raises(ResumeError, match=r"no foreign\.txt\.fastgen-index"):
        Journal(foreign, {}, resume=True)


def test_merge_interleaves_parts_by_unit(tmp_path):
    parts = [tmp_path / "p0", tmp_path / "p1"]
    for rank, part in enumerate(parts):
        journal = Journal(part, {"rank": rank}, resume=False)
        for unit in range(rank, 6, 2):
            journal.commit(unit, f"{unit}\n")
        journal.close()
    merge_parts(parts, tmp_path / "out", "done\n")
    assert (tmp_path / "out").read_text() == "0\n1\n2\n3\n4\n5\ndone\n"
