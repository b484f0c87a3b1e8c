"""What the claim reader remembers of each claim it reads (`ClaimInfos`) is kept only
for a reader of it, the sampler or the claim status writer, whose passes forget the
claims no longer prepared: without either, nothing is kept."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpudra.driver.agent import AgentConfig
from gpudra.driver.claims import ClaimRef
from gpudra.driver.holders import ClaimInfo, ClaimInfos
from gpudra.driver.node import NodeService

from tests.driver.test_device_metrics import POOL, emulator, plugin_config, shares_claim
from tests.driver.test_holders_reread import FlakyKube

pytestmark = pytest.mark.anyio

READS = 50


@pytest.mark.parametrize(
    ("sample_interval_s", "claim_status", "kept"),
    [(0, False, 0), (0, True, READS), (10, False, READS)],
    ids=["no-reader", "claim-status", "sampling"],
)
async def test_claims_read_are_remembered_only_for_a_reader(
    tmp_path: Path, sample_interval_s: float, claim_status: bool, kept: int
) -> None:
    """Reading claims for their prepares (the kubelet plugin's reader): with sampling
    and claim status off, nothing would ever forget what it kept of them, so it keeps
    nothing; with either on, it keeps them for that reader (whose passes forget the
    claims once unprepared: test_device_metrics.py)."""
    objects = [
        shares_claim(f"00000000-0000-4000-8000-{i:012d}", "team-a", f"s{i}", 1)
        for i in range(READS)
    ]
    settings = plugin_config(
        tmp_path, sample_interval_s=sample_interval_s, claim_status=claim_status
    )
    service = NodeService(
        AgentConfig(node_name=POOL), FlakyKube(objects, {}), emulator("l4"), settings
    )
    for obj in objects:
        meta = obj["metadata"]
        await service._claims.read(ClaimRef(meta["namespace"], meta["uid"], meta["name"]))
    assert len(service._infos.snapshot()) == kept


def test_a_snapshot_handed_out_never_changes() -> None:
    """A pass holds a snapshot while claims are read and forgotten: it keeps what it
    was handed, and the next snapshot has the changes."""
    infos = ClaimInfos()
    infos.remember("u1", ClaimInfo())
    first = infos.snapshot()
    infos.remember("u2", ClaimInfo())
    infos.remember("u3", ClaimInfo())
    assert set(first) == {"u1"}
    second = infos.snapshot()
    assert set(second) == {"u1", "u2", "u3"}
    infos.retain(["u1", "u2", "u3"])
    infos.retain(["u1"])  # u2 and u3 unprepared
    infos.remember("u4", ClaimInfo())
    assert set(second) == {"u1", "u2", "u3"}
    assert set(infos.snapshot()) == {"u1", "u4"}
