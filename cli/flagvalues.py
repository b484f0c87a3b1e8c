"""Values of command-line flags that several commands take in the same form."""

from __future__ import annotations

import math

__all__ = ["seconds_within"]


def seconds_within(
    raw: str, low: float, high: float = math.inf, *, low_excluded: bool = False
) -> float | None:
    """`raw` as seconds from `low` to `high` (more than `low` with `low_excluded`); None
    where it is no number, not finite ("nan", "inf") or out of range, for the flag's own
    type to refuse naming its bounds and why they are what they are."""
    try:
        value = float(raw)
    except ValueError:
        return None
    in_range = low < value <= high if low_excluded else low <= value <= high
    return value if math.isfinite(value) and in_range else None
