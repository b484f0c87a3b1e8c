"""The tenant controller: watches GpuTenants, Namespaces and owned ResourceQuotas into
`TenantState` and keeps each tenant's native ResourceQuota.

The rules themselves are pure and live apart: what a tenant allows in
``tenant_rules.py``, which tenant applies where and which quotas should exist in
``tenant_state.py``. This module is the I/O around them.

Why quota is a native ResourceQuota: the API server's quota admission checks and
updates the namespace's usage atomically when a ResourceClaim is created, so concurrent
pods can never exceed ``deviceQuota``; a check in this webhook could not give that
guarantee (claims are created later by the controller-manager, and requests race). The
webhook's own pre-check against the quota's ``status.used`` exists only to deny early
with a readable message naming the tenant, the limit and the usage; under concurrency
the native quota is what holds, and a claim it rejects leaves the pod pending with an
event from the controller-manager.

The controller is level-triggered: every watch event marks the state dirty, and a
reconcile compares the desired quotas with the cached owned ones and writes only the
differences (no writes while nothing changed). It owns exactly the ResourceQuotas named
`QUOTA_NAME` that carry the `MANAGED_BY_LABEL`; a same-named quota without the label is
left alone and reported.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping
from typing import Any, Final

import anyio
import anyio.abc
from gpudra.api.tenants import GROUP, PLURAL, VERSION
from gpudra.common.kube import ApiError, Kube
from gpudra.webhook.convert import DEFAULT_POLICY, ConversionPolicy
from gpudra.webhook.tenant_state import QUOTA_NAME, TENANT_LABEL, TenantState

__all__ = [
    "MANAGED_BY_LABEL",
    "MANAGED_BY_VALUE",
    "QUOTA_NAME",
    "TENANT_LABEL",
    "TenantController",
]

log = logging.getLogger(__name__)

MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE: Final = "gpudra"
TENANTS_PATH: Final = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
NAMESPACES_PATH: Final = "/api/v1/namespaces"
QUOTAS_PATH: Final = "/api/v1/resourcequotas"


class _Reflector:
    """List, then watch, one collection into `TenantState`; relists after a watch ends."""

    def __init__(
        self,
        kube: Kube,
        state: TenantState,
        kind: str,
        path: str,
        query: Mapping[str, str],
        *,
        missing_ok: bool = False,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.kube = kube
        self.state = state
        self.kind = kind
        self.path = path
        self.query = dict(query)
        self.missing_ok = missing_ok
        self.backoff_max_s = backoff_max_s

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                try:
                    listing = await self.kube.request("GET", self.path, query=self.query)
                except ApiError as exc:
                    if not (self.missing_ok and exc.status == 404):
                        raise
                    # No GpuTenant CRD: no tenant can exist. Check again later.
                    self.state.replace(self.kind, ())
                    log.warning(
                        "GpuTenant CRD not installed; tenant rules are off until it is",
                        extra={"fields": {"path": self.path}},
                    )
                    await anyio.sleep(self.backoff_max_s)
                    continue
                self.state.replace(self.kind, listing["items"])
                query = {
                    **self.query,
                    "resourceVersion": listing["metadata"]["resourceVersion"],
                    "allowWatchBookmarks": "true",
                }
                async for ev in self.kube.watch(self.path, query):
                    event_type, obj = ev.get("type"), ev.get("object") or {}
                    if event_type == "ERROR":
                        break  # usually 410 Gone: relist
                    if event_type in ("ADDED", "MODIFIED", "DELETED"):
                        self.state.event(self.kind, event_type, obj)
                backoff = 0.2
            except Exception as exc:  # aiohttp errors are not OSErrors; never die on them
                log.warning(
                    "watch failed; retrying",
                    extra={"fields": {"kind": self.kind, "error": repr(exc), "retry_s": backoff}},
                )
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)


class TenantController:
    """Watches GpuTenants, Namespaces and owned ResourceQuotas; keeps the quotas."""

    def __init__(
        self,
        kube: Kube,
        base_policy: ConversionPolicy = DEFAULT_POLICY,
        *,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.kube = kube
        self.backoff_max_s = backoff_max_s
        self.writes = 0
        self.last_error: str | None = None
        self._dirty = anyio.Event()
        self.state = TenantState(base_policy=base_policy, on_change=self._mark_dirty)
        self._foreign: set[str] = set()

    @property
    def ready(self) -> bool:
        return self.state.ready

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Watch and reconcile until cancelled; reports started once every watch listed."""
        selector = {"labelSelector": f"{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"}
        reflectors = [
            _Reflector(self.kube, self.state, "tenants", TENANTS_PATH, {}, missing_ok=True),
            _Reflector(self.kube, self.state, "namespaces", NAMESPACES_PATH, {}),
            _Reflector(self.kube, self.state, "quotas", QUOTAS_PATH, selector),
        ]
        async with anyio.create_task_group() as tg:
            for reflector in reflectors:
                tg.start_soon(reflector.run)
            while not self.state.ready:
                await self._wait_dirty()
            task_status.started()
            self._dirty.set()
            await self._reconcile_loop()

    def _mark_dirty(self) -> None:
        self._dirty.set()

    async def _wait_dirty(self) -> None:
        await self._dirty.wait()
        self._dirty = anyio.Event()

    async def _reconcile_loop(self) -> None:
        backoff = 0.2
        while True:
            await self._wait_dirty()
            try:
                await self.reconcile_once()
                self.last_error = None
                backoff = 0.2
            except Exception as exc:
                self.last_error = repr(exc)
                log.warning(
                    "quota reconcile failed; retrying",
                    extra={"fields": {"error": repr(exc), "retry_s": backoff}},
                )
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
                self._dirty.set()

    async def reconcile_once(self) -> int:
        """Bring the owned ResourceQuotas to the desired state; returns the writes made."""
        state = self.state
        desired = state.desired_quotas()
        writes = 0
        for namespace, have in sorted(state.quotas.items()):
            if namespace not in desired:
                await self._write(namespace, self._delete(namespace, have))
                writes += 1
        for namespace, (hard, tenant) in sorted(desired.items()):
            current = state.quotas.get(namespace)
            if current is None:
                if namespace in self._foreign:
                    continue
                await self._write(namespace, self._create(namespace, hard, tenant))
                writes += 1
            elif (current.get("spec") or {}).get("hard") != hard or (
                current["metadata"].get("labels") or {}
            ).get(TENANT_LABEL) != tenant:
                await self._write(namespace, self._update(current, hard, tenant))
                writes += 1
        self._foreign &= set(desired)
        self.writes += writes
        return writes

    async def _write(self, namespace: str, action: Awaitable[None]) -> None:
        try:
            await action
        except ApiError as exc:
            if exc.status == 404:  # namespace or quota already gone
                self.state.put_quota(namespace, None)
                return
            if exc.status == 403 and namespace in self.state.namespaces:
                # Usually a terminating namespace; its deletion event follows.
                log.info(
                    "quota write refused",
                    extra={"fields": {"namespace": namespace, "error": exc.message}},
                )
                return
            raise

    async def _create(self, namespace: str, hard: dict[str, str], tenant: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {
                "name": QUOTA_NAME,
                "namespace": namespace,
                "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE, TENANT_LABEL: tenant},
            },
            "spec": {"hard": hard},
        }
        try:
            created = await self.kube.request(
                "POST", f"/api/v1/namespaces/{namespace}/resourcequotas", body
            )
        except ApiError as exc:
            if exc.status != 409:
                raise
            # Same name, not ours (ours would be in the cache): never take it over.
            self._foreign.add(namespace)
            log.warning(
                "a ResourceQuota of the same name exists but is not managed by gpudra; "
                "leaving it alone, so the tenant's deviceQuota is not enforced there",
                extra={"fields": {"namespace": namespace, "name": QUOTA_NAME}},
            )
            return
        self.state.put_quota(namespace, created)
        log.info(
            "created device quota",
            extra={"fields": {"namespace": namespace, "tenant": tenant, "hard": hard}},
        )

    async def _update(self, have: Mapping[str, Any], hard: dict[str, str], tenant: str) -> None:
        meta = have["metadata"]
        body = {
            **have,
            "metadata": {**meta, "labels": {**(meta.get("labels") or {}), TENANT_LABEL: tenant}},
            "spec": {**(have.get("spec") or {}), "hard": hard},
        }
        path = f"/api/v1/namespaces/{meta['namespace']}/resourcequotas/{QUOTA_NAME}"
        updated = await self.kube.request("PUT", path, body)
        self.state.put_quota(meta["namespace"], updated)
        log.info(
            "updated device quota",
            extra={"fields": {"namespace": meta["namespace"], "tenant": tenant, "hard": hard}},
        )

    async def _delete(self, namespace: str, have: Mapping[str, Any]) -> None:
        # The UID precondition deletes only the object we own, never a replacement.
        body = {"preconditions": {"uid": have["metadata"]["uid"]}}
        path = f"/api/v1/namespaces/{namespace}/resourcequotas/{QUOTA_NAME}"
        await self.kube.request("DELETE", path, body)
        self.state.put_quota(namespace, None)
        log.info("deleted device quota", extra={"fields": {"namespace": namespace}})
