"""How long a prepare waits for the claim that holds its device (`gpudra node
--conflict-wait`, chart value `node.conflictWaitSeconds`).

A cluster whose pods take longer to stop than the default wait raises it; one that
wants the refusal at once, as before the wait existed, sets 0. The wait itself (what
ends it, what it records) is tested with the rest of the preparer."""

from __future__ import annotations

import logging
from typing import cast

import anyio
import pytest
from gpudra.common.kube import Kube

from tests.driver.test_prepare import (
    Node,
    _gpu_held,
    discover,
    h100,
    node,  # noqa: F401  (the fixture)
    offline_claim,
)
from tests.driver.test_take_over import node_service

pytestmark = pytest.mark.anyio

WAITS = "claim waits for a device's holder to be unprepared"


async def test_a_conflict_wait_of_0_refuses_at_once_and_says_no_wait(
    node: Node,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """0 is the refusal as it was before the wait: no log line saying the claim waits,
    and an error that does not claim a wait (the kubelet retries at its next sync)."""
    preparer, _gpu, _old, [new] = await _gpu_held(node, 2, 0, "tenant-b")

    with caplog.at_level(logging.INFO, logger="gpudra.driver.prepare"), anyio.fail_after(5):
        error = (await preparer.prepare([new]))[new.uid].error

    assert error is not None and "already prepared exclusively" in error
    assert "must be unprepared first" in error
    assert "waited" not in error
    assert not [r for r in caplog.records if r.getMessage() == WAITS]


async def test_the_agents_conflict_wait_is_the_one_its_prepares_wait(
    node: Node,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The node service hands its plugin config's wait to the preparer: a holder that
    stays makes the prepare wait that long, and the error names it."""
    emu = h100()
    service = node_service(node, cast(Kube, object()), emu, conflict_wait_s=0.25)
    await service.agent.scan()
    preparer = service.preparer
    assert preparer is not None
    await preparer.recover()
    gpu = discover(emu).gpus[2].device.name
    old, new = (offline_claim(ns, [("gpu", {"device": gpu})], {}) for ns in ("a", "b"))
    assert (await preparer.prepare([old]))[old.uid].error is None

    with caplog.at_level(logging.INFO, logger="gpudra.driver.prepare"), anyio.fail_after(5):
        error = (await preparer.prepare([new]))[new.uid].error

    assert error is not None and "waited 0.25 s for it" in error
    assert [r.__dict__["fields"]["claim"] for r in caplog.records if r.getMessage() == WAITS] == [
        new.uid
    ]
