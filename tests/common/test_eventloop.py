"""The loop gpudra's long-running processes run on."""

from __future__ import annotations

import asyncio

import uvloop
from gpudra.common.eventloop import run_event_loop


async def _loop_and(value: int, other: str) -> tuple[type[asyncio.AbstractEventLoop], int, str]:
    return type(asyncio.get_running_loop()), value, other


def test_main_runs_on_uvloop_with_its_arguments_and_returns_its_value() -> None:
    loop, value, other = run_event_loop(_loop_and, 7, "x")
    assert issubclass(loop, uvloop.Loop)
    assert (value, other) == (7, "x")
