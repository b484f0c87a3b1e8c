"""Claims prepared before an agent restart, read again from the API server.

The checkpoint does not say whether a device with a share ID is a memory slice or
integer shares, nor how big: until its claim is read, its holder is Unknown and not
billed, and a read that fails is retried until it succeeds or the claim is gone."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from gpudra.common.backoff import Backoff
from gpudra.common.kube import ApiError, Kube, claim_path
from gpudra.driver.agent import AgentConfig
from gpudra.driver.checkpoint import ClaimRecord
from gpudra.driver.claimreader import ApiClaims
from gpudra.driver.claimstatus import device_statuses
from gpudra.driver.holders import (
    MEMORY_SLICE,
    TIME_SLICING,
    UNKNOWN,
    ClaimInfos,
    HeldDevice,
    Holder,
)
from gpudra.driver.node import NodeService

from tests.driver.test_device_metrics import (
    DRIVER,
    POOL,
    Node,
    claim,
    emulator,
    inventory_of,
    plugin_config,
    shares_claim,
)

pytestmark = pytest.mark.anyio

BIG, SMALL = (f"00000000-0000-4000-8000-00000000000{i}" for i in (1, 2))


class FlakyKube(Kube):
    """An API server holding `claims` that answers the first `failures[uid]` GETs of a
    claim with 429 (as one under load does), and a claim it does not hold with 404."""

    def __init__(self, claims: Sequence[dict[str, Any]], failures: Mapping[str, int]) -> None:
        self.objects = {
            claim_path(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in claims
        }
        self.failures = Counter(failures)
        self.gets: Counter[str] = Counter()

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        uid = path.rsplit("claim-", 1)[-1]
        self.gets[uid] += 1
        if self.failures[uid] > 0:
            self.failures[uid] -= 1
            raise ApiError(429, "too many requests", method, path)
        if path not in self.objects:
            raise ApiError(404, "not found", method, path)
        return self.objects[path]


def records(uuid: str) -> list[ClaimRecord]:
    """team-a's claim took 3 of gpu-0's 4 shares, team-b's 1."""
    return [
        claim(BIG, "team-a", "a", "gpu-0", uuid, share_id="s1"),
        claim(SMALL, "team-b", "b", "gpu-0", uuid, share_id="s2"),
    ]


async def billed_over(node: Node, seconds: int) -> dict[tuple[str, str], float]:
    """(namespace, sharing) -> device-seconds billed, sampled every 10 s for `seconds`."""
    await node.sampler.sample_once()
    for _ in range(seconds // 10):
        node.clock.now += 10
        await node.sampler.sample_once()
    return {(k.namespace, k.sharing): v for k, v in node.accounting.allocated().items()}


async def test_a_reread_that_fails_is_retried_and_bills_as_a_first_read_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart, team-a's claim cannot be read twice (the API server is busy):
    read on the third try, it is billed its 3 shares of 4 as TimeSlicing, as if the
    first read had worked, and team-b pays for its 1 share only."""
    nvml = emulator("l4", {"utilization": 60})
    prepared = records(inventory_of(nvml).gpus[0].uuid)
    kube = FlakyKube(
        [shares_claim(BIG, "team-a", "s1", 3), shares_claim(SMALL, "team-b", "s2", 1)],
        failures={BIG: 2},
    )
    service = NodeService(AgentConfig(node_name=POOL), kube, nvml, plugin_config(tmp_path))
    monkeypatch.setattr(service, "_prepared_claims", lambda: prepared)  # as recovered
    with anyio.fail_after(10):
        await service._reread_prepared_claims()
    assert kube.gets == {BIG: 3, SMALL: 1}

    node = Node(nvml, prepared, service._infos, shares={"gpu-0": 4})
    assert await billed_over(node, 100) == {
        ("team-a", TIME_SLICING): pytest.approx(75),
        ("team-b", TIME_SLICING): pytest.approx(25),
    }


async def test_an_unread_claim_is_unknown_and_unbilled_and_the_others_pay_their_own_part() -> None:
    """team-a's claim not read yet: it is neither called a memory slice nor billed,
    and team-b still pays its 1 share of 4, never half of the GPU."""
    nvml = emulator("l4", {"utilization": 60})
    prepared = records(inventory_of(nvml).gpus[0].uuid)
    infos = ClaimInfos()
    kube = FlakyKube([shares_claim(SMALL, "team-b", "s2", 1)], failures={})
    claims = ApiClaims(kube, driver=DRIVER, pool=POOL, infos=infos)
    await claims.read(prepared[1].ref)
    node = Node(nvml, prepared, infos, shares={"gpu-0": 4})
    assert await billed_over(node, 100) == {("team-b", TIME_SLICING): pytest.approx(25)}
    latest = node.sampler.latest
    assert latest is not None
    assert {h.namespace: h.sharing for h in latest.held["gpu-0"].holders} == {
        "team-a": UNKNOWN,
        "team-b": TIME_SLICING,
    }
    [status] = device_statuses(prepared[0], driver=DRIVER, pool=POOL, info=None)
    assert status["data"]["sharing"] == UNKNOWN


def test_while_a_holder_is_unread_only_parts_of_their_own_size_are_billed() -> None:
    """A memory slice or integer shares is its own size whoever else holds the GPU; an
    equal part, or the whole GPU, would depend on what the unread claim took."""

    def holder(
        uid: str, sharing: str, *, memory: int | None = None, shares: int | None = None
    ) -> Holder:
        return Holder(
            "ns", "pod", f"claim-{uid}", uid, "gpu", sharing, memory=memory, shares=shares
        )

    def gpu(*holders: Holder, published: int | None = None) -> HeldDevice:
        return HeldDevice(
            "gpu-0", "GPU-1", "GPU-1", False, holders, published_shares=published, memory_total=80
        )

    unread = holder("u0", UNKNOWN)
    one_share, slice_20 = (
        holder("u1", TIME_SLICING, shares=1),
        holder("u2", MEMORY_SLICE, memory=20),
    )
    assert gpu(unread, one_share, published=4).shares() == [(one_share, 0.25)]
    assert gpu(unread, slice_20).shares() == [(slice_20, 0.25)]
    unsized = holder("u3", MEMORY_SLICE)  # read, but its claim gave no size
    assert gpu(unread, unsized).shares() == []
    assert gpu(unread).shares() == []
    assert gpu(unsized).shares() == [(unsized, 1.0)]  # alone, it holds the whole GPU


async def test_a_claim_gone_from_the_api_server_or_the_checkpoint_is_no_longer_read() -> None:
    """A deleted claim (404) is read once; one the API server keeps refusing is read
    on the backoff's pace until it is unprepared; then the reads end."""
    kube = FlakyKube([], failures={SMALL: 1000})  # BIG: deleted
    infos = ClaimInfos()
    claims = ApiClaims(kube, driver=DRIVER, pool=POOL, infos=infos)
    prepared = records("GPU-1")
    passes = 0

    def checkpoint() -> list[ClaimRecord]:
        nonlocal passes
        passes += 1
        return prepared if passes <= 3 else prepared[:1]  # team-b's claim unprepared

    with anyio.fail_after(5):
        await claims.read_unknown(checkpoint, backoff=Backoff(first_s=0.01, max_s=0.01))
    assert kube.gets == {BIG: 1, SMALL: 3}
    assert infos.snapshot() == {}
