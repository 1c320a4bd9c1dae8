"""The journal never touches a finished output before a run succeeds, nor leaves copies when it refuses."""

from __future__ import annotations

import pytest

from fastgen.cli.journal import Journal, ResumeError, index_path, partial_path


def _finished(path, header, text):
    journal = Journal(path, header, resume=False)
    journal.commit(0, text)
    journal.finish("end\n")


def test_a_new_run_leaves_the_old_output_until_it_finishes(tmp_path):
    out = tmp_path / "out.txt"
    _finished(out, {"run": 1}, "old\n")
    journal = Journal(out, {"run": 2}, resume=False)
    assert out.read_text() == "old\nend\n", "nothing may be written before the first unit"
    assert not partial_path(out).exists()
    journal.commit(0, "new\n")
    assert out.read_text() == "old\nend\n"
    assert partial_path(out).read_text() == "new\n"
    journal.finish("end\n")
    assert out.read_text() == "new\nend\n"
    assert not partial_path(out).exists() and not index_path(partial_path(out)).exists()


def test_resuming_with_other_settings_leaves_no_copy(tmp_path):
    out = tmp_path / "out.txt"
    _finished(out, {"beam": 4}, "a\n")
    with pytest.raises(ResumeError, match="different settings"):
        Journal(out, {"beam": 5}, resume=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt", "out.txt.fastgen-index"]
