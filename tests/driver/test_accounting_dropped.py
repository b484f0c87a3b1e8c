"""A holding change the log dropped (the node's other claims filled it while the
sampler was late) leaves the time around it unbilled: never a gap billed to the claim
that held nothing in it, nor its share moved onto a claim that shared the device."""

from __future__ import annotations

import pytest
from gpudra.driver.holders import DEFAULT_HOLDING_CHANGES

from tests.driver.test_accounting_spans import l4_node, prepared, unprepared, uuid_of
from tests.driver.test_device_metrics import Node, billed, claim

pytestmark = pytest.mark.anyio


def fill_the_log(node: Node) -> None:
    """Changes of the node's other claims that fill the log: with the change told before
    them and the one told after, it holds one too many, and drops the first."""
    for i in range(DEFAULT_HOLDING_CHANGES - 1):
        node.sampler.holdings.held(f"elsewhere-{i}")


async def test_a_dropped_release_does_not_bill_the_gap_until_the_claim_came_back() -> None:
    """team-a's pod leaves 5 s into the interval and its claim is prepared again for a
    new pod at 20 s; the release's time is dropped. The gap from 5 s to 20 s is not
    billed: only the 10 s since it came back are, never the 30 s of the interval."""
    node = l4_node()
    uuid = uuid_of(node)
    node.claims.append(claim("u1", "team-a", "a", "gpu-0", uuid))
    await node.sampler.sample_once()
    node.clock.now += 5
    unprepared(node, "u1")
    fill_the_log(node)
    node.clock.now += 15
    prepared(node, claim("u1", "team-a", "b", "gpu-0", uuid))
    node.clock.now += 10
    await node.sampler.sample_once()
    assert node.sampler.holdings.dropped == 1
    assert billed(node) == {"team-a": pytest.approx(10)}


async def test_a_dropped_hold_does_not_move_the_claims_share_onto_its_co_holder() -> None:
    """team-b's claim joins team-a's on a time-sliced GPU 5 s into the interval and
    leaves at 20 s; the join's time is dropped. team-a is never billed the whole GPU
    for the time it shared it: it pays half while team-b may have been there, and all
    of the 10 s after team-b left (20 s, under the 22.5 s it held)."""
    node = l4_node()
    uuid = uuid_of(node)
    node.claims.append(claim("u1", "team-a", "a", "gpu-0", uuid, time_slice=True))
    await node.sampler.sample_once()
    node.clock.now += 5
    prepared(node, claim("u2", "team-b", "b", "gpu-0", uuid, time_slice=True))
    fill_the_log(node)
    node.clock.now += 15
    unprepared(node, "u2")
    node.clock.now += 10
    await node.sampler.sample_once()
    assert node.sampler.holdings.dropped == 1
    assert billed(node) == {"team-a": pytest.approx(20)}
