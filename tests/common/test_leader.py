"""Leader election on a Lease: one holder, taken over only after a lease duration of no
change as the taker's own clock times it, given up before anyone may take it, and
handed back at once on stop."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from gpudra.common.leader import LeaderElector, micro_time

from tests.common.leases import Clock, LeaseApi

pytestmark = pytest.mark.anyio

MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


def elector(api: LeaseApi, identity: str, clock: Callable[[], float], **kw: Any) -> LeaderElector:
    return LeaderElector(
        api,  # type: ignore[arg-type]
        name="quota-writer",
        namespace="gpudra",
        identity=identity,
        clock=clock,
        **kw,
    )


async def until(what: str, probe: Callable[[], bool], within_s: float = 60) -> None:
    """Waits for `probe()` to hold; the bound is generous, never what is asserted."""
    try:
        with anyio.fail_after(within_s):
            while not probe():
                await anyio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_an_absent_lease_is_created_and_then_renewed() -> None:
    api, clock = LeaseApi(), Clock()
    a = elector(api, "pod-a", clock, wall=lambda: 1_700_000_000.25)
    assert not a.leading
    assert await a.try_acquire_or_renew()
    assert a.leading and a.holder == "pod-a"
    spec = api.spec
    assert spec["holderIdentity"] == "pod-a"
    assert spec["leaseDurationSeconds"] == 15
    assert spec["leaseTransitions"] == 0
    assert spec["renewTime"] == spec["acquireTime"] == "2023-11-14T22:13:20.250000Z"
    assert MICRO_TIME.fullmatch(micro_time(0.0))
    acquired, version = spec["acquireTime"], api.version
    a._wall = lambda: 1_700_000_002.0
    assert await a.try_acquire_or_renew()
    assert [m for m, _ in api.writes] == ["POST", "PUT"]
    assert api.version != version
    assert api.spec["acquireTime"] == acquired
    assert api.spec["renewTime"] == "2023-11-14T22:13:22.000000Z"
    assert api.spec["leaseTransitions"] == 0


async def test_a_follower_takes_a_lease_only_after_its_duration_unchanged_by_its_clock() -> None:
    """The holder's renewTime lies far in the past by the follower's wall clock (a node
    whose clock is behind): still live, because only changes seen here are timed."""
    api = LeaseApi()
    a_clock, b_clock = Clock(), Clock()
    a = elector(api, "pod-a", a_clock, wall=lambda: 0.0)
    b = elector(api, "pod-b", b_clock)
    assert await a.try_acquire_or_renew()

    assert not await b.try_acquire_or_renew()
    assert not b.leading and b.holder == "pod-a"
    b_clock.now += 14.0
    assert not await b.try_acquire_or_renew()
    # The holder renews: the follower times the lease again from when it saw that.
    a_clock.now += 2.0
    assert await a.try_acquire_or_renew()
    b_clock.now += 14.0
    assert not await b.try_acquire_or_renew()
    assert api.spec["holderIdentity"] == "pod-a"
    b_clock.now += 14.0  # 14 s since the change was seen: not yet
    assert not await b.try_acquire_or_renew()
    b_clock.now += 1.0  # 15 s without a change: the holder is gone
    assert await b.try_acquire_or_renew()
    assert b.leading
    assert api.spec["holderIdentity"] == "pod-b"
    assert api.spec["leaseTransitions"] == 1
    # The old holder, back, sees another's live lease and follows.
    a_clock.now += 30.0
    assert not await a.try_acquire_or_renew()
    assert not a.leading


async def test_a_leader_stops_leading_when_renewals_fail_past_the_renew_deadline() -> None:
    api, clock = LeaseApi(), Clock()
    a = elector(api, "pod-a", clock, renew_deadline_s=10.0, retry_s=0.01)
    changes: list[bool] = []
    a.on_change(changes.append)
    assert await a.try_acquire_or_renew()
    api.fail = True
    clock.now += 9.0
    assert not await a.try_acquire_or_renew()
    assert a.leading  # within the deadline: a failed renewal is retried
    clock.now += 1.0
    # Past the deadline: no longer leading, before the 15 s after which another may
    # take the lease, whether or not the loop has run since.
    assert not a.leading
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.run)
        await until("the loss to be reported", lambda: changes == [True, False])
        tg.cancel_scope.cancel()
    # Renewals work again: leading again.
    api.fail = False
    assert await a.try_acquire_or_renew()
    assert a.leading and changes == [True, False, True]


async def test_a_conflict_on_the_write_means_another_won() -> None:
    api, clock = LeaseApi(), Clock()
    a = elector(api, "pod-a", clock)
    changes: list[bool] = []
    a.on_change(changes.append)
    assert await a.try_acquire_or_renew()
    api.conflict_next_put = True
    assert not await a.try_acquire_or_renew()
    assert not a.leading and changes == [True, False]
    # Two candidates creating the lease at once: the second create meets a 409.
    api2 = LeaseApi()
    b = elector(api2, "pod-b", clock)

    class Racing:
        """c finds no lease; b creates it before c's create arrives."""

        async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
            if method == "POST":
                assert await b.try_acquire_or_renew()
            return await api2.request(method, path, body, **kw)

    c = elector(Racing(), "pod-c", clock)  # type: ignore[arg-type]
    assert not await c.try_acquire_or_renew()
    assert not c.leading and b.leading
    assert api2.spec["holderIdentity"] == "pod-b"


