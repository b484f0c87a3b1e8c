"""SIGTERM and SIGINT stop a process's tasks through their `finally` blocks, which
Python's default handling skips: the webhook's Lease is handed back and the node
agent's registration socket removed only there."""

from __future__ import annotations

import os
import signal

import anyio
import pytest
from gpudra.common.signals import stop_on_signal

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_stops_the_tasks_through_their_clean_up(signum: signal.Signals) -> None:
    started, cleaned = anyio.Event(), []

    async def holder() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                # A second signal during the clean-up (an impatient sender) is caught
                # too: the default handler would end the process here.
                os.kill(os.getpid(), signum)
                await anyio.sleep(0.05)
                cleaned.append("released")

    with anyio.fail_after(30):
        async with stop_on_signal() as tg:
            tg.start_soon(holder)
            await started.wait()
            os.kill(os.getpid(), signum)
    assert cleaned == ["released"]


async def test_the_drain_runs_with_the_tasks_still_running_and_a_second_signal_ends_it() -> None:
    """A webhook keeps serving while it drains: the group's tasks are cancelled only
    after the drain; a second signal (a person's second Ctrl-C) cuts the drain short."""
    events: list[str] = []
    serving, draining = anyio.Event(), anyio.Event()

    async def server() -> None:
        serving.set()
        try:
            await anyio.sleep_forever()
        finally:
            events.append("server stopped")

    async def drain() -> None:
        events.append("drain begun")
        draining.set()
        try:
            await anyio.sleep_forever()  # only the second signal ends it
        finally:
            events.append("drain ended")

    with anyio.fail_after(30):
        async with stop_on_signal(drain) as tg:
            tg.start_soon(server)
            await serving.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            await draining.wait()
            await anyio.sleep(0.05)
            assert events == ["drain begun"]  # the server still runs
            os.kill(os.getpid(), signal.SIGTERM)
    assert events == ["drain begun", "drain ended", "server stopped"]
