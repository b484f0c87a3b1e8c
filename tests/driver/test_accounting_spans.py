"""Accounting bills each claim for the time it held its devices, from its prepare
completing to its unprepare, as the preparer tells the sampler's holding log: not
only whole sampling intervals."""

from __future__ import annotations

import anyio
import pytest
from gpudra.driver.accounting import Accounting
from gpudra.driver.checkpoint import ClaimRecord
from gpudra.driver.holders import ClaimInfo, ClaimInfos, HoldingLog
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.driver.test_device_metrics import (
    Node,
    billed,
    claim,
    emulator,
    inventory_of,
)

pytestmark = pytest.mark.anyio


def prepared(node: Node, record: ClaimRecord) -> None:
    """`record`'s prepare completes now: in the checkpoint and told, as the preparer
    does both in one step."""
    node.claims.append(record)
    node.sampler.holdings.held(record.uid)


def unprepared(node: Node, uid: str) -> None:
    [record] = [c for c in node.claims if c.uid == uid]
    node.claims.remove(record)
    node.sampler.holdings.released(record)


def l4_node(
    utilization: float = 90, *, interval_s: float = 30, infos: ClaimInfos | None = None
) -> Node:
    """An L4 sampled every `interval_s`, busy at `utilization` percent, holding nothing."""
    return Node(emulator("l4", {"utilization": utilization}), (), infos, interval_s=interval_s)


def uuid_of(node: Node) -> str:
    return inventory_of(node.nvml).gpus[0].uuid


async def test_a_claim_prepared_and_unprepared_between_two_samples_is_billed_its_time() -> None:
    """A 20 s job on a 30 s interval: billed 20 s at the next sample (the samples alone
    never see it), idle as its GPU was, labelled with the DeviceClass its claim had even
    though the claim reader forgot the claim once it was unprepared."""
    infos = ClaimInfos()
    node = l4_node(utilization=1, infos=infos)
    uuid = uuid_of(node)
    await node.sampler.sample_once()
    node.clock.now += 5
    infos.remember("u1", ClaimInfo(device_classes={("gpu-0", None): "gpu.nvidia.com"}))
    prepared(node, claim("u1", "team-a", "a", "gpu-0", uuid))
    node.clock.now += 20
    unprepared(node, "u1")
    infos.retain([])  # gone from the checkpoint: the reader forgets it
    node.clock.now += 5
    await node.sampler.sample_once()
    assert billed(node) == {"team-a": pytest.approx(20)}
    assert billed(node, "gpudra_idle_device_seconds_total") == {"team-a": pytest.approx(20)}
    [key] = node.accounting.allocated()
    assert (key.device_class, key.sharing) == ("gpu.nvidia.com", "Exclusive")
    node.clock.now += 30
    await node.sampler.sample_once()  # billed once, and nothing kept of it
    assert billed(node) == {"team-a": pytest.approx(20)}
    assert node.sampler.holdings.take() == ()


async def test_a_holder_change_within_an_interval_is_billed_where_it_happened() -> None:
    """team-a's pod ends 10 s into the interval and team-b's claim gets the GPU 2 s
    later: each pays for its own part, and the 2 s between nobody."""
    node = l4_node()
    uuid = uuid_of(node)
    prepared(node, claim("u1", "team-a", "a", "gpu-0", uuid))
    await node.sampler.sample_once()
    node.clock.now += 10
    unprepared(node, "u1")
    node.clock.now += 2
    prepared(node, claim("u2", "team-b", "b", "gpu-0", uuid))
    node.clock.now += 18
    await node.sampler.sample_once()
    assert billed(node) == {"team-a": pytest.approx(10), "team-b": pytest.approx(18)}
    node.clock.now += 30
    await node.sampler.sample_once()
    assert billed(node) == {"team-a": pytest.approx(10), "team-b": pytest.approx(48)}


