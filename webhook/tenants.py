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
left alone and reported, and the create is tried again every `FOREIGN_RETRY_S`: the
quota watch selects gpudra's label, so no event says when the admin removed it.

A reconcile runs after every event of an owned quota, and the quota controller updates
each quota's status whenever a claim comes or goes, so a pass must cost little where
nothing changed: a quota found as desired is not parsed again until it or its desired
spec changes (`_checked`).

Several replicas run this controller, each with all its watches and `TenantState`
(admission reads it), but with a `LeaderElector` only the one holding the lease writes
quotas: during a rollout two releases may want different quotas (one counts another
DeviceClass) and would otherwise overwrite each other until the old pods are gone.
Leadership is checked before each write, so a replica that stops leading mid-pass
writes nothing more; one that gains it reconciles at once, from its warm caches.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import anyio
import anyio.abc
from gpudra.api.tenants import PATH, excluded_namespaces
from gpudra.common.backoff import Backoff
from gpudra.common.kube import ApiError, Kube
from gpudra.common.leader import LeaderElector
from gpudra.common.reconcile import ReconcileLoop
from gpudra.common.watch import Reflector
from gpudra.webhook.convert import DEFAULT_POLICY, ConversionPolicy
from gpudra.webhook.pod_security import ENFORCE_LABEL, PRIVILEGED
from gpudra.webhook.tenant_state import QUOTA_NAME, TENANT_LABEL, TenantState, quota_spec_is
from gpudra.webhook.validate import driver_classes

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
NAMESPACES_PATH: Final = "/api/v1/namespaces"
QUOTAS_PATH: Final = "/api/v1/resourcequotas"
_WATCH_BACKOFF: Final = Backoff(max_s=30.0)
_NO_CRD_RETRY_S: Final = 30.0
# A quota update meets the quota controller's status write at most about once: a second
# conflict in a row is left to the next pass.
_UPDATE_ATTEMPTS: Final = 2
FOREIGN_RETRY_S: Final = 30.0
"""How often the create is tried again where a same-named quota gpudra does not
manage was found."""


