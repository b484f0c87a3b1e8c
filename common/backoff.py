"""How long a controller waits before retrying something that failed.

Doubling keeps a component from hammering an API server that is struggling; the cap
bounds how long the component lags behind once the server is back. Every retry loop
(`gpudra.common.watch`, `gpudra.common.reconcile`) takes its delays from here, so a
cap given at the command line or in a test means the same thing everywhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(frozen=True)
class Backoff:
    """Delays that double from `first_s` and never exceed `max_s`.

    A frozen policy rather than a counter: each loop draws its own `delays()` and
    starts a fresh series after a success, so one policy can be shared by many loops.
    """

    first_s: float = 0.2
    max_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.first_s > 0:
            raise ValueError(f"Backoff.first_s must be above 0 seconds, got {self.first_s}")
        if self.max_s < self.first_s:
            raise ValueError(
                f"Backoff.max_s ({self.max_s}) must be at least first_s ({self.first_s}); "
                "raise max_s or lower first_s"
            )

    def delays(self) -> Iterator[float]:
        """An endless series: first_s, 2 * first_s, ... up to max_s, then max_s forever."""
        delay = self.first_s
        while delay < self.max_s:
            yield delay
            delay *= 2
        yield from itertools.repeat(self.max_s)
