"""GpuTenant rules for admission, and the controller that keeps their ResourceQuotas.

Where the rules live: GpuTenant objects (``api/tenants.py``) are the only source. Three
watches (GpuTenants, Namespaces, and the ResourceQuotas this controller owns) fill
`TenantState`, an in-memory view the admission paths read without any API call, so an
admission request costs a few dictionary lookups (the webhook's target is p99 < 10 ms).
Until all three watches have listed once, GPU pods and claims are denied (fail closed,
and readiness reports not ready) rather than admitted without their tenant's rules.

Overlapping tenants: a namespace named in a tenant's ``namespaces`` list belongs to that
tenant even when other tenants select it by label (most specific wins). Two tenants of
equal specificity are a conflict: GPU pods and claims there are denied with a message
naming both, and the namespace's ResourceQuota gets, per DeviceClass, the smallest limit
any of them sets, so a misconfiguration never widens quota. The rule is deterministic:
it does not depend on creation order or on which watch event came first.

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

import dataclasses
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import anyio.abc
from gpudra.api.quantity import QuantityError, parse_quantity
from gpudra.api.tenants import (
    GROUP,
    PLURAL,
    QUOTA_RESOURCE_SUFFIX,
    VERSION,
    Specificity,
    Tenant,
    TenantError,
    parse_tenant,
    quota_key,
)
from gpudra.common.backoff import Backoff
from gpudra.common.kube import ApiError, Kube
from gpudra.common.reconcile import ReconcileLoop
from gpudra.common.watch import Reflector
from gpudra.webhook.convert import (
    DEFAULT_POLICY,
    Conversion,
    ConversionPolicy,
    ConvertedClaim,
    DeviceKind,
)

__all__ = [
    "MANAGED_BY_LABEL",
    "MANAGED_BY_VALUE",
    "QUOTA_NAME",
    "TENANT_LABEL",
    "Lookup",
    "QuotaUsage",
    "TenantController",
    "TenantRules",
    "TenantState",
    "policy_for",
]

log = logging.getLogger(__name__)

QUOTA_NAME: Final = "gpudra-gpu-quota"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE: Final = "gpudra"
TENANT_LABEL: Final = "gpudra.io/tenant"
TENANTS_PATH: Final = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
NAMESPACES_PATH: Final = "/api/v1/namespaces"
QUOTAS_PATH: Final = "/api/v1/resourcequotas"
_WATCH_BACKOFF: Final = Backoff(max_s=30.0)
_NO_CRD_RETRY_S: Final = 30.0


def policy_for(tenant: Tenant, base: ConversionPolicy = DEFAULT_POLICY) -> ConversionPolicy:
    """The conversion policy of `tenant`'s namespaces: `base` with its gpuResource mapping."""
    mapping = tenant.spec.gpu_resource
    sharing = tenant.spec.gpu_sharing
    if sharing == "Exclusive":
        return dataclasses.replace(base, gpu_resource_kind=DeviceKind.GPU)
    interval = mapping.time_slicing_interval if mapping else None
    return dataclasses.replace(
        base,
        gpu_resource_kind=DeviceKind.SHARED,
        shared_strategy=sharing,
        time_slice_interval=interval or base.time_slice_interval,
    )


@dataclass(frozen=True)
class QuotaUsage:
    """A namespace's device quota per DeviceClass, from the owned ResourceQuota's status."""

    hard: Mapping[str, int]
    used: Mapping[str, int]


