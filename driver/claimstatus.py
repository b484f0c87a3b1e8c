"""What each pod really got, in its ResourceClaim's `status.devices`.

For every device this node prepared, the claim's status gets an entry (driver, pool,
device, share ID) whose `data` says what the device is: the GPU UUID, the MIG device
UUID (also of a MIG device the prepare created, which nothing else maps), the sharing
mode and, for a memory slice, its size. `kubectl get resourceclaim -o yaml` then shows
it. The entry goes when the claim is unprepared.

The writer runs beside the preparer, never inside a prepare: it reconciles the
checkpoint's completed claims with what it wrote, on a short interval, so a prepare
pays no API call for it. Writes are server-side apply with the driver name as field
manager, so entries of other drivers on the same claim are left alone, and with the
claim's UID, so a claim re-created under the same name is not written to. Where the
API server refuses the field (too old, or the status subresource not allowed to this
agent) or drops it (the DRAResourceClaimDeviceStatus gate off: the write succeeds and
the stored claim has no entry), the writer logs it once per claim and goes on: status
is a view, never a reason to fail a pod.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import anyio
import anyio.abc
from gpudra.common.kube import ApiError, Kube, claim_path
from gpudra.common.periodic import run_every
from gpudra.driver.checkpoint import ClaimRecord
from gpudra.driver.holders import MEMORY_SLICE, UNKNOWN, ClaimInfo, sharing_of

__all__ = ["ClaimStatusWriter", "device_statuses"]

log = logging.getLogger(__name__)

_APPLY: Final = "application/apply-patch+yaml"


def device_statuses(
    record: ClaimRecord, *, driver: str, pool: str, info: ClaimInfo | None = None
) -> list[dict[str, Any]]:
    """The `status.devices` entries of one prepared claim's devices in `pool`."""
    out: list[dict[str, Any]] = []
    for device in record.devices:
        if device.pool != pool:
            continue
        details = device.details
        sharing = sharing_of(device, info)
        data: dict[str, Any] = {"sharing": sharing}
        gpu_uuid = details.gpu_uuid or details.uuid
        if gpu_uuid:
            data["gpuUUID"] = gpu_uuid
        if details.mig is not None and details.uuid:
            data["migUUID"] = details.uuid
        memory = info.memory.get((device.device, device.share_id)) if info else None
        if sharing == MEMORY_SLICE and memory is not None:
            data["memoryLimit"] = memory
        entry: dict[str, Any] = {"driver": driver, "pool": pool, "device": device.device}
        if device.share_id is not None:
            entry["shareID"] = device.share_id
        entry["data"] = data
        out.append(entry)
    return out


def _kept(stored: Any, entries: list[dict[str, Any]]) -> bool:
    """Whether the claim the API server returned from the write has every entry written
    (by driver, pool, device and share ID; the server may normalize `data`)."""
    status = stored.get("status") if isinstance(stored, Mapping) else None
    devices = status.get("devices") if isinstance(status, Mapping) else None

    def key(entry: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(entry.get(k) for k in ("driver", "pool", "device", "shareID"))

    have = (
        {key(d) for d in devices if isinstance(d, Mapping)} if isinstance(devices, list) else set()
    )
    return all(key(e) in have for e in entries)


class ClaimStatusWriter:
    """Keeps `status.devices` of the claims this node prepared (see the module docstring)."""

    def __init__(
        self,
        kube: Kube,
        *,
        driver: str,
        pool: str,
        prepared: Callable[[], Iterable[ClaimRecord]],
        claim_info: Callable[[], Mapping[str, ClaimInfo]] = dict,
        interval_s: float = 2.0,
    ) -> None:
        self._kube = kube
        self._driver = driver
        self._pool = pool
        self._prepared = prepared
        self._claim_info = claim_info
        self.interval_s = interval_s
        # Claim UID -> (namespace, name, entries written); refused: UIDs not retried.
        self._written: dict[str, tuple[str, str, list[dict[str, Any]]]] = {}
        self._refused: set[str] = set()

    async def _apply(
        self, uid: str, namespace: str, name: str, entries: list[dict[str, Any]]
    ) -> bool:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"devices": entries},
        }
        try:
            stored = await self._kube.request(
                "PATCH",
                f"{claim_path(namespace, name)}/status",
                body,
                query={"fieldManager": self._driver, "force": "true"},
                content_type=_APPLY,
                request_timeout_s=10.0,
            )
        except ApiError as err:
            fields = {"claim": f"{namespace}/{name}", "uid": uid, "error": str(err)}
            if not entries and 400 <= err.status < 500:
                # Gone or re-created (404, 409): nothing of ours is left. Refused: give up.
                if err.status not in (404, 409):
                    log.warning(
                        "the API server refused removing the claim's device status",
                        extra={"fields": fields},
                    )
                return True
            if err.status in (400, 403, 404, 409, 422):
                self._refused.add(uid)
                log.warning(
                    "the API server refused the claim's device status; not writing it",
                    extra={"fields": fields},
                )
                return False
            log.warning(
                "writing the claim's device status failed; retrying", extra={"fields": fields}
            )
            return False
        if entries and not _kept(stored, entries):
            self._refused.add(uid)
            log.warning(
                "the API server dropped the claim's device status (is the "
                "DRAResourceClaimDeviceStatus feature gate off?); not writing it",
                extra={"fields": {"claim": f"{namespace}/{name}", "uid": uid}},
            )
            return False
        return True

    async def sync_once(self) -> None:
        """Write the entries of newly prepared claims, remove those of unprepared ones."""
        infos = self._claim_info()
        current = {r.uid: r for r in self._prepared() if r.completed}
        for uid, record in current.items():
            if uid in self._refused:
                continue
            entries = device_statuses(
                record, driver=self._driver, pool=self._pool, info=infos.get(uid)
            )
            if not entries or self._written.get(uid, ("", "", None))[2] == entries:
                continue
            if any(e["data"]["sharing"] == UNKNOWN for e in entries):
                # Not read again since a restart: what the previous agent wrote stays
                # until the read says whether the device is a slice or shares.
                continue
            if await self._apply(uid, record.namespace, record.name, entries):
                self._written[uid] = (record.namespace, record.name, entries)
        for uid in [u for u in self._written if u not in current]:
            namespace, name, _entries = self._written[uid]
            if await self._apply(uid, namespace, name, []):
                del self._written[uid]
        self._refused &= set(current)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        await run_every(
            self.interval_s,
            self.sync_once,
            failed="claim device status sync failed; trying again",
            logger=log,
        )
