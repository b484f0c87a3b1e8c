"""The ResourceClaim the scheduler will create for a pod's DRA extended resources.

With the ``DRAExtendedResource`` feature (beta and on by default from Kubernetes 1.36),
every DeviceClass can be asked for by name as an extended resource, whether or not it
sets ``extendedResourceName``: ``deviceclass.resource.kubernetes.io/<class>: 2`` in a
container's resources. The pod names no claim; the scheduler creates one for it while
scheduling (one request per container, owned by the pod, annotated
``resource.kubernetes.io/extended-resource-claim: "true"``) and the kubelet hands its
devices to the containers. The webhook would meet that claim only once it is created,
alone, so the pod's other devices would not count with it: `maxDevicesPerPod` would
hold per claim, not per pod.

So at the pod's admission the webhook builds that claim's spec here, as the scheduler
will (`kube-scheduler`'s ``createRequestsAndMappings``: a request per long-lived
container, sidecars included; an init container reuses the devices of the long-lived
containers after it and asks only for the rest, and of those the largest is the one
request), and judges it as it judges any claim, counting its devices with the pod's
others. When the scheduler then creates it, the claim is counted with the pod that
owns it (`fills_extended_resources`). Only the implicit names of the driver's classes
are built here: a class's own ``extendedResourceName`` (``nvidia.com/gpu``) is counted
by the rules' view of the pod already (`tenant_rules.rules_view`).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

from gpudra.api.quantity import QuantityError, parse_quantity
from gpudra.webhook.owners import controller_of

__all__ = [
    "DEVICE_CLASS_PREFIX",
    "EXTENDED_RESOURCE_CLAIM_ANNOTATION",
    "ExtendedClaim",
    "extended_resource_claim",
    "fills_extended_resources",
]

DEVICE_CLASS_PREFIX: Final = "deviceclass.resource.kubernetes.io/"
"""The implicit extended resource name of every DeviceClass: this prefix, then its name."""
EXTENDED_RESOURCE_CLAIM_ANNOTATION: Final = "resource.kubernetes.io/extended-resource-claim"
"""Set to "true" by the scheduler on the claim it creates for a pod's extended resources."""
_MAX_INT64: Final = 2**63 - 1


@dataclass(frozen=True)
class ExtendedClaim:
    """The spec of the claim the scheduler will create, and what in the pod asks for it."""

    spec: dict[str, Any]
    asked: str
    """For messages: each request, the resource and the container behind it."""


def extended_resource_claim(
    pod: Mapping[str, Any], classes: Collection[str]
) -> ExtendedClaim | None:
    """The claim the scheduler will create for `pod`'s implicit extended resources of
    `classes`, or None when the pod asks for none."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return None
    init = _items(spec.get("initContainers"))
    containers = [*init, *_items(spec.get("containers"))]
    n_init = len(init)
    asked = [_requests(c) for c in containers]
    # Sidecars (init containers that keep running) hold their devices as regular ones do.
    lives = [i >= n_init or c.get("restartPolicy") == "Always" for i, c in enumerate(containers)]
    names = sorted({n for a in asked for n in a} & {DEVICE_CLASS_PREFIX + c for c in classes})
    requests: list[tuple[dict[str, Any], str]] = []
    for name in names:
        device_class = name.removeprefix(DEVICE_CLASS_PREFIX)
        counts = [a.get(name, 0) for a in asked]
        long_lived = [count if lives[i] else 0 for i, count in enumerate(counts)]
        # What the long-lived containers from each one on hold (one pass: a review may
        # carry thousands of containers, and a quadratic walk would hold the loop).
        held_after = list(itertools.accumulate(reversed(long_lived)))[::-1]
        short_lived: list[tuple[int, int]] = []  # (count, container index)
        for index, count in enumerate(counts):
            if lives[index] or not count:
                continue
            # What the long-lived containers from it on hold is reused first.
            if held_after[index] < count:
                short_lived.append((count - held_after[index], index))
        chosen = [(i, n) for i, n in enumerate(long_lived) if n]
        if short_lived:
            count, index = max(short_lived, key=lambda s: s[0])
            chosen.append((index, count))
        for index, count in chosen:
            request = _request(index, asked[index], name, device_class, count)
            container = containers[index].get("name")
            requests.append(
                (request, f'{request["name"]} ({name}={count}, container "{container}")')
            )
    if not requests:
        return None
    requests.sort(key=lambda r: str(r[0]["name"]))
    spec = {"devices": {"requests": [r for r, _ in requests]}}
    return ExtendedClaim(spec, "; ".join(d for _, d in requests))


def fills_extended_resources(claim: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether `claim` is the one the scheduler created for `pod`'s extended resources:
    annotated as such and controlled by the pod, by its name and UID."""
    metadata = claim.get("metadata")
    metadata = metadata if isinstance(metadata, Mapping) else {}
    annotations = metadata.get("annotations")
    if not isinstance(annotations, Mapping):
        return False
    if annotations.get(EXTENDED_RESOURCE_CLAIM_ANNOTATION) != "true":
        return False
    pod_meta = pod.get("metadata")
    pod_meta = pod_meta if isinstance(pod_meta, Mapping) else {}
    uid, name = pod_meta.get("uid"), pod_meta.get("name")
    owner = controller_of(claim)
    return (
        uid is not None
        and owner is not None
        and owner.get("kind") == "Pod"
        and owner.get("uid") == uid
        and owner.get("name") == name
    )


def _items(value: object) -> list[Mapping[str, Any]]:
    return [c for c in value if isinstance(c, Mapping)] if isinstance(value, list) else []


def _requests(container: Mapping[str, Any]) -> dict[str, int]:
    """A container's whole-number resource requests; a limit stands for a missing request,
    as the API server's defaults make it. Other values ask for nothing (the scheduler
    skips what is not a whole int64; the API server refuses it for extended resources)."""
    resources = container.get("resources")
    resources = resources if isinstance(resources, Mapping) else {}
    merged: dict[str, object] = {}
    for section in ("limits", "requests"):
        values = resources.get(section)
        if isinstance(values, Mapping):
            merged.update({str(k): v for k, v in values.items()})
    return {name: _whole(value) for name, value in merged.items()}


def _whole(value: object) -> int:
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return value if 0 <= value <= _MAX_INT64 else 0
    if not isinstance(value, str):
        return 0
    try:
        amount = parse_quantity(value.strip()).amount
    except QuantityError:
        return 0
    return int(amount) if amount.denominator == 1 and amount <= _MAX_INT64 else 0


def _request(
    index: int, asked: Mapping[str, int], name: str, device_class: str, count: int
) -> dict[str, Any]:
    """One request, named as the scheduler names it: the container's index among init
    and regular containers, and the resource's among its sorted request names."""
    position = sorted(asked).index(name)
    return {
        "name": f"container-{index}-request-{position}",
        "exactly": {
            "deviceClassName": device_class,
            "allocationMode": "ExactCount",
            "count": count,
        },
    }
