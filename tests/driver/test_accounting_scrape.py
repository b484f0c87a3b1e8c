"""A new accounting counter is first served at zero, so that Prometheus's `increase()`
and `rate()`, which take a series' first sample as where it starts, count every
GPU-second billed to it; what that first scrape holds back is served beside it."""

from __future__ import annotations

import pytest

from tests.driver.test_accounting_spans import l4_node, prepared, unprepared, uuid_of
from tests.driver.test_device_metrics import claim, only, values

pytestmark = pytest.mark.anyio

ALLOCATED = "gpudra_allocated_device_seconds_total"
IDLE = "gpudra_idle_device_seconds_total"
WITHHELD = "gpudra_withheld_allocated_device_seconds"
WITHHELD_IDLE = "gpudra_withheld_idle_device_seconds"


async def test_a_new_counter_is_first_served_at_zero_so_increase_counts_every_second() -> None:
    """team-a's claim holds an idle GPU for 30 s before its counters' first scrape and
    30 s more before the second: the first serves both at zero (the 30 s withheld beside
    them), the second 60, so the increase Prometheus sees is all 60."""
    node = l4_node(utilization=1)
    await node.sampler.sample_once()
    prepared(node, claim("u1", "team-a", "a", "gpu-0", uuid_of(node)))
    node.clock.now += 30
    await node.sampler.sample_once()
    first = node.scrape()
    assert only(first, ALLOCATED, namespace="team-a") == 0
    assert only(first, IDLE, namespace="team-a") == 0
    assert only(first, WITHHELD, namespace="team-a") == pytest.approx(30)
    assert only(first, WITHHELD_IDLE, namespace="team-a") == pytest.approx(30)
    node.clock.now += 30
    await node.sampler.sample_once()
    second = node.scrape()
    assert only(second, ALLOCATED, namespace="team-a") == pytest.approx(60)
    assert only(second, IDLE, namespace="team-a") == pytest.approx(60)
    assert values(second, WITHHELD) == values(second, WITHHELD_IDLE) == []
    # What the accounting billed is the same whoever scraped, and when.
    assert list(node.accounting.allocated().values()) == [pytest.approx(60)]


async def test_a_counter_made_again_after_it_was_dropped_is_first_served_at_zero_again() -> None:
    """A counter dropped for want of holders and made again later is a new series: its
    first scrape serves it at zero again. One made and dropped between two scrapes is
    never served, and nothing of it is kept."""
    node = l4_node()
    node.accounting.retain_s = 60
    uuid = uuid_of(node)
    await node.sampler.sample_once()
    prepared(node, claim("u1", "ci-run-1", "a", "gpu-0", uuid))
    node.clock.now += 30
    await node.sampler.sample_once()
    assert only(node.scrape(), ALLOCATED, namespace="ci-run-1") == 0
    assert only(node.scrape(), ALLOCATED, namespace="ci-run-1") == pytest.approx(30)
    unprepared(node, "u1")
    prepared(node, claim("u2", "ci-run-2", "b", "gpu-0", uuid))  # never scraped
    node.clock.now += 30
    await node.sampler.sample_once()
    unprepared(node, "u2")
    for _ in range(3):  # past the retention: both counters dropped
        node.clock.now += 30
        await node.sampler.sample_once()
    assert not node.accounting._unserved  # nothing kept of the one never served
    assert values(node.scrape(), ALLOCATED) == []
    prepared(node, claim("u3", "ci-run-1", "c", "gpu-0", uuid))
    node.clock.now += 30
    await node.sampler.sample_once()
    got = node.scrape()
    assert only(got, ALLOCATED, namespace="ci-run-1") == 0
    assert only(got, WITHHELD, namespace="ci-run-1") == pytest.approx(30)
