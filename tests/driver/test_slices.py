"""Publishing the pool as the API server takes it: request policies checked as
validation.go checks them, one-share GPUs, a server that drops the MIG counters, slice
names for any node, and the first-fit order the scheduler reads the slices in.

The SliceController runs against an HTTP server that answers as kube-apiserver does for
the parts these tests need (create, replace, delete; what a disabled feature gate drops;
a 422 for a request policy it refuses), through the agent's real API client."""

from __future__ import annotations

import copy
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import anyio
import pynvml
import pytest
from aiohttp import web
from gpudra.api.names import dns_subdomain_problem
from gpudra.cli.main import build_parser
from gpudra.cli.node import _agent_config
from gpudra.common.kube import Kube
from gpudra.driver import publish
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import MigStrategy, SharedGpus, discover
from gpudra.driver.gpushares import GpuShares
from gpudra.driver.health import HealthPolicy, HealthState, UnmonitoredEvent, XidEvent
from gpudra.driver.nvml import NvmlEmulator, load_nvml
from gpudra.driver.nvml.emulator import load_builtin_profile
from gpudra.driver.slices import (
    SLICES,
    DeviceLimitError,
    PoolContent,
    PoolError,
    SliceController,
    SliceLimits,
    capacity_problems,
    plan_slices,
    slice_names,
    uncounted_by_server,
    validate_device,
)

from tests.common.loopback import kube_serving

DRIVER = "gpu.nvidia.com"
GI = 1024**3

# --- request policies, as validation.go's TestValidateDeviceCapacity has them -----------


def policy(
    default: str | None = None,
    values: list[str] | None = None,
    low: str | None = None,
    high: str | None = None,
    step: str | None = None,
    *,
    ranged: bool = False,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if default is not None:
        out["default"] = default
    if values is not None:
        out["validValues"] = values
    if ranged or low is not None:
        rng: dict[str, str] = {}
        for key, value in (("min", low), ("max", high), ("step", step)):
            if value is not None:
                rng[key] = value
        out["validRange"] = rng
    return out


# (capacity value, policy, the reasons the server gives; empty: accepted). The scenarios
# of k8s v1.36.5 pkg/apis/resource/validation/validation_device_capacity_test.go, by name.
GO_SCENARIOS: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "no-policy": ("1Gi", {}, []),
    "policy-with-valid-values-without-default": (
        "1Gi",
        policy(values=["1Gi"]),
        ["default: required when validValues is defined"],
    ),
    "policy-with-valid-range-without-default": (
        "1Gi",
        policy(low="1Gi"),
        ["default: required when validRange is defined"],
    ),
    "policy-with-valid-range-without-min": (
        "1Gi",
        policy("1Gi", ranged=True),
        ["min: required when validRange is defined"],
    ),
    "valid-simple-range": ("10Gi", policy("1Gi", low="1Gi"), []),
    "valid-range-with-max": ("10Gi", policy("1Gi", low="1Gi", high="10Gi"), []),
    "valid-range-with-step": ("10Gi", policy("1Gi", low="1Gi", step="1Gi"), []),
    "valid-range-with-max-and-step": (
        "10Gi",
        policy("1Gi", low="1Gi", high="10Gi", step="1Gi"),
        [],
    ),
    "valid-single-option": ("10Gi", policy("1Gi", values=["1Gi"]), []),
    "valid-two-options": ("10Gi", policy("1Gi", values=["1Gi", "10Gi"]), []),
    "default-without-policy": ("10Gi", policy("1Gi"), []),
    "more-than-one-policy": (
        "10Gi",
        policy("1Gi", values=["1Gi"], low="1Gi"),
        ['cannot specify "validValues" and "validRange" at the same time'],
    ),
    "invalid-options": (
        "10Gi",
        policy("1Gi", values=["20Gi"]),
        [
            "option is larger than capacity value: 10Gi",
            "default 1Gi is not valid according to the requestPolicy",
        ],
    ),
    "invalid-options-duplicate": (
        "10Gi",
        policy("1Gi", values=["1Gi", "1Gi"]),
        ["validValues[1]: duplicate value 1073741824"],
    ),
    "invalid-options-duplicate-normalized": (
        "10Gi",
        policy("1Ki", values=["1Ki", "1024"]),
        ["validValues[1]: duplicate value 1024"],
    ),
    "invalid-options-unsort": (
        "10Gi",
        policy("1Gi", values=["2Gi", "1Gi"]),
        ["validValues[1] 1Gi: values must be sorted in ascending order"],
    ),
    "invalid-range-large-min-small-max": (
        "10Gi",
        policy("2Gi", low="20Gi", high="1Gi"),
        [
            "min is larger than capacity value: 10Gi",
            "default 2Gi is less than min: 20Gi",
            "min 20Gi is larger than max: 1Gi",
            "default 2Gi is more than max: 1Gi",
        ],
    ),
    "invalid-range-large-max": (
        "10Gi",
        policy("1Gi", low="1Gi", high="20Gi"),
        ["max 20Gi: max is larger than capacity value: 10Gi"],
    ),
    "invalid-range-multiple-of-step": (
        "10Gi",
        policy("2Gi", low="1Gi", high="10Gi", step="2Gi"),
        [
            "default 2Gi is not a multiple of a given step (2Gi) from (1Gi)",
            "max 10Gi is not a multiple of a given step (2Gi) from (1Gi)",
        ],
    ),
    "invalid-range-large-step": (
        "10Gi",
        policy("1Gi", low="1Gi", step="10Gi"),
        ["one step (1Gi + 10Gi) is larger than capacity value: 10Gi"],
    ),
}