async def test_a_shared_gpus_interval_is_split_among_the_holders_of_each_part() -> None:
    """Time-sliced: u1 holds the GPU throughout, u2 comes at 15 s and goes at 25 s,
    u3 comes at 20 s. Each part of the interval is split equally among its holders:
    0-15 u1 alone, 15-20 u1 and u2, 20-25 all three, 25-30 u1 and u3."""
    node = l4_node()
    uuid = uuid_of(node)

    def sliced(uid: str) -> ClaimRecord:
        return claim(uid, f"ns-{uid}", uid, "gpu-0", uuid, time_slice=True)

    prepared(node, sliced("u1"))
    await node.sampler.sample_once()
    node.clock.now += 15
    prepared(node, sliced("u2"))
    node.clock.now += 5
    prepared(node, sliced("u3"))
    node.clock.now += 5
    unprepared(node, "u2")
    node.clock.now += 5
    await node.sampler.sample_once()
    assert billed(node) == {
        "ns-u1": pytest.approx(15 + 5 / 2 + 5 / 3 + 5 / 2),
        "ns-u2": pytest.approx(5 / 2 + 5 / 3),
        "ns-u3": pytest.approx(5 / 3 + 5 / 2),
    }
    assert sum(billed(node).values()) == pytest.approx(30)


async def test_a_stall_bills_nobody_not_even_claims_that_came_and_went_within_it() -> None:
    node = l4_node(interval_s=10)
    uuid = uuid_of(node)
    prepared(node, claim("u1", "team-a", "a", "gpu-0", uuid))
    await node.sampler.sample_once()
    node.clock.now += 5
    prepared(node, claim("u2", "team-b", "b", "gpu-0", uuid))
    node.clock.now += 10
    unprepared(node, "u2")
    node.clock.now += 85  # more than three intervals since the last sample: a stall
    await node.sampler.sample_once()
    assert billed(node) == {}
    node.clock.now += 10
    unprepared(node, "u1")  # after the stall, billed again
    await node.sampler.sample_once()
    assert billed(node) == {"team-a": pytest.approx(10)}


async def test_a_failed_pass_keeps_what_it_was_told_for_the_next() -> None:
    node = l4_node()
    uuid = uuid_of(node)
    await node.sampler.sample_once()
    node.clock.now += 5
    prepared(node, claim("u1", "team-a", "a", "gpu-0", uuid))
    node.clock.now += 10
    unprepared(node, "u1")

    def broken() -> None:
        raise RuntimeError("the driver is wedged")

    node.nvml.nvmlInit = broken  # type: ignore[method-assign]
    node.clock.now += 10
    with pytest.raises(RuntimeError):
        await node.sampler.sample_once()
    del node.nvml.nvmlInit
    node.clock.now += 10
    await node.sampler.sample_once()
    assert billed(node) == {"team-a": pytest.approx(10)}


def test_the_holding_log_keeps_the_newest_changes_and_counts_those_it_drops() -> None:
    now = [0.0]
    log = HoldingLog(clock=lambda: now[0], limit=3)
    for uid in ("u1", "u2", "u3", "u4", "u5"):
        now[0] += 1
        log.held(uid)
    assert [c.claim_uid for c in log.take()] == ["u3", "u4", "u5"]
    assert log.dropped == 2
    log.held("u6")
    taken = log.take()
    log.held("u7")
    log.held("u8")
    log.put_back(taken)  # a failed pass's change goes before the newer ones
    assert [c.claim_uid for c in log.take()] == ["u6", "u7", "u8"]
    for uid in ("u9", "u10", "u11"):
        log.held(uid)
    log.put_back(taken)  # full: the newest kept
    assert [c.claim_uid for c in log.take()] == ["u9", "u10", "u11"]
    assert log.dropped == 3
    with pytest.raises(ValueError, match="limit"):
        HoldingLog(limit=0)


async def test_the_drop_count_is_exported() -> None:
    node = l4_node()
    for i in range(10_001):
        node.sampler.holdings.held(f"u{i}")
    [value] = [v for n, _, v in node.scrape() if n == "gpudra_holding_changes_dropped_total"]
    assert value == 1


