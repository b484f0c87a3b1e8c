"""`run_every` goes on after a failed pass and logs it."""

from __future__ import annotations

import logging

import anyio
import pytest
from gpudra.common.periodic import run_every

pytestmark = pytest.mark.anyio


async def test_a_failed_pass_is_logged_and_the_next_one_comes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    passes: list[int] = []
    done = anyio.Event()

    async def step() -> None:
        passes.append(len(passes))
        if len(passes) == 1:
            raise RuntimeError("first pass breaks")
        if len(passes) == 3:
            done.set()

    logger = logging.getLogger("test.periodic")
    with caplog.at_level(logging.ERROR, logger="test.periodic"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_every(0.01, step, failed="pass failed", logger=logger))
            with anyio.fail_after(30):  # a hang guard, not a speed check
                await done.wait()
            tg.cancel_scope.cancel()
    assert passes == [0, 1, 2]
    (record,) = caplog.records
    assert record.getMessage() == "pass failed"
    assert record.exc_info is not None
