"""Publishing a node's devices as ResourceSlices, and keeping them published.

Two halves: `plan_slices` is pure (devices in, slice specs out, split within the API
limits of the running server version) and `SliceController` is level-triggered: any
watch event, inventory or health change marks the pool dirty, and one reconcile
compares what should exist with what the watch shows exists. Someone deleting or
editing our slices (the kubelet wipes them at its start) is just another difference.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from gpudra.api.names import (
    DNS_SUBDOMAIN_MAX,
    attribute_name_problem,
    dns_label_problem,
    dns_subdomain_problem,
)
from gpudra.api.quantity import Quantity, QuantityError, parse_quantity
from gpudra.common.backoff import Backoff
from gpudra.common.kube import RESOURCE_API, ApiError, Kube
from gpudra.common.reconcile import ReconcileLoop
from gpudra.common.watch import EventType, Reflector

log = logging.getLogger(__name__)

SLICES = f"{RESOURCE_API}/resourceslices"
# The API's semantic version rule for `version` attributes (semver.org 2.0.0).
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


class PoolError(ValueError):
    """The pool cannot be published as described; nothing is written."""


class DeviceLimitError(PoolError):
    """A device breaks a resource.k8s.io/v1 rule; names the device and the field."""

    def __init__(self, device: str, field_name: str, problem: str) -> None:
        super().__init__(f"device {device}: {field_name} {problem}")
        self.device = device
        self.field = field_name


@dataclass(frozen=True)
class PoolContent:
    """Everything one node publishes for one driver, as resource.k8s.io/v1 JSON."""

    devices: list[dict[str, Any]]
    counter_sets: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class SliceLimits:
    """The API server's ResourceSlice limits; `for_server` picks a version's."""

    max_devices: int = 128
    # 1.35+: a slice whose devices carry taints or consume counters holds fewer.
    max_devices_constrained: int = 64
    max_counter_sets: int = 8
    max_counters_per_set: int = 32
    max_consumes_per_device: int = 2
    max_taints: int = 16
    max_attributes_and_capacities: int = 32
    # Values of all of a device's attributes, each item of a list one (list-type
    # attributes, DRAListTypeAttributes).
    max_attribute_values: int = 48
    max_attribute_string: int = 64
    # 1.35+: a slice has devices or sharedCounters, never both.
    separate_counters: bool = True
    # 1.35+: a device taint may have effect None (informational). 1.34 refuses the whole
    # slice for one, so there such taints stay in the agent (health, metrics) unpublished.
    informational_taints: bool = True

    @classmethod
    def for_server(cls, minor: int) -> SliceLimits:
        if minor <= 34:
            return cls(
                max_devices_constrained=128,
                max_taints=4,
                separate_counters=False,
                informational_taints=False,
            )
        return cls()


_INFORMATIONAL = "None"
"""The taint effect that only informs; every other keeps the scheduler off the device."""


def _keeping_off(dev: dict[str, Any]) -> bool:
    """Whether a taint of `dev` keeps the scheduler off it."""
    return any(t.get("effect") != _INFORMATIONAL for t in dev.get("taints") or ())


def _publishable(dev: dict[str, Any], limits: SliceLimits) -> dict[str, Any]:
    """`dev` as this server accepts it: without effect-None taints where it has none."""
    taints = dev.get("taints")
    if limits.informational_taints or not taints:
        return dev
    kept = [t for t in taints if t.get("effect") != _INFORMATIONAL]
    if len(kept) == len(taints):
        return dev
    out = {k: v for k, v in dev.items() if k != "taints"}
    if kept:
        out["taints"] = kept
    return out


@dataclass
class KnownNames:
    """Names already found valid in one pool. The same attribute, capacity and counter
    names repeat on every device, so `plan_slices` checks each once (publishing a large
    node checks thousands of keys otherwise)."""

    qualified: set[str] = field(default_factory=set)  # attribute and capacity names
    counters: set[str] = field(default_factory=set)


def validate_device(
    dev: dict[str, Any], limits: SliceLimits, known: KnownNames | None = None
) -> None:
    """Rejects what the API server would reject, naming the device and the field.

    Raises `DeviceLimitError`. The one check of a published device: it runs on the
    JSON that goes on the wire, so what passes here is what the server receives.
    """
    known = KnownNames() if known is None else known
    name = dev.get("name", "")
    problem = dns_label_problem(name)
    if problem is not None:
        raise DeviceLimitError(name or "''", "name", problem)
    attrs = dev.get("attributes", {})
    caps = dev.get("capacity", {})
    if len(attrs) + len(caps) > limits.max_attributes_and_capacities:
        raise DeviceLimitError(
            name,
            "attributes+capacity",
            f"has {len(attrs)} attributes and {len(caps)} capacities, over the API limit of "
            f"{limits.max_attributes_and_capacities} together; drop some attributes",
        )
    values = 0
    for key, val in attrs.items():
        _check_name(name, "attribute", key, known)
        values += _check_attribute(name, key, val, limits)
    if values > limits.max_attribute_values:
        raise DeviceLimitError(
            name,
            "attributes",
            f"hold {values} values, lists counted item by item, over the API limit of "
            f"{limits.max_attribute_values}; drop some attributes or --numa-node-list",
        )
    shared = bool(dev.get("allowMultipleAllocations"))
    for key, cap in caps.items():
        _check_name(name, "capacity", key, known)
        if not isinstance(cap, dict) or "value" not in cap:
            raise DeviceLimitError(name, f"capacity {key}", f"must be {{value: ...}} (got {cap!r})")
        if "requestPolicy" not in cap:
            continue
        if not shared:
            raise DeviceLimitError(
                name,
                f"capacity {key}",
                "has a requestPolicy, which the API allows only on a device with "
                "allowMultipleAllocations",
            )
        problems = capacity_problems(cap)
        if problems:
            raise DeviceLimitError(name, f"capacity {key}", "; ".join(problems))
    uses = dev.get("consumesCounters", [])
    if len(uses) > limits.max_consumes_per_device:
        raise DeviceLimitError(
            name,
            "consumesCounters",
            f"has {len(uses)} entries, over the limit of {limits.max_consumes_per_device}",
        )
    for use in uses:
        _check_counters(name, f"consumesCounters {use.get('counterSet')}", use, limits, known)
    taints = dev.get("taints", [])
    if len(taints) > limits.max_taints:
        raise DeviceLimitError(
            name, "taints", f"has {len(taints)} taints, over the limit of {limits.max_taints}"
        )


def _list_hint(body: dict[str, Any]) -> str:
    """What to do where a refused slice holds list-type attributes: an API server
    without the DRAListTypeAttributes feature gate drops a list, and then refuses the
    attribute left with no value."""
    lists = sorted(
        {
            key
            for dev in body.get("spec", {}).get("devices", [])
            for key, val in dev.get("attributes", {}).items()
            if isinstance(val, dict) and "ints" in val
        }
    )
    if not lists:
        return ""
    return (
        f" (it publishes {', '.join(lists)} as a list, --numa-node-list: enable the "
        "DRAListTypeAttributes feature gate on the API server and the scheduler, or run "
        "the agent without --numa-node-list, chart value node.numaNodeList: false)"
    )


# validation.go: CapacityRequestPolicyDiscreteMaxOptions.
MAX_VALID_VALUES = 10


def capacity_problems(cap: dict[str, Any]) -> list[str]:
    """Why the API server refuses a capacity of a device with allowMultipleAllocations,
    each reason as it words it; empty when it accepts it.

    A port of v1.36 validation.go's `validateMultiAllocatableDeviceCapacity` and what it
    calls (`validateRequestPolicy`, `validateRequestPolicyValidValues`,
    `validateRequestPolicyRange`, `validateRequestPolicyRangeStep`), rule for rule:
    quantities compare exactly, the step arithmetic uses `Value()` (rounded up to an
    integer) as Go does, and duplicate valid values are found by `Value()` too. A step
    whose `Value()` is 0 is refused here: Go divides by it (the write would fail).
    """
    try:
        value = _quantity(cap.get("value"), "value")
        policy = cap.get("requestPolicy")
        if policy is None:
            return []
        if not isinstance(policy, dict):
            return [f"requestPolicy must be an object (got {policy!r})"]
        valid_values = policy.get("validValues") or []
        valid_range = policy.get("validRange")
        if valid_values and valid_range is not None:
            return [
                "requestPolicy: exactly one policy can be specified, cannot specify "
                '"validValues" and "validRange" at the same time'
            ]
        raw_default = policy.get("default")
        if valid_values:
            if raw_default is None:
                return ["requestPolicy.default: required when validValues is defined"]
            options = [_quantity(v, f"validValues[{i}]") for i, v in enumerate(valid_values)]
            return _valid_values_problems(_quantity(raw_default, "default"), value, options)
        if valid_range is not None:
            if raw_default is None:
                return ["requestPolicy.default: required when validRange is defined"]
            if not isinstance(valid_range, dict):
                return [f"requestPolicy.validRange must be an object (got {valid_range!r})"]
            return _range_problems(_quantity(raw_default, "default"), value, valid_range)
        return []
    except QuantityError as e:
        return [str(e)]


def _quantity(raw: Any, where: str) -> Quantity:
    try:
        return parse_quantity(raw, allow_negative=True)
    except QuantityError as e:
        raise QuantityError(f"{where} {e}") from None


def _valid_values_problems(
    default: Quantity, value: Quantity, options: list[Quantity]
) -> list[str]:
    """validateRequestPolicyValidValues: ascending, at most 10, each within the
    capacity, no two with the same Value(), the default among them."""
    where = "requestPolicy.validValues"
    problems = [
        f"{where}[{i + 1}] {options[i + 1]}: values must be sorted in ascending order"
        for i in range(len(options) - 1)
        if options[i].amount > options[i + 1].amount
    ]
    found_default = False
    if len(options) > MAX_VALID_VALUES:
        # validateSet stops at the size, before any item: the default is not found.
        problems.append(
            f"{where}: has {len(options)} values, more than the {MAX_VALID_VALUES} allowed"
        )
    else:
        seen: set[int] = set()
        for i, option in enumerate(options):
            if option.amount > value.amount:
                problems.append(
                    f"{where}[{i}] {option}: option is larger than capacity value: {value}"
                )
            if option.amount == default.amount:
                found_default = True
            key = option.value()
            if key in seen:
                problems.append(f"{where}[{i}]: duplicate value {key}")
            seen.add(key)
    if not found_default:
        problems.append(f"{where}: default {default} is not valid according to the requestPolicy")
    return problems


def _range_problems(default: Quantity, value: Quantity, valid_range: dict[str, Any]) -> list[str]:
    """validateRequestPolicyRange: min required and within the capacity, the default
    between min and max, max within the capacity, min plus one step within the capacity,
    the default and max on the step grid from min."""
    where = "requestPolicy.validRange"
    if valid_range.get("min") is None:
        return [f"{where}.min: required when validRange is defined"]
    low = _quantity(valid_range["min"], "validRange.min")
    problems: list[str] = []
    if low.amount > value.amount:
        problems.append(f"{where}.min {low}: min is larger than capacity value: {value}")
    if default.amount < low.amount:
        problems.append(f"{where}.min: default {default} is less than min: {low}")
    high: Quantity | None = None
    if valid_range.get("max") is not None:
        high = _quantity(valid_range["max"], "validRange.max")
        if low.amount > high.amount:
            problems.append(f"{where}.max: min {low} is larger than max: {high}")
        if high.amount > value.amount:
            problems.append(f"{where}.max {high}: max is larger than capacity value: {value}")
        if default.amount > high.amount:
            problems.append(f"{where}.max: default {default} is more than max: {high}")
    if valid_range.get("step") is not None:
        step = _quantity(valid_range["step"], "validRange.step")
        if low.amount + step.amount > value.amount:
            problems.append(
                f"{where}.step {step}: one step ({low} + {step}) is larger than capacity "
                f"value: {value}"
            )
        if step.value() == 0:
            problems.append(f"{where}.step {step}: must be at least 1 once rounded up")
            return problems
        for what, amount in (("default", default), ("max", high)):
            if amount is not None and (amount.value() - low.value()) % step.value() != 0:
                problems.append(
                    f"{where}.step: {what} {amount} is not a multiple of a given step "
                    f"({step}) from ({low})"
                )
    return problems


def validate_counter_set(counter_set: dict[str, Any], limits: SliceLimits) -> None:
    """A `sharedCounters` entry: a DNS-label name and at most the API's counters."""
    name = counter_set.get("name", "")
    problem = dns_label_problem(name)
    if problem is not None:
        raise PoolError(f"counter set {name!r}: name {problem}")
    counters = counter_set.get("counters", {})
    if len(counters) > limits.max_counters_per_set:
        raise PoolError(
            f"counter set {name}: {len(counters)} counters, over the limit "
            f"of {limits.max_counters_per_set}"
        )
    for counter in counters:
        problem = dns_label_problem(counter)
        if problem is not None:
            raise PoolError(f"counter set {name}: counter {counter!r} {problem}")


