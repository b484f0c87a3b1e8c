"""The claims the kubelet names, and the checked claims the device layer prepares.

The kubelet sends only a claim's namespace, name and UID (`ClaimRef`). The plugin
reads the ResourceClaim and checks it here (`checked_claim`): that it is the claim
the kubelet means (same UID), that it is allocated, which of its results are this
driver's in this node's pool, and that the opaque configs addressed to this driver
are valid. The device layer receives the resulting `Claim` and never sees the API
object, as the upstream kubeletplugin library hands drivers claims it already read.

Plain types and pure functions, shared by the protocol and device layers, so the
order (namespace, uid, name) and the wording of a claim's errors cannot differ
between them. The API read itself is in `gpudra.driver.claimreader`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from gpudra.api.config import BoundConfig, ConfigError, bound_configs
from gpudra.api.names import POD_CLAIM_NAME_ANNOTATION, is_dns_label, is_dns_subdomain
from gpudra.api.quantity import QuantityError, parse_quantity
from gpudra.api.sharing import SHARES_CAPACITY, driver_capacities
from gpudra.driver.cdi import CdiError, validate_claim_uid

__all__ = [
    "ALLOCATION_CONFIG_PATH",
    "AllocatedDevice",
    "Claim",
    "ClaimError",
    "ClaimRef",
    "check_ref",
    "checked_claim",
    "config_error",
    "reserved_pods",
]

ALLOCATION_CONFIG_PATH: Final = "status.allocation.devices.config"
_RESULTS_PATH: Final = "status.allocation.devices.results"
_MIB: Final = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it: its owner must fetch and check it."""

    namespace: str
    uid: str
    name: str

    def describe(self) -> str:
        """How every message about the claim starts."""
        return f"ResourceClaim {self.namespace}/{self.name} ({self.uid})"


class ClaimError(Exception):
    """A per-claim failure; the message goes to the kubelet (and the pod's events)."""


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One allocation result of this driver in this node's pool.

    `index` is the result's position in `status.allocation.devices.results`, so an
    error can name the field; `consumed_memory` is the memory the scheduler took
    from a shared device, in bytes; `consumed_shares` the integer shares it took from
    a GPU published with shares (then memory is not a slice: it is not enforced).
    """

    index: int
    request: str
    device: str
    share_id: str | None = None
    admin_access: bool = False
    consumed_memory: int | None = None
    consumed_shares: int | None = None

    @property
    def path(self) -> str:
        return f"{_RESULTS_PATH}[{self.index}]"


@dataclass(frozen=True, slots=True)
class Claim:
    """An allocated ResourceClaim, read and checked for this driver on this node.

    `devices` is never empty; the configs are the allocation's opaque configs for
    this driver, parsed, class configs first as they take precedence last. `pod`
    is the first pod the claim is reserved for (the kubelet does not tell us).
    """

    ref: ClaimRef
    devices: tuple[AllocatedDevice, ...]
    class_configs: tuple[BoundConfig, ...] = ()
    claim_configs: tuple[BoundConfig, ...] = ()
    pod: str = ""
    pod_uid: str = ""
    pod_claim_name: str | None = None
    """The claim's `resource.kubernetes.io/pod-claim-name` annotation, unchecked: the
    pod's name for a claim made from its template (`gpudra.driver.devicemetadata`)."""

    @property
    def uid(self) -> str:
        return self.ref.uid

    @property
    def namespace(self) -> str:
        return self.ref.namespace

    @property
    def name(self) -> str:
        return self.ref.name


def config_error(ref: ClaimRef, err: ConfigError) -> ClaimError:
    """The claim's error for invalid opaque configs, with where to fix them."""
    issues = "; ".join(str(issue) for issue in err.issues)
    return ClaimError(
        f"{ref.describe()}: invalid opaque config: {issues}; fix the parameters in the "
        "claim's spec.devices.config or in the DeviceClass's spec.config (the allocation "
        "copies them)"
    )


def check_ref(ref: ClaimRef) -> None:
    """Refuse a reference that cannot name a claim, before it goes into a URL or a file name."""
    try:
        validate_claim_uid(ref.uid)
    except CdiError as exc:
        raise ClaimError(f"claim {ref.namespace}/{ref.name}: {exc}") from None
    if not is_dns_label(ref.namespace) or not is_dns_subdomain(ref.name):
        raise ClaimError(
            f"claim {ref.namespace!r}/{ref.name!r} ({ref.uid}): namespace must be a DNS "
            "label and name a DNS subdomain"
        )


