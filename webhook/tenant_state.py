"""The GpuTenants, Namespaces and owned ResourceQuotas in memory, and what follows.

Where the rules live: GpuTenant objects (``api/tenants.py``) are the only source. The
controller's three watches (``tenants.py``) feed `TenantState`, an in-memory view the
admission paths read without any API call, so an admission request costs a few
dictionary lookups (the webhook's target is p99 < 10 ms). Until all three watches have
listed once, GPU pods and claims are denied (fail closed, and readiness reports not
ready) rather than admitted without their tenant's rules.

Overlapping tenants: a namespace named in a tenant's ``namespaces`` list belongs to that
tenant even when other tenants select it by label (most specific wins), and a tenant
with an empty ``namespaceSelector`` (the default tenant) governs only the namespaces no
other tenant selects: its quota is kept there and moves to the specific tenant's (or
goes) when a namespace's labels make another tenant select it. Two tenants of equal
specificity are a conflict: GPU pods and claims there are denied with a message naming
both, and the namespace's ResourceQuota gets, per DeviceClass, the smallest limit any
of them sets, so a misconfiguration never widens quota. The rule is deterministic: it
does not depend on creation order or on which watch event came first.

No I/O: the controller writes the quotas `TenantState.desired_quotas` asks for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gpudra.api.quantity import QuantityError, parse_quantity
from gpudra.api.tenants import (
    Specificity,
    TenantError,
    TenantReach,
    invalid_in_reach,
    parse_tenant,
    quota_key,
    winning_tenants,
)
from gpudra.webhook.convert import DEFAULT_POLICY, ConversionPolicy
from gpudra.webhook.pod_security import PRIVILEGED, enforce_level
from gpudra.webhook.tenant_rules import Lookup, QuotaUsage, TenantRules, policy_for

__all__ = ["QUOTA_NAME", "TENANT_LABEL", "TenantState"]

log = logging.getLogger(__name__)

QUOTA_NAME: Final = "gpudra-gpu-quota"
"""The one ResourceQuota per namespace that the controller owns."""
TENANT_LABEL: Final = "gpudra.io/tenant"
"""On an owned quota: the tenant(s) it was made for."""

_NO_TENANT: Final = Lookup()


def _amounts_are(have: Mapping[str, Any], hard: Mapping[str, str]) -> bool:
    """The same keys with the same amounts (the API server writes quantities in its
    canonical form: 1000 comes back as "1k")."""
    if set(have) != set(hard):
        return False
    try:
        return all(
            parse_quantity(str(have[k])).amount == parse_quantity(v).amount for k, v in hard.items()
        )
    except QuantityError:
        return False


def quota_spec_is(quota: Mapping[str, Any], hard: Mapping[str, str]) -> bool:
    """Whether a ResourceQuota's spec is exactly `hard`, and nothing else (a scope would
    make it count no claim)."""
    spec = quota.get("spec") or {}
    return not set(spec) - {"hard"} and _amounts_are(spec.get("hard") or {}, hard)


def quota_enforced(quota: Mapping[str, Any], hard: Mapping[str, str]) -> bool:
    """Whether the API server enforces `hard` with this ResourceQuota now.

    Its quota admission limits by ``status.hard`` alone and refuses while ``status.used``
    lacks a limited key (apiserver's resourcequota admission, ``CheckRequest`` and
    ``hasUsageStats``). Both are written by kube-controller-manager's quota controller
    after each change of the spec: a quota just created has no status and limits
    nothing, and one just lowered keeps its old limit. Until the status says `hard`,
    the quota is not in place.
    """
    if not quota_spec_is(quota, hard):
        return False
    status = quota.get("status") or {}
    return _amounts_are(status.get("hard") or {}, hard) and set(hard) <= set(
        status.get("used") or {}
    )


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
    quota_classes: frozenset[str] = frozenset()
    """The driver's DeviceClasses: a quota written for `deviceQuota` limits each one it
    does not name to 0. Kubernetes counts a claim's devices against its own class only,
    and several classes give the same GPUs (the shared class, per-profile MIG classes,
    an admin's), so a quota on one class alone would leave the others unlimited."""
    pod_security_default: str = PRIVILEGED
    """The Pod Security level the API server enforces in a namespace without the
    enforce label (``gpudra.webhook.pod_security``)."""
    excluded: frozenset[str] = frozenset()
    """The namespaces the webhook never reviews (kube-system, its own): a default tenant
    does not govern them, so it writes no quota there and they are not reported as its
    namespaces without Pod Security (the node agent's namespace must be privileged)."""
    tenants: dict[str, TenantRules] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)
    _reach: dict[str, TenantReach] = field(default_factory=dict)
    namespaces: dict[str, _Namespace] = field(default_factory=dict)
    quotas: dict[str, dict[str, Any]] = field(default_factory=dict)
    synced: dict[str, bool] = field(
        default_factory=lambda: {"tenants": False, "namespaces": False, "quotas": False}
    )
    _memo: dict[str, Lookup] = field(default_factory=dict)
    _usage: dict[str, QuotaUsage] = field(default_factory=dict)
    _selected: dict[str, list[TenantRules] | None] = field(default_factory=dict)
    _desired: dict[str, tuple[dict[str, str], str]] | None = None
    _open: dict[str, tuple[str, ...]] | None = None

    @property
    def ready(self) -> bool:
        return all(self.synced.values())

    # -- feeding --------------------------------------------------------------------------
    def replace(self, kind: str, items: Iterable[Mapping[str, Any]]) -> None:
        """A fresh listing of `kind` ("tenants", "namespaces" or "quotas")."""
        if kind == "tenants":
            self.tenants.clear()
            self.invalid.clear()
            self._reach.clear()
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
                self._reach.pop(name, None)
            elif kind == "namespaces":
                self.namespaces.pop(name, None)
            elif name == QUOTA_NAME and namespace in self.quotas:
                # A late event of a quota deleted before the one cached now (the same
                # name, made again) must not drop the live one.
                cached = self.quotas[namespace]["metadata"].get("uid")
                if cached is None or cached == meta.get("uid"):
                    self.quotas.pop(namespace)
        else:
            self._put(kind, obj)
        self._changed(kind, namespace)

    def put_quota(self, namespace: str, obj: Mapping[str, Any] | None) -> None:
        """Record the controller's own write (None: deleted) before its event arrives."""
        if obj is None:
            self.quotas.pop(namespace, None)
        elif not _newer(self.quotas.get(namespace), obj):
            # Its event, or a later one (the quota controller's status with what the
            # namespace uses), may have come in before the write's own answer: the
            # answer must not put the older object back over it.
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
                self._reach[name] = TenantReach.of(obj)
                return
            self.invalid.pop(name, None)
            self._reach.pop(name, None)
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
            self._open = None
        elif kind == "namespaces":
            self._memo.pop(namespace, None)
            self._selected.pop(namespace, None)
            self._usage.pop(namespace, None)
            self._desired = None
            self._open = None
        else:
            self._usage.pop(namespace, None)
            self._memo.pop(namespace, None)
            if self.invalid:  # an invalid tenant's quota is kept, so quotas decide
                self._desired = None
        self.on_change()

    # -- admission ------------------------------------------------------------------------
    def namespace_labels(self, namespace: str) -> Mapping[str, str] | None:
        """The labels of `namespace` as last watched; None until the Namespaces are
        listed, or while a new namespace's event has not arrived."""
        if not self.synced["namespaces"]:
            return None
        found = self.namespaces.get(namespace)
        return found.labels if found is not None else None

    def lookup(self, namespace: str) -> Lookup:
        """The tenant rules for `namespace` (memoised until the next change, for a
        namespace that exists: `_memoised`)."""
        found = self._memo.get(namespace)
        if found is None:
            found = self._resolve(namespace)
            if self._memoised(namespace):
                self._memo[namespace] = found
        return found

    def quota_usage(self, namespace: str) -> QuotaUsage | None:
        found = self._usage.get(namespace)
        if found is None:
            found = QuotaUsage.of(self.quotas.get(namespace))
            if found is not None and self._memoised(namespace):
                self._usage[namespace] = found
        return found

    def _memoised(self, namespace: str) -> bool:
        """Whether answers for `namespace` are kept: only for one the Namespace watch
        knows. Anyone who reaches the webhook's port may send a review naming any
        namespace, so keeping answers for made-up names would grow without bound."""
        return namespace in self.namespaces

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
        broken = self._invalid_in_reach(namespace, winners) or (
            None if winners else self._invalid_owner(namespace)
        )
        if broken:
            return Lookup(
                denial=f"namespace {namespace} belongs to GpuTenant {broken}, which is "
                f"invalid ({self.invalid[broken]}); fix the GpuTenant"
            )
        if not winners:
            return _NO_TENANT
        if len(winners) > 1:
            names = " and ".join(f'"{r.tenant.name}"' for r in winners)
            labels = self.namespace_labels(namespace) or {}
            how = winners[0].tenant.spec.selects(namespace, labels, self.excluded)
            fix = (
                "keep one default tenant (namespaceSelector: {}): delete the others or give "
                "them a label selector"
                if how is Specificity.DEFAULT
                else "list the namespace in exactly one tenant's spec.namespaces or make "
                "the selectors disjoint"
            )
            return Lookup(
                denial=f"namespace {namespace} is selected by GpuTenants {names} with equal "
                f"specificity, so which rules apply is ambiguous; {fix}"
            )
        desired = self.desired_quotas().get(namespace)
        wants_quota = any(r.tenant.spec.device_quota is not None for r in winners)
        if desired is not None or (wants_quota and namespace not in self.namespaces):
            current = self.quotas.get(namespace)
            if desired is None or current is None or not quota_enforced(current, desired[0]):
                # Without it the API server counts nothing: refuse, as with unknown rules.
                return Lookup(
                    denial=f"the ResourceQuota {QUOTA_NAME} that enforces deviceQuota in "
                    f"namespace {namespace} is not in place yet; retry in a few seconds (if "
                    "this lasts, the gpudra webhook's log says why: a ResourceQuota of that "
                    "name it does not manage, or a refused write; or kube-controller-manager "
                    "has not counted the quota's status)"
                )
        return Lookup(rules=winners[0])

    def _invalid_in_reach(self, namespace: str, winners: list[TenantRules]) -> str | None:
        """An invalid tenant that would select `namespace` at least as specifically as the
        valid `winners` do: it would win or conflict, so its unknown rules decide."""
        if not self._reach:
            return None
        ns = self.namespaces.get(namespace)
        labels = ns.labels if ns is not None else None
        return invalid_in_reach(
            namespace, labels, [r.tenant for r in winners], self._reach, self.excluded
        )

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
        if namespace in self._selected:
            return self._selected[namespace]
        found = self._select(namespace)
        if self._memoised(namespace):
            self._selected[namespace] = found
        return found

    def _select(self, namespace: str) -> list[TenantRules] | None:
        ns = self.namespaces.get(namespace)
        ordered = (self.tenants[name].tenant for name in sorted(self.tenants))
        labels = ns.labels if ns is not None else None
        winners = winning_tenants(namespace, labels, ordered, self.excluded)
        return None if winners is None else [self.tenants[t.name] for t in winners]

    # -- pod security ---------------------------------------------------------------------
    def without_pod_security(self) -> dict[str, tuple[str, ...]]:
        """Tenant namespaces where the API server lets pods be privileged (Pod Security
        level ``privileged``): namespace -> the tenants there, valid or not (memoised
        until a tenant or namespace changes). A privileged pod gets every GPU of its
        node without a claim, so the tenant's rules do not hold there."""
        if self._open is None:
            self._open = self._compute_open()
        return self._open

    def _compute_open(self) -> dict[str, tuple[str, ...]]:
        found: dict[str, tuple[str, ...]] = {}
        if not self.tenants and not self._reach:
            return found
        for namespace, ns in sorted(self.namespaces.items()):
            if ns.terminating or enforce_level(ns.labels, self.pod_security_default) != PRIVILEGED:
                continue
            names = {rules.tenant.name for rules in self._winners(namespace) or []}
            names.update(
                n
                for n, reach in self._reach.items()
                if reach.selects(namespace, ns.labels, self.excluded)
            )
            if names:
                found[namespace] = tuple(sorted(names))
        return found

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
            quotas = [
                r.tenant.spec.device_quota
                for r in winners
                if r.tenant.spec.device_quota is not None
            ]
            if quotas:
                # Each tenant alone gives the driver's classes it does not name 0 (an
                # empty quota: no GPUs) and leaves other classes unlimited; together, the
                # smallest of those per class, so a conflict never widens one.
                hard: dict[str, int] = {}
                for device_class in {*self.quota_classes, *(c for q in quotas for c in q)}:
                    limits = [
                        q.get(device_class, 0)
                        for q in quotas
                        if device_class in q or device_class in self.quota_classes
                    ]
                    hard[device_class] = min(limits)
                desired[namespace] = (
                    {quota_key(c): str(n) for c, n in sorted(hard.items())},
                    # A label value: at most 63 characters, alphanumeric at both ends.
                    ".".join(r.tenant.name for r in winners)[:63].strip("._-"),
                )
        return desired


def _newer(cached: Mapping[str, Any] | None, written: Mapping[str, Any]) -> bool:
    """Whether `cached` is a later version of the same object than `written`: the same
    UID and a higher resourceVersion (etcd's revision; read as a number only to order
    two versions of one object, where both are numbers)."""
    if cached is None:
        return False
    old, new = cached.get("metadata") or {}, written.get("metadata") or {}
    if old.get("uid") != new.get("uid"):
        return False
    try:
        return int(str(old.get("resourceVersion"))) > int(str(new.get("resourceVersion")))
    except (TypeError, ValueError):
        return False
