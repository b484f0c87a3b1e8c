"""Device metrics and accounting: emulated telemetry read by the sampler through NVML,
scraped from the real metrics HTTP endpoint."""

from __future__ import annotations

import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml
import pytest
from gpudra.common.kube import Kube
from gpudra.common.metricsserver import serve_metrics
from gpudra.driver.accounting import DEFAULT_ZERO_WINDOW_S, Accounting
from gpudra.driver.agent import AgentConfig
from gpudra.driver.checkpoint import Checkpoint, ClaimRecord, ClaimState, DeviceRecord
from gpudra.driver.claims import ClaimRef, checked_claim
from gpudra.driver.claimstatus import device_statuses
from gpudra.driver.devices import Device, Inventory, discover
from gpudra.driver.health import HealthState, XidEvent
from gpudra.driver.holders import ClaimInfo, ClaimInfos, claim_info
from gpudra.driver.metrics import DeviceMetrics, PreparedDevices
from gpudra.driver.mig import create_compute_instance, create_gpu_instance
from gpudra.driver.node import NodeService, PluginConfig
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile, parse_profile
from gpudra.driver.records import CreatedMig, DeviceDetails, TimeSliceSet, UsedMig
from gpudra.driver.sampling import DEFAULT_INTERVAL_S, Sampler
from gpudra.driver.tenancy import NamespaceTenants
from kubernetes_asyncio.client import ApiClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.anyio

POOL = "node-a"
GIB = 1024**3


def emulator(name: str, telemetry: dict[str, Any] | None = None) -> NvmlEmulator:
    doc = load_builtin_profile(name).model_dump(mode="json")
    if telemetry is not None:
        doc["gpus"][0]["telemetry"] = telemetry
    return NvmlEmulator(parse_profile(doc))


def inventory_of(nvml: NvmlEmulator) -> Inventory:
    return discover(nvml)


def claim(
    uid: str,
    namespace: str,
    pod: str,
    device: str,
    uuid: str,
    *,
    share_id: str | None = None,
    time_slice: bool = False,
    admin_access: bool = False,
) -> ClaimRecord:
    details = DeviceDetails(
        type="gpu",
        gpu_uuid=uuid,
        uuid=uuid,
        pod=pod,
        time_slice=TimeSliceSet(uuid, 1) if time_slice else None,
    )
    return ClaimRecord(
        uid=uid,
        namespace=namespace,
        name=f"claim-{uid}",
        state=ClaimState.PREPARE_COMPLETED,
        devices=(
            DeviceRecord(
                pool=POOL,
                device=device,
                request_names=("gpu",),
                share_id=share_id,
                exclusive=share_id is None and not time_slice and not admin_access,
                admin_access=admin_access,
                details=details,
            ),
        ),
    )


ORG = {"org": "research"}


def gpu_tenant(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "gpudra.io/v1alpha1",
        "kind": "GpuTenant",
        "metadata": {"name": name},
        "spec": spec,
    }