@dataclass(frozen=True)
class TenantRules:
    """A tenant with its conversion policy, built once per tenant change."""

    tenant: Tenant
    policy: ConversionPolicy

    @property
    def label(self) -> str:
        return self.tenant.label

    def check_pod(
        self, conversion: Conversion, namespace: str, usage: QuotaUsage | None
    ) -> str | None:
        """The reason a converted pod breaks the tenant's rules, or None."""
        spec = self.tenant.spec
        for claim in conversion.claims:
            where = _where(claim)
            if not spec.allows_class(claim.device_class):
                return (
                    f"{self.label}: device class {claim.device_class} is not allowed; allowed "
                    f"classes: {_listing(spec.allowed_device_classes)} ({where})"
                )
            if claim.kind is DeviceKind.MIG and not spec.allows_mig_profile(claim.profile):
                return (
                    f"{self.label}: MIG profile {claim.profile} is not allowed; allowed "
                    f"profiles: {_listing(spec.allowed_mig_profiles)} ({where})"
                )
            mode = self.policy.sharing(claim.kind)
            if not spec.allows_sharing(mode):
                return (
                    f"{self.label}: sharing mode {mode} is not allowed; allowed modes: "
                    f"{_listing(spec.allowed_sharing)} ({where})"
                )
        total = sum(c.devices for c in conversion.claims)
        limit = spec.max_devices_per_pod
        if limit is not None and total > limit:
            breakdown = "; ".join(_where(c) for c in conversion.claims)
            return (
                f"{self.label}: maxDevicesPerPod is {limit}, this pod asks for {total} "
                f"devices ({breakdown})"
            )
        if usage is not None:
            asks: dict[str, int] = {}
            for claim in conversion.claims:
                asks[claim.device_class] = asks.get(claim.device_class, 0) + claim.devices
            for device_class, count in sorted(asks.items()):
                hard = usage.hard.get(device_class)
                if hard is None:
                    continue
                used = usage.used.get(device_class, 0)
                if used + count > hard:
                    return (
                        f"{self.label}: quota {device_class} in namespace {namespace}: limit "
                        f"{hard}, used {used}, this pod asks for {count}"
                    )
        return None


def _where(claim: ConvertedClaim) -> str:
    resources = " and ".join(claim.resources)
    noun = "container" if len(claim.containers) == 1 else "containers"
    counts = ", ".join(f"{name}={count}" for name, count in claim.containers)
    return f"{resources} in {noun} {counts}"


def _listing(values: Iterable[str] | None) -> str:
    items = list(values or ())
    return ", ".join(items) if items else "none"


@dataclass(frozen=True)
class Lookup:
    """What admission should apply in a namespace: rules, nothing, or a denial."""

    rules: TenantRules | None = None
    denial: str = ""


_NO_TENANT: Final = Lookup()


@dataclass
class _Namespace:
    labels: Mapping[str, str]
    terminating: bool


