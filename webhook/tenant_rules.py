"""What a GpuTenant allows, and a converted pod checked against it: pure rules.

A tenant's rules are built once per tenant change (`TenantRules`: the tenant with the
conversion policy its ``gpuResource`` mapping gives), so an admission only evaluates
them. `maxDevicesPerPod` counts every device a pod will get: the converted claims plus
each claim and template the pod refers to by hand (`ReferencedClaim`, counted by
`claim_devices`; the admission layer reads them), shared claims included. The quota
check here exists only to deny early with a readable message naming the
tenant, the limit and the usage; the native ResourceQuota the controller keeps
(``tenants.py``) is what holds under concurrency. Hand-written claims are checked
against the same rules by ``validate.py``.

No I/O: `TenantState` (``tenant_state.py``) resolves which rules apply in a namespace.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpudra.api.quantity import QuantityError, parse_quantity
from gpudra.api.tenants import MAX_DEVICES_PER_CLAIM, QUOTA_RESOURCE_SUFFIX, Tenant
from gpudra.webhook.convert import (
    DEFAULT_POLICY,
    GPU_RESOURCE,
    Conversion,
    ConversionPolicy,
    ConvertedClaim,
    DeviceKind,
    convert_pod,
)

__all__ = [
    "Lookup",
    "QuotaUsage",
    "ReferencedClaim",
    "StoredClaim",
    "TenantRules",
    "claim_classes",
    "claim_devices",
    "device_counts",
    "pod_devices",
    "policy_for",
    "rules_view",
]


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


def rules_view(pod: Mapping[str, Any], policy: ConversionPolicy) -> Conversion:
    """What `pod`'s legacy GPU resources amount to, however it asks, for the tenant rules.

    The webhook patches only some pods, but the rules hold for all: an opted-out pod, one
    that merely looks converted, and one whose ``nvidia.com/gpu`` a DeviceClass's
    ``extendedResourceName`` serves are counted as if converted. Native resources are
    allocated from the GPU class (Exclusive), so the view maps them there.
    """
    native = policy.native_resources
    if native:
        kind = DeviceKind.GPU if GPU_RESOURCE in native else policy.gpu_resource_kind
        policy = dataclasses.replace(policy, native_resources=frozenset(), gpu_resource_kind=kind)
    return convert_pod(pod, policy, every_pod=True)


@dataclass(frozen=True)
class QuotaUsage:
    """A namespace's device quota per DeviceClass, from the owned ResourceQuota's status."""

    hard: Mapping[str, int]
    used: Mapping[str, int]

    @classmethod
    def of(cls, quota: Mapping[str, Any] | None) -> QuotaUsage | None:
        """The usage a ResourceQuota object reports (None: no quota). The limits are its
        ``status.hard``, the ones the API server enforces (`quota_enforced`), never a
        spec it has not counted yet."""
        if quota is None:
            return None
        status = quota.get("status") or {}
        hard = _by_class(status.get("hard") or {})
        used = _by_class(status.get("used") or {})
        return cls(hard, used)


@dataclass(frozen=True)
class ReferencedClaim:
    """A claim a pod refers to that the conversion did not write, with its device count."""

    pod_claim_name: str
    source: str
    """What it refers to, for messages: ``ResourceClaim x`` or ``ResourceClaimTemplate y``."""
    devices: int
    scheduled: bool = False
    """The claim the scheduler made for the pod's extended resources (stored, or being
    created), not one built as it would make it: it holds the devices of the native
    resources (a DeviceClass's ``extendedResourceName``) it serves through DRA, which
    the rules' view of the pod then leaves out (`Admission._users_over_limit`)."""


@dataclass(frozen=True)
class StoredClaim:
    """A claim or template a pod refers to, as stored in the API."""

    spec: Mapping[str, Any]
    """The ResourceClaimSpec (a template's ``spec.spec``)."""
    allocated: bool = False
    """A claim with ``status.allocation``: its devices are held already, so a pod naming
    it takes nothing more from the quota. Templates never are."""


def claim_classes(spec: object) -> set[str]:
    """The DeviceClasses a ResourceClaimSpec's requests and their alternatives name."""
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    requests = devices.get("requests") if isinstance(devices, Mapping) else None
    names: set[str] = set()
    for request in requests if isinstance(requests, list) else ():
        if not isinstance(request, Mapping):
            continue
        subs = request.get("firstAvailable")
        for option in [request.get("exactly"), *(subs if isinstance(subs, list) else ())]:
            name = option.get("deviceClassName") if isinstance(option, Mapping) else None
            if isinstance(name, str):
                names.add(name)
    return names


def claim_devices(spec: object, classes: frozenset[str]) -> int:
    """How many devices of the driver's `classes` a ResourceClaimSpec can be allocated.

    ``allocationMode: All`` counts as the most one claim may hold, and of a request's
    ``firstAvailable`` alternatives the largest counts: the limit must hold whichever
    the scheduler picks. Malformed parts count nothing here; the API server and the
    claim validation refuse them.
    """
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    requests = devices.get("requests") if isinstance(devices, Mapping) else None
    total = 0
    for request in requests if isinstance(requests, list) else ():
        if not isinstance(request, Mapping):
            continue
        subs = request.get("firstAvailable")
        options = [request.get("exactly"), *(subs if isinstance(subs, list) else ())]
        total += max((_request_devices(o, classes) for o in options), default=0)
    return total


def _request_devices(request: object, classes: frozenset[str]) -> int:
    if not isinstance(request, Mapping) or request.get("deviceClassName") not in classes:
        return 0
    if request.get("allocationMode", "ExactCount") == "All":
        return MAX_DEVICES_PER_CLAIM
    count = request.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int):
        return 1
    return max(count, 0)


