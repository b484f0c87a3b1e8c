"""What the API server under test offers, asked of the server itself at run time.

Why at run time: gpudra supports Kubernetes 1.34 to 1.37 and each release serves a
different set of DRA features (an API version, a field behind a gate that is off or
unknown). A test of such a feature skips with the reason this module finds, so
`make test-versions` shows per version what works, and a server where a gate is off
(a managed cluster, kind) reads the same. Nothing here knows version numbers: a field
the server drops, or a value it refuses, on a dry-run create is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from e2e.cluster.kube import ApiError, Kube

GROUP = "resource.k8s.io"
PROBE_DRIVER = "probe.gpudra.dev"
PROBE_NODE = "probe-node"


def served_versions(kube: Kube, resource: str) -> list[str]:
    """The `resource.k8s.io` versions whose discovery lists `resource` (a plural), in the
    server's order (preferred first)."""
    group = kube.request("GET", f"/apis/{GROUP}")
    found = []
    for entry in group.get("versions", []):
        listed = kube.request("GET", f"/apis/{GROUP}/{entry['version']}")
        if any(r.get("name") == resource for r in listed.get("resources", [])):
            found.append(entry["version"])
    return found


def device_taint_rules(kube: Kube) -> tuple[str, str | None]:
    """The version DeviceTaintRules are served at (the one it moves to between releases:
    v1alpha3 in 1.34, later beta), or "" with why none is."""
    versions = served_versions(kube, "devicetaintrules")
    if versions:
        return versions[0], None
    return "", "the API server serves no DeviceTaintRule: DRADeviceTaints(Rules) is off"


@contextmanager
def device_taint_rule(
    kube: Kube, driver: str, pool: str, device: str, effect: str
) -> Iterator[None]:
    """A maintenance DeviceTaintRule on one device, at whatever version this server serves
    it, deleted on the way out; skips the test where the server serves none."""
    version, reason = device_taint_rules(kube)
    if reason:
        pytest.skip(reason)
    name = f"maintenance-{pool}-{device}"
    rules = f"/apis/{GROUP}/{version}/devicetaintrules"
    rule = {
        "apiVersion": f"{GROUP}/{version}",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name},
        "spec": {
            "deviceSelector": {"driver": driver, "pool": pool, "device": device},
            "taint": {"key": "example.com/maintenance", "effect": effect},
        },
    }
    kube.request("POST", rules, rule)
    try:
        yield
    finally:
        kube.request("DELETE", f"{rules}/{name}")


def _dry_run(kube: Kube, obj: dict[str, Any]) -> Any:
    return kube.create(obj, dryRun="All")


def _probe_slice(device: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{PROBE_DRIVER}-probe"},
        "spec": {
            "driver": PROBE_DRIVER,
            "nodeName": PROBE_NODE,
            "pool": {"name": "probe", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "probe", **device}],
        },
    }


def consumable_capacity(kube: Kube) -> str | None:
    """None when a device may be allocated to several claims (DRAConsumableCapacity)."""
    stored = _dry_run(
        kube, _probe_slice({"allowMultipleAllocations": True, "capacity": {"m": {"value": "1"}}})
    )
    if stored["spec"]["devices"][0].get("allowMultipleAllocations"):
        return None
    return "the API server drops allowMultipleAllocations: DRAConsumableCapacity is off"


def device_taints(kube: Kube) -> str | None:
    """None when a ResourceSlice keeps device taints (DRADeviceTaints)."""
    taint = {"key": "example.com/probe", "effect": "NoSchedule"}
    stored = _dry_run(kube, _probe_slice({"taints": [taint]}))
    if stored["spec"]["devices"][0].get("taints"):
        return None
    return "the API server drops ResourceSlice device taints: DRADeviceTaints is off"


def informational_taints(kube: Kube) -> str | None:
    """None when a device taint may have effect None (1.35 and newer)."""
    taint = {"key": "example.com/probe", "effect": "None"}
    try:
        _dry_run(kube, _probe_slice({"taints": [taint]}))
    except ApiError as e:
        if e.status == 422:
            return "the API server knows no device taint effect None (Kubernetes 1.35 added it)"
        raise
    return None


def prioritized_list(kube: Kube) -> str | None:
    """None when a claim's request may list alternatives (`firstAvailable`,
    DRAPrioritizedList)."""
    claim = {
        "apiVersion": f"{GROUP}/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "probe-first-available", "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "r", "firstAvailable": [{"name": "s", "deviceClassName": "probe"}]}
                ]
            }
        },
    }
    try:
        stored = _dry_run(kube, claim)
    except ApiError as e:
        if e.status == 422:
            return "the API server refuses firstAvailable: DRAPrioritizedList is off"
        raise
    if stored["spec"]["devices"]["requests"][0].get("firstAvailable"):
        return None
    return "the API server drops firstAvailable: DRAPrioritizedList is off"
