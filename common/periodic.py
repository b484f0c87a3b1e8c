"""Run one step on a fixed interval, forever, surviving the step's failures.

Background jobs of the node agent (device sampling, claim status) must not die on one
bad pass, nor spin on a failing one: each pass is logged on failure and the next one
comes one interval later, as if it had succeeded.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn

import anyio

__all__ = ["run_every"]


async def run_every(
    interval_s: float,
    step: Callable[[], Awaitable[object]],
    *,
    failed: str,
    logger: logging.Logger,
) -> NoReturn:
    """Await `step()` now and every `interval_s` seconds after it returns; a failure is
    logged with `failed` (what to say) and the loop goes on."""
    while True:
        try:
            await step()
        except Exception:
            logger.exception(failed)
        await anyio.sleep(interval_s)
