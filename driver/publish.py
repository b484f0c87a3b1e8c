"""What one node publishes: the inventory and its health, as ResourceSlice JSON.

Attribute keys stay unqualified (they mean the driver's own domain, as in the
upstream driver), so `device.attributes["gpu.nvidia.com"].productName` selects the
same devices here; the `resource.kubernetes.io/...` keys are already qualified.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpudra.driver.devices import AttributeValue, Device, Inventory, MigStrategy, Version
from gpudra.driver.health import HealthReport, Taint
from gpudra.driver.slices import PoolContent


def attribute(value: AttributeValue) -> dict[str, Any]:
    if isinstance(value, Version):
        return {"version": value.value}
    if isinstance(value, bool):  # before int: bool is an int subclass
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value}


def taint(t: Taint) -> dict[str, Any]:
    out: dict[str, Any] = {
        "key": t.key,
        "effect": t.effect.value,
        "timeAdded": t.time_added.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if t.value is not None:
        out["value"] = t.value
    return out


def _counters(values: Mapping[str, int]) -> dict[str, dict[str, str]]:
    return {k: {"value": str(v)} for k, v in values.items()}


def device(dev: Device, taints: tuple[Taint, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": dev.name,
        "attributes": {k: attribute(v) for k, v in dev.attributes.items()},
        "capacity": {k: {"value": str(v)} for k, v in dev.capacity.items()},
    }
    if dev.consumes_counters:
        out["consumesCounters"] = [
            {"counterSet": c.counter_set, "counters": _counters(c.counters)}
            for c in dev.consumes_counters
        ]
    if taints:
        out["taints"] = [taint(t) for t in taints]
    return out


def pool_content(
    inventory: Inventory, strategy: MigStrategy, health: HealthReport | None = None
) -> PoolContent:
    devices = [
        device(d, health.taints(d.name) if health else ()) for d in inventory.devices(strategy)
    ]
    sets = [
        {"name": cs.name, "counters": _counters(cs.counters)}
        for cs in inventory.counter_sets(strategy)
    ]
    return PoolContent(devices=devices, counter_sets=sets)
