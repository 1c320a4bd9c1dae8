"""``benchmarks.serve_load``'s sustainable rate: the highest rate held below the first rate missed."""

from benchmarks.serve_load import P95_TARGET_S, sustainable


def _row(rate: float, p95: float | None, failed: int = 0) -> dict:
    return {"rate": rate, "p95_s": p95, "failed": failed}


def test_a_rate_held_after_a_miss_does_not_count():
    """The finer EPYC run: 32 and 34 held, 36 missed, 38 held under the request cap: 34."""
    rows = [_row(32, 1.21), _row(34, 1.80), _row(36, 2.42), _row(38, 1.45)]
    assert sustainable(rows) == 34


def test_failures_none_and_order():
    assert sustainable([_row(20, 0.5, failed=1), _row(16, 0.4)]) == 16  # sorted by rate; a failure is a miss
    assert sustainable([_row(12, None)]) is None  # no answer, no latency: missed
    assert sustainable([_row(12, P95_TARGET_S + 0.01)]) is None
    assert sustainable([_row(12, P95_TARGET_S), _row(16, 0.1)]) == 16
    assert sustainable([]) is None