async def test_a_stopped_leader_releases_the_lease_and_another_takes_it_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api, clock = LeaseApi(), Clock()
    a = elector(api, "pod-a", clock, retry_s=0.01)
    b = elector(api, "pod-b", clock)
    with caplog.at_level(logging.INFO, logger="gpudra.common.leader"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.run)
            await until("a to lead", lambda: a.leading)
            assert not await b.try_acquire_or_renew()
            tg.cancel_scope.cancel()
    assert not a.leading
    assert api.spec["holderIdentity"] == ""
    assert api.spec["leaseDurationSeconds"] == 1
    gained = [r for r in caplog.records if r.getMessage() == "leader election: leading"]
    assert gained and gained[0].fields["identity"] == "pod-a"  # type: ignore[attr-defined]
    # No lease duration to wait: the same instant by b's clock, it takes the lease.
    assert await b.try_acquire_or_renew()
    assert b.leading and api.spec["holderIdentity"] == "pod-b"
    assert api.spec["leaseTransitions"] == 1
    assert api.spec["leaseDurationSeconds"] == 15


async def test_a_lease_written_by_another_since_is_not_released() -> None:
    """A leader that lost its renewals and was replaced does not hand back the lease
    of the new holder when it stops: the release is guarded by its resourceVersion."""
    api, a_clock, b_clock = LeaseApi(), Clock(), Clock()
    a = elector(api, "pod-a", a_clock)
    b = elector(api, "pod-b", b_clock)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    b_clock.now += 15.0
    assert await b.try_acquire_or_renew()
    await a.release()
    assert api.spec["holderIdentity"] == "pod-b"


def test_timings_that_would_let_two_lead_are_refused_naming_the_fix() -> None:
    api = LeaseApi()
    with pytest.raises(ValueError, match=r"renew deadline .* < lease duration") as err:
        elector(api, "pod-a", Clock(), renew_deadline_s=15.0)
    assert "raise the lease duration" in str(err.value)
    with pytest.raises(ValueError, match="unique"):
        elector(api, "", Clock())


async def test_a_resigned_leader_hands_the_lease_back_and_takes_no_further_part() -> None:
    """A replica about to stop (a webhook draining after SIGTERM) resigns while it still
    runs: it writes nothing more at once, its lease is released, and its loop does not
    take the lease again however long the process lives on."""
    api, clock = LeaseApi(), Clock()
    a = elector(api, "pod-a", clock, retry_s=0.01)
    b = elector(api, "pod-b", clock)
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.run)
        await until("a to lead", lambda: a.leading)
        await a.resign()
        assert not a.leading
        assert api.spec["holderIdentity"] == ""
        writes = len(api.writes)
        await anyio.sleep(0.1)  # ten of its retry periods
        assert len(api.writes) == writes and not a.leading
        assert await b.try_acquire_or_renew()  # at once, no lease duration to wait
        await anyio.sleep(0.1)
        assert api.spec["holderIdentity"] == "pod-b"
        tg.cancel_scope.cancel()


async def test_a_candidate_that_resigns_before_running_never_takes_the_lease() -> None:
    api, clock = LeaseApi(), Clock()
    a = elector(api, "pod-a", clock, retry_s=0.01)
    await a.resign()
    with anyio.fail_after(10):
        await a.run()  # ends at once
    assert api.lease is None and not a.leading
