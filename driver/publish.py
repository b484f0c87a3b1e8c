"""What one node publishes: the inventory and its health, as ResourceSlice JSON.

The one serializer of devices: the agent publishes through it, and `slices.plan_slices`
checks its output against the API's limits before anything is written.

Attribute keys stay unqualified (they mean the driver's own domain, as in the
upstream driver), so `device.attributes["gpu.nvidia.com"].productName` selects the
same devices here; the `resource.kubernetes.io/...` keys are already qualified.

A GPU chosen for memory slices (`gpudra node --shared-gpus`) is the same device with
`allowMultipleAllocations: true` and a request policy on its memory capacity (see
`memory_request_policy`); the scheduler then hands it to several claims, each with a
`shareID` and the memory it consumes, and the kubelet plugin enforces that amount with
the MPS pinned-memory limit. That capacity alone is published qualified, as
`<driver>/memory`: up to Kubernetes 1.37 the scheduler matches `capacity.requests`
names literally (a request for `gpu.nvidia.com/memory` never matches a capacity named
`memory`, nor the reverse), so claims ask for `<driver>/memory`, and such a request fits
no exclusive GPU, whose capacity stays `memory` as upstream publishes it. From 1.38 it
reads a name without a domain as the driver's (kubernetes#142202), so either spelling
fits either GPU; a claim keeps to shared GPUs with the selector
`device.allowMultipleAllocations`, and admission reads both spellings
(`api.sharing.driver_capacities`).

A GPU published with integer shares (`gpudra node --gpu-shares N`, the device
plugin's time-slicing `replicas`) is the same device with `allowMultipleAllocations`
and the upstream driver's `--consumable-shares=N` capacities: `shares` (value N,
requested in whole shares) and `memory` with a zero default, so a request for
`shares: 1` takes one of N places and no memory. Unlike upstream, a request that names no
shares takes all N (the `shares` default): a whole-GPU claim gets the GPU only while
no share is taken, and keeps every share off it. Claims written for upstream's
integer shares ask `capacity.requests: {shares: 1}` and behave the same here.

`legacy` (`gpudra node --legacy-attributes`) adds the attributes upstream removed
(`devices.LEGACY_ATTRIBUTES`: `index`, `minor`, `parentIndex` in v25.8.0, `pcieBusID`
in v25.12.0), so a selector written for older releases, such as upstream's quickstart
`device.attributes['gpu.nvidia.com'].index == 0`, still matches. Off by default: those
numbers are not stable across reboots and driver reloads, and `pcieBusID` only repeats
`resource.kubernetes.io/pciBusID` (docs/gpus.md).

`lists` (`gpudra node --numa-node-list`) publishes `resource.kubernetes.io/numaNode` in
KEP-6072's list form, the GPU's node followed by the nearest nodes of its socket, for
clusters with the DRAListTypeAttributes feature gate, where `matchAttribute` matches
lists that share a node (from Kubernetes 1.37). Off by default: without the gate the API
server refuses the list (docs/gpus.md).
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

from gpudra.api.sharing import SHARES_CAPACITY
from gpudra.driver.devices import (
    MEMORY_SLICE_MIN,
    AttributeValue,
    CounterSet,
    Device,
    Inventory,
    MigKey,
    MigStrategy,
    Version,
)
from gpudra.driver.health import HealthReport, Taint
from gpudra.driver.slices import PoolContent


def attribute(value: AttributeValue) -> dict[str, Any]:
    if type(value) is str:  # most attributes; a MIG node publishes thousands
        return {"string": value}
    if isinstance(value, Version):
        return {"version": value.value}
    if isinstance(value, bool):  # before int: bool is an int subclass
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, tuple):
        return {"ints": list(value)}
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


def counter_set(cs: CounterSet) -> dict[str, Any]:
    """A `sharedCounters` entry: what one physical GPU can hand out."""
    return {"name": cs.name, "counters": _counters(cs.counters)}


def memory_request_policy(memory: int) -> dict[str, Any]:
    """How claims consume a shared GPU's memory (bytes in, `requestPolicy` JSON out).

    - min 1Gi: smaller slices are not worth an MPS daemon each;
    - no step: the API wants `max` on the step grid, and GPU memory is rarely whole
      GiB (an H100 80GB reports 79.65 GiB), so a 1Gi step would put the last partial
      GiB out of reach; requests are consumed exactly (MPS takes whole MiB);
    - default = all of it: the scheduler gives a request that names no memory amount
      (an ordinary whole-GPU claim) a share with the default, so the default is the
      whole GPU: such a claim gets the GPU only while no slice is on it, and no slice
      fits beside it. A 1Gi default would turn "a GPU" into a 1Gi slice silently.
    """
    return {
        "default": str(memory),
        "validRange": {"min": _quantity(MEMORY_SLICE_MIN), "max": str(memory)},
    }


def _quantity(amount: int) -> str:
    """Whole GiB as `NGi` (how people read and write them), anything else in bytes."""
    gib = 1024**3
    return f"{amount // gib}Gi" if amount and amount % gib == 0 else str(amount)


_MIB = 1024**2


def shares_capacity(memory: int, shares: int) -> dict[str, Any]:
    """The capacities of a GPU published with `shares` integer shares (upstream's names).

    `memory` keeps the upstream policy for integer shares (default 0, 1Mi steps, the
    maximum rounded down to the step grid, as the API wants), so a share consumes no
    memory unless it asks; `shares` defaults to all of them, so a claim that asks for
    no shares is a whole GPU (see the module docstring).
    """
    if shares < 1:
        raise ValueError(f"shares must be at least 1, not {shares}")
    top = memory // _MIB * _MIB
    return {
        "memory": {
            "value": str(top),
            "requestPolicy": {
                "default": "0",
                "validRange": {"min": "0", "max": str(top), "step": "1Mi"},
            },
        },
        SHARES_CAPACITY: {"value": str(shares), "requestPolicy": _shares_policy(shares)},
    }


def _shares_policy(shares: int) -> dict[str, Any]:
    """Whole shares from 1 to all of them, all by default.

    One share has no step: the API wants `min + step` within the capacity
    (validation.go, validateRequestPolicyRange), and 1 + 1 is more than one share, so
    the server would refuse every slice of the pool. Without a step the scheduler
    still hands out whole shares only: a smaller request rounds up to `min` (1), a
    larger one is over `max` (1). So a one-share GPU is one whole allocation, and a
    claim for `shares: 1` written for N shares still fits it.
    """
    valid_range = {"min": "1", "max": str(shares)}
    if shares > 1:
        valid_range["step"] = "1"
    return {"default": str(shares), "validRange": valid_range}


def memory_capacity(driver: str) -> str:
    """The name a shared GPU's memory is published (and requested) under."""
    return f"{driver}/memory"


def device_attributes(
    dev: Device, *, legacy: bool = False, lists: bool = False
) -> dict[str, dict[str, Any]]:
    """`dev`'s attributes as its ResourceSlice publishes them, which the device
    metadata a container reads lists too: `legacy` with upstream's old attributes,
    `lists` with the list form of those that have one."""
    attributes = {
        **dev.attributes,
        **(dev.legacy_attributes if legacy else {}),
        **(dev.list_attributes if lists else {}),
    }
    return {k: attribute(v) for k, v in attributes.items()}


def device(
    dev: Device,
    taints: tuple[Taint, ...] = (),
    *,
    shared_by: str | None = None,
    shares: int = 0,
    legacy: bool = False,
    lists: bool = False,
) -> dict[str, Any]:
    """One device; `shared_by` (the driver name) publishes it for memory slices,
    `shares` > 0 for that many integer shares, `legacy` with upstream's old attributes,
    `lists` with the list form of the attributes that have one."""
    out: dict[str, Any] = {
        "name": dev.name,
        "attributes": device_attributes(dev, legacy=legacy, lists=lists),
        "capacity": {k: {"value": str(v)} for k, v in dev.capacity.items()},
    }
    if shared_by is not None:
        memory = dev.capacity["memory"]
        out["allowMultipleAllocations"] = True
        del out["capacity"]["memory"]
        out["capacity"][memory_capacity(shared_by)] = {
            "value": str(memory),
            "requestPolicy": memory_request_policy(memory),
        }
    elif shares > 0:
        out["allowMultipleAllocations"] = True
        out["capacity"].update(shares_capacity(dev.capacity["memory"], shares))
    if dev.consumes_counters:
        out["consumesCounters"] = [
            {"counterSet": c.counter_set, "counters": _counters(c.counters)}
            for c in dev.consumes_counters
        ]
    if taints:
        out["taints"] = [taint(t) for t in taints]
    return out


def pool_content(
    inventory: Inventory,
    strategy: MigStrategy,
    health: HealthReport | None = None,
    *,
    shared: frozenset[str] = frozenset(),
    driver: str | None = None,
    shares: Mapping[str, int] | None = None,
    legacy: bool = False,
    lists: bool = False,
    own_migs: Container[MigKey] = frozenset(),
) -> PoolContent:
    """The pool; devices named in `shared` (from `SharedGpus.resolve`) are published for
    memory slices of `driver`, which names their memory capacity; those in `shares`
    (from `GpuShares.resolve`) with that many integer shares; `legacy` adds upstream's
    old attributes to every device, `lists` the list form of those that have one.
    `own_migs` are the MIG instances gpudra made for prepared claims
    (`mig.recorded_instances`): under dynamic MIG what every other instance holds is
    kept out of the pool (`Gpu.dynamic_view`)."""
    if shared and driver is None:
        raise ValueError("shared devices need the driver name for their memory capacity")
    devices = [
        device(
            d,
            health.taints(d.name) if health else (),
            shared_by=driver if d.name in shared else None,
            shares=(shares or {}).get(d.name, 0),
            legacy=legacy,
            lists=lists,
        )
        for d in inventory.devices(strategy, own_migs)
    ]
    sets = [counter_set(cs) for cs in inventory.counter_sets(strategy, own_migs)]
    return PoolContent(devices=devices, counter_sets=sets)
