"""The kubelet's pod-side DRA behaviour, on top of the protocol stand-in.

Watches the pods the real scheduler bound to one node and, like the kubelet's DRA
manager, calls NodePrepareResources once per driver per pod with all of that pod's
allocated claims for the driver, and NodeUnprepareResources when the pod terminates
or disappears. Results are kept per pod for tests to inspect (CDI IDs, errors).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from gpudra.common.kube import ApiError, Kube
from gpudra.driver.plugin import ClaimRef, PrepareResult

from e2e.kubelet_standin import KubeletStandin

log = logging.getLogger(__name__)


@dataclass
class PodDevices:
    namespace: str
    name: str
    uid: str
    # driver -> claim uid -> result
    prepared: dict[str, dict[str, PrepareResult]] = field(default_factory=dict)
    claims: dict[str, list[ClaimRef]] = field(default_factory=dict)
    unprepared: bool = False
    error: str | None = None

    def cdi_ids(self) -> list[str]:
        return sorted(
            cdi
            for results in self.prepared.values()
            for res in results.values()
            for dev in res.devices
            for cdi in dev.cdi_device_ids
        )


class PodClaimsDriver:
    def __init__(
        self, kube: Kube, kubelet: KubeletStandin, node: str, drivers: tuple[str, ...]
    ) -> None:
        self.kube = kube
        self.kubelet = kubelet
        self.node = node
        self.drivers = drivers
        self.pods: dict[str, PodDevices] = {}
        self.changed = anyio.Event()
        self._lock = anyio.Lock()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        selector = {"fieldSelector": f"spec.nodeName={self.node}"}
        started = False
        while True:
            try:
                listing = await self.kube.request("GET", "/api/v1/pods", query=selector)
                for pod in listing["items"]:
                    await self._sync(pod, deleted=False)
                if not started:
                    task_status.started()
                    started = True
                q = {**selector, "resourceVersion": listing["metadata"]["resourceVersion"]}
                async for ev in self.kube.watch("/api/v1/pods", q):
                    if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        await self._sync(ev["object"], deleted=ev["type"] == "DELETED")
            except (ApiError, OSError) as e:
                log.warning("pod watch failed: %s", e)
                await anyio.sleep(0.5)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    async def wait_for(
        self, uid: str, *, unprepared: bool = False, timeout_s: float = 60.0
    ) -> PodDevices:
        with anyio.fail_after(timeout_s):
            while True:
                pd = self.pods.get(uid)
                if pd is not None and (pd.unprepared if unprepared else (pd.prepared or pd.error)):
                    return pd
                await self.changed.wait()

    async def _sync(self, pod: dict[str, Any], *, deleted: bool) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        async with self._lock:
            pd = self.pods.get(uid)
            if deleted or meta.get("deletionTimestamp"):
                if pd is not None and pd.prepared and not pd.unprepared:
                    for driver, claims in pd.claims.items():
                        errors = await self.kubelet.unprepare(driver, claims)
                        bad = {k: v for k, v in errors.items() if v}
                        if bad:
                            pd.error = f"unprepare {driver}: {bad}"
                    pd.unprepared = True
                    self._notify()
                if meta.get("deletionTimestamp") and not deleted:
                    # The kubelet confirms deletion once the pod's resources are released.
                    with contextlib.suppress(ApiError):
                        await self.kube.request(
                            "DELETE",
                            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                            {"gracePeriodSeconds": 0},
                        )
                return
            if pd is not None and (pd.prepared or pd.error):
                return
            by_driver = await self._allocated_claims(pod)
            if by_driver is None:
                return  # claims not created or allocated yet: a later event retries
            pd = PodDevices(meta["namespace"], meta["name"], uid)
            self.pods[uid] = pd
            for driver, claims in by_driver.items():
                pd.claims[driver] = claims
                try:
                    pd.prepared[driver] = await self.kubelet.prepare(driver, claims)
                except Exception as e:  # the real kubelet fails the pod's sandbox start
                    pd.error = f"prepare {driver}: {e}"
            for results in pd.prepared.values():
                errs = [r.error for r in results.values() if r.error]
                if errs:
                    pd.error = "; ".join(errs)
            self._notify()

    async def _allocated_claims(self, pod: dict[str, Any]) -> dict[str, list[ClaimRef]] | None:
        ns = pod["metadata"]["namespace"]
        wanted = pod["spec"].get("resourceClaims") or []
        if not wanted:
            return {}
        statuses = {
            s["name"]: s.get("resourceClaimName")
            for s in pod.get("status", {}).get("resourceClaimStatuses") or []
        }
        out: dict[str, list[ClaimRef]] = {}
        for entry in wanted:
            name = entry.get("resourceClaimName") or statuses.get(entry["name"])
            if not name:
                return None
            try:
                claim = await self.kube.request(
                    "GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}"
                )
            except ApiError:
                return None
            alloc = claim.get("status", {}).get("allocation")
            if not alloc:
                return None
            drivers = {r["driver"] for r in alloc["devices"]["results"]}
            for d in sorted(drivers & set(self.drivers)):
                out.setdefault(d, []).append(ClaimRef(ns, claim["metadata"]["uid"], name))
        return out