def _check_name(device: str, what: str, key: str, known: KnownNames) -> None:
    """`what` is "attribute" or "capacity"; the field is named only in an error, since
    this runs for every key of every device."""
    if key in known.qualified:
        return
    problem = attribute_name_problem(key)
    if problem is not None:
        raise DeviceLimitError(device, f"{what} {key}", problem)
    known.qualified.add(key)


def _check_attribute(device: str, key: str, val: Any, limits: SliceLimits) -> int:
    """Shaped as the API wants, a string within its length, a version semantic, a list
    of ints not empty; how many values it holds.

    Runs for every attribute of every device (a MIG node publishes thousands), so the
    common kinds return early and the messages are built only for an error."""
    if isinstance(val, dict) and len(val) == 1:
        [(kind, value)] = val.items()
        if kind in {"int", "bool"}:
            return 1
        if kind == "ints":
            if isinstance(value, list) and value and all(type(v) is int for v in value):
                return len(value)
            raise DeviceLimitError(
                device, f"attribute {key}", f"must be a non-empty list of ints (got {value!r})"
            )
        if kind in {"string", "version"}:
            if isinstance(value, str) and len(value) > limits.max_attribute_string:
                raise DeviceLimitError(
                    device,
                    f"attribute {key}",
                    f"is {len(value)} characters, over the API limit of "
                    f"{limits.max_attribute_string}: {value[:20]!r}...",
                )
            if kind == "version" and not _SEMVER.match(str(value)):
                raise DeviceLimitError(
                    device,
                    f"attribute {key}",
                    f"{value!r} is not a semantic version (e.g. 1.2.3)",
                )
            return 1
    raise DeviceLimitError(
        device,
        f"attribute {key}",
        f"must have exactly one of int, bool, string, version, ints (got {val!r})",
    )


