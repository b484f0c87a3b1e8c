"""The published devices against the resource.k8s.io/v1 rules: the one check of what
goes on the wire, run on the serializer's output, naming the device and the field."""

from __future__ import annotations

from typing import Any

import pytest
from gpudra.driver import publish
from gpudra.driver.devices import MigStrategy, discover
from gpudra.driver.nvml import load_nvml
from gpudra.driver.slices import (
    DeviceLimitError,
    PoolContent,
    PoolError,
    SliceLimits,
    plan_slices,
    validate_counter_set,
    validate_device,
)

LIMITS = SliceLimits()


def gpu(**changes: Any) -> dict[str, Any]:
    dev: dict[str, Any] = {
        "name": "gpu-0",
        "attributes": {
            "type": {"string": "gpu"},
            "driverVersion": {"version": "580.95.5"},
            "resource.kubernetes.io/numaNode": {"int": 0},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }
    dev.update(changes)
    return dev


def refusal(dev: dict[str, Any], limits: SliceLimits = LIMITS) -> DeviceLimitError:
    with pytest.raises(DeviceLimitError) as err:
        validate_device(dev, limits)
    return err.value


@pytest.mark.parametrize(
    ("profile", "strategy"),
    [
        ("h100-80gb-hbm3-x8", MigStrategy.STATIC),
        ("h100-80gb-hbm3-x8-mig", MigStrategy.DYNAMIC),
        ("a100-40gb-mig-mixed", MigStrategy.STATIC),
        ("a100-40gb-mig-mixed", MigStrategy.DYNAMIC),
    ],
)
def test_every_discovered_device_passes(profile: str, strategy: MigStrategy) -> None:
    content = publish.pool_content(discover(load_nvml(f"emulated:{profile}")), strategy)
    for limits in (SliceLimits.for_server(34), SliceLimits.for_server(36)):
        assert plan_slices(content, limits)


def test_device_name_must_be_a_dns_label() -> None:
    err = refusal(gpu(name="GPU_0"))
    assert (err.device, err.field) == ("GPU_0", "name")
    assert "must be a DNS label of at most 63" in str(err)
    assert refusal(gpu(name="g" * 64)).field == "name"
    validate_device(gpu(name="g" * 63), LIMITS)


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("copy-engines", "must be a C identifier"),
        ("x" * 33, "at most 32 characters"),
        ("Bad_Domain!/type", "has domain"),
        (f"{'d' * 64}/type", "at most 63 characters"),
    ],
)
def test_attribute_and_capacity_names_follow_the_api(key: str, why: str) -> None:
    err = refusal(gpu(attributes={key: {"int": 1}}))
    assert err.field == f"attribute {key}"
    assert why in str(err)
    err = refusal(gpu(capacity={key: {"value": "1"}}))
    assert err.field == f"capacity {key}"


def test_attribute_values() -> None:
    assert "exactly one of" in str(refusal(gpu(attributes={"a": {"int": 1, "bool": True}})))
    assert "exactly one of" in str(refusal(gpu(attributes={"a": {"float": 1.5}})))
    err = refusal(gpu(attributes={"driverVersion": {"version": "580.95.05"}}))
    assert "is not a semantic version" in str(err)
    err = refusal(gpu(attributes={"productName": {"string": "x" * 65}}))
    assert str(err).startswith("device gpu-0: attribute productName is 65 characters")
    validate_device(gpu(attributes={"productName": {"string": "x" * 64}}), LIMITS)


def test_attributes_and_capacities_share_one_limit() -> None:
    attrs = {f"a{i}": {"int": i} for i in range(31)}
    validate_device(gpu(attributes=attrs), LIMITS)  # 31 + memory
    attrs["a31"] = {"int": 31}
    assert refusal(gpu(attributes=attrs)).field == "attributes+capacity"


def test_counters_consumed_and_taints_within_the_server_limits() -> None:
    use = {"counterSet": "gpu-0-counter-set", "counters": {"memory-slice-0": {"value": "1"}}}
    assert refusal(gpu(consumesCounters=[use] * 3)).field == "consumesCounters"
    many = {f"c{i}": {"value": "1"} for i in range(33)}
    err = refusal(gpu(consumesCounters=[{"counterSet": "s", "counters": many}]))
    assert err.field == "consumesCounters s"
    bad = {"counterSet": "s", "counters": {"Memory": {"value": "1"}}}
    assert "must be a DNS label" in str(refusal(gpu(consumesCounters=[bad])))
    taint = {"key": "gpu.nvidia.com/xid", "effect": "NoSchedule"}
    validate_device(gpu(taints=[taint] * 16), SliceLimits.for_server(36))
    assert refusal(gpu(taints=[taint] * 5), SliceLimits.for_server(34)).field == "taints"


def test_informational_taints_stay_unpublished_where_the_server_has_no_effect_none() -> None:
    """1.34 refuses a whole slice for one taint of effect None; 1.35 and newer take it."""
    info = {"key": "gpu.nvidia.com/xid", "value": "13", "effect": "None"}
    critical = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
    content = PoolContent(
        devices=[gpu(taints=[info]), {**gpu(taints=[info, critical]), "name": "gpu-1"}]
    )
    (old,) = plan_slices(content, SliceLimits.for_server(34))
    assert [d.get("taints") for d in old["devices"]] == [None, [critical]]
    (new,) = plan_slices(content, SliceLimits.for_server(35))
    assert [d.get("taints") for d in new["devices"]] == [[info], [info, critical]]
    assert content.devices[0]["taints"] == [info]  # the agent's own view is untouched


def test_counter_sets() -> None:
    validate_counter_set({"name": "gpu-0-counter-set", "counters": {"a": {"value": "1"}}}, LIMITS)
    with pytest.raises(PoolError, match="counter set 'Set-0': name must be a DNS label"):
        validate_counter_set({"name": "Set-0", "counters": {}}, LIMITS)
    with pytest.raises(PoolError, match="counter 'copyEngines' must be a DNS label"):
        validate_counter_set({"name": "s", "counters": {"copyEngines": {"value": "1"}}}, LIMITS)
    many = {f"c{i}": {"value": "1"} for i in range(33)}
    with pytest.raises(PoolError, match="33 counters, over the limit of 32"):
        plan_slices(PoolContent(devices=[], counter_sets=[{"name": "s", "counters": many}]), LIMITS)
