"""The one reconcile loop of every gpudra controller.

Our controllers are level-triggered: a watch event, a timer or an inventory change does
not say what to do, it only says "the world may differ from what was last written".
The reconcile then compares the whole desired state with the whole observed state, so
a missed or duplicated signal costs nothing and any number of signals that arrive
while a reconcile runs coalesce into one more run (which reads the newest state).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import anyio.abc
from gpudra.common.backoff import Backoff

__all__ = ["ReconcileLoop"]

log = logging.getLogger(__name__)


class ReconcileLoop:
    """Runs `reconcile` after each `poke()`, one run at a time, until cancelled.

    A failed run is retried after a capped backoff: the failure is usually the API
    server being away or a write racing another writer, both of which pass. Errors of
    the `permanent` types (bad input) are not retried, because the same input fails
    the same way; the next poke, which comes with new input, tries again. Runs wait
    until `ready()` holds (caches listed), so a reconcile never acts on a partial view.
    """

    def __init__(
        self,
        reconcile: Callable[[], Awaitable[object]],
        *,
        backoff: Backoff | None = None,
        permanent: tuple[type[Exception], ...] = (),
        ready: Callable[[], bool] | None = None,
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        self._reconcile = reconcile
        self._backoff = backoff or Backoff()
        self._permanent = permanent
        self._ready = ready
        self._fields = dict(fields or {})
        self._dirty = anyio.Event()
        self.last_error: Exception | None = None
        """The error of the latest run; None once a run succeeds."""

    def poke(self) -> None:
        """Something may have changed: reconcile once more (soon, not once per poke)."""
        self._dirty.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Reconcile on every poke; reports started just before the first run."""
        started = False
        delays = self._backoff.delays()
        while True:
            await self._dirty.wait()
            self._dirty = anyio.Event()
            if self._ready is not None and not self._ready():
                continue
            if not started:
                started = True
                task_status.started()
            try:
                await self._reconcile()
            except self._permanent as exc:
                self.last_error = exc
                log.error(
                    "reconcile failed; not retried until something changes",
                    extra={"fields": {**self._fields, "error": str(exc)}},
                )
            except Exception as exc:
                self.last_error = exc
                delay = next(delays)
                log.warning(
                    "reconcile failed; retrying",
                    extra={"fields": {**self._fields, "error": repr(exc), "retry_s": delay}},
                )
                await anyio.sleep(delay)
                self.poke()
            else:
                self.last_error = None
                delays = self._backoff.delays()
