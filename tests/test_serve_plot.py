"""The serving latency figure (benchmarks/serve_plot.py): drawn from the committed load-test results."""

from __future__ import annotations

import json
import re

from benchmarks import serve_plot


def test_committed_figure_is_drawn_from_the_committed_results():
    drawn = serve_plot.figure(serve_plot.load(serve_plot.RESULTS))
    assert serve_plot.OUT.read_text() == drawn, "redraw it: python -m benchmarks.serve_plot"


def _result(rates: list[float], p95: float) -> dict:
    points = [{"rate": rate, "p50_s": p95 / 2, "p95_s": p95} for rate in rates]
    model = {"params": {"num_beams": 4, "max_new_tokens": 8}, "fastgen": points, "baseline": points}
    return {"settings": {"p95_target_s": 2.0}, "models": {"tiny": model}}


def test_later_files_add_rates_and_replace_repeated_ones(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(_result([1.0, 2.0], p95=0.5)))
    second.write_text(json.dumps(_result([2.0, 8.0], p95=3.0)))
    models = serve_plot.load([first, second])
    fastgen = models["tiny"]["servers"]["fastgen"]
    assert sorted(fastgen) == [1.0, 2.0, 8.0]
    assert fastgen[1.0]["p95_s"] == 0.5 and fastgen[2.0]["p95_s"] == 3.0

    svg = serve_plot.figure(models)
    lines = re.findall(r'<polyline points="([^"]+)" fill="none" stroke="[^"]+" stroke-width="2"', svg)
    assert len(lines) == 4  # 2 servers x 2 percentiles, 3 rates each, left to right
    for line in lines:
        xs = [float(point.split(",")[0]) for point in line.split()]
        assert len(xs) == 3 and xs == sorted(xs)
    assert svg.count("<circle") == 4 * 3
    assert "tiny: beam 4, 8 new tokens" in svg


def test_ticks_reach_the_largest_value_in_round_steps():
    assert serve_plot.nice_ticks(6.25) == [0, 2, 4, 6, 8]
    assert serve_plot.nice_ticks(64) == [0, 20, 40, 60, 80]
    assert serve_plot.nice_ticks(0.9)[-1] >= 0.9
