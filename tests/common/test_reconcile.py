"""The shared reconcile loop: coalescing, capped retries, permanent errors, readiness."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import pytest
from gpudra.common.backoff import Backoff
from gpudra.common.reconcile import ReconcileLoop

pytestmark = pytest.mark.anyio
GUARD = 10  # seconds: only a hang guard, never a speed check


class BadInput(ValueError):
    pass


class Reconcile:
    """A reconcile that records its runs and fails or blocks as told."""

    def __init__(self) -> None:
        self.runs = 0
        self.failures: list[Exception] = []
        self.gate: anyio.Event | None = None
        self.seen_errors: list[Exception | None] = []
        self.loop: ReconcileLoop | None = None

    async def __call__(self) -> None:
        self.runs += 1
        assert self.loop is not None
        self.seen_errors.append(self.loop.last_error)
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            raise self.failures.pop(0)


def make(reconcile: Reconcile, **kwargs: Any) -> ReconcileLoop:
    loop = ReconcileLoop(reconcile, **kwargs)
    reconcile.loop = loop
    return loop


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured context a log call passed as `extra={"fields": ...}`."""
    found: dict[str, Any] = record.__dict__["fields"]
    return found


async def until(probe: Callable[[], bool]) -> None:
    with anyio.fail_after(GUARD):
        while not probe():
            await anyio.sleep(0.01)


async def test_pokes_during_a_run_coalesce_into_one_more_run() -> None:
    reconcile = Reconcile()
    reconcile.gate = anyio.Event()
    loop = make(reconcile)
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        loop.poke()
        await until(lambda: reconcile.runs == 1)
        for _ in range(5):
            loop.poke()
        reconcile.gate.set()
        await until(lambda: reconcile.runs == 2)
        await anyio.wait_all_tasks_blocked()
        assert reconcile.runs == 2
        tg.cancel_scope.cancel()


async def test_failures_are_retried_with_a_capped_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gpudra.common.reconcile")
    reconcile = Reconcile()
    reconcile.failures = [RuntimeError(f"API down {i}") for i in range(4)]
    loop = make(reconcile, backoff=Backoff(first_s=0.01, max_s=0.02), fields={"what": "test"})
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        loop.poke()
        await until(lambda: reconcile.runs == 5)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert loop.last_error is None
    # Each retry saw the previous failure; the successful run cleared it.
    assert [str(e) for e in reconcile.seen_errors[1:]] == [f"API down {i}" for i in range(4)]
    delays = [fields(r)["retry_s"] for r in caplog.records if r.msg == "reconcile failed; retrying"]
    assert delays == [0.01, 0.02, 0.02, 0.02]
    assert all(fields(r)["what"] == "test" for r in caplog.records)


async def test_backoff_starts_over_after_a_success(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpudra.common.reconcile")
    reconcile = Reconcile()
    reconcile.failures = [RuntimeError("one"), RuntimeError("two")]
    loop = make(reconcile, backoff=Backoff(first_s=0.01, max_s=0.04))
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        loop.poke()
        await until(lambda: reconcile.runs == 3)
        reconcile.failures = [RuntimeError("three")]
        loop.poke()
        await until(lambda: reconcile.runs == 5)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    delays = [fields(r)["retry_s"] for r in caplog.records]
    assert delays == [0.01, 0.02, 0.01]


async def test_permanent_errors_wait_for_the_next_poke(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpudra.common.reconcile")
    reconcile = Reconcile()
    reconcile.failures = [BadInput("device gpu-2: attribute name is too long")]
    loop = make(reconcile, permanent=(BadInput,))
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        loop.poke()
        await until(lambda: reconcile.runs == 1)
        await anyio.wait_all_tasks_blocked()
        assert reconcile.runs == 1
        assert isinstance(loop.last_error, BadInput)
        assert [r.levelno for r in caplog.records] == [logging.ERROR]
        assert "device gpu-2" in fields(caplog.records[0])["error"]
        loop.poke()
        await until(lambda: reconcile.runs == 2)
        await anyio.wait_all_tasks_blocked()
        assert loop.last_error is None
        tg.cancel_scope.cancel()


async def test_nothing_runs_and_nothing_starts_until_ready() -> None:
    reconcile = Reconcile()
    ready = False
    loop = make(reconcile, ready=lambda: ready)
    started = anyio.Event()

    async def start(tg: anyio.abc.TaskGroup) -> None:
        await tg.start(loop.run)
        started.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(start, tg)
        loop.poke()
        await anyio.wait_all_tasks_blocked()
        assert reconcile.runs == 0
        assert not started.is_set()
        ready = True
        loop.poke()
        await until(lambda: reconcile.runs == 1)
        await started.wait()
        tg.cancel_scope.cancel()
