"""A new accounting counter is first served at zero, so that Prometheus's `increase()`
and `rate()`, which take a series' first sample as where it starts, count every
GPU-second billed to it; what the zero holds back is served beside it. The zero is
served to every scrape for a window from the series' first, so that every reader (an
HA pair of Prometheus servers, `gpudra top` or `gpudra report` reading the agent)
that scrapes within the window sees it, not only whichever came first."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from gpudra.common.kube import Kube
from gpudra.driver.accounting import DEFAULT_ZERO_WINDOW_S, Accounting
from gpudra.driver.agent import AgentConfig
from gpudra.driver.node import NodeService
from kubernetes_asyncio.client import ApiClient

from tests.driver.test_accounting_spans import l4_node, prepared, unprepared, uuid_of
from tests.driver.test_device_metrics import (
    POOL,
    Node,
    claim,
    emulator,
    only,
    plugin_config,
    values,
)

pytestmark = pytest.mark.anyio

ALLOCATED = "gpudra_allocated_device_seconds_total"
IDLE = "gpudra_idle_device_seconds_total"
WITHHELD = "gpudra_withheld_allocated_device_seconds"
WITHHELD_IDLE = "gpudra_withheld_idle_device_seconds"
WINDOW = DEFAULT_ZERO_WINDOW_S
INTERVAL = 30  # the sampling interval of `l4_node`, and the chart's scrape interval


async def held_idle(node: Node, seconds: float) -> None:
    """Sample `node` every `INTERVAL` seconds for `seconds` more."""
    for _ in range(round(seconds / INTERVAL)):
        node.clock.now += INTERVAL
        await node.sampler.sample_once()


async def test_two_readers_both_see_a_new_counter_at_zero_then_its_total() -> None:
    """team-a's claim holds an idle GPU for 30 s before its counters' first scrape.
    Two readers scrape the agent in turn, 15 s apart, every 30 s: the first scrape
    of each serves zero (what was counted withheld beside it), so the increase each
    sees from its first sample to its last is every GPU-second billed, not only the
    first reader's."""
    node = l4_node(utilization=1)
    await node.sampler.sample_once()
    prepared(node, claim("u1", "team-a", "a", "gpu-0", uuid_of(node)))
    await held_idle(node, 30)
    first_a = node.scrape()
    node.clock.now += 15
    first_b = node.scrape()  # the second reader, within the window
    for first in (first_a, first_b):
        assert only(first, ALLOCATED, namespace="team-a") == 0
        assert only(first, IDLE, namespace="team-a") == 0
        assert only(first, WITHHELD, namespace="team-a") == pytest.approx(30)
        assert only(first, WITHHELD_IDLE, namespace="team-a") == pytest.approx(30)
    node.clock.now -= 15
    readers: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(round(WINDOW / INTERVAL)):  # both go on scraping through the window
        await held_idle(node, INTERVAL)
        readers["a"].append(only(node.scrape(), ALLOCATED, namespace="team-a"))
        node.clock.now += 15
        readers["b"].append(only(node.scrape(), ALLOCATED, namespace="team-a"))
        node.clock.now -= 15
    [billed] = node.accounting.allocated().values()
    assert billed == pytest.approx(30 + WINDOW)
    for seen in readers.values():  # zero within the window, then the total
        assert seen[:-1] == [0] * (len(seen) - 1)
        assert seen[-1] == pytest.approx(billed)
    last = node.scrape()
    assert values(last, WITHHELD) == values(last, WITHHELD_IDLE) == []
    assert not node.accounting._zero_until  # nothing kept once the window has passed


async def test_a_reader_first_arriving_after_the_window_sees_the_total() -> None:
    """The window is the series', from its first scrape by anybody, not each reader's:
    a reader first arriving just before it ends still sees the zero, one first arriving
    as it ends (a `gpudra report` run later) the total, with nothing withheld."""
    node = l4_node(utilization=1)
    await node.sampler.sample_once()
    prepared(node, claim("u1", "team-a", "a", "gpu-0", uuid_of(node)))
    await held_idle(node, 30)
    first_scrape = node.clock.now
    assert only(node.scrape(), ALLOCATED, namespace="team-a") == 0  # the first reader
    await held_idle(node, WINDOW)
    node.clock.now = first_scrape + WINDOW - 1
    inside = node.scrape()  # a second reader, first arriving a second before the end
    assert only(inside, ALLOCATED, namespace="team-a") == 0
    assert only(inside, WITHHELD, namespace="team-a") == pytest.approx(30 + WINDOW)
    node.clock.now = first_scrape + WINDOW
    late = node.scrape()  # a third, first arriving as it ends
    assert only(late, ALLOCATED, namespace="team-a") == pytest.approx(30 + WINDOW)
    assert only(late, IDLE, namespace="team-a") == pytest.approx(30 + WINDOW)
    assert values(late, WITHHELD) == values(late, WITHHELD_IDLE) == []


async def test_a_window_of_zero_serves_the_zero_to_the_first_scrape_only() -> None:
    node = Node(emulator("l4", {"utilization": 1}), interval_s=INTERVAL, zero_window_s=0)
    await node.sampler.sample_once()
    prepared(node, claim("u1", "team-a", "a", "gpu-0", uuid_of(node)))
    await held_idle(node, 30)
    assert only(node.scrape(), ALLOCATED, namespace="team-a") == 0
    assert only(node.scrape(), ALLOCATED, namespace="team-a") == pytest.approx(30)


async def test_a_counter_made_again_after_it_was_dropped_is_first_served_at_zero_again() -> None:
    """A counter dropped for want of holders and made again later is a new series: it
    is served at zero again for a window. One made and dropped between two scrapes is
    never served, and nothing of it is kept; nor of one dropped within its window."""
    node = l4_node()
    node.accounting.retain_s = 60
    uuid = uuid_of(node)
    await node.sampler.sample_once()
    prepared(node, claim("u1", "ci-run-1", "a", "gpu-0", uuid))
    await held_idle(node, 30)
    assert only(node.scrape(), ALLOCATED, namespace="ci-run-1") == 0
    unprepared(node, "u1")
    prepared(node, claim("u2", "ci-run-2", "b", "gpu-0", uuid))  # never scraped
    await held_idle(node, 30)
    unprepared(node, "u2")
    await held_idle(node, 90)  # past the retention, within the window: both dropped
    assert not node.accounting._zero_until  # nothing kept of either
    assert values(node.scrape(), ALLOCATED) == []
    prepared(node, claim("u3", "ci-run-1", "c", "gpu-0", uuid))
    await held_idle(node, 30)
    got = node.scrape()
    assert only(got, ALLOCATED, namespace="ci-run-1") == 0
    assert only(got, WITHHELD, namespace="ci-run-1") == pytest.approx(30)


@pytest.mark.parametrize("window", [-1.0, math.nan, math.inf])
def test_the_zero_window_must_be_seconds_zero_or_more(window: float) -> None:
    with pytest.raises(ValueError, match=r"zero window .* 0 or more"):
        Accounting(zero_window_s=window)


async def test_the_node_gives_its_accounting_the_configured_window(tmp_path: Path) -> None:
    config = plugin_config(tmp_path, zero_window_s=300.0)
    async with ApiClient() as api:
        service = NodeService(AgentConfig(node_name=POOL), Kube(api), emulator("l4"), config)
    assert service.sampler is not None
    [observe] = service.sampler._on_sample
    accounting = getattr(observe, "__self__", None)
    assert isinstance(accounting, Accounting)
    assert accounting.zero_window_s == 300.0
