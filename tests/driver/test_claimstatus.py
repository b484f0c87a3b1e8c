"""Claim status entries, and a writer that degrades cleanly where the API server
refuses them (the real API server's acceptance is in test_prepare and the e2e tests)."""

from __future__ import annotations

from typing import Any

import pytest
from gpudra.common.kube import ApiError, Kube
from gpudra.driver.checkpoint import ClaimRecord, ClaimState, DeviceRecord
from gpudra.driver.claimstatus import ClaimStatusWriter, device_statuses
from gpudra.driver.holders import ClaimInfo
from gpudra.driver.records import DeviceDetails

pytestmark = pytest.mark.anyio

GPU = "GPU-4f5e0000-0000-0000-0000-000000000001"


def slice_claim(uid: str = "u1") -> ClaimRecord:
    return ClaimRecord(
        uid=uid,
        namespace="team-a",
        name="c1",
        state=ClaimState.PREPARE_COMPLETED,
        devices=(
            DeviceRecord(
                pool="node-a",
                device="gpu-0",
                share_id="7f3e",
                exclusive=False,
                details=DeviceDetails(type="gpu", gpu_uuid=GPU, uuid=GPU),
            ),
            DeviceRecord(pool="other-node", device="gpu-3"),
        ),
    )


def test_a_memory_slice_entry_names_its_share_and_memory() -> None:
    info = ClaimInfo(memory={("gpu-0", "7f3e"): 20 * 1024**3})
    [entry] = device_statuses(slice_claim(), driver="gpu.nvidia.com", pool="node-a", info=info)
    assert entry == {
        "driver": "gpu.nvidia.com",
        "pool": "node-a",
        "device": "gpu-0",
        "shareID": "7f3e",
        "data": {"sharing": "MemorySlice", "gpuUUID": GPU, "memoryLimit": 20 * 1024**3},
    }


def read() -> dict[str, ClaimInfo]:
    """The slice claim, read from the API server."""
    return {"u1": ClaimInfo(memory={("gpu-0", "7f3e"): 20 * 1024**3})}


class RecordingKube(Kube):
    """An API server that stores every status write."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.calls.append((method, path, body))
        return body


async def test_a_claim_not_read_since_a_restart_keeps_the_status_written_before() -> None:
    # After an agent restart a shared device's claim is read again before anything
    # says whether it is a memory slice or integer shares: the status a previous agent
    # wrote is not overwritten with "Unknown" meanwhile.
    kube = RecordingKube()
    infos: dict[str, ClaimInfo] = {}
    writer = ClaimStatusWriter(
        kube,
        driver="gpu.nvidia.com",
        pool="node-a",
        prepared=lambda: [slice_claim()],
        claim_info=lambda: infos,
    )
    await writer.sync_once()
    assert kube.calls == []
    infos.update(read())
    await writer.sync_once()
    [(_, _, body)] = kube.calls
    assert body["status"]["devices"][0]["data"]["sharing"] == "MemorySlice"


class RefusingKube(Kube):
    """An API server without the field: every status write answers 422."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.calls.append((method, path, body))
        raise ApiError(422, "status.devices: field not declared in schema", method, path)


async def test_a_refusing_api_server_is_asked_once_per_claim_and_nothing_fails() -> None:
    kube = RefusingKube()
    claims = [slice_claim()]
    writer = ClaimStatusWriter(
        kube, driver="gpu.nvidia.com", pool="node-a", prepared=lambda: claims, claim_info=read
    )
    await writer.sync_once()
    await writer.sync_once()
    [(method, path, body)] = kube.calls
    assert method == "PATCH"
    assert path.endswith("/namespaces/team-a/resourceclaims/c1/status")
    assert body["metadata"]["uid"] == "u1"
    claims.clear()  # unprepared: nothing was written, so nothing to remove
    await writer.sync_once()
    assert len(kube.calls) == 1


class DroppingKube(Kube):
    """An API server with the DRAResourceClaimDeviceStatus gate off: the write succeeds
    and the stored claim has no `status.devices`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.calls.append((method, path, body))
        return {"metadata": body["metadata"], "status": {"allocation": {"devices": {}}}}


async def test_a_server_that_drops_the_field_is_logged_once_and_not_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kube = DroppingKube()
    claims = [slice_claim()]
    writer = ClaimStatusWriter(
        kube, driver="gpu.nvidia.com", pool="node-a", prepared=lambda: claims, claim_info=read
    )
    with caplog.at_level("WARNING", logger="gpudra.driver.claimstatus"):
        await writer.sync_once()
        await writer.sync_once()
    [record] = caplog.records
    assert "dropped" in record.getMessage()
    assert len(kube.calls) == 1
    claims.clear()  # nothing stored, so nothing to remove at unprepare
    await writer.sync_once()
    assert len(kube.calls) == 1