@pytest.mark.parametrize("name", sorted(GO_SCENARIOS))
def test_request_policies_are_checked_as_the_api_server_checks_them(name: str) -> None:
    value, request_policy, reasons = GO_SCENARIOS[name]
    cap: dict[str, Any] = {"value": value}
    if request_policy or name != "no-policy":
        cap["requestPolicy"] = request_policy
    problems = capacity_problems(cap)
    assert len(problems) == len(reasons), problems
    for problem, reason in zip(problems, reasons, strict=True):
        assert reason in problem
    dev = {"name": "gpu-0", "allowMultipleAllocations": True, "capacity": {"memory": cap}}
    if reasons:
        with pytest.raises(DeviceLimitError) as err:
            validate_device(dev, SliceLimits())
        assert (err.value.device, err.value.field) == ("gpu-0", "capacity memory")
    else:
        validate_device(dev, SliceLimits())


def test_request_policy_edges_the_go_table_leaves_out() -> None:
    """Eleven values (the set is refused at its size, so the default is not found), a
    step that rounds to zero (Go would divide by it), and unreadable quantities."""
    values = [str(i) for i in range(1, 12)]
    problems = capacity_problems({"value": "20", "requestPolicy": policy("1", values=values)})
    assert [p.split(":")[-1].strip() for p in problems] == [
        "has 11 values, more than the 10 allowed",
        "default 1 is not valid according to the requestPolicy",
    ]
    zero = capacity_problems({"value": "4", "requestPolicy": policy("0", low="0", step="0")})
    assert zero == ["requestPolicy.validRange.step 0: must be at least 1 once rounded up"]
    assert capacity_problems({"value": "x", "requestPolicy": policy("1", low="1")}) == [
        "value 'x' is not a quantity; expected a number with an optional suffix: Ki Mi Gi Ti "
        "Pi Ei, n u m k M G T P E, or e<exp>"
    ]
    assert capacity_problems({"value": "4", "requestPolicy": policy("1", low="one")})[0].startswith(
        "validRange.min 'one' is not a quantity"
    )
    # Step arithmetic is on Value(), rounded up, as in Go: 3 is two steps of 1500m, yet
    # the server refuses it, since 1500m is 2 once rounded.
    assert capacity_problems({"value": "4", "requestPolicy": policy("3", low="0", step="1500m")})
    assert not capacity_problems(
        {"value": "4", "requestPolicy": policy("2", low="0", step="1500m")}
    )


