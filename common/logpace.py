"""How often a recurring warning is logged.

A server shedding connections under a flood may shed thousands a second; a line for
each would flood the logs in turn and cost the CPU the bound is there to save. The
count goes to a metric every time; the log gets the first occurrence and then at most
one line per interval (a minute unless told), saying how many happened since the last.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["LogPace"]


class LogPace:
    """`due()` once per occurrence: the number of occurrences to report when a line is
    due now (the first one, then once `interval_s` has passed since the last line),
    else None. Not thread-safe: one owner calls it."""

    def __init__(
        self, interval_s: float = 60.0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self._since = 0

    def due(self) -> int | None:
        self._since += 1
        now = self._clock()
        if self._last is not None and now - self._last < self._interval_s:
            return None
        count, self._last, self._since = self._since, now, 0
        return count