def checked_claim(ref: ClaimRef, obj: object, *, driver: str, pool: str) -> Claim:
    """The claim `ref` names, from the ResourceClaim `obj` the API server returned.

    Raises ClaimError when it is another claim (deleted and re-created), not
    allocated, allocated nothing of `driver` in `pool`, or carries invalid configs.
    """
    if not isinstance(obj, Mapping):
        raise ClaimError(f"{ref.describe()}: the API server returned no object")
    uid = (obj.get("metadata") or {}).get("uid")
    if uid != ref.uid:
        raise ClaimError(
            f"ResourceClaim {ref.namespace}/{ref.name} has metadata.uid {uid}, but the "
            f"kubelet asked for UID {ref.uid}: the claim was deleted and re-created; the "
            "pod of the old claim must go before the new one can be prepared"
        )
    allocation = (obj.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(
            f"{ref.describe()} has no status.allocation: it is not allocated (the "
            "scheduler allocates it when it schedules a pod that uses it)"
        )
    section = allocation.get("devices") or {}
    ours = [
        (i, r)
        for i, r in enumerate(section.get("results") or [])
        if isinstance(r, Mapping) and r.get("driver") == driver and r.get("pool") == pool
    ]
    if not ours:
        raise ClaimError(
            f"{ref.describe()}: {_RESULTS_PATH} has no device of driver {driver} in pool "
            f"{pool}; the claim was allocated for another node or driver"
        )
    entries = section.get("config") or []
    try:
        class_configs = bound_configs(
            entries, driver=driver, prefix=ALLOCATION_CONFIG_PATH, source="FromClass"
        )
        claim_configs = bound_configs(
            entries, driver=driver, prefix=ALLOCATION_CONFIG_PATH, source="FromClaim"
        )
    except ConfigError as exc:
        raise config_error(ref, exc) from None
    return Claim(
        ref=ref,
        devices=tuple(_allocated(ref, i, r, driver) for i, r in ours),
        class_configs=tuple(class_configs),
        claim_configs=tuple(claim_configs),
        pod=_pod_name(obj),
        pod_uid=reserved_pods(obj).get(_pod_name(obj), ""),
        pod_claim_name=_pod_claim_name(obj),
    )


def _allocated(
    ref: ClaimRef, index: int, result: Mapping[str, Any], driver: str
) -> AllocatedDevice:
    share_id = result.get("shareID")
    consumed = driver_capacities(result.get("consumedCapacity") or {}, driver)
    shares = _shares(ref, index, consumed.get(SHARES_CAPACITY))
    raw = consumed.get("memory")
    memory: int | None = None
    if raw is not None and shares is None:
        try:
            memory = parse_quantity(str(raw).strip()).value()
        except QuantityError as exc:
            raise ClaimError(
                f"{ref.describe()}: {_RESULTS_PATH}[{index}].consumedCapacity.memory: {exc}"
            ) from None
        if memory < _MIB:
            # MPS takes whole MiB, and a limit of 0 would mean no limit at all.
            raise ClaimError(
                f"{ref.describe()}: {_RESULTS_PATH}[{index}].consumedCapacity.memory is "
                f"{raw}; a memory slice must be at least 1Mi: raise the claim's capacity "
                "request"
            )
    return AllocatedDevice(
        index=index,
        request=str(result.get("request") or ""),
        device=str(result.get("device") or ""),
        share_id=str(share_id) if share_id else None,
        admin_access=result.get("adminAccess") is True,
        consumed_memory=memory,
        consumed_shares=shares,
    )


def _shares(ref: ClaimRef, index: int, raw: object) -> int | None:
    """Integer shares consumed from a GPU published with shares (`publish.shares_capacity`)."""
    if raw is None:
        return None
    try:
        amount = parse_quantity(str(raw).strip()).amount
    except QuantityError as exc:
        raise ClaimError(
            f"{ref.describe()}: {_RESULTS_PATH}[{index}].consumedCapacity.shares: {exc}"
        ) from None
    if amount.denominator != 1 or amount < 1:
        raise ClaimError(
            f"{ref.describe()}: {_RESULTS_PATH}[{index}].consumedCapacity.shares is {raw}; "
            "a GPU's shares are whole numbers from 1: ask for capacity shares of at least 1"
        )
    return int(amount)


def reserved_pods(claim: Mapping[str, Any]) -> dict[str, str]:
    """The Pods a claim object is reserved for, name -> UID, in `reservedFor`'s order.

    The UID tells a pod from one re-created under the same name while the claim is held.
    """
    return {
        str(consumer.get("name") or ""): str(consumer.get("uid") or "")
        for consumer in (claim.get("status") or {}).get("reservedFor") or ()
        if isinstance(consumer, Mapping)
        and consumer.get("resource") == "pods"
        and not consumer.get("apiGroup")
    }


def _pod_claim_name(claim: Mapping[str, Any]) -> str | None:
    annotations = (claim.get("metadata") or {}).get("annotations")
    value = annotations.get(POD_CLAIM_NAME_ANNOTATION) if isinstance(annotations, Mapping) else None
    return value if isinstance(value, str) else None


def _pod_name(claim: Mapping[str, Any]) -> str:
    """The first Pod the claim is reserved for."""
    return next(iter(reserved_pods(claim)), "")