# A step of a scenario on one GPU: time passes, then a claim is prepared (told or not,
# time-sliced or not), unprepared (told or not), or the node is sampled.
_STEPS = st.lists(
    st.tuples(
        st.floats(0, 20, allow_nan=False),
        st.sampled_from(("prepare", "prepare-untold", "unprepare", "unprepare-untold", "sample")),
        st.integers(0, 3),
        st.booleans(),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(steps=_STEPS)
def test_a_gpu_is_never_billed_more_than_the_time_that_passed(
    steps: list[tuple[float, str, int, bool]],
) -> None:
    """Whatever claims come and go, told or not, and however far apart the samples:
    the GPU-seconds billed at each sample never exceed the time since the previous
    (nor anything across a stall), and where every change was told, they are exactly
    the time the GPU was held by anybody."""
    node = l4_node(interval_s=10)
    uuid = uuid_of(node)

    async def run() -> None:
        last: float | None = None
        told_only = True
        held_for = 0.0  # since the previous sample, by anybody
        for delay, action, index, sliced in steps:
            if node.claims:
                held_for += delay
            node.clock.now += delay
            uid = f"u{index}"
            holds = any(c.uid == uid for c in node.claims)
            if action.startswith("prepare") and not holds:
                record = claim(uid, f"ns-{uid}", uid, "gpu-0", uuid, time_slice=sliced)
                if action == "prepare":
                    prepared(node, record)
                else:
                    node.claims.append(record)
                    told_only = False
            elif action.startswith("unprepare") and holds:
                if action == "unprepare":
                    unprepared(node, uid)
                else:
                    node.claims = [c for c in node.claims if c.uid != uid]
                    told_only = False
            elif action == "sample":
                before = sum(node.accounting.allocated().values())
                await node.sampler.sample_once()
                added = sum(node.accounting.allocated().values()) - before
                now = node.clock.now
                if last is None or now - last > 30:
                    assert added == 0
                else:
                    assert 0 <= added <= now - last + 1e-9
                    if told_only:
                        assert added == pytest.approx(held_for)
                last, held_for, told_only = now, 0.0, True

    anyio.run(run)


async def test_a_counter_nothing_held_a_device_under_for_a_day_is_dropped() -> None:
    """Short-lived namespaces each left their two series until the agent restarted: a
    counter whose labels no claim has held a device under for `retain_s` goes, one
    still held stays however long its device idles, and one made again starts at zero
    (a new series, which Prometheus's increase() counts from its first sample)."""
    node = l4_node(utilization=1)
    node.accounting.retain_s = 300
    uuid = uuid_of(node)
    await node.sampler.sample_once()
    prepared(node, claim("u1", "ci-run-1", "a", "gpu-0", uuid, time_slice=True))
    prepared(node, claim("u2", "team-a", "b", "gpu-0", uuid, time_slice=True))
    node.clock.now += 30
    await node.sampler.sample_once()
    unprepared(node, "u1")
    left_at = node.clock.now
    for _ in range(10):  # 300 s on: kept, the retention not yet past
        node.clock.now += 30
        await node.sampler.sample_once()
    assert node.clock.now - left_at == 300
    assert billed(node) == {"ci-run-1": pytest.approx(15), "team-a": pytest.approx(315)}
    node.clock.now += 30
    await node.sampler.sample_once()
    assert billed(node) == {"team-a": pytest.approx(345)}
    assert billed(node, "gpudra_idle_device_seconds_total") == {"team-a": pytest.approx(345)}
    prepared(node, claim("u3", "ci-run-1", "c", "gpu-0", uuid, time_slice=True))
    node.clock.now += 30
    await node.sampler.sample_once()
    assert billed(node) == {"ci-run-1": pytest.approx(15), "team-a": pytest.approx(360)}


def test_the_counter_retention_must_be_positive() -> None:
    with pytest.raises(ValueError, match="counter retention 0 must be a positive"):
        Accounting(retain_s=0)
