"""Which GpuTenant each namespace belongs to, for the `tenant` label of device metrics
and accounting.

The agent bills GPU-seconds per tenant, so it must know the tenants as the webhook
does: it watches GpuTenants and Namespaces with the common list/watch loop and applies
the same selection rule (`gpudra.api.tenants.winning_tenants`), so a namespace is billed
to the tenant whose rules admitted its pods. The tenant is looked up at each sample,
not stored with the claim: a tenant created or changed while a claim is held takes
effect at the next sample, and a restart needs nothing from the checkpoint.

No tenant (no GpuTenant selects the namespace, the CRD is not installed, the watches
have not listed yet), an ambiguous one (two tenants of equal specificity, which the
webhook denies) and an invalid one that would win or tie (`invalid_in_reach`: the
webhook denies GPU pods there, as its rules are unknown) all read as "": GPU-seconds
are never billed to a guess, nor to a tenant whose rules did not admit the pods.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

import anyio
import anyio.abc
from gpudra.api.tenants import (
    PATH,
    Tenant,
    TenantError,
    TenantReach,
    excluded_namespaces,
    invalid_in_reach,
    parse_tenant,
    winning_tenants,
)
from gpudra.common.kube import Kube
from gpudra.common.watch import EventType, Reflector

__all__ = ["NAMESPACES_PATH", "NamespaceTenants"]

log = logging.getLogger(__name__)

NAMESPACES_PATH: Final = "/api/v1/namespaces"
_NO_CRD_RETRY_S: Final = 60.0


class NamespaceTenants:
    """The watched GpuTenants (the valid ones, and how far each invalid one reaches) and
    namespace labels, and each namespace's tenant name.

    Fed by two `Reflector`s (`run`); tests feed it API objects directly. Answers are
    memoised per namespace and dropped on any change that can alter them.
    """

    def __init__(self, *, own_namespace: str = "") -> None:
        # As the webhook's: no default tenant governs the namespaces it never reviews,
        # so the system's and gpudra's own GPU use is billed to no tenant.
        self._excluded = excluded_namespaces(own_namespace)
        self._tenants: dict[str, Tenant] = {}
        self._invalid: dict[str, TenantReach] = {}
        self._labels: dict[str, Mapping[str, str]] = {}
        self._memo: dict[str, str] = {}

    def tenant_of(self, namespace: str) -> str:
        """The name of the one tenant `namespace` belongs to, else ""."""
        found = self._memo.get(namespace)
        if found is None:
            found = self._memo[namespace] = self._resolve(namespace)
        return found

    def _resolve(self, namespace: str) -> str:
        labels = self._labels.get(namespace)
        ordered = (self._tenants[name] for name in sorted(self._tenants))
        winners = winning_tenants(namespace, labels, ordered, self._excluded)
        if winners is None or len(winners) != 1:
            return ""  # labels not known yet, no tenant, or ambiguous
        if invalid_in_reach(namespace, labels, winners, self._invalid, self._excluded):
            return ""  # an invalid tenant would win or tie: its unknown rules decide
        return winners[0].name

    # -- feeding ------------------------------------------------------------------------
    def list_tenants(self, items: list[dict[str, Any]]) -> None:
        self._tenants.clear()
        self._invalid.clear()
        for obj in items:
            self._put_tenant(obj)
        self._memo.clear()

    def tenant_event(self, event_type: EventType, obj: dict[str, Any]) -> None:
        if event_type == "DELETED":
            self._tenants.pop(obj["metadata"]["name"], None)
            self._invalid.pop(obj["metadata"]["name"], None)
        else:
            self._put_tenant(obj)
        self._memo.clear()

    def list_namespaces(self, items: list[dict[str, Any]]) -> None:
        self._labels = {o["metadata"]["name"]: _labels(o) for o in items}
        self._memo.clear()

    def namespace_event(self, event_type: EventType, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if event_type == "DELETED":
            self._labels.pop(name, None)
        else:
            self._labels[name] = _labels(obj)
        self._memo.pop(name, None)

    def _put_tenant(self, obj: Mapping[str, Any]) -> None:
        name = obj["metadata"]["name"]
        try:
            self._tenants[name] = parse_tenant(obj)
        except TenantError as exc:
            # The webhook reports it and denies GPU pods wherever it would decide; there
            # it bills nobody, and no other tenant either.
            self._tenants.pop(name, None)
            self._invalid[name] = TenantReach.of(obj)
            log.info("GpuTenant is invalid; not billed", extra={"fields": {"error": str(exc)}})
        else:
            self._invalid.pop(name, None)

    # -- watching -----------------------------------------------------------------------
    async def run(
        self, kube: Kube, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Watch GpuTenants and Namespaces until cancelled. Started at once: until the
        first listings (or without the permission to list), every tenant reads as ""."""
        tenants = Reflector(
            kube,
            PATH,
            on_list=self.list_tenants,
            on_event=self.tenant_event,
            absent_retry_s=_NO_CRD_RETRY_S,  # no CRD: no tenant can exist yet
            fields={"kind": "tenants"},
        )
        namespaces = Reflector(
            kube,
            NAMESPACES_PATH,
            on_list=self.list_namespaces,
            on_event=self.namespace_event,
            fields={"kind": "namespaces"},
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(tenants.run)
            tg.start_soon(namespaces.run)
            task_status.started()


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})