@pytest.mark.parametrize("shares", [1, 2, 7, 1024])
def test_every_share_count_publishes_a_policy_the_api_server_takes(shares: int) -> None:
    inventory = discover(load_nvml("emulated:l4"))
    (gpu,) = publish.pool_content(inventory, MigStrategy.STATIC, shares={"gpu-0": shares}).devices
    validate_device(gpu, SliceLimits())
    policy_ = gpu["capacity"]["shares"]["requestPolicy"]
    assert policy_["default"] == str(shares)  # a claim naming no shares takes the GPU
    assert policy_["validRange"]["min"] == "1"
    assert policy_["validRange"]["max"] == str(shares)


def test_one_share_is_one_whole_allocation_by_the_schedulers_rounding() -> None:
    """What consumable_capacity.go does with the policy of a one-share GPU: every
    request it can satisfy consumes the one share; more is refused."""
    gpu = publish.shares_capacity(24 * GI, 1)["shares"]
    assert gpu == {
        "value": "1",
        "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1"}},
    }

    def consumed(request: str | None) -> Decimal | None:
        rng = gpu["requestPolicy"]["validRange"]
        amount = Decimal(gpu["requestPolicy"]["default"] if request is None else request)
        amount = max(amount, Decimal(rng["min"]))  # roundUpRange, no step: as is
        return None if amount > Decimal(rng["max"]) else amount  # violateValidRange

    assert [consumed(r) for r in (None, "0.5", "1", "2")] == [1, 1, 1, None]


# --- an API server at the HTTP level ---------------------------------------------------