def _check_counters(
    device: str, where: str, use: dict[str, Any], limits: SliceLimits, known: KnownNames
) -> None:
    counters = use.get("counters", {})
    if len(counters) > limits.max_counters_per_set:
        raise DeviceLimitError(
            device,
            where,
            f"has {len(counters)} counters, over the limit of {limits.max_counters_per_set}",
        )
    for counter in counters.keys() - known.counters:
        problem = dns_label_problem(counter)
        if problem is not None:
            raise DeviceLimitError(device, f"{where}: counter {counter!r}", problem)
        known.counters.add(counter)


def _constrained(dev: dict[str, Any]) -> bool:
    return bool(dev.get("taints") or dev.get("consumesCounters"))


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _shared(dev: dict[str, Any]) -> bool:
    return bool(dev.get("allowMultipleAllocations"))


def _loose_chunks(devices: list[dict[str, Any]], size: int) -> list[list[Any]]:
    """Devices that consume no counters, shareable ones (`allowMultipleAllocations`) in
    slices of their own, after the exclusive ones.

    Their own slices: the 1.34 scheduler never allocates a shareable device listed after
    an exclusive one in the same slice (its claim stays "cannot allocate all claims"),
    while alone in a slice it is (measured on v1.34.12; 1.35 and later do not mind, and
    the split costs them nothing). After: the scheduler takes the first device that
    fits, so a claim for a whole GPU gets an exclusive one before it takes all of a
    shared GPU's memory and shuts the memory slices out."""
    shared = [d for d in devices if _shared(d)]
    exclusive = [d for d in devices if not _shared(d)]
    return _chunks(exclusive, size) + _chunks(shared, size)


