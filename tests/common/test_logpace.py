"""LogPace: the first occurrence is logged, then at most one line per interval, each
saying how many occurred since the last."""

from __future__ import annotations

from gpudra.common.logpace import LogPace


def test_first_then_once_per_interval_with_the_count_since() -> None:
    now = [100.0]
    pace = LogPace(60.0, clock=lambda: now[0])
    assert pace.due() == 1  # the first is logged
    for _ in range(4):
        now[0] += 10
        assert pace.due() is None  # within the interval: counted, not logged
    now[0] += 20  # 60 s after the last line
    assert pace.due() == 5  # the four held back and this one
    now[0] += 59.9
    assert pace.due() is None
    now[0] += 0.1
    assert pace.due() == 2
