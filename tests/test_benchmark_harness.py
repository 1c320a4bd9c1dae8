"""The benchmarks' shared harness (benchmarks.measure): alternating rounds, the result header, JSON writing."""

from __future__ import annotations

import json

from benchmarks.measure import alternate, result_header, write_result


def test_alternate_warms_up_each_variant_then_rotates_the_order():
    calls: list[str] = []

    def run(name: str):
        calls.append(name)
        return f"{name}-out-{len(calls)}", len(calls), -len(calls)

    rounds = alternate(run, ["a", "b", "c"], rounds=3)
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert rounds.outputs == {"a": "a-out-11", "b": "b-out-12", "c": "c-out-10"}  # the last timed call's
    assert rounds.column("a") == [4, 9, 11] and rounds.column("a", 1) == [-4, -9, -11]  # warm-up not measured
    assert set(rounds.load_average) == {"start", "end"} and len(rounds.load_average["start"]) == 3


def test_result_header_and_write_result(tmp_path):
    header = result_header("beam_loop", ["--scenario", "bart-base"])
    assert header["benchmark"] == "beam_loop"
    assert header["command"] == "python -m benchmarks.beam_loop --scenario bart-base"
    assert header["date_utc"].endswith("Z")
    path = tmp_path / "results" / "x.json"
    write_result(path, header | {"speedup": 1.5})
    assert json.loads(path.read_text()) == header | {"speedup": 1.5}
    assert path.read_text().endswith("}\n")