def _device_chunks(devices: list[dict[str, Any]], limits: SliceLimits) -> list[list[Any]]:
    """1.35+: the devices in slices, every exclusive device before every shareable one
    (as `_loose_chunks`, whose reasons hold here too), and in each kind the devices
    without taints or counters (128 a slice) before the others (64 a slice).

    A taint, even of effect None (an application XID, an unmonitored GPU), only lowers
    the device count of its slice: it must not move a shareable GPU ahead of the
    exclusive ones, where a whole-GPU claim would take all of its memory first."""
    chunks: list[list[Any]] = []
    for kind in ([d for d in devices if not _shared(d)], [d for d in devices if _shared(d)]):
        plain = [d for d in kind if not _constrained(d)]
        constrained = [d for d in kind if _constrained(d)]
        chunks += _chunks(plain, limits.max_devices)
        chunks += _chunks(constrained, limits.max_devices_constrained)
    return chunks


def plan_slices(content: PoolContent, limits: SliceLimits) -> list[dict[str, Any]]:
    """Splits the pool into slice bodies (`devices` / `sharedCounters` only).

    Deterministic: the same content always gives the same slices in the same order,
    so an unchanged inventory never causes a write.
    """
    content = PoolContent([_publishable(d, limits) for d in content.devices], content.counter_sets)
    seen: set[str] = set()
    known = KnownNames()
    for dev in content.devices:
        validate_device(dev, limits, known)
        if dev["name"] in seen:
            raise PoolError(f"device {dev['name']}: name used twice in the pool")
        seen.add(dev["name"])
    for cs in content.counter_sets:
        validate_counter_set(cs, limits)
    sets = {cs["name"]: cs for cs in content.counter_sets}
    for dev in content.devices:
        for use in dev.get("consumesCounters", []):
            if use["counterSet"] not in sets:
                raise PoolError(
                    f"device {dev['name']}: consumesCounters names unknown counter set "
                    f"{use['counterSet']!r}"
                )
    bodies: list[dict[str, Any]] = []
    if limits.separate_counters:
        for group in _chunks(content.counter_sets, limits.max_counter_sets):
            bodies.append({"sharedCounters": group})
        bodies += [{"devices": c} for c in _device_chunks(content.devices, limits)]
        return bodies
    # 1.34: devices live in the slice that holds the counter sets they consume.
    by_set: dict[str, list[dict[str, Any]]] = {name: [] for name in sets}
    loose: list[dict[str, Any]] = []
    for dev in content.devices:
        uses = dev.get("consumesCounters", [])
        if uses:
            by_set[uses[0]["counterSet"]].append(dev)
        else:
            loose.append(dev)
    for name, devs in by_set.items():
        if len(devs) > limits.max_devices:
            raise PoolError(f"counter set {name}: {len(devs)} devices exceed one slice")
        bodies.append({"sharedCounters": [sets[name]], "devices": devs})
    bodies += [{"devices": c} for c in _loose_chunks(loose, limits.max_devices)]
    return bodies