@dataclass
class ApiServer:
    """Stores ResourceSlices as kube-apiserver does. `drop_counters`: its
    DRAPartitionableDevices gate is off (strategy.go drops the counter fields);
    `drop_taints`: its DRADeviceTaints gate is off (strategy.go drops the devices'
    taints unless the slice stored already has some); `refuse`: a validation that
    answers 422 with its message; `on_request`: called with each request's method and
    path before it is answered, while the client waits. Lists and watches the slices
    (the watch sends nothing and ends soon, as a quiet one does at its timeout)."""

    drop_counters: bool = False
    drop_taints: bool = False
    refuse: Callable[[dict[str, Any]], str | None] | None = None
    on_request: Callable[[str, str], None] | None = None
    minor: int = 36
    store: dict[str, dict[str, Any]] = field(default_factory=dict)
    writes: list[tuple[str, str]] = field(default_factory=list)
    version: int = 0

    def _stored(self, body: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        spec = obj["spec"]
        if self.drop_counters:
            spec.pop("sharedCounters", None)
            for dev in spec.get("devices") or []:
                dev.pop("consumesCounters", None)
        old = self.store.get(obj["metadata"]["name"], {}).get("spec", {})
        if self.drop_taints and not any(d.get("taints") for d in old.get("devices") or []):
            for dev in spec.get("devices") or []:
                dev.pop("taints", None)
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    async def handle(self, request: web.Request) -> web.Response:
        path, method = request.path, request.method
        if self.on_request is not None:
            self.on_request(method, path)
        if path == "/version":
            return web.json_response({"major": "1", "minor": str(self.minor)})
        if path.startswith("/api/v1/nodes/"):
            return web.json_response({"metadata": {"name": path.rsplit("/", 1)[1], "uid": "u-1"}})
        if not path.startswith(SLICES):
            return web.json_response({"message": "not found"}, status=404)
        name = path.removeprefix(SLICES).strip("/")
        if method == "GET" and not name and request.query.get("watch") == "true":
            await anyio.sleep(0.1)
            return web.Response(content_type="application/json")
        if method == "GET" and not name:
            listing = {"items": list(self.store.values()), "metadata": {"resourceVersion": "1"}}
            return web.json_response(listing)
        if method == "DELETE":
            self.writes.append((method, name))
            self.store.pop(name, None)
            return web.json_response({})
        body = await request.json()
        name = body["metadata"]["name"]
        self.writes.append((method, name))
        problem = self.refuse(body) if self.refuse is not None else None
        if problem is not None:
            message = f'ResourceSlice.resource.k8s.io "{name}" is invalid: {problem}'
            return web.json_response({"message": message}, status=422)
        self.store[name] = self._stored(body)
        return web.json_response(self.store[name], status=201 if method == "POST" else 200)

    def pool(self) -> list[dict[str, Any]]:
        """The slices of the pool's newest generation, checked complete (as the
        scheduler's GatherPools wants it), in the order the scheduler reads them."""
        newest = max(o["spec"]["pool"]["generation"] for o in self.store.values())
        current = [o for o in self.store.values() if o["spec"]["pool"]["generation"] == newest]
        assert len(current) == current[0]["spec"]["pool"]["resourceSliceCount"] == len(self.store)
        return sorted(current, key=lambda o: str(o["metadata"]["name"]))


@asynccontextmanager
async def api_server(server: ApiServer) -> AsyncIterator[Kube]:
    async with kube_serving(server.handle) as kube:
        yield kube


def devices_in(pool: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for o in pool for d in o["spec"].get("devices") or []]


# --- one share per GPU -------------------------------------------------------------------


def refuse_a_step_past_the_capacity(body: dict[str, Any]) -> str | None:
    """validation.go's one rule a one-share policy broke: min + step within the value."""
    for dev in body["spec"].get("devices") or []:
        for key, cap in dev.get("capacity", {}).items():
            rng = cap.get("requestPolicy", {}).get("validRange", {})
            numbers = [rng.get("step", "x"), rng.get("min", "x"), cap["value"]]
            if not all(n.isdigit() for n in numbers):
                continue  # memory's 1Mi steps: not this rule's case
            step, low, value = map(int, numbers)
            if low + step > value:
                return f"spec.devices.capacity[{key}].requestPolicy.validRange.step: one step"
    return None


@pytest.mark.anyio
@pytest.mark.parametrize("shares", [1, 3])
async def test_gpu_shares_1_publishes_the_whole_pool(shares: int) -> None:
    server = ApiServer(refuse=refuse_a_step_past_the_capacity)
    async with api_server(server) as kube:
        config = AgentConfig(
            node_name="n1", health_events=False, gpu_shares=GpuShares(default=shares)
        )
        agent = NodeAgent(config, kube, load_nvml("emulated:h100-80gb-hbm3-x8"))
        await agent.scan()
        await agent.slices.reconcile_once()
    devices = devices_in(server.pool())
    assert len(devices) == 8
    assert {d["capacity"]["shares"]["value"] for d in devices} == {str(shares)}


@pytest.mark.anyio
async def test_a_policy_the_server_would_refuse_stops_the_pool_before_any_write() -> None:
    """The check runs on the wire JSON before the first slice: a refused device never
    leaves a pool half written with a new generation (incomplete, so unallocatable)."""
    content = publish.pool_content(
        discover(load_nvml("emulated:h100-80gb-hbm3-x8")),
        MigStrategy.STATIC,
        shares={f"gpu-{i}": 2 for i in range(8)},
    )
    bad = copy.deepcopy(content.devices[-1])
    bad["capacity"]["shares"]["requestPolicy"]["validRange"]["max"] = "3"
    server = ApiServer()
    async with api_server(server) as kube:
        broken = PoolContent([*content.devices[:-1], bad], content.counter_sets)
        agent_slices = NodeAgent(AgentConfig(node_name="n1"), kube, load_nvml("emulated:l4")).slices
        agent_slices.source = lambda: broken
        with pytest.raises(
            PoolError, match=r"device gpu-7: capacity shares .*max 3: max is larger"
        ):
            await agent_slices.reconcile_once()
    assert server.writes == []


# --- an API server that drops the MIG counters -----------------------------------------


def mixed_node() -> NvmlEmulator:
    """Eight H100s, GPUs 0 and 1 in MIG mode: whole GPUs and dynamic MIG side by side."""
    nvml = load_nvml("emulated:h100-80gb-hbm3-x8")
    assert isinstance(nvml, NvmlEmulator)
    nvml.nvmlInit()
    for index in (0, 1):
        nvml.nvmlDeviceSetMigMode(nvml.nvmlDeviceGetHandleByIndex(index), 1)
    nvml.nvmlShutdown()
    return nvml


def test_counters_the_server_stored_without_are_named() -> None:
    sent = {
        "sharedCounters": [{"name": "gpu-0-counter-set", "counters": {}}],
        "devices": [
            {"name": "gpu-0-mig-1g10gb-19-0", "consumesCounters": [{"counterSet": "x"}]},
            {"name": "gpu-2"},
        ],
    }
    stripped = {"devices": [{"name": "gpu-0-mig-1g10gb-19-0"}, {"name": "gpu-2"}]}
    assert uncounted_by_server(sent, stripped) == [
        "counter set gpu-0-counter-set",
        "gpu-0-mig-1g10gb-19-0",
    ]
    assert uncounted_by_server(sent, sent) == []
    assert uncounted_by_server({"devices": [{"name": "gpu-2"}]}, {}) == []


@pytest.mark.anyio
@pytest.mark.parametrize("minor", [34, 35])
async def test_a_server_that_drops_counters_gets_no_mig_placements(
    minor: int, caplog: pytest.LogCaptureFixture
) -> None:
    """With DRAPartitionableDevices off (the default on 1.34 and 1.35) the placements
    would be independent devices to the scheduler, which allocates overlapping ones:
    the agent says so once and publishes the node without them."""
    server = ApiServer(drop_counters=True, minor=minor)
    async with api_server(server) as kube:
        agent = NodeAgent(AgentConfig(node_name="n1", health_events=False), kube, mixed_node())
        await agent.scan()
        with caplog.at_level(logging.ERROR, logger="gpudra.driver.slices"):
            await agent.slices.reconcile_once()
            refused = list(agent.slices.counters_refused)
            await agent.slices.reconcile_once()  # nothing changed: nothing written
            writes = len(server.writes)
            agent.slices.trigger()  # a rescan or health change: still none
            await agent.slices.reconcile_once()
    assert len(server.writes) == writes
    pool = server.pool()
    assert [d["name"] for d in devices_in(pool)] == [f"gpu-{i}" for i in range(2, 8)]
    assert not any(o["spec"].get("sharedCounters") for o in pool)
    assert refused and refused[0] == "counter set gpu-0-counter-set"
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "DRAPartitionableDevices" in record.getMessage()
    assert "--mig-strategy static" in record.getMessage()
    assert record.__dict__["fields"]["withheld"] > 0


@pytest.mark.anyio
@pytest.mark.parametrize("drop_taints", [True, False], ids=["gate-off", "gate-on"])
async def test_a_server_that_drops_taints_gets_no_broken_device(
    drop_taints: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """With DRADeviceTaints off (the default on 1.34 and 1.35) the API server drops the
    health taints, and the scheduler would go on handing out a GPU the node found
    broken: the agent says so once and publishes the pool without it, then leaves the
    pool at rest. Where the server keeps taints, the GPU is published tainted."""
    inventory = discover(load_nvml("emulated:h100-80gb-hbm3-x8"))
    health = HealthState(inventory, HealthPolicy())

    def source() -> PoolContent:
        return publish.pool_content(inventory, MigStrategy.STATIC, health.report(), driver=DRIVER)

    server = ApiServer(drop_taints=drop_taints, minor=35)
    async with api_server(server) as kube:
        slices = SliceController(kube, driver=DRIVER, node="n1", source=source)
        await slices.reconcile_once()
        health.apply(XidEvent(inventory.gpus[3].uuid, 48))  # a double-bit ECC error
        slices.trigger()
        with caplog.at_level(logging.ERROR, logger="gpudra.driver.slices"):
            await slices.reconcile_once()
            writes = len(server.writes)
            slices.trigger()
            await slices.reconcile_once()  # nothing changed: nothing written
    assert len(server.writes) == writes
    published = {d["name"]: d for d in devices_in(server.pool())}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    if drop_taints:
        assert sorted(published) == [f"gpu-{i}" for i in range(8) if i != 3]
        assert slices.taints_refused == ["gpu-3"]
        (record,) = errors
        assert "DRADeviceTaints" in record.getMessage()
    else:
        assert published["gpu-3"]["taints"][0]["effect"] == "NoSchedule"
        assert slices.taints_refused == [] and errors == []


# --- health changes that come while the agent is busy ---------------------------------------


@pytest.mark.anyio
async def test_a_taint_raised_while_the_server_version_is_read_is_published() -> None:
    """A reconcile reads the server's version (its limits) before it plans the pool;
    an XID whose trigger comes during that read is published by the run the trigger
    asks for. Planned from the content read before the read, the run took a stale
    plan for a new one: the trigger was lost, and the taint stayed unpublished until
    the next change, which could be its own expiry."""
    inventory = discover(load_nvml("emulated:h100-80gb-hbm3-x8"))
    health = HealthState(inventory, HealthPolicy())

    def source() -> PoolContent:
        return publish.pool_content(inventory, MigStrategy.STATIC, health.report(), driver=DRIVER)

    server = ApiServer(minor=35)
    async with api_server(server) as kube:
        slices = SliceController(kube, driver=DRIVER, node="n1", source=source)
        await slices.reconcile_once()

        def second_xid(method: str, path: str) -> None:
            if path == "/version":
                server.on_request = None
                health.apply(XidEvent(inventory.gpus[1].uuid, 74))
                slices.trigger()

        health.apply(XidEvent(inventory.gpus[2].uuid, 13))
        slices.trigger()
        server.on_request = second_xid
        await slices.reconcile_once()
        await slices.reconcile_once()  # the run the second trigger asks for
    published = {d["name"]: d for d in devices_in(server.pool())}
    assert [(t["value"], t["effect"]) for t in published["gpu-1"]["taints"]] == [
        ("74", "NoSchedule")
    ]
    assert [(t["value"], t["effect"]) for t in published["gpu-2"]["taints"]] == [("13", "None")]


class WatchedOnceWritten(NvmlEmulator):
    """Eight H100s whose health events are registered only once `written` is set (the
    pool is on the server), and GPU 3's not at all: NVML refuses it."""

    def __init__(self, written: threading.Event) -> None:
        super().__init__(load_builtin_profile("h100-80gb-hbm3-x8"))
        self.written = written

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        if not self.written.wait(30):
            raise AssertionError("the agent wrote no slice")
        if self.nvmlDeviceGetIndex(handle) == 3:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        super().nvmlDeviceRegisterEvents(handle, eventTypes, eventSet)


@pytest.mark.anyio
async def test_a_gpu_the_watcher_cannot_watch_is_published_unmonitored() -> None:
    """What the health watcher finds as it starts (a GPU whose events NVML will not
    deliver) changes the pool like any later event, also after the first slices were
    written without it. The agent once followed health from the generation after the
    watcher's start, so that change reached no slice until another one came."""
    written = threading.Event()

    def on_request(method: str, _path: str) -> None:
        if method == "POST":
            written.set()

    def gpu_3_tainted() -> bool:
        """Read from every slice stored: a generation is written slice by slice."""
        devices = (d for o in server.store.values() for d in o["spec"].get("devices") or [])
        return any(d["name"] == "gpu-3" and d.get("taints") for d in devices)

    server = ApiServer(on_request=on_request)
    async with api_server(server) as kube:
        agent = NodeAgent(AgentConfig(node_name="n1"), kube, WatchedOnceWritten(written))
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            with anyio.fail_after(10):
                while not gpu_3_tainted():
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
    (gpu3,) = [d for d in devices_in(server.pool()) if d["name"] == "gpu-3"]
    taints = [(t["key"], t["effect"]) for t in gpu3["taints"]]
    assert taints == [(f"{DRIVER}/unmonitored", "None")]


def refuse_counters_beside_devices(body: dict[str, Any]) -> str | None:
    """1.35+ validation: a slice holds counter sets or devices, never both."""
    spec = body["spec"]
    if spec.get("sharedCounters") and spec.get("devices"):
        return "spec: Invalid value: only one of `sharedCounters` or `devices` may be set"
    return None


@pytest.mark.anyio
async def test_a_control_plane_upgraded_under_the_agent_gets_its_layout() -> None:
    """1.34 puts a GPU's counter set and its placements in one slice; 1.35 refuses
    that, and the 1.36 scheduler reads no devices from a slice with counter sets. An
    agent started on 1.34 plans again with the upgraded server's layout: at its next
    resync, and at once when the server refuses a write (the kubelet's restart, part
    of a node's upgrade, deletes the node's slices)."""
    server = ApiServer(minor=34)
    async with api_server(server) as kube:
        agent = NodeAgent(AgentConfig(node_name="n1", health_events=False), kube, mixed_node())
        await agent.scan()
        await agent.slices.reconcile_once()
        assert any(o["spec"].get("sharedCounters") and o["spec"]["devices"] for o in server.pool())

        server.minor, server.refuse = 36, refuse_counters_beside_devices
        server.store.clear()  # the kubelet's restart deletes them; the watch relists
        agent.slices._listed([])
        await agent.slices.reconcile_once()
        first = server.pool()

        server.minor = 34  # and back, at a resync
        server.refuse = None
        agent.slices.trigger()
        await agent.slices.reconcile_once()
    assert not any(o["spec"].get("sharedCounters") and o["spec"].get("devices") for o in first)
    assert len(devices_in(first)) == 6 + 2 * 25
    again = server.pool()
    assert all(o["spec"]["devices"] for o in again)  # counter sets beside devices again
    assert len(devices_in(again)) == 6 + 2 * 25


@pytest.mark.anyio
async def test_a_server_that_keeps_counters_gets_every_placement() -> None:
    server = ApiServer()
    async with api_server(server) as kube:
        agent = NodeAgent(AgentConfig(node_name="n1", health_events=False), kube, mixed_node())
        await agent.scan()
        await agent.slices.reconcile_once()
    assert agent.slices.counters_refused == []
    pool = server.pool()
    assert len(devices_in(pool)) == 6 + 2 * 25
    assert [cs["name"] for o in pool for cs in o["spec"].get("sharedCounters") or []] == [
        "gpu-0-counter-set",
        "gpu-1-counter-set",
    ]


# --- slice names --------------------------------------------------------------------------

LONG_NODE = ".".join(["a" * 62, "b" * 62, "c" * 62, "d" * 60])  # 249: a valid node name


def test_slice_names_are_unchanged_where_they_fit() -> None:
    assert slice_names("n1", DRIVER, 3) == [f"n1-{DRIVER}-{i}" for i in range(3)]


@pytest.mark.parametrize("node", [LONG_NODE, "n" * 253, "a" * 237, "x." * 120 + "yy"])
def test_slice_names_fit_the_api_for_any_valid_node_name(node: str) -> None:
    assert dns_subdomain_problem(node) is None
    for count in (1, 12, 130):
        names = slice_names(node, "gpu.a-driver-name-of-sixty-three-characters.example.com", count)
        assert len(set(names)) == count
        for name in names:
            assert dns_subdomain_problem(name) is None, name
        assert names == slice_names(
            node, "gpu.a-driver-name-of-sixty-three-characters.example.com", count
        )
    other = node[:-1] + ("z" if node[-1] != "z" else "y")
    assert set(slice_names(node, DRIVER, 2)).isdisjoint(slice_names(other, DRIVER, 2))


@pytest.mark.anyio
async def test_a_long_node_name_is_published() -> None:
    server = ApiServer()
    async with api_server(server) as kube:
        agent = NodeAgent(
            AgentConfig(node_name=LONG_NODE, health_events=False), kube, load_nvml("emulated:l4")
        )
        await agent.scan()
        await agent.slices.reconcile_once()
    ((name, obj),) = server.store.items()
    assert dns_subdomain_problem(name) is None
    assert obj["spec"]["nodeName"] == obj["spec"]["pool"]["name"] == LONG_NODE


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--driver-name=GPU.example.com"], "--driver-name 'GPU.example.com' must be a DNS"),
        (["--driver-name=" + "a." * 32 + "io"], "at most 63 characters"),
        (["--driver-name=gpu_example.com"], "--driver-name 'gpu_example.com'"),
    ],
)
def test_the_agent_refuses_a_driver_name_its_slices_cannot_carry(
    flags: list[str], message: str
) -> None:
    args = build_parser().parse_args(["node", "--node-name=n1", *flags])
    with pytest.raises(SystemExit, match=re.escape(message)):
        _agent_config(args)
    ok = build_parser().parse_args(["node", f"--node-name={LONG_NODE}", "--driver-name=gpu.x.io"])
    assert _agent_config(ok).driver_name == "gpu.x.io"
    bad_node = build_parser().parse_args(["node", "--node-name=Node_1"])
    with pytest.raises(SystemExit, match="--node-name 'Node_1' must be a DNS subdomain"):
        _agent_config(bad_node)