class TenantController:
    """Watches GpuTenants, Namespaces and owned ResourceQuotas; keeps the quotas."""

    def __init__(
        self,
        kube: Kube,
        base_policy: ConversionPolicy = DEFAULT_POLICY,
        *,
        backoff_max_s: float = 30.0,
        extra_classes: Sequence[str] = (),
        pod_security_default: str = PRIVILEGED,
        own_namespace: str = "gpudra",
        foreign_retry_s: float = FOREIGN_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
        leader: LeaderElector | None = None,
    ) -> None:
        self.kube = kube
        self.backoff_max_s = backoff_max_s
        self.writes = 0
        self._reconciler = ReconcileLoop(
            self.reconcile_once,
            backoff=Backoff(max_s=backoff_max_s),
            ready=lambda: self.state.ready,
            fields={"controller": "tenant quotas"},
        )
        self.state = TenantState(
            base_policy=base_policy,
            on_change=self._reconciler.poke,
            quota_classes=driver_classes(base_policy, extra_classes),
            pod_security_default=pod_security_default,
            # The namespaces the webhook never reviews, as `Admission` excludes them.
            excluded=excluded_namespaces(own_namespace),
        )
        # Namespace -> when a same-named quota gpudra does not manage was last found there.
        self._foreign: dict[str, float] = {}
        self._foreign_retry_s = foreign_retry_s
        self._clock = clock
        # Namespace -> (the owned quota's UID and resourceVersion, the desired spec and
        # tenant label it was found to hold): not parsed again while all are the same.
        self._checked: dict[str, tuple[tuple[Any, Any], Mapping[str, str], str]] = {}
        self._reported_open: Mapping[str, tuple[str, ...]] = {}
        # Without an elector this replica is the only writer (one replica, or tests).
        self.leader = leader
        if leader is not None:
            leader.on_change(self._leadership_changed)

    @property
    def writing(self) -> bool:
        """Whether this replica writes the quotas now: it leads, or no election is held."""
        return self.leader is None or self.leader.leading

    def _leadership_changed(self, leading: bool) -> None:
        """A new leader catches up at once: the quotas may have drifted, or been written
        by a release that wants them otherwise, while another replica led."""
        if leading:
            self._reconciler.poke()

    @property
    def ready(self) -> bool:
        return self.state.ready

    @property
    def last_error(self) -> str | None:
        """Why the latest quota reconcile failed; None once one succeeds."""
        error = self._reconciler.last_error
        return None if error is None else repr(error)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Watch and reconcile until cancelled; reports started once every watch listed."""
        selector = {"labelSelector": f"{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"}
        reflectors = [
            # No GpuTenant CRD: no tenant can exist; tenant rules are off until it is.
            self._reflector("tenants", PATH, {}, absent_retry_s=_NO_CRD_RETRY_S),
            self._reflector("namespaces", NAMESPACES_PATH, {}),
            self._reflector("quotas", QUOTAS_PATH, selector),
        ]
        async with anyio.create_task_group() as tg:
            for reflector in reflectors:
                tg.start_soon(reflector.run)
            await tg.start(self._reconciler.run)
            tg.start_soon(self._retry_foreign)
            if self.leader is not None:
                tg.start_soon(self.leader.run)
            task_status.started()

    async def _retry_foreign(self) -> None:
        """Reconcile again while a same-named quota gpudra does not manage holds a
        namespace: its removal sends no event to the label-selected watch."""
        while True:
            await anyio.sleep(self._foreign_retry_s)
            if self._foreign:
                self._reconciler.poke()

    def _reflector(
        self, kind: str, path: str, query: Mapping[str, str], absent_retry_s: float | None = None
    ) -> Reflector:
        """List, then watch, one collection into `TenantState`."""
        return Reflector(
            self.kube,
            path,
            query=query,
            on_list=functools.partial(self.state.replace, kind),
            on_event=functools.partial(self.state.event, kind),
            backoff=_WATCH_BACKOFF,
            absent_retry_s=absent_retry_s,
            fields={"kind": kind},
        )

    async def reconcile_once(self) -> int:
        """Bring the owned ResourceQuotas to the desired state; returns the writes made."""
        state = self.state
        self._report_pod_security()
        desired = state.desired_quotas()
        writes = 0
        # One namespace's refused write never keeps the others from their quotas: each is
        # tried, and the first failure is raised after them all, for the loop to retry.
        failures: list[ApiError] = []
        for namespace, have in sorted(state.quotas.items()):
            if namespace not in desired:
                writes += await self._write(
                    namespace, functools.partial(self._delete, namespace, have), failures
                )
        now = self._clock()
        for namespace, (hard, tenant) in sorted(desired.items()):
            current = state.quotas.get(namespace)
            if current is not None:
                # Ours after all (the answer to a create was lost, a 409 followed).
                self._foreign.pop(namespace, None)
            if current is None:
                found = self._foreign.get(namespace)
                if found is not None and now - found < self._foreign_retry_s:
                    continue
                action = functools.partial(self._create, namespace, hard, tenant)
                writes += await self._write(namespace, action, failures)
                continue
            meta = current["metadata"]
            version = (meta.get("uid"), meta.get("resourceVersion"))
            if self._checked.get(namespace) == (version, hard, tenant):
                continue
            if set(current.get("spec") or {}) - {"hard"}:
                # A scope would make it count no claim, and the API server refuses to
                # change a quota's scopes: made again (the next pass creates it).
                action = functools.partial(self._delete, namespace, current)
                writes += await self._write(namespace, action, failures)
            elif (
                not quota_spec_is(current, hard)
                or (current["metadata"].get("labels") or {}).get(TENANT_LABEL) != tenant
            ):
                action = functools.partial(self._update, current, hard, tenant)
                writes += await self._write(namespace, action, failures)
            else:
                self._checked[namespace] = (version, hard, tenant)
        self._foreign = {n: t for n, t in self._foreign.items() if n in desired}
        if len(self._checked) > len(desired):
            self._checked = {n: c for n, c in self._checked.items() if n in desired}
        self.writes += writes
        if failures:
            raise failures[0]
        return writes

    def _report_pod_security(self) -> None:
        """Warn, each time the set changes, of tenant namespaces where pods may be
        privileged: the tenant rules bound claims, and a privileged pod needs none."""
        found = self.state.without_pod_security()
        if found == self._reported_open:
            return
        self._reported_open = found
        if found:
            names = sorted(found)
            log.warning(
                "tenant namespaces do not enforce Pod Security baseline: a privileged pod "
                "there gets every GPU of its node without a claim, outside its tenant's "
                f"rules; label them {ENFORCE_LABEL}=baseline (or restricted)",
                extra={
                    "fields": {
                        "count": len(names),
                        "namespaces": names[:20],
                        "tenants": sorted({t for ts in found.values() for t in ts})[:20],
                    }
                },
            )

    async def _write(
        self, namespace: str, action: Callable[[], Awaitable[None]], failures: list[ApiError]
    ) -> int:
        """1 when `action` wrote; a failure other than a gone or terminating namespace is
        logged and added to `failures`. Nothing is written unless this replica leads."""
        if not self.writing:
            return 0
        try:
            await action()
        except ApiError as exc:
            if exc.status == 404:  # namespace or quota already gone
                self.state.put_quota(namespace, None)
                return 0
            if exc.status == 403 and namespace in self.state.namespaces:
                # Usually a terminating namespace; its deletion event follows.
                log.info(
                    "quota write refused",
                    extra={"fields": {"namespace": namespace, "error": exc.message}},
                )
                return 0
            log.warning(
                "quota write failed",
                extra={"fields": {"namespace": namespace, "error": exc.message}},
            )
            failures.append(exc)
            return 0
        return 1

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
            # Ours after all when it carries our label (the answer to an earlier create
            # was lost, or the watch lags): taken into the cache, updated next time.
            existing = await self.kube.request(
                "GET", f"/api/v1/namespaces/{namespace}/resourcequotas/{QUOTA_NAME}"
            )
            labels = (existing.get("metadata") or {}).get("labels") or {}
            if labels.get(MANAGED_BY_LABEL) == MANAGED_BY_VALUE:
                self.state.put_quota(namespace, existing)
                return
            # Same name, not ours: never take it over.
            if namespace not in self._foreign:
                log.warning(
                    "a ResourceQuota of the same name exists but is not managed by gpudra; "
                    "leaving it alone, so the tenant's deviceQuota is not enforced there and "
                    "its GPU pods and claims are refused until it is removed",
                    extra={"fields": {"namespace": namespace, "name": QUOTA_NAME}},
                )
            self._foreign[namespace] = self._clock()
            return
        self.state.put_quota(namespace, created)
        log.info(
            "created device quota",
            extra={"fields": {"namespace": namespace, "tenant": tenant, "hard": hard}},
        )

    async def _update(self, have: Mapping[str, Any], hard: dict[str, str], tenant: str) -> None:
        """Replace the quota's limits and tenant label. The quota controller writes the
        status right after every change of ours, so the version we hold is often one
        behind: a conflict reads the quota again and tries once more on it, while it is
        still ours (a replacement of the same name is left to the next pass)."""
        meta = have["metadata"]
        namespace = meta["namespace"]
        path = f"/api/v1/namespaces/{namespace}/resourcequotas/{QUOTA_NAME}"
        for attempt in range(_UPDATE_ATTEMPTS):
            meta = have["metadata"]
            body = {
                **have,
                "metadata": {
                    **meta,
                    "labels": {**(meta.get("labels") or {}), TENANT_LABEL: tenant},
                },
                "spec": {"hard": hard},
            }
            try:
                updated = await self.kube.request("PUT", path, body)
                break
            except ApiError as exc:
                if exc.status != 409 or attempt + 1 == _UPDATE_ATTEMPTS:
                    raise
                latest = await self.kube.request("GET", path)
                if latest["metadata"].get("uid") != meta.get("uid") or not self.writing:
                    raise
                have = latest
        self.state.put_quota(namespace, updated)
        log.info(
            "updated device quota",
            extra={"fields": {"namespace": namespace, "tenant": tenant, "hard": hard}},
        )

    async def _delete(self, namespace: str, have: Mapping[str, Any]) -> None:
        # The UID precondition deletes only the object we own, never a replacement.
        body = {"preconditions": {"uid": have["metadata"]["uid"]}}
        path = f"/api/v1/namespaces/{namespace}/resourcequotas/{QUOTA_NAME}"
        await self.kube.request("DELETE", path, body)
        self.state.put_quota(namespace, None)
        log.info("deleted device quota", extra={"fields": {"namespace": namespace}})