def unshared_by_server(sent: dict[str, Any], stored: dict[str, Any]) -> list[str]:
    """Devices sent with `allowMultipleAllocations` that the server stored without it.

    An API server without the DRAConsumableCapacity gate drops the field (and the
    request policies) silently, so the GPU is published exclusive: worth saying once.
    """
    kept = {d.get("name") for d in stored.get("devices", []) if d.get("allowMultipleAllocations")}
    return [
        d["name"]
        for d in sent.get("devices", [])
        if d.get("allowMultipleAllocations") and d["name"] not in kept
    ]


def uncounted_by_server(sent: dict[str, Any], stored: dict[str, Any]) -> list[str]:
    """Counter sets and devices sent with counters that the server stored without them.

    An API server without the DRAPartitionableDevices gate (off by default up to 1.35)
    drops `sharedCounters` and every `consumesCounters` silently (the resourceslice
    strategy's dropDisabledDRAPartitionableDevicesFields), so the scheduler sees every
    dynamic MIG placement as a device of its own and allocates overlapping ones.
    """
    kept_sets = {cs.get("name") for cs in stored.get("sharedCounters") or []}
    dropped = [
        f"counter set {cs['name']}"
        for cs in sent.get("sharedCounters") or []
        if cs["name"] not in kept_sets
    ]
    counted = {d.get("name") for d in stored.get("devices") or [] if d.get("consumesCounters")}
    dropped += [
        d["name"]
        for d in sent.get("devices") or []
        if d.get("consumesCounters") and d["name"] not in counted
    ]
    return dropped


def untainted_by_server(sent: dict[str, Any], stored: dict[str, Any]) -> list[str]:
    """Devices sent with taints that the server stored without them.

    An API server without the DRADeviceTaints gate (off by default up to 1.35) drops
    every device's taints silently (the resourceslice strategy's
    dropDisabledDRADeviceTaintsFields), so the scheduler goes on allocating a device the
    node found broken: its pods then fail at prepare, or run on a GPU that is lost.
    """
    tainted = {d.get("name") for d in stored.get("devices") or [] if d.get("taints")}
    return [
        d["name"] for d in sent.get("devices") or [] if d.get("taints") and d["name"] not in tainted
    ]


def without_taints(content: PoolContent) -> PoolContent:
    """The pool as a node publishes it where the API server drops taints
    (`untainted_by_server`): without the devices a taint would keep the scheduler off,
    and without taints on the others, which the server would drop."""
    devices = [
        {k: v for k, v in d.items() if k != "taints"}
        for d in content.devices
        if not _keeping_off(d)
    ]
    return PoolContent(devices, content.counter_sets)


def without_counters(content: PoolContent) -> PoolContent:
    """The pool less every device that consumes counters and every counter set: what a
    node publishes where the API server drops counters (`uncounted_by_server`)."""
    return PoolContent([d for d in content.devices if not d.get("consumesCounters")])


# Digits kept free for the index after a shortened node name (`slice_names`).
_INDEX_ROOM = 6
_HASH_CHARS = 10


def slice_names(node: str, driver: str, count: int) -> list[str]:
    """The names of a pool's `count` slices, in the order `plan_slices` made them.

    `<node>-<driver>-<index>`: deterministic, so a deleted slice is easy to recognise
    and restore, and stable across restarts. A name must be a DNS subdomain of at most
    253 characters, and a node name may have 253 itself (the driver name, checked at
    start, at most 63): where the name would be longer, the node part becomes the
    node name's head and 10 hex digits of its SHA-256, which keeps it unique per node.
    Names that fit are left as they were, so an upgrade renames no slice.

    The scheduler reads a pool's slices sorted by name, byte by byte, and takes the
    first device that fits, so their order carries `plan_slices`'s (exclusive GPUs
    before shared ones). Past 10 slices `-10` sorts before `-2`; rather than pad the
    index (which would rename every slice of every node on upgrade), the indices are
    handed out in the order their names sort: slice 2 of the plan is named `-10` when
    there are 11 or more. The set of names is the same as before, only which slice
    carries which one changes, and only for pools of 11 or more slices.
    """
    last = str(max(count - 1, 0))
    prefix = f"{node}-{driver}-"
    if len(prefix) + len(last) > DNS_SUBDOMAIN_MAX:
        digest = hashlib.sha256(node.encode()).hexdigest()[:_HASH_CHARS]
        keep = DNS_SUBDOMAIN_MAX - len(driver) - len(digest) - 3 - _INDEX_ROOM
        # A node name's dots and dashes sit between letters or digits: a cut one would
        # end the part on a character the API refuses before a '-'.
        head = node[: max(keep, 0)].rstrip(".-")
        prefix = f"{head}-{digest}-{driver}-" if head else f"{digest}-{driver}-"
    return [prefix + index for index in sorted(str(i) for i in range(count))]