def namespace(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Node:
    """A sampler, accounting and device metrics wired as `NodeService` wires them,
    served on a real metrics endpoint."""

    def __init__(
        self,
        nvml: NvmlEmulator,
        claims: Sequence[ClaimRecord] = (),
        infos: ClaimInfos | None = None,
        health: HealthState | None = None,
        tenants: NamespaceTenants | None = None,
        containers: dict[str, dict[str, str]] | None = None,
        shares: dict[str, int] | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        zero_window_s: float = DEFAULT_ZERO_WINDOW_S,
    ) -> None:
        self.nvml = nvml
        self.inventory = inventory_of(nvml)
        self.claims = list(claims)
        self.clock = Clock()
        self.accounting = Accounting(idle_below=5, zero_window_s=zero_window_s)
        infos = infos or ClaimInfos()
        self.sampler = Sampler(
            nvml,
            pool=POOL,
            inventory=lambda: self.inventory,
            prepared=lambda: self.claims,
            claim_info=infos.snapshot,
            tenant_of=(tenants or NamespaceTenants()).tenant_of,
            containers=lambda: containers or {},
            shares=lambda: shares or {},
            health=lambda: health,
            on_sample=(self.accounting.observe,),
            clock=self.clock,
            interval_s=interval_s,
        )
        self.registry = CollectorRegistry()
        self.registry.register(DeviceMetrics(self.sampler, self.accounting))

    def scrape(self) -> list[tuple[str, dict[str, str], float]]:
        server, thread = serve_metrics("127.0.0.1", 0, self.registry)  # as the agent serves
        try:
            return scrape(f"http://127.0.0.1:{server.server_port}/metrics")
        finally:
            server.shutdown()
            thread.join()


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples a metrics endpoint answers: (name, labels, value)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def values(
    samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str
) -> list[float]:
    return [
        v
        for n, lab, v in samples
        if n == name and all(lab.get(k) == want for k, want in labels.items())
    ]


def only(samples: Any, name: str, **labels: str) -> float:
    found = values(samples, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0]


# What the first scrape of a counter's series withholds from it (served at zero).
WITHHELD = {
    "gpudra_allocated_device_seconds_total": "gpudra_withheld_allocated_device_seconds",
    "gpudra_idle_device_seconds_total": "gpudra_withheld_idle_device_seconds",
}


def counted(samples: Any, name: str, **labels: str) -> float:
    """One accounting counter's GPU-seconds in one scrape, what the series' first scrape
    withholds included: the total a sum of the counters as they are takes."""
    return only(samples, name, **labels) + sum(values(samples, WITHHELD[name], **labels))


@pytest.fixture
def l4() -> Iterator[NvmlEmulator]:
    yield emulator(
        "l4",
        {
            "utilization": 3,
            "memoryUtilization": 1,
            "temperature": 88,
            "power": 41.5,
            "smClock": 2040,
            "memoryUsed": 2 * GIB,
            "eccCorrected": 4,
        },
    )


async def test_a_held_gpu_reports_its_values_labelled_with_its_holder(l4: NvmlEmulator) -> None:
    uuid = inventory_of(l4).gpus[0].uuid
    infos = ClaimInfos()
    infos.remember("u1", ClaimInfo(device_classes={("gpu-0", None): "gpu.nvidia.com"}))
    health = HealthState(inventory_of(l4))
    health.apply(XidEvent(uuid, 79))
    # A container name is the pod's to choose: the exposition escapes what it holds.
    containers = {"u1": {"gpu": 'main,x"}\n'}}
    node = Node(
        l4, [claim("u1", "team-a", "trainer", "gpu-0", uuid)], infos, health, None, containers
    )
    await node.sampler.sample_once()
    got = node.scrape()
    holder = {
        "device": "gpu-0",
        "uuid": uuid,
        "namespace": "team-a",
        "pod": "trainer",
        "container": 'main,x"}\n',
    }
    assert only(got, "gpudra_gpu_utilization_percent", **holder, sharing="Exclusive") == 3
    assert only(got, "gpudra_gpu_memory_used_bytes", **holder) == 2 * GIB
    assert only(got, "gpudra_gpu_temperature_celsius", **holder) == 88
    assert only(got, "gpudra_gpu_power_watts", **holder) == 41.5
    assert only(got, "gpudra_gpu_sm_clock_mhz", **holder) == 2040
    assert only(got, "gpudra_gpu_ecc_errors_total", **holder, type="corrected") == 4
    assert only(got, "gpudra_gpu_healthy", **holder) == 0
    assert only(got, "gpudra_gpu_xid_errors_total", gpu_uuid=uuid, xid="79") == 1
    assert only(got, "gpudra_gpu_utilization_percent", **holder, utilization_scope="device") == 3

    node.claims = []  # unprepared: the series lose their holder labels
    await node.sampler.sample_once()
    got = node.scrape()
    assert only(got, "gpudra_gpu_utilization_percent", uuid=uuid, namespace="", pod="") == 3


async def test_a_mig_device_says_it_has_no_utilization_of_its_own() -> None:
    nvml = emulator("a100-40gb-mig-mixed", {"utilization": 97})
    inventory = inventory_of(nvml)
    gpu = inventory.gpus[0]
    mig = gpu.mig_devices[0]
    assert mig.uuid is not None
    nvml.telemetry.script(mig.uuid, memoryUsed=GIB)
    node = Node(nvml)
    await node.sampler.sample_once()
    got = node.scrape()
    # nvml.h: "On MIG-enabled GPUs, querying device utilization rates is not currently
    # supported": the parent has no utilization either (not a 0), and says why.
    assert values(got, "gpudra_gpu_utilization_percent", uuid=gpu.uuid) == []
    assert values(got, "gpudra_gpu_memory_utilization_percent", uuid=gpu.uuid) == []
    parent = {"uuid": gpu.uuid, "metric": "utilization", "reason": "not_supported"}
    assert only(got, "gpudra_gpu_metric_unavailable", **parent) == 1
    assert only(got, "gpudra_gpu_memory_total_bytes", uuid=gpu.uuid) > 0
    labels = {"uuid": gpu.uuid, "utilization_scope": "unavailable"}
    assert only(got, "gpudra_gpu_memory_total_bytes", **labels) > 0
    # Never a made-up figure: absent, with the reason, and the scope label says so.
    assert values(got, "gpudra_gpu_utilization_percent", uuid=mig.uuid) == []
    assert (
        only(
            got,
            "gpudra_gpu_memory_used_bytes",
            uuid=mig.uuid,
            mig_uuid=mig.uuid,
            gpu_uuid=gpu.uuid,
            utilization_scope="unavailable",
        )
        == GIB
    )
    reason = {"uuid": mig.uuid, "metric": "utilization", "reason": "not_supported"}
    assert only(got, "gpudra_gpu_metric_unavailable", **reason) == 1


async def test_a_value_the_gpu_does_not_support_is_absent_with_a_reason() -> None:
    nvml = emulator("l4", {"unsupported": ["power", "smClock"]})
    node = Node(nvml)
    await node.sampler.sample_once()
    got = node.scrape()
    uuid = node.inventory.gpus[0].uuid
    assert values(got, "gpudra_gpu_power_watts") == []
    assert only(got, "gpudra_gpu_metric_unavailable", uuid=uuid, metric="power") == 1
    assert only(got, "gpudra_gpu_metric_unavailable", uuid=uuid, metric="sm_clock") == 1
    assert only(got, "gpudra_gpu_temperature_celsius", uuid=uuid) == 35


async def test_a_lost_gpu_loses_its_series_not_the_sampler() -> None:
    nvml = emulator("h100-80gb-hbm3-x8")
    node = Node(nvml)
    lost = node.inventory.gpus[1].uuid
    nvml.lose_gpu(1)
    await node.sampler.sample_once()
    got = node.scrape()
    assert values(got, "gpudra_gpu_utilization_percent", uuid=lost) == []
    assert len(values(got, "gpudra_gpu_utilization_percent")) == 7
    assert values(got, "gpudra_gpu_metric_unavailable", uuid=lost)


async def test_memory_slices_are_billed_by_their_share_and_idle_while_under_threshold() -> None:
    nvml = emulator("l4", {"utilization": 2})
    gpu = inventory_of(nvml).gpus[0]
    nvml.nvmlInit()
    total = nvml.nvmlDeviceGetMemoryInfo(
        nvml.nvmlDeviceGetHandleByIndex(0), version=pynvml.nvmlMemory_v2
    ).total
    nvml.nvmlShutdown()
    infos = ClaimInfos()
    for uid, share, size in (("u1", "s1", total // 4), ("u2", "s2", total // 2)):
        infos.remember(
            uid,
            ClaimInfo(
                device_classes={("gpu-0", share): "gpu-slice.nvidia.com"},
                memory={("gpu-0", share): size},
            ),
        )
    tenants = NamespaceTenants()  # team-a and team-b are research's by their label
    tenants.list_tenants([gpu_tenant("research", namespaceSelector={"matchLabels": ORG})])
    tenants.list_namespaces([namespace("team-a", ORG), namespace("team-b", ORG)])
    node = Node(
        nvml,
        [
            claim("u1", "team-a", "a", "gpu-0", gpu.uuid, share_id="s1"),
            claim("u2", "team-b", "b", "gpu-0", gpu.uuid, share_id="s2"),
        ],
        infos,
        tenants=tenants,
        interval_s=100,
    )
    await node.sampler.sample_once()
    node.clock.now += 100
    await node.sampler.sample_once()
    got = node.scrape()
    a = {"namespace": "team-a", "tenant": "research", "sharing": "MemorySlice"}
    b = {"namespace": "team-b", "tenant": "research", "sharing": "MemorySlice"}
    assert counted(got, "gpudra_allocated_device_seconds_total", **a) == pytest.approx(25)
    assert counted(got, "gpudra_allocated_device_seconds_total", **b) == pytest.approx(50)
    assert counted(got, "gpudra_idle_device_seconds_total", **a) == pytest.approx(25)
    assert counted(
        got, "gpudra_allocated_device_seconds_total", device_class="gpu-slice.nvidia.com", **b
    ) == pytest.approx(50)
    assert only(got, "gpudra_device_idle_seconds", pod="a") == 100

    nvml.telemetry.script(0, utilization=80)  # busy: billed, not idle, idle gauge gone
    node.clock.now += 100
    await node.sampler.sample_once()
    got = node.scrape()
    assert counted(got, "gpudra_allocated_device_seconds_total", **a) == pytest.approx(50)
    assert counted(got, "gpudra_idle_device_seconds_total", **a) == pytest.approx(25)
    assert values(got, "gpudra_device_idle_seconds") == []


async def test_time_sliced_holders_split_a_gpu_equally() -> None:
    nvml = emulator("l4", {"utilization": 60})
    uuid = inventory_of(nvml).gpus[0].uuid
    node = Node(
        nvml,
        [
            claim(uid, f"ns-{uid}", uid, "gpu-0", uuid, time_slice=True)
            for uid in ("u1", "u2", "u3", "u4")
        ],
        interval_s=40,
    )
    await node.sampler.sample_once()
    node.clock.now += 40
    await node.sampler.sample_once()
    got = node.scrape()
    counter = "gpudra_allocated_device_seconds_total"
    billed = [
        counted(got, counter, namespace=f"ns-{uid}", sharing="TimeSlicing")
        for uid in ("u1", "u2", "u3", "u4")
    ]
    assert billed == [pytest.approx(10)] * 4
    assert values(got, "gpudra_idle_device_seconds_total") == [0.0] * 4
    assert len(values(got, "gpudra_gpu_utilization_percent", uuid=uuid)) == 4


DRIVER = "gpu.nvidia.com"


def plugin_config(tmp_path: Path, **settings: Any) -> PluginConfig:
    """A node service's plugin settings in `tmp_path`, with no driver on the machine."""
    return PluginConfig(
        kubelet_root=tmp_path / "kubelet",
        cdi_root=tmp_path / "cdi",
        state_dir=tmp_path / "state",
        toolkit_spec=False,
        driver_libraries=("usr/lib/libnvidia-ml.so.1",),
        **settings,
    )


def shares_claim(uid: str, namespace: str, share: str, taken: int) -> dict[str, Any]:
    """The claim object the scheduler allocated `taken` integer shares of gpu-0 to."""
    result = {
        "driver": DRIVER,
        "pool": POOL,
        "device": "gpu-0",
        "request": "gpu",
        "shareID": share,
        "consumedCapacity": {"shares": str(taken)},
    }
    return {
        "metadata": {"name": f"claim-{uid}", "namespace": namespace, "uid": uid},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def shares_info(uid: str, namespace: str, share: str, taken: int) -> ClaimInfo:
    """What the agent reads of a claim holding `taken` integer shares of gpu-0: the
    `claim_info` of the object the scheduler allocated."""
    obj = shares_claim(uid, namespace, share, taken)
    ref = ClaimRef(namespace, uid, obj["metadata"]["name"])
    return claim_info(obj, checked_claim(ref, obj, driver=DRIVER, pool=POOL))


BIG_HOLDER, SMALL_HOLDER = (f"00000000-0000-4000-8000-00000000000{i}" for i in (1, 2))


def shares_node(shares: dict[str, int]) -> tuple[Node, ClaimInfos]:
    """gpu-0 of an L4 at 60% held by two claims of integer shares: team-a's
    (`BIG_HOLDER`, share s1) took 3, team-b's (`SMALL_HOLDER`, s2) 1; the node's GPUs
    published with `shares`. The node, and what the agent read of the claims."""
    nvml = emulator("l4", {"utilization": 60})
    uuid = inventory_of(nvml).gpus[0].uuid
    infos = ClaimInfos()
    infos.remember(BIG_HOLDER, shares_info(BIG_HOLDER, "team-a", "s1", 3))
    infos.remember(SMALL_HOLDER, shares_info(SMALL_HOLDER, "team-b", "s2", 1))
    records = [
        claim(BIG_HOLDER, "team-a", "a", "gpu-0", uuid, share_id="s1"),
        claim(SMALL_HOLDER, "team-b", "b", "gpu-0", uuid, share_id="s2"),
    ]
    return Node(nvml, records, infos, shares=shares, interval_s=100), infos


async def test_integer_shares_are_billed_by_the_shares_each_holder_took() -> None:
    """On a GPU published with 4 shares, a claim that took 3 of them pays three times
    what one that took 1 pays: billed equally, the small holder paid for the big one's
    time. Some shares are time-sliced with the other shares' holders, no memory slice."""
    node, infos = shares_node({"gpu-0": 4})
    await node.sampler.sample_once()
    node.clock.now += 100
    await node.sampler.sample_once()
    assert billed(node) == {"team-a": pytest.approx(75), "team-b": pytest.approx(25)}
    got = node.scrape()
    assert {s.get("sharing") for n, s, _ in got if n.startswith("gpudra_allocated")} == {
        "TimeSlicing"
    }
    info = infos.snapshot()[SMALL_HOLDER]
    status = device_statuses(node.claims[1], driver=DRIVER, pool=POOL, info=info)
    assert status[0]["data"]["sharing"] == "TimeSlicing"


def slices_node(nvml: NvmlEmulator, sizes: dict[str, int]) -> Node:
    """gpu-0 held in memory slices of `sizes` bytes, one claim per namespace."""
    uuid = inventory_of(nvml).gpus[0].uuid
    infos = ClaimInfos()
    records = []
    for n, (ns, size) in enumerate(sizes.items()):
        infos.remember(f"u{n}", ClaimInfo(memory={("gpu-0", f"s{n}"): size}))
        records.append(claim(f"u{n}", ns, ns, "gpu-0", uuid, share_id=f"s{n}"))
    return Node(nvml, records, infos, interval_s=100)


async def test_memory_slices_are_billed_against_the_published_memory_when_a_reading_fails() -> None:
    """The scheduler divided the GPU's memory as the inventory published it: a sample
    whose memory call failed (here the GPU fell off the bus) split the slices equally,
    a 1 GiB slice beside a 20 GiB one paying half the GPU."""
    nvml = emulator("l4", {"utilization": 50})
    node = slices_node(nvml, {"small": GIB, "big": 20 * GIB})
    published = node.inventory.gpus[0].device.capacity["memory"]
    await node.sampler.sample_once()
    node.clock.now += 100
    await node.sampler.sample_once()
    before = billed(node)
    assert before["small"] == pytest.approx(100 * GIB / published)
    nvml.lose_gpu(0)
    for _ in range(2):
        node.clock.now += 100
        sample = await node.sampler.sample_once()
    [(_device, reading)] = sample.devices
    assert "memory_total" not in reading.values
    after = billed(node)
    assert after["small"] - before["small"] == pytest.approx(200 * GIB / published)
    assert after["big"] - before["big"] == pytest.approx(200 * 20 * GIB / published)


async def test_slices_or_shares_whose_whole_is_not_known_are_billed_nothing() -> None:
    """Without the memory the GPU is published with (no inventory yet), or the shares
    it is published with (no longer published with shares), no slice or share holder
    is billed an equal part of the GPU instead: that bills the small ones for the big."""
    node = slices_node(emulator("l4", {"utilization": 50}), {"small": GIB, "big": 20 * GIB})
    node.inventory = None
    await node.sampler.sample_once()
    node.clock.now += 100
    await node.sampler.sample_once()
    assert billed(node) == {}

    node, _ = shares_node({})
    await node.sampler.sample_once()
    node.clock.now += 100
    await node.sampler.sample_once()
    assert billed(node) == {}


def test_the_idle_threshold_must_be_a_percentage() -> None:
    with pytest.raises(ValueError, match="percentage"):
        Accounting(idle_below=150)


@pytest.mark.parametrize(("interval", "sampled"), [(10.0, True), (0.0, False)])
async def test_the_node_samples_and_writes_claim_status_only_when_switched_on(
    tmp_path: Path, interval: float, sampled: bool
) -> None:
    nvml = emulator("l4")
    config = plugin_config(tmp_path, sample_interval_s=interval, claim_status=sampled)
    async with ApiClient() as api:
        service = NodeService(AgentConfig(node_name=POOL), Kube(api), nvml, config)
        names = {family.name for family in service.registry.collect()}
    assert (service.sampler is not None) is sampled
    assert (service.status_writer is not None) is sampled
    assert ("gpudra_gpu_utilization_percent" in names) is sampled
    assert "gpudra_claim_operations" in names


def test_claim_infos_outlive_a_pass_between_the_read_and_the_checkpoint() -> None:
    now = [0.0]
    infos = ClaimInfos(pending_s=60, clock=lambda: now[0])
    infos.remember("u1", ClaimInfo())
    infos.retain([])  # the prepare has not written the checkpoint yet
    assert "u1" in infos.snapshot()
    infos.retain(["u1"])  # prepared
    infos.retain(["u1"])
    assert "u1" in infos.snapshot()
    infos.retain([])  # unprepared
    assert "u1" not in infos.snapshot()
    infos.remember("u2", ClaimInfo())  # read, but its prepare failed before the checkpoint
    now[0] += 61
    infos.retain([])
    assert infos.snapshot() == {}


async def test_holders_are_labelled_with_their_namespaces_tenant_as_it_changes() -> None:
    """The tenant is the namespace's now: set by a GpuTenant created while the claim
    is held, changed by a relabel, and empty when two tenants claim it equally."""
    nvml = emulator("l4", {"utilization": 50})
    uuid = inventory_of(nvml).gpus[0].uuid
    tenants = NamespaceTenants()
    node = Node(nvml, [claim("u1", "team-a", "a", "gpu-0", uuid)], tenants=tenants)

    def tenant_label() -> str:
        [labels] = [
            lab
            for name, lab, _ in node.scrape()
            if name == "gpudra_gpu_utilization_percent" and lab["pod"] == "a"
        ]
        return labels["tenant"]

    await node.sampler.sample_once()
    assert tenant_label() == ""  # nothing watched yet
    tenants.list_namespaces([namespace("team-a", ORG)])
    tenants.list_tenants([])
    await node.sampler.sample_once()
    assert tenant_label() == ""
    tenants.tenant_event("ADDED", gpu_tenant("research", namespaceSelector={"matchLabels": ORG}))
    await node.sampler.sample_once()
    assert tenant_label() == "research"
    tenants.namespace_event("MODIFIED", namespace("team-a", {"org": "vision"}))
    await node.sampler.sample_once()
    assert tenant_label() == ""
    tenants.tenant_event("ADDED", gpu_tenant("vision", namespaces=["team-a"]))
    await node.sampler.sample_once()
    assert tenant_label() == "vision"  # named beats selected by label
    tenants.tenant_event("ADDED", gpu_tenant("other", namespaces=["team-a"]))
    await node.sampler.sample_once()
    assert tenant_label() == ""  # ambiguous: billed to nobody
    tenants.tenant_event("DELETED", gpu_tenant("other", namespaces=["team-a"]))
    tenants.tenant_event("ADDED", gpu_tenant("broken", namespaces=["team-b"], maxDevicesPerPod=0))
    node.clock.now += 10
    await node.sampler.sample_once()
    assert tenant_label() == "vision"  # an invalid tenant elsewhere changes nothing here
    assert counted(node.scrape(), "gpudra_allocated_device_seconds_total", tenant="vision") == 10
    tenants.tenant_event(
        "MODIFIED", gpu_tenant("broken", namespaces=["team-a"], maxDevicesPerPod=0)
    )
    node.clock.now += 10
    await node.sampler.sample_once()
    assert tenant_label() == ""  # it names team-a too: the webhook denies, nobody is billed
    assert counted(node.scrape(), "gpudra_allocated_device_seconds_total", tenant="") == 10


def test_an_invalid_tenant_leaves_the_namespaces_it_would_decide_to_no_tenant() -> None:
    """As the webhook: an invalid GpuTenant's rules are unknown, so wherever it would
    win or tie, no other tenant's rules admitted the pods, and none is billed."""
    tenants = NamespaceTenants()
    tenants.list_namespaces([namespace("team-a", ORG), namespace("team-b", ORG)])
    research = gpu_tenant("research", namespaceSelector={"matchLabels": ORG})
    tenants.list_tenants([research, gpu_tenant("team-a", namespaces=["team-a"])])
    assert tenants.tenant_of("team-a") == "team-a"  # by name beats by label
    # An edit makes team-a invalid (an unknown field): it names team-a, so it decides there.
    tenants.tenant_event("MODIFIED", gpu_tenant("team-a", namespaces=["team-a"], typo=1))
    assert tenants.tenant_of("team-a") == ""
    assert tenants.tenant_of("team-b") == "research"  # out of its reach
    tenants.tenant_event("MODIFIED", gpu_tenant("team-a", namespaces=["team-a"]))  # fixed
    assert tenants.tenant_of("team-a") == "team-a"

    # By label, it ties a tenant that selects by label, and loses to one that names.
    broken = gpu_tenant("broken", namespaceSelector={"matchLabels": ORG}, typo=1)
    tenants.list_tenants([research, broken, gpu_tenant("team-a", namespaces=["team-a"])])
    assert tenants.tenant_of("team-b") == ""
    assert tenants.tenant_of("team-a") == "team-a"
    # A selector it cannot read is taken to select every namespace.
    unreadable = gpu_tenant("broken", namespaceSelector={"matchLabels": "org"})
    tenants.tenant_event("MODIFIED", unreadable)
    assert tenants.tenant_of("team-b") == ""
    tenants.tenant_event("DELETED", unreadable)
    assert tenants.tenant_of("team-b") == "research"


def billed(node: Node, name: str = "gpudra_allocated_device_seconds_total") -> dict[str, float]:
    """The counter `name`'s GPU-seconds by namespace in one scrape, what a series' first
    scrape withholds included, as a sum of the counters as they are takes them."""
    totals: dict[tuple[tuple[str, str], ...], float] = {}
    for n, labels, v in node.scrape():
        if n in (name, WITHHELD.get(name)):
            row = tuple(sorted(labels.items()))
            totals[row] = totals.get(row, 0.0) + v
    return {dict(row)["namespace"]: v for row, v in totals.items()}


async def test_a_claim_that_gets_a_device_is_billed_only_from_the_sample_it_held_it_at() -> None:
    """A holder change between two samples that the agent was not told the time of (as
    for claims prepared before it started): neither the claim that left nor the one
    that came is billed for that interval (the samples do not say when it happened),
    and the new claim never pays for the old one's time. Told changes are billed where
    they happened (test_accounting_spans.py)."""
    nvml = emulator("l4", {"utilization": 90})
    uuid = inventory_of(nvml).gpus[0].uuid
    node = Node(nvml, [claim("u1", "team-a", "a", "gpu-0", uuid)])
    await node.sampler.sample_once()
    node.clock.now += 10
    await node.sampler.sample_once()
    node.clock.now += 10
    node.claims = [claim("u2", "team-b", "b", "gpu-0", uuid)]  # team-a's pod ended
    await node.sampler.sample_once()
    assert billed(node) == {"team-a": pytest.approx(10)}
    node.clock.now += 10
    await node.sampler.sample_once()
    assert billed(node) == {"team-a": pytest.approx(10), "team-b": pytest.approx(10)}
    # The same namespace and pod name, another claim (a re-created pod): not the same.
    node.clock.now += 10
    node.claims = [claim("u3", "team-b", "b", "gpu-0", uuid)]
    await node.sampler.sample_once()
    assert billed(node) == {"team-a": pytest.approx(10), "team-b": pytest.approx(10)}


async def test_a_shared_gpus_holders_keep_their_own_shares_as_others_come_and_go() -> None:
    nvml = emulator("l4", {"utilization": 90})
    uuid = inventory_of(nvml).gpus[0].uuid

    def sliced(uid: str) -> ClaimRecord:
        return claim(uid, f"ns-{uid}", uid, "gpu-0", uuid, time_slice=True)

    node = Node(nvml, [sliced("u1"), sliced("u2")])
    await node.sampler.sample_once()
    node.clock.now += 10
    node.claims = [sliced("u2")]  # u1 left: u2 still pays its half, not u1's
    await node.sampler.sample_once()
    assert billed(node) == {"ns-u2": pytest.approx(5)}
    node.clock.now += 10
    await node.sampler.sample_once()
    assert billed(node) == {"ns-u2": pytest.approx(15)}
    node.clock.now += 10
    node.claims = [sliced("u2"), sliced("u3")]  # u3 came: u2 pays half, u3 nothing yet
    await node.sampler.sample_once()
    assert billed(node) == {"ns-u2": pytest.approx(20)}
    node.clock.now += 10
    await node.sampler.sample_once()
    assert billed(node) == {"ns-u2": pytest.approx(25), "ns-u3": pytest.approx(5)}


async def test_idle_time_is_each_holders_own() -> None:
    """A claim that gets a device another left idle does not inherit its idle time (nor
    its GpuAllocatedIdle alert); on a shared device each holder has its own."""
    nvml = emulator("l4", {"utilization": 0})
    uuid = inventory_of(nvml).gpus[0].uuid
    node = Node(nvml, [claim("u1", "team-a", "a", "gpu-0", uuid)], interval_s=3600)
    for _ in range(3):
        await node.sampler.sample_once()
        node.clock.now += 3600
    assert billed(node, "gpudra_device_idle_seconds") == {"team-a": 7200}
    node.claims = [claim("u2", "team-b", "b", "gpu-0", uuid)]
    await node.sampler.sample_once()
    assert billed(node, "gpudra_device_idle_seconds") == {"team-b": 0}
    assert billed(node, "gpudra_idle_device_seconds_total") == {"team-a": pytest.approx(7200)}

    node.claims = [claim("u1", "team-a", "a", "gpu-0", uuid, time_slice=True)]
    await node.sampler.sample_once()
    node.clock.now += 600
    node.claims.append(claim("u2", "team-b", "b", "gpu-0", uuid, time_slice=True))
    await node.sampler.sample_once()
    assert billed(node, "gpudra_device_idle_seconds") == {"team-a": 600, "team-b": 0}


async def test_a_hopper_mig_device_reports_its_own_utilization_through_gpm() -> None:
    """H100: GPM measures each MIG instance's SMs, from the second pass on (two samples
    make a figure), never the parent's value; the samples of a destroyed MIG device are
    freed."""
    doc = load_builtin_profile("h100-80gb-mig-r580").model_dump(mode="json")
    doc["gpus"][0]["telemetry"] = {"utilization": 97}
    doc["gpus"][0]["migInstances"] = [
        {"profileId": 19, "placementStart": 0},
        {"profileId": 19, "placementStart": 1},
    ]
    nvml = NvmlEmulator(parse_profile(doc))
    gpu = inventory_of(nvml).gpus[0]
    busy, quiet = (m.uuid for m in gpu.mig_devices)
    assert busy is not None and quiet is not None
    nvml.telemetry.script(busy, utilization=64)
    node = Node(nvml)
    await node.sampler.sample_once()
    got = node.scrape()
    assert values(got, "gpudra_gpu_utilization_percent", mig_uuid=busy) == []
    first = {"uuid": busy, "metric": "utilization", "reason": "first_gpm_sample"}
    assert only(got, "gpudra_gpu_metric_unavailable", **first) == 1

    node.clock.now += 10
    await node.sampler.sample_once()
    got = node.scrape()
    mine = {"utilization_scope": "mig_instance", "gpu_uuid": gpu.uuid}
    assert only(got, "gpudra_gpu_utilization_percent", mig_uuid=busy, **mine) == 64
    # Not scripted on its own: GPM measures the instance as the GPU's load, 97 here.
    assert only(got, "gpudra_gpu_utilization_percent", mig_uuid=quiet, **mine) == 97
    for mig_uuid in (busy, quiet):
        mig_util = {"uuid": mig_uuid, "metric": "utilization"}
        assert values(got, "gpudra_gpu_metric_unavailable", **mig_util) == []
    # The MIG-enabled parent has none (nvml.h), and says so.
    parent = {"uuid": gpu.uuid, "metric": "utilization", "reason": "not_supported"}
    assert only(got, "gpudra_gpu_metric_unavailable", **parent) == 1

    nvml.telemetry.script(busy, utilization=3)
    await node.sampler.sample_once()
    assert only(node.scrape(), "gpudra_gpu_utilization_percent", mig_uuid=busy) == 3

    assert nvml.gpm_samples_held() == 2  # the last one of each MIG device
    # The MIG devices gone from the inventory (destroyed): their samples are freed.
    node.inventory = inventory_of(NvmlEmulator(load_builtin_profile("h100-80gb-mig-r580")))
    await node.sampler.sample_once()
    assert nvml.gpm_samples_held() == 0


def repeated(samples: list[tuple[str, dict[str, str], float]]) -> list[str]:
    """The series that appear more than once with one label set (Prometheus drops them)."""
    seen = Counter((name, tuple(sorted(labels.items()))) for name, labels, _ in samples)
    return sorted(name for (name, _), count in seen.items() if count > 1)


async def test_an_admin_access_claim_holds_nothing_to_be_idle_or_underused() -> None:
    """A monitoring pod's admin-access claim on a free, idle GPU: not billed, and no
    series names it as the GPU's holder, so neither GpuAllocatedIdle nor
    GpuLowUtilization fires for every GPU a monitoring DaemonSet reads."""
    nvml = emulator("l4", {"utilization": 0})
    uuid = inventory_of(nvml).gpus[0].uuid
    probe = claim("m1", "monitoring", "dcgm-probe", "gpu-0", uuid, admin_access=True)
    node = Node(nvml, [probe], interval_s=3600)
    for _ in range(3):
        await node.sampler.sample_once()
        node.clock.now += 3600
    got = node.scrape()
    assert values(got, "gpudra_device_idle_seconds") == []
    assert values(got, "gpudra_allocated_device_seconds_total") == []
    assert only(got, "gpudra_gpu_utilization_percent", uuid=uuid, namespace="", pod="") == 0
    assert values(got, "gpudra_gpu_utilization_percent", namespace="monitoring") == []

    # Beside a holder: the holder's series and idle time, none for the probe.
    node.claims = [claim("u1", "team-a", "a", "gpu-0", uuid), probe]
    await node.sampler.sample_once()
    node.clock.now += 3600
    await node.sampler.sample_once()
    got = node.scrape()
    assert billed(node, "gpudra_device_idle_seconds") == {"team-a": 3600}
    assert {lab["namespace"] for n, lab, _ in got if n == "gpudra_gpu_utilization_percent"} == {
        "team-a"
    }


async def test_one_claim_holding_two_slices_of_a_gpu_is_one_series_per_label_set() -> None:
    """Two memory slices of gpu-0 for one request of one claim are one holder (as it is
    billed), and a claim re-created under its name while the old one is still prepared
    has the same labels: each family has each label set once."""
    nvml = emulator("l4", {"utilization": 2, "eccCorrected": 1})
    uuid = inventory_of(nvml).gpus[0].uuid
    first = claim("u1", "team-a", "trainer", "gpu-0", uuid, share_id="s1")
    two = replace(first, devices=(first.devices[0], replace(first.devices[0], share_id="s2")))
    node = Node(nvml, [two])
    prepared = Checkpoint(Path("unused"), boot_id=None, claims={"u1": two})
    node.registry.register(PreparedDevices(lambda: prepared, POOL))
    await node.sampler.sample_once()
    node.clock.now += 10
    await node.sampler.sample_once()
    got = node.scrape()
    assert repeated(got) == []
    assert only(got, "gpudra_gpu_utilization_percent", pod="trainer") == 2
    assert only(got, "gpudra_device_idle_seconds", pod="trainer") == 10
    assert only(got, "gpudra_prepared_device_info", pod="trainer") == 1

    again = replace(
        claim("u2", "team-a", "trainer", "gpu-0", uuid, time_slice=True), name=first.name
    )
    node.claims = [replace(first, devices=(replace(first.devices[0], share_id=None),)), again]
    await node.sampler.sample_once()
    node.clock.now += 10
    await node.sampler.sample_once()
    assert repeated(node.scrape()) == []


async def test_a_stalled_sampler_withdraws_the_device_series_and_says_how_old_they_are() -> None:
    """A pass that hangs in NVML or keeps failing leaves the last sample in place: past
    three intervals its values are withdrawn (absent, not frozen) and the age says why;
    the time of the stall is billed to nobody, and idle runs start again after it."""
    nvml = emulator("l4", {"utilization": 1})
    uuid = inventory_of(nvml).gpus[0].uuid
    node = Node(nvml, [claim("u1", "team-a", "a", "gpu-0", uuid)])
    node.clock.now += 5
    got = node.scrape()  # nothing sampled yet: the age counts from the start
    assert only(got, "gpudra_sample_age_seconds") == 5
    assert only(got, "gpudra_sample_stale_after_seconds") == 30
    await node.sampler.sample_once()
    node.clock.now += 10
    await node.sampler.sample_once()
    node.clock.now += 30  # three intervals: a late pass, not yet a stall
    got = node.scrape()
    assert only(got, "gpudra_sample_age_seconds") == 30
    assert only(got, "gpudra_gpu_utilization_percent", pod="a") == 1
    assert only(got, "gpudra_device_idle_seconds", pod="a") == 10

    def broken() -> None:
        raise RuntimeError("the driver is wedged")

    nvml.nvmlInit = broken  # type: ignore[method-assign]
    for _ in range(360):  # an hour of failing passes
        node.clock.now += 10
        with pytest.raises(RuntimeError):
            await node.sampler.sample_once()
    got = node.scrape()
    assert only(got, "gpudra_sample_age_seconds") == 3630
    for name in ("gpudra_gpu_utilization_percent", "gpudra_gpu_temperature_celsius"):
        assert values(got, name) == []
    assert values(got, "gpudra_device_idle_seconds") == []
    assert billed(node, "gpudra_idle_device_seconds_total") == {"team-a": pytest.approx(10)}

    del nvml.nvmlInit  # the driver answers again, the GPU still idle
    await node.sampler.sample_once()
    got = node.scrape()
    assert only(got, "gpudra_sample_age_seconds") == 0
    assert only(got, "gpudra_gpu_utilization_percent", pod="a") == 1
    assert only(got, "gpudra_device_idle_seconds", pod="a") == 0  # idle since now, as known
    assert billed(node) == {"team-a": pytest.approx(10)}  # the stall is billed to nobody
    assert billed(node, "gpudra_idle_device_seconds_total") == {"team-a": pytest.approx(10)}


HOUR = 3600


def h100_mig(*instances: tuple[int, int], utilization: float = 50) -> NvmlEmulator:
    """An H100 with MIG enabled and the MIG devices (GI profile ID, placement start)."""
    doc = load_builtin_profile("h100-80gb-mig-r580").model_dump(mode="json")
    doc["gpus"][0]["telemetry"] = {"utilization": utilization}
    doc["gpus"][0]["migInstances"] = [
        {"profileId": profile, "placementStart": start} for profile, start in instances
    ]
    return NvmlEmulator(parse_profile(doc))


def mig_claim(
    uid: str,
    namespace: str,
    device: Device,
    mig_uuid: str,
    *,
    created: bool = False,
    time_slice: bool = False,
) -> ClaimRecord:
    """A claim holding a MIG device as prepare records it: one that existed (static
    MIG), or with `created` one its prepare made at `device`'s placement (dynamic)."""
    at = device.placement
    assert at is not None
    mig = (
        CreatedMig(at.profile_id, at.profile, at.start, at.size) if created else UsedMig(None, None)
    )
    details = DeviceDetails(
        type="mig",
        gpu_uuid=device.parent_uuid,
        uuid=mig_uuid,
        pod=f"pod-{uid}",
        mig=mig,
        time_slice=TimeSliceSet(mig_uuid, 1) if time_slice else None,
    )
    record = DeviceRecord(
        pool=POOL,
        device=device.name,
        request_names=("gpu",),
        exclusive=not time_slice,
        details=details,
    )
    return ClaimRecord(
        uid=uid,
        namespace=namespace,
        name=f"claim-{uid}",
        state=ClaimState.PREPARE_COMPLETED,
        devices=(record,),
    )


async def held_for_an_hour(node: Node) -> dict[str, float]:
    """Namespace -> GPU-hours billed, after two samples an hour apart."""
    await node.sampler.sample_once()
    node.clock.now += HOUR
    await node.sampler.sample_once()
    return {ns: seconds / HOUR for ns, seconds in billed(node).items()}


async def seven_1g_tenants(utilization: float = 50) -> Node:
    """One H100 in seven 1g.10gb instances, each held by a namespace of its own
    (team-0 to team-6) for one hour."""
    nvml = h100_mig(*((19, start) for start in range(7)), utilization=utilization)
    node = Node(nvml, interval_s=HOUR)
    node.claims = [
        mig_claim(f"u{i}", f"team-{i}", mig, str(mig.uuid))
        for i, mig in enumerate(node.inventory.gpus[0].mig_devices)
    ]
    await held_for_an_hour(node)
    return node


async def test_seven_1g_instances_of_one_gpu_bill_one_gpu_hour_per_hour() -> None:
    """A MIG device bills its compute slices' part of its GPU: each 1g of an H100 a
    seventh, so the seven of them, held an hour, are one GPU-hour, as the GPU held whole
    is (and as seven 10 GiB memory slices of it would be near enough)."""
    node = await seven_1g_tenants(utilization=2)  # idle: the idle counter follows
    per_namespace = {ns: seconds / HOUR for ns, seconds in billed(node).items()}
    assert per_namespace == {f"team-{i}": pytest.approx(1 / 7) for i in range(7)}
    assert sum(per_namespace.values()) == pytest.approx(1.0)
    idle = billed(node, "gpudra_idle_device_seconds_total")
    assert sum(idle.values()) / HOUR == pytest.approx(1.0)


async def test_a_3g_and_a_4g_made_by_prepares_bill_one_gpu_hour_together() -> None:
    """Dynamic MIG: the instances a prepare created after discovery, billed by the
    placements' profiles as discovery read them, three and four sevenths."""
    nvml = h100_mig()
    inventory = inventory_of(nvml)  # before the instances exist
    gpu = inventory.gpus[0]
    claims = []
    for uid, name in (("u3", "gpu-0-mig-3g40gb-9-4"), ("u4", "gpu-0-mig-4g40gb-5-0")):
        device = inventory.find(name)
        assert device is not None and device.placement is not None
        gi = create_gpu_instance(nvml, gpu.uuid, device.placement)
        _, mig_uuid = create_compute_instance(nvml, gpu.uuid, gi)
        claims.append(mig_claim(uid, f"team-{uid}", device, mig_uuid, created=True))
    node = Node(nvml, claims, interval_s=HOUR)
    node.inventory = inventory
    got = await held_for_an_hour(node)
    assert got == {"team-u3": pytest.approx(3 / 7), "team-u4": pytest.approx(4 / 7)}
    assert sum(got.values()) == pytest.approx(1.0)


async def test_time_sliced_holders_of_a_mig_device_split_its_share_of_the_gpu() -> None:
    """Two claims time-slicing one 1g instance: each half of its seventh."""
    nvml = h100_mig((19, 0))
    node = Node(nvml, interval_s=HOUR)
    [mig] = node.inventory.gpus[0].mig_devices
    node.claims = [
        mig_claim(uid, f"team-{uid}", mig, str(mig.uuid), time_slice=True) for uid in ("a", "b")
    ]
    got = await held_for_an_hour(node)
    assert got == {"team-a": pytest.approx(1 / 14), "team-b": pytest.approx(1 / 14)}
    assert {k.sharing for k in node.accounting.allocated()} == {"TimeSlicing"}


async def test_a_mig_device_the_inventory_does_not_name_is_billed_nothing() -> None:
    """Its part of the GPU unknown (no view names it: no inventory yet), a MIG device
    is billed nothing rather than a guess, since billed whole one 1g would pay for
    seven; its series still name its holder, and a whole GPU is billed all the same."""
    nvml = h100_mig((19, 0))
    node = Node(nvml, interval_s=HOUR)
    [mig] = node.inventory.gpus[0].mig_devices
    l4 = inventory_of(emulator("l4")).gpus[0]
    node.claims = [
        mig_claim("m", "team-mig", mig, str(mig.uuid)),
        # A whole GPU is all of itself, inventory or not (not sampled here: no matter).
        claim("g", "team-gpu", "g", l4.device.name, l4.uuid),
    ]
    node.inventory = replace(node.inventory, gpus=())
    assert await held_for_an_hour(node) == {"team-gpu": pytest.approx(1.0)}
    got = node.scrape()
    assert values(
        got, "gpudra_gpu_memory_total_bytes", mig_uuid=str(mig.uuid), namespace="team-mig"
    )


def test_the_default_tenant_bills_no_namespace_the_webhook_never_reviews() -> None:
    """As the webhook: the default tenant (an empty selector) governs the namespaces no
    other tenant selects, but never kube-system nor the agent's own namespace, whose
    pods the webhook never reviews: their GPU use is billed to no tenant."""
    tenants = NamespaceTenants(own_namespace="gpudra")
    tenants.list_namespaces(
        [namespace(n, {}) for n in ("kube-system", "gpudra", "scratch")]
        + [namespace("team-a", ORG)]
    )
    default = gpu_tenant("default", namespaceSelector={})
    research = gpu_tenant("research", namespaceSelector={"matchLabels": ORG})
    tenants.list_tenants([default, research])
    assert tenants.tenant_of("scratch") == "default"
    assert tenants.tenant_of("team-a") == "research"  # a label selector wins
    assert tenants.tenant_of("kube-system") == ""
    assert tenants.tenant_of("gpudra") == ""
    # An invalid default tenant would decide only where it would govern.
    tenants.list_tenants([gpu_tenant("default", namespaceSelector={}, typo=1), research])
    assert tenants.tenant_of("scratch") == ""
    assert tenants.tenant_of("team-a") == "research"
