"""Stopping a long-running process cleanly on SIGTERM and SIGINT.

Kubernetes stops a pod with SIGTERM, and Python's default for it ends the process at
once: no `finally` runs. The node agent must remove its registration socket so the
kubelet deregisters it, and the webhook's quota writer must hand its Lease back so the
next replica takes over within a retry rather than a lease duration. Both run their
tasks in the group `stop_on_signal` yields, which the first of those signals cancels.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import AsyncIterator

import anyio
import anyio.abc

__all__ = ["stop_on_signal"]

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def stop_on_signal() -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group the first SIGTERM or SIGINT cancels, its tasks then stopping
    through their `finally` blocks; it ends when they have. The signals stay caught
    until then, so one sent again during the clean-up does not cut it short (the
    kubelet's SIGKILL at the end of the grace period still does). Without a signal
    the group runs until its tasks end, like any other."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:

            async def cancel_on_signal() -> None:
                async for signum in signals:
                    log.info("stopping", extra={"fields": {"signal": signal.Signals(signum).name}})
                    tg.cancel_scope.cancel()
                    return

            tg.start_soon(cancel_on_signal)
            yield tg
