"""ResourceClaim fixtures shared by tests and benchmarks: a pod that holds a claim on
one node (the real scheduler allocates the claim when it schedules the pod)."""

from __future__ import annotations

import functools
from typing import Any

from e2e.cluster.kube import Kube, wait_for


def pod_with_claim(
    name: str, namespace: str, node: str | None, *, claim: str = "", template: str = ""
) -> dict[str, Any]:
    """A pause pod using ResourceClaim `claim` or one from `template`, pinned to `node`
    unless it is None."""
    if bool(claim) == bool(template):
        raise ValueError("give exactly one of claim or template")
    source = {"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": template}
    pinned = {"nodeSelector": {"kubernetes.io/hostname": node}} if node is not None else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            **pinned,
            "resourceClaims": [{"name": "gpu", **source}],
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def claim_template(
    name: str, namespace: str, cel: str, *, count: int = 1, device_class: str = "gpu.nvidia.com"
) -> dict[str, Any]:
    """A ResourceClaimTemplate for `count` devices of `device_class` that match `cel`."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": device_class,
                                "count": count,
                                "allocationMode": "ExactCount",
                                "selectors": [{"cel": {"expression": cel}}],
                            },
                        }
                    ]
                }
            }
        },
    }


def wait_allocated(kube: Kube, name: str, namespace: str, timeout: float = 60) -> dict[str, Any]:
    """The claim, once the scheduler has written its allocation."""

    def allocated() -> dict[str, Any] | None:
        claim: dict[str, Any] = kube.get("ResourceClaim", name, namespace)
        return claim if (claim.get("status") or {}).get("allocation") else None

    result: dict[str, Any] = wait_for(f"claim {name} allocated", allocated, timeout=timeout)
    return result


def claim_name(pod: dict[str, Any], ref: str) -> str:
    """The ResourceClaim behind the pod's claim entry `ref`: named in the spec, or made
    from its template (then in the pod's status, once the controller made it)."""
    for entry in pod["spec"].get("resourceClaims") or ():
        if entry["name"] == ref and entry.get("resourceClaimName"):
            return str(entry["resourceClaimName"])
    for status in (pod.get("status") or {}).get("resourceClaimStatuses") or ():
        if status["name"] == ref:
            return str(status["resourceClaimName"])
    return ""


def attr(device: dict[str, Any], name: str) -> Any:
    """A published device's attribute `name`, whatever its type (string, int, ...)."""
    value = device["attributes"][name]
    return next(iter(value.values()))


def node_devices(kube: Kube, node: str) -> dict[str, dict[str, Any]]:
    """Device name -> device, over every ResourceSlice of `node`."""
    return {
        device["name"]: device
        for s in kube.list("ResourceSlice", fieldSelector=f"spec.nodeName={node}")
        for device in s["spec"].get("devices") or ()
    }


def shared_devices(kube: Kube, node: str, least: int = 1) -> dict[str, dict[str, Any]]:
    """`node_devices` once at least `least` of them offer `shares`. An agent restarted
    with `--gpu-shares` connects to the kubelet before, or while, it republishes its
    slices: until then the API holds the devices it published without shares."""

    def with_shares() -> dict[str, dict[str, Any]] | None:
        devices = node_devices(kube, node)
        shared = {n: d for n, d in devices.items() if "shares" in d.get("capacity", {})}
        return shared if len(shared) >= least else None

    found: dict[str, dict[str, Any]] = wait_for(
        f"{least} device(s) of {node} with shares", with_shares, timeout=60
    )
    return found


def running(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    pod: dict[str, Any] | None = kube.get_or_none("Pod", name, namespace)
    return pod if pod and (pod.get("status") or {}).get("phase") == "Running" else None


def wait_running(kube: Kube, namespace: str, *names: str, timeout: float = 120) -> None:
    for name in names:
        wait_for(f"pod {name} Running", functools.partial(running, kube, namespace, name), timeout)