@dataclass
class _Published:
    # The slice bodies (`plan_slices`) this generation publishes. Kept whole and
    # compared with ==, as the reconcile compares specs: a MIG node's pool is
    # thousands of dicts, and hashing its canonical JSON cost ten times the compare.
    bodies: list[dict[str, Any]]
    generation: int
    # name -> spec exactly as the server returned it after our last write, so
    # server-side normalisation (quantities, defaults) never reads as a change.
    specs: dict[str, dict[str, Any]]


class SliceController:
    """Keeps one node's pool for one driver published.

    `source()` returns the desired PoolContent (it may raise: then nothing is
    written and the current slices stay, rather than publishing a partial pool).
    Call `trigger()` whenever the inventory or health changes.

    An API server that drops counters (`uncounted_by_server`: the DRAPartitionableDevices
    gate is off, the default up to 1.35) would let the scheduler allocate overlapping
    dynamic MIG placements, whose second prepare fails and leaves its pod stuck. The
    first write that shows it stops the reconcile: the agent logs an error naming the
    gate, and from then on publishes the pool without any device that consumes
    counters (`without_counters`): whole GPUs stay, MIG-enabled GPUs offer nothing.
    Not the static view (the MIG devices that exist): the kubelet plugin resolves an
    allocated name in the strategy it was started with, and a static MIG device has
    its placement's name, so it would try to create the instance that is already there.
    `counters_refused` says so; enabling the gate takes an agent restart, which tries
    counters again, or `--mig-strategy static` publishes the existing MIG devices.

    An API server that drops device taints (`untainted_by_server`: DRADeviceTaints off,
    the default up to 1.35) would let the scheduler go on allocating a device the node
    found broken. The first write that shows it is handled the same way: one error
    naming the gate, and from then on the pool is published without the devices a
    taint would keep the scheduler off (`without_taints`), each back once healthy;
    `taints_refused` says so. NoExecute cannot evict pods that way, only keep new ones
    off.

    `stand_down`, where given, is asked before every reconcile: it gives a reason once
    another process publishes this node's pool: in a rolling update with a surge pod, the new agent
    beside this one, once it took the kubelet plugin's checkpoint over. From then on
    this controller writes and deletes no slice (the two would otherwise supersede each
    other's generations for as long as both run) and says so once.
    """

    def __init__(
        self,
        kube: Kube,
        *,
        driver: str,
        node: str,
        source: Callable[[], PoolContent],
        limits: SliceLimits | None = None,
        resync_s: float = 300.0,
        backoff_max_s: float = 10.0,
        stand_down: Callable[[], str | None] | None = None,
    ) -> None:
        self.kube = kube
        self.driver = driver
        self.node = node
        self.source = source
        # Injected limits stay; otherwise they follow the server's version, read again
        # whenever the pool is planned (a control plane upgraded from 1.34 to 1.35 takes
        # another layout: counter sets in slices of their own).
        self.limits = limits
        self._plan_limits: SliceLimits | None = None
        self.resync_s = resync_s
        self.backoff_max_s = backoff_max_s
        self.writes = 0
        self.reconciles = 0
        self.converged = anyio.Event()
        self._cache: dict[str, dict[str, Any]] = {}
        self._synced = False
        self._published: _Published | None = None
        self._node_uid: str | None = None
        self._plan: list[dict[str, Any]] | None = None
        # What the server dropped counters from (`uncounted_by_server`); once set, the
        # pool is published without devices that consume counters (class docstring).
        self.counters_refused: list[str] = []
        # What the server dropped taints from (`untainted_by_server`); once set, the pool
        # is published without the devices their taints would keep the scheduler off.
        self.taints_refused: list[str] = []
        self._stand_down = stand_down
        # Why another process publishes the pool now (class docstring); None: this one.
        self.stood_down: str | None = None
        # Bad inventory (PoolError) is not retried in a loop; the next change retries it.
        self._reconciler = ReconcileLoop(
            self.reconcile_once,
            backoff=Backoff(max_s=backoff_max_s),
            permanent=(PoolError,),
            ready=lambda: self._synced,
            fields=self.fields,
        )

    @property
    def last_error(self) -> str | None:
        """Why the latest reconcile failed; None once one succeeds."""
        error = self._reconciler.last_error
        return None if error is None else str(error)

    def trigger(self) -> None:
        """The desired content may have changed: rebuild it at the next reconcile."""
        self._plan = None
        self._reconciler.poke()

    def _observed_changed(self) -> None:
        # Only the slices on the server moved: the desired content is unchanged, so
        # the next reconcile reuses the plan instead of rebuilding and validating it.
        self._reconciler.poke()

    @property
    def fields(self) -> dict[str, str]:
        return {"node": self.node, "driver": self.driver}

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        reflector = Reflector(
            self.kube,
            SLICES,
            query={"fieldSelector": f"spec.nodeName={self.node},spec.driver={self.driver}"},
            on_list=self._listed,
            on_event=self._watched,
            backoff=Backoff(max_s=self.backoff_max_s),
            fields=self.fields,
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(reflector.run)
            tg.start_soon(self._resync_loop)
            task_status.started()
            await self._reconciler.run()

    # -- watch ---------------------------------------------------------------
    def _listed(self, items: list[dict[str, Any]]) -> None:
        self._cache = {o["metadata"]["name"]: o for o in items}
        self._synced = True
        self._observed_changed()

    def _watched(self, kind: EventType, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self._cache.pop(name, None)
        else:
            self._cache[name] = obj
        self._observed_changed()

    async def _resync_loop(self) -> None:
        while True:
            await anyio.sleep(self.resync_s)
            self.trigger()

    # -- reconcile -----------------------------------------------------------
    async def _limits(self) -> SliceLimits:
        """The limits to plan with: injected ones, or the running server version's."""
        if self.limits is not None:
            return self.limits
        return SliceLimits.for_server(await self.kube.server_minor())

    async def _server_changed(self) -> bool:
        """Whether the server's limits are no longer those the plan was made with (its
        version changed under the agent); if so the plan is dropped."""
        if self.limits is not None or self._plan_limits is None:
            return False
        if await self._limits() == self._plan_limits:
            return False
        self._plan = None
        log.info(
            "the API server's version changed: planning the slices again",
            extra={"fields": self.fields},
        )
        return True

    async def _owner(self) -> list[dict[str, Any]]:
        if self._node_uid is None:
            node = await self.kube.request("GET", f"/api/v1/nodes/{self.node}")
            self._node_uid = node["metadata"]["uid"]
        return [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self.node,
                "uid": self._node_uid,
                "controller": True,
            }
        ]

    def _desired(self, bodies: list[dict[str, Any]], generation: int) -> dict[str, dict[str, Any]]:
        out = {}
        names = slice_names(self.node, self.driver, len(bodies))
        for name in names:
            problem = dns_subdomain_problem(name)
            if problem is not None:
                raise PoolError(
                    f"slice name {name!r} {problem}: check the driver name {self.driver!r} "
                    f"and the node name {self.node!r}"
                )
        for name, body in zip(names, bodies, strict=True):
            spec = {
                "driver": self.driver,
                "nodeName": self.node,
                "pool": {
                    "name": self.node,
                    "generation": generation,
                    "resourceSliceCount": len(bodies),
                },
                **body,
            }
            out[name] = spec
        return out

    def _standing_down(self) -> bool:
        """Whether another process publishes the pool now; said once, for good."""
        if self.stood_down is None and self._stand_down is not None:
            self.stood_down = self._stand_down()
            if self.stood_down is not None:
                log.warning(
                    "another agent publishes this node's ResourceSlices now: this one "
                    "writes and deletes none of them",
                    extra={"fields": {**self.fields, "reason": self.stood_down}},
                )
        return self.stood_down is not None

    async def reconcile_once(self) -> None:
        self.reconciles += 1
        if self._standing_down():
            return
        if self._plan is None:
            # The limits first: `_limits` awaits the server, and a `trigger()` while it
            # does clears a plan not made yet. Read before that await, the content
            # would be planned as it was, the trigger lost, and the change (a taint)
            # left unpublished until the next one.
            limits = self._plan_limits = await self._limits()
            content = self.source()
            if self.counters_refused:
                content = without_counters(content)
            if self.taints_refused:
                content = without_taints(content)
            self._plan = plan_slices(content, limits)
        bodies = self._plan
        observed = dict(self._cache)
        max_gen = max((o["spec"]["pool"]["generation"] for o in observed.values()), default=0)
        pub = self._published
        if pub is None or pub.bodies != bodies:
            generation = max_gen + 1
            if pub is None and self._adoptable(observed, bodies, max_gen):
                generation = max_gen
            pub = _Published(bodies, generation, {})
        elif max_gen > pub.generation:
            # Someone published a newer generation of our pool: supersede it.
            pub = _Published(bodies, max_gen + 1, {})
        desired = self._desired(bodies, pub.generation)
        owner = await self._owner()
        for name, spec in desired.items():
            have = observed.get(name)
            if have is not None and have["spec"] == pub.specs.get(name, spec):
                pub.specs[name] = have["spec"]
                continue
            body: dict[str, Any] = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {
                    "name": name,
                    "ownerReferences": owner,
                    "labels": {"app.kubernetes.io/managed-by": "gpudra"},
                },
                "spec": spec,
            }
            try:
                if have is None:
                    resp = await self._write("POST", SLICES, body)
                else:
                    body["metadata"]["resourceVersion"] = have["metadata"]["resourceVersion"]
                    resp = await self._write("PUT", f"{SLICES}/{name}", body)
            except PoolError:
                # Refused: by a server upgraded since the plan (1.35 refuses a slice
                # holding counter sets and devices), planned again at once; else bad
                # inventory, which the next change retries.
                if await self._server_changed():
                    await self.reconcile_once()
                    return
                raise
            pub.specs[name] = resp["spec"]
            self._cache[name] = resp
            dropped = unshared_by_server(spec, resp["spec"])
            if dropped:
                log.warning(
                    "the API server dropped allowMultipleAllocations: these GPUs are "
                    "published exclusive; enable the DRAConsumableCapacity feature gate "
                    "on the API server and the scheduler for memory slices",
                    extra={"fields": {**self.fields, "slice": name, "devices": dropped}},
                )
            uncounted = uncounted_by_server(spec, resp["spec"])
            if uncounted and not self.counters_refused:
                self._refuse_counters(name, uncounted, bodies)
                # Counter sets come first in a plan, so this is the first slice written
                # of a new generation: the pool stays incomplete (the scheduler takes
                # nothing from it) until the generation without counters is whole.
                await self.reconcile_once()
                return
            untainted = untainted_by_server(spec, resp["spec"])
            if untainted and not self.taints_refused:
                self._refuse_taints(name, untainted)
                await self.reconcile_once()  # a new generation without those devices
                return
        for name in observed.keys() - desired.keys():
            self.writes += 1
            try:
                await self.kube.request("DELETE", f"{SLICES}/{name}")
            except ApiError as e:
                if e.status != 404:
                    raise
            self._cache.pop(name, None)
        self._published = pub
        self.converged.set()

    def _refuse_counters(self, name: str, dropped: list[str], bodies: list[dict[str, Any]]) -> None:
        self.counters_refused = dropped
        withheld = sum(
            1 for body in bodies for d in body.get("devices", ()) if d.get("consumesCounters")
        )
        self._withhold(
            name,
            dropped,
            "the API server dropped the MIG counters (sharedCounters, consumesCounters): "
            "its DRAPartitionableDevices feature gate is off, so the scheduler would "
            "allocate overlapping MIG placements. Publishing no dynamic MIG placements "
            "on this node. Fix: enable DRAPartitionableDevices on kube-apiserver and "
            "kube-scheduler (on by default from 1.36) and restart the gpudra node "
            "agents, or run them with --mig-strategy static (chart: node.migStrategy: "
            "static) to publish the MIG devices that exist",
            withheld=withheld,
        )

    def _refuse_taints(self, name: str, dropped: list[str]) -> None:
        self.taints_refused = dropped
        self._withhold(
            name,
            dropped,
            "the API server dropped the device taints: its DRADeviceTaints feature gate "
            "is off, so the scheduler would go on allocating the devices this node found "
            "broken. Publishing none of them while they are tainted (NoExecute cannot "
            "evict running pods this way). Fix: enable DRADeviceTaints on kube-apiserver, "
            "kube-scheduler and kube-controller-manager (on by default from 1.36) and "
            "restart the gpudra node agents",
        )

    def _withhold(self, name: str, dropped: list[str], message: str, **fields: Any) -> None:
        """A field the API server dropped from slice `name`: plan again (without what it
        was for) and say so, once, as an error naming the gate and the fix."""
        self._plan = None
        fields = {"slice": name, "dropped": dropped[:8], "droppedCount": len(dropped), **fields}
        log.error(message, extra={"fields": {**self.fields, **fields}})

    def _adoptable(
        self, observed: dict[str, dict[str, Any]], bodies: list[dict[str, Any]], generation: int
    ) -> bool:
        """After a restart, identical slices already published are kept as they are."""
        desired = self._desired(bodies, generation)
        if observed.keys() != desired.keys():
            return False
        return all(observed[n]["spec"] == s for n, s in desired.items())

    async def _write(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.writes += 1
        t0 = time.monotonic()
        try:
            resp: dict[str, Any] = await self.kube.request(method, path, body)
        except ApiError as e:
            if e.status in (409, 404):
                # Raced with another writer or a deletion: the watch brings the new
                # state and the next reconcile retries.
                raise
            if e.status == 422:
                raise PoolError(
                    f"the API server rejected slice {body['metadata']['name']}: {e.message}"
                    f"{_list_hint(body)}"
                ) from e
            raise
        log.debug(
            "slice written",
            extra={
                "fields": {
                    **self.fields,
                    "slice": body["metadata"]["name"],
                    "method": method,
                    "ms": round((time.monotonic() - t0) * 1000, 1),
                }
            },
        )
        return resp
