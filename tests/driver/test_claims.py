"""Checking a ResourceClaim the kubelet names before the device layer gets it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from gpudra.driver.claims import (
    AllocatedDevice,
    ClaimError,
    ClaimRef,
    check_ref,
    checked_claim,
)

DRIVER = "gpu.nvidia.com"
POOL = "worker-1"
REF = ClaimRef("team-a", "5b0e3c1a-9d2f-4e7b-8a6c-1f2e3d4c5b6a", "train")
GPU_CONFIG = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}


def _claim(**status: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"namespace": REF.namespace, "name": REF.name, "uid": REF.uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "driver": "other.example.com",
                            "pool": POOL,
                            "device": "x",
                            "request": "a",
                        },
                        {"driver": DRIVER, "pool": "worker-2", "device": "gpu-0", "request": "a"},
                        {
                            "driver": DRIVER,
                            "pool": POOL,
                            "device": "gpu-5",
                            "request": "mem/small",
                            "shareID": "8b3f6a52-1c55-4c0e-b0c7-1f0ad1a2b3c4",
                            "consumedCapacity": {f"{DRIVER}/memory": "10Gi"},
                        },
                        {
                            "driver": DRIVER,
                            "pool": POOL,
                            "device": "gpu-1",
                            "request": "watch",
                            "adminAccess": True,
                        },
                    ],
                    "config": [
                        {
                            "source": "FromClaim",
                            "opaque": {"driver": DRIVER, "parameters": {**GPU_CONFIG}},
                        },
                        {
                            "source": "FromClass",
                            "opaque": {"driver": DRIVER, "parameters": {**GPU_CONFIG}},
                        },
                        {"source": "FromClaim", "opaque": {"driver": "other", "parameters": {}}},
                    ],
                }
            },
            "reservedFor": [
                {"resource": "jobs", "apiGroup": "batch", "name": "job"},
                {"resource": "pods", "name": "trainer-0"},
            ],
        },
    }
    obj["status"].update(status)
    return obj


def test_claim_keeps_this_drivers_results_in_this_pool_and_its_configs() -> None:
    claim = checked_claim(REF, _claim(), driver=DRIVER, pool=POOL)

    assert claim.ref == REF
    assert claim.devices == (
        AllocatedDevice(
            index=2,
            request="mem/small",
            device="gpu-5",
            share_id="8b3f6a52-1c55-4c0e-b0c7-1f0ad1a2b3c4",
            consumed_memory=10 * 1024**3,
        ),
        AllocatedDevice(index=3, request="watch", device="gpu-1", admin_access=True),
    )
    assert claim.devices[1].path == "status.allocation.devices.results[3]"
    assert [c.path for c in claim.class_configs] == [
        "status.allocation.devices.config[1].opaque.parameters"
    ]
    assert [c.path for c in claim.claim_configs] == [
        "status.allocation.devices.config[0].opaque.parameters"
    ]
    assert claim.pod == "trainer-0"


def _error(obj: object, ref: ClaimRef = REF) -> str:
    with pytest.raises(ClaimError) as caught:
        checked_claim(ref, obj, driver=DRIVER, pool=POOL)
    return str(caught.value)


def test_another_claim_of_the_same_name_names_both_uids() -> None:
    other = ClaimRef(REF.namespace, "00000000-0000-4000-8000-000000000001", REF.name)
    error = _error(_claim(), other)
    assert f"has metadata.uid {REF.uid}, but the kubelet asked for UID {other.uid}" in error


def test_claim_without_allocation_or_without_our_devices_is_refused() -> None:
    assert "has no status.allocation" in _error(_claim(allocation=None))
    elsewhere = _claim()
    for result in elsewhere["status"]["allocation"]["devices"]["results"]:
        result["pool"] = "worker-2"
    error = _error(elsewhere)
    assert f"no device of driver {DRIVER} in pool {POOL}" in error
    assert "the API server returned no object" in _error(None)


def test_invalid_config_and_capacity_name_the_field() -> None:
    bad = _claim()
    bad["status"]["allocation"]["devices"]["config"][1]["opaque"]["parameters"]["sharing"] = {
        "strategy": "Sometimes"
    }
    error = _error(bad)
    assert "status.allocation.devices.config[1].opaque.parameters.sharing.strategy" in error
    assert "fix the parameters in the claim's spec.devices.config" in error

    for memory, expected in (("lots", "consumedCapacity.memory: "), ("512Ki", "at least 1Mi")):
        small = copy.deepcopy(_claim())
        small["status"]["allocation"]["devices"]["results"][2]["consumedCapacity"] = {
            "memory": memory
        }
        error = _error(small)
        assert "status.allocation.devices.results[2].consumedCapacity.memory" in error
        assert expected in error


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        (ClaimRef("team-a", "not-a-uid", "train"), "is not a Kubernetes UID"),
        (ClaimRef("Team_A", REF.uid, "train"), "namespace must be a DNS label"),
        (ClaimRef("team-a", REF.uid, "../train"), "name a DNS subdomain"),
    ],
)
def test_references_that_name_no_claim_are_refused(ref: ClaimRef, expected: str) -> None:
    with pytest.raises(ClaimError, match=expected):
        check_ref(ref)