@dataclass(frozen=True)
class TenantRules:
    """A tenant with its conversion policy, built once per tenant change."""

    tenant: Tenant
    policy: ConversionPolicy

    @property
    def label(self) -> str:
        return self.tenant.label

    def check_pod(
        self,
        conversion: Conversion,
        namespace: str,
        usage: QuotaUsage | None,
        referenced: Sequence[ReferencedClaim] = (),
    ) -> str | None:
        """The reason a pod breaks the tenant's rules, or None.

        `referenced` are the pod's other claims (hand-written or shared), which count
        towards ``maxDevicesPerPod`` with the converted ones.
        """
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
            mode = self.policy.sharing(claim.kind, claim.profile)
            if not spec.allows_sharing(mode):
                return (
                    f"{self.label}: sharing mode {mode} is not allowed; allowed modes: "
                    f"{_listing(spec.allowed_sharing)} ({where})"
                )
        total = pod_devices(conversion, referenced)
        limit = spec.max_devices_per_pod
        if limit is not None and total > limit:
            return (
                f"{self.label}: maxDevicesPerPod is {limit}, this pod asks for {total} "
                f"devices ({device_counts(conversion, referenced)})"
            )
        if usage is not None:
            asks: dict[str, int] = {}
            for claim in conversion.claims:
                asks[claim.device_class] = asks.get(claim.device_class, 0) + claim.devices
            for device_class, count in sorted(asks.items()):
                if why := _over_quota(usage, device_class, namespace, count):
                    return f"{self.label}: {why}"
        return None

    def stored_claim_over_quota(
        self, claim: StoredClaim, namespace: str, usage: QuotaUsage | None
    ) -> str | None:
        """Why a stored claim that is not allocated yet may not be handed to a new pod
        under the quota: a class it names has no quota here, or the namespace already
        uses more of it than its quota allows (claims stored before the quota or before
        it was lowered: the API server counts a claim only when it is created)."""
        if usage is None or claim.allocated:
            return None
        for device_class in sorted(claim_classes(claim.spec)):
            if why := _over_quota(usage, device_class, namespace, 0):
                return why
        return None


def _over_quota(usage: QuotaUsage, device_class: str, namespace: str, asks: int) -> str | None:
    """Why `asks` more devices of `device_class` (0: none, the namespace as it is) break
    the namespace's quota, or None."""
    hard = usage.hard.get(device_class)
    if hard is None:
        return None
    used = usage.used.get(device_class, 0)
    where = f"quota {device_class} in namespace {namespace}"
    if hard == 0:
        return (
            f"{where}: deviceQuota sets no limit for this class, so it may not be used "
            "here; the cluster admin adds it to the GpuTenant's deviceQuota"
        )
    if used + asks <= hard:
        return None
    if asks:
        return f"{where}: limit {hard}, used {used}, this pod asks for {asks}"
    return (
        f"{where}: limit {hard}, used {used}, over the limit already (claims stored before "
        f"the quota or before it was lowered); bring its claims of {device_class} within "
        "the quota"
    )


def pod_devices(conversion: Conversion, referenced: Sequence[ReferencedClaim]) -> int:
    """How many devices a pod will get: what the rules' view of its legacy resources
    asks for (`rules_view`) and its other claims. Both the pod's admission and a claim's
    (`Admission._users_over_limit`) count a pod with this, so ``maxDevicesPerPod``
    holds the same whichever is admitted last."""
    return sum(c.devices for c in conversion.claims) + sum(r.devices for r in referenced)


def device_counts(conversion: Conversion, referenced: Sequence[ReferencedClaim]) -> str:
    """What `pod_devices` counted, part by part, for a denial: each legacy resource by
    container (``nvidia.com/gpu in container cuda=1``), then each claim."""
    return "; ".join(
        [_where(c) for c in conversion.claims]
        + [f"claim {r.pod_claim_name} ({r.source}): {r.devices}" for r in referenced]
    )


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
