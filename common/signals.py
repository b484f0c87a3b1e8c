"""Stopping a long-running process cleanly on SIGTERM and SIGINT.

Kubernetes stops a pod with SIGTERM, and Python's default for it ends the process at
once (or, as a container's PID 1, not at all until the SIGKILL at the end of the grace
period): no `finally` runs. The node agent must remove its registration socket so the
kubelet deregisters it, and the webhook's quota writer must hand its Lease back so the
next replica takes over within a retry rather than a lease duration. Both run their
tasks in the group `stop_on_signal` yields, which the first of those signals cancels,
the webhook after a drain: the API servers keep sending reviews to a replica until
they see its endpoint withdrawn, so it serves them a few seconds more, not ready.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import anyio.abc

__all__ = ["stop_on_signal"]

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def stop_on_signal(
    drain: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group the first SIGTERM or SIGINT cancels, its tasks then stopping
    through their `finally` blocks; it ends when they have. `drain`, where given, is
    awaited first, the tasks running on meanwhile; a second signal cuts it short. The
    signals stay caught until the group has ended, so one sent during the clean-up
    does not cut that short (the kubelet's SIGKILL at the end of the grace period
    still does). Without a signal the group runs until its tasks end, like any other."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:

        async def next_signal() -> None:
            async for signum in signals:
                log.info("stopping", extra={"fields": {"signal": signal.Signals(signum).name}})
                return

        async with anyio.create_task_group() as tg:

            async def cancel_on_signal() -> None:
                await next_signal()
                if drain is not None:
                    async with anyio.create_task_group() as draining:

                        async def cut_short() -> None:
                            await next_signal()
                            draining.cancel_scope.cancel()

                        draining.start_soon(cut_short)
                        await drain()
                        draining.cancel_scope.cancel()
                tg.cancel_scope.cancel()

            tg.start_soon(cancel_on_signal)
            yield tg