# --- the order the scheduler reads ----------------------------------------------------------


def first_fit_order(bodies: list[dict[str, Any]], node: str = "n1") -> list[dict[str, Any]]:
    """Devices in the scheduler's order: slices sorted by name, devices as listed."""
    named = dict(zip(slice_names(node, DRIVER, len(bodies)), bodies, strict=True))
    return [d for name in sorted(named) for d in named[name].get("devices", [])]


@pytest.mark.parametrize(
    "events",
    [
        pytest.param(
            lambda inv: [UnmonitoredEvent(g.uuid, "no events") for g in inv.gpus],
            id="all-unmonitored",
        ),
        pytest.param(
            lambda inv: [XidEvent(inv.gpus[0].uuid, 31), XidEvent(inv.gpus[5].uuid, 13)],
            id="app-xids",
        ),
    ],
)
def test_informational_taints_keep_exclusive_gpus_ahead_of_shared_ones(
    events: Callable[[Any], list[Any]],
) -> None:
    inventory = discover(load_nvml("emulated:h100-80gb-hbm3-x8"))
    shared, _ = SharedGpus.parse("0").resolve(inventory)
    health = HealthState(inventory, HealthPolicy())
    for event in events(inventory):
        health.apply(event)
    content = publish.pool_content(
        inventory, MigStrategy.STATIC, health.report(), shared=shared, driver=DRIVER
    )
    assert any(d.get("taints") for d in content.devices)
    order = first_fit_order(plan_slices(content, SliceLimits.for_server(36)))
    kinds = [bool(d.get("allowMultipleAllocations")) for d in order]
    assert kinds == sorted(kinds)  # every exclusive GPU before the shared one
    assert len(order) == 8


def test_eleven_slices_and_more_are_read_in_plan_order() -> None:
    """Slice 2 of the plan is named -10 once there are 11: the names sort as planned."""
    devices: list[dict[str, Any]] = [
        {"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}} for i in range(128 * 11)
    ]
    devices += [
        {**d, "name": f"s{d['name']}", "allowMultipleAllocations": True} for d in devices[:5]
    ]
    bodies = plan_slices(PoolContent(devices), SliceLimits.for_server(36))
    assert len(bodies) == 12
    assert first_fit_order(bodies) == [d for b in bodies for d in b["devices"]]
    names = slice_names("n1", DRIVER, 12)
    assert names[2] == f"n1-{DRIVER}-10" and sorted(names) == names
    assert set(names) == {f"n1-{DRIVER}-{i}" for i in range(12)}  # no slice renamed