@dataclass
class TenantState:
    """The watched objects and everything derived from them, for admission and quota.

    Fed by `TenantController`'s watches (tests feed it the same API objects directly).
    Derived answers are memoised per namespace and dropped only where a change can alter
    them: a tenant change drops all, a Namespace event its own namespace, and the quota
    status updates that come with every claim only that namespace's usage. So an
    admission lookup is a dictionary hit, and a reconcile after a quota or namespace event
    costs O(namespaces) dictionary hits rather than O(namespaces x tenants) selector runs.
    """

    base_policy: ConversionPolicy = DEFAULT_POLICY
    on_change: Callable[[], None] = lambda: None
    tenants: dict[str, TenantRules] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)
    namespaces: dict[str, _Namespace] = field(default_factory=dict)
    quotas: dict[str, dict[str, Any]] = field(default_factory=dict)
    synced: dict[str, bool] = field(
        default_factory=lambda: {"tenants": False, "namespaces": False, "quotas": False}
    )
    _memo: dict[str, Lookup] = field(default_factory=dict)
    _usage: dict[str, QuotaUsage | None] = field(default_factory=dict)
    _selected: dict[str, list[TenantRules] | None] = field(default_factory=dict)
    _desired: dict[str, tuple[dict[str, str], str]] | None = None

    @property
    def ready(self) -> bool:
        return all(self.synced.values())

    # -- feeding --------------------------------------------------------------------------
    def replace(self, kind: str, items: Iterable[Mapping[str, Any]]) -> None:
        """A fresh listing of `kind` ("tenants", "namespaces" or "quotas")."""
        if kind == "tenants":
            self.tenants.clear()
            self.invalid.clear()
        elif kind == "namespaces":
            self.namespaces.clear()
        else:
            self.quotas.clear()
        for obj in items:
            self._put(kind, obj)
        self.synced[kind] = True
        self._changed("tenants")

    def event(self, kind: str, event_type: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED or DELETED) for `kind`."""
        meta = obj["metadata"]
        namespace = meta["name"] if kind == "namespaces" else meta.get("namespace")
        if event_type == "DELETED":
            name = obj["metadata"]["name"]
            if kind == "tenants":
                self.tenants.pop(name, None)
                self.invalid.pop(name, None)
            elif kind == "namespaces":
                self.namespaces.pop(name, None)
            elif name == QUOTA_NAME and namespace in self.quotas:
                self.quotas.pop(namespace)
        else:
            self._put(kind, obj)
        self._changed(kind, namespace)

    def put_quota(self, namespace: str, obj: Mapping[str, Any] | None) -> None:
        """Record the controller's own write (None: deleted) before its event arrives."""
        if obj is None:
            self.quotas.pop(namespace, None)
        else:
            self.quotas[namespace] = dict(obj)
        self._usage.pop(namespace, None)
        self._memo.pop(namespace, None)
        if self.invalid:
            self._desired = None

    def _put(self, kind: str, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        name = meta["name"]
        if kind == "tenants":
            try:
                tenant = parse_tenant(obj)
                rules = TenantRules(tenant, policy_for(tenant, self.base_policy))
            except (TenantError, ValueError) as exc:
                self.tenants.pop(name, None)
                if self.invalid.get(name) != str(exc):
                    log.error("ignoring invalid GpuTenant", extra={"fields": {"error": str(exc)}})
                self.invalid[name] = str(exc)
                return
            self.invalid.pop(name, None)
            self.tenants[name] = rules
        elif kind == "namespaces":
            phase = (obj.get("status") or {}).get("phase")
            self.namespaces[name] = _Namespace(
                dict(meta.get("labels") or {}), phase == "Terminating"
            )
        elif name == QUOTA_NAME:
            self.quotas[meta["namespace"]] = dict(obj)

    def _changed(self, kind: str, namespace: str | None = None) -> None:
        if kind == "tenants" or namespace is None:
            self._memo.clear()
            self._usage.clear()
            self._selected.clear()
            self._desired = None
        elif kind == "namespaces":
            self._memo.pop(namespace, None)
            self._selected.pop(namespace, None)
            self._desired = None
        else:
            self._usage.pop(namespace, None)
            self._memo.pop(namespace, None)
            if self.invalid:  # an invalid tenant's quota is kept, so quotas decide
                self._desired = None
        self.on_change()

    # -- admission ------------------------------------------------------------------------
    def lookup(self, namespace: str) -> Lookup:
        """The tenant rules for `namespace` (memoised until the next change)."""
        found = self._memo.get(namespace)
        if found is None:
            found = self._resolve(namespace)
            self._memo[namespace] = found
        return found

    def quota_usage(self, namespace: str) -> QuotaUsage | None:
        if namespace not in self._usage:
            self._usage[namespace] = _usage(self.quotas.get(namespace))
        return self._usage[namespace]

    def _resolve(self, namespace: str) -> Lookup:
        if not self.ready:
            return Lookup(
                denial="the gpudra webhook has not loaded the GpuTenant rules yet; retry "
                "in a few seconds"
            )
        if not self.tenants and not self.invalid:
            return _NO_TENANT
        winners = self._winners(namespace)
        if winners is None:
            return Lookup(
                denial=f"namespace {namespace} is not in the gpudra webhook's cache yet, so "
                "its GpuTenant cannot be determined; retry in a few seconds"
            )
        if not winners:
            broken = self._invalid_owner(namespace)
            if broken:
                return Lookup(
                    denial=f"namespace {namespace} belongs to GpuTenant {broken}, which is "
                    f"invalid ({self.invalid[broken]}); fix the GpuTenant"
                )
            return _NO_TENANT
        if len(winners) > 1:
            names = " and ".join(f'"{r.tenant.name}"' for r in winners)
            return Lookup(
                denial=f"namespace {namespace} is selected by GpuTenants {names} with equal "
                "specificity, so which rules apply is ambiguous; list the namespace in "
                "exactly one tenant's spec.namespaces or make the selectors disjoint"
            )
        return Lookup(rules=winners[0])

    def _invalid_owner(self, namespace: str) -> str | None:
        """The invalid tenant whose quota this namespace holds, if any: its rules are
        unknown, so admission fails closed and the quota is kept."""
        quota = self.quotas.get(namespace)
        if quota is None:
            return None
        owner = (quota["metadata"].get("labels") or {}).get(TENANT_LABEL)
        return owner if owner in self.invalid else None

    def _winners(self, namespace: str) -> list[TenantRules] | None:
        """The tenants of highest specificity that select `namespace`, sorted by name;
        None when labels would decide but the namespace is not known yet."""
        if namespace not in self._selected:
            self._selected[namespace] = self._select(namespace)
        return self._selected[namespace]

    def _select(self, namespace: str) -> list[TenantRules] | None:
        ns = self.namespaces.get(namespace)
        best: Specificity | None = None
        winners: list[TenantRules] = []
        for name in sorted(self.tenants):
            rules = self.tenants[name]
            spec = rules.tenant.spec
            if ns is None:
                if spec.namespaces is not None and namespace in spec.namespaces:
                    how: Specificity | None = Specificity.NAME
                elif spec.namespace_selector is not None:
                    return None
                else:
                    how = None
            else:
                how = spec.selects(namespace, ns.labels)
            if how is None:
                continue
            if best is None or how > best:
                best, winners = how, [rules]
            elif how == best:
                winners.append(rules)
        return winners

    # -- quota ----------------------------------------------------------------------------
    def desired_quotas(self) -> dict[str, tuple[dict[str, str], str]]:
        """Namespace -> (ResourceQuota ``spec.hard``, tenant label value) to keep there
        (memoised: quota status updates, the most frequent events, do not change it)."""
        if self._desired is None:
            self._desired = self._compute_desired()
        return self._desired

    def _compute_desired(self) -> dict[str, tuple[dict[str, str], str]]:
        desired: dict[str, tuple[dict[str, str], str]] = {}
        if not self.tenants and not self.invalid:
            return desired
        for namespace, ns in self.namespaces.items():
            if ns.terminating:
                continue
            winners = self._winners(namespace) or []
            if not winners and self._invalid_owner(namespace):
                quota = self.quotas[namespace]
                desired[namespace] = (
                    dict(quota.get("spec", {}).get("hard") or {}),
                    quota["metadata"]["labels"][TENANT_LABEL],
                )
                continue
            hard: dict[str, int] = {}
            for rules in winners:
                for device_class, limit in (rules.tenant.spec.device_quota or {}).items():
                    hard[device_class] = min(limit, hard.get(device_class, limit))
            if hard:
                desired[namespace] = (
                    {quota_key(c): str(n) for c, n in sorted(hard.items())},
                    ".".join(r.tenant.name for r in winners)[:63].strip("."),
                )
        return desired


def _usage(quota: Mapping[str, Any] | None) -> QuotaUsage | None:
    if quota is None:
        return None
    status = quota.get("status") or {}
    spec_hard = (quota.get("spec") or {}).get("hard") or {}
    hard = _by_class(status.get("hard") or spec_hard)
    used = _by_class(status.get("used") or {})
    return QuotaUsage(hard, used)


def _by_class(values: Mapping[str, Any]) -> dict[str, int]:
    result: dict[str, int] = {}
    for key, value in values.items():
        if not key.endswith(QUOTA_RESOURCE_SUFFIX):
            continue
        try:
            amount = parse_quantity(str(value)).amount
        except QuantityError:
            continue
        result[key.removesuffix(QUOTA_RESOURCE_SUFFIX)] = math.ceil(amount)
    return result


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
        self._reconciler = ReconcileLoop(
            self.reconcile_once,
            backoff=Backoff(max_s=backoff_max_s),
            ready=lambda: self.state.ready,
            fields={"controller": "tenant quotas"},
        )
        self.state = TenantState(base_policy=base_policy, on_change=self._reconciler.poke)
        self._foreign: set[str] = set()

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
            self._reflector("tenants", TENANTS_PATH, {}, absent_retry_s=_NO_CRD_RETRY_S),
            self._reflector("namespaces", NAMESPACES_PATH, {}),
            self._reflector("quotas", QUOTAS_PATH, selector),
        ]
        async with anyio.create_task_group() as tg:
            for reflector in reflectors:
                tg.start_soon(reflector.run)
            await tg.start(self._reconciler.run)
            task_status.started()

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
