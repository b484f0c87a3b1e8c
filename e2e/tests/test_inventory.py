"""Issue: GPU inventory on the real control plane. Node agents with emulated NVML
publish slices; the real scheduler allocates against them; health taints steer it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import pynvml
import pytest
from gpudra.api.config import GpuConfig
from gpudra.api.deviceclasses import device_classes
from gpudra.api.sharing import resolve_sharing
from gpudra.cli.main import build_parser
from gpudra.cli.node import _agent_config
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.checkpoint import ClaimRecord, ClaimState, DeviceRecord
from gpudra.driver.claimreader import ApiClaims
from gpudra.driver.claims import ClaimRef, checked_claim
from gpudra.driver.claimstatus import ClaimStatusWriter
from gpudra.driver.devices import MigStrategy
from gpudra.driver.health import HealthPolicy
from gpudra.driver.holders import ClaimInfos
from gpudra.driver.nvml import NvmlEmulator, NvmlLibrary, load_nvml
from gpudra.driver.nvml.emulator import load_builtin_profile, parse_profile
from gpudra.driver.records import DeviceDetails

from e2e import features, smoke
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import ApiError
from e2e.cluster.kube import Kube as SyncKube
from e2e.tenant_user import pod_bound_token, token_kubeconfig
from e2e.tools import helm

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
DRIVER = "gpu.nvidia.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
RBAC = "/apis/rbac.authorization.k8s.io/v1"


RECOVERY_S = 10.0
"""Quiet after which a taint that heals by time is lifted (scaled down from the default):
long enough for a loaded machine to create a namespace, its claims and pods, and have
the scheduler judge them, while the taint they are judged against is still published."""


@dataclass
class Node:
    agent: NodeAgent
    nvml: Any


R590 = "590.48.01"
"""worker-1's driver: R590 adds the one entry point gpudra reads that R580 lacks, the
unrepairable-memory flag, so its GPUs answer every call discovery and health make."""


ATS_GPU = 5
"""worker-1's GPU whose NVML says ATS (as a Grace system's would); the others say HMM."""


def on_driver(profile: str, version: str, node: str) -> NvmlLibrary:
    """Built-in `profile`'s GPUs on driver `version`, each GPU's addressing mode HMM but
    GPU `ATS_GPU`'s (no product profile has one: none was read off a real GPU)."""
    document = load_builtin_profile(profile).model_dump(mode="json")
    document["driverVersion"] = version
    for i, gpu in enumerate(document["gpus"]):
        gpu["addressingMode"] = (
            pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS
            if i == ATS_GPU
            else pynvml.NVML_DEVICE_ADDRESSING_MODE_HMM
        )
    return NvmlEmulator(parse_profile(document), uuid_salt=node, source=f"{profile} on {version}")


def profile_nvml(node: str, profile: str, driver: str | None = None) -> NvmlLibrary:
    """Built-in `profile`'s GPUs for `node`, on driver `driver` (None: the profile's)."""
    if driver is not None:
        return on_driver(profile, driver, node)
    return load_nvml(f"emulated:{profile}", uuid_salt=node)


@asynccontextmanager
async def agents(
    cluster: Cluster,
    kube: SyncKube,
    nvmls: Mapping[str, tuple[NvmlLibrary, MigStrategy]],
    **options: Any,
) -> AsyncIterator[dict[str, Node]]:
    """A node agent for each node of `nvmls` (its GPUs and MIG strategy; `options` are
    more of `AgentConfig`), its slices written before this yields; every slice of the
    driver deleted after."""
    for dc in device_classes(DRIVER):
        kube.apply(dc)
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    policy = HealthPolicy(driver_name=DRIVER, recovery_after_s=RECOVERY_S)
    out: dict[str, Node] = {}
    async with anyio.create_task_group() as tg:
        for node, (nvml, strategy) in nvmls.items():
            config = AgentConfig(
                node_name=node,
                driver_name=DRIVER,
                mig_strategy=strategy,
                health=policy,
                **options,
            )
            agent = NodeAgent(config, akube, nvml)
            await tg.start(agent.run)
            out[node] = Node(agent, nvml)
        for n in out.values():
            await n.agent.slices.converged.wait()
        yield out
        tg.cancel_scope.cancel()
    for o in kube.list("ResourceSlice"):
        if o["spec"]["driver"] == DRIVER:
            kube.delete("ResourceSlice", o["metadata"]["name"])
    await akube.close()


@pytest.fixture
async def nodes(cluster: Cluster, kube: SyncKube) -> AsyncIterator[dict[str, Node]]:
    nvmls = {
        "worker-1": (profile_nvml("worker-1", "h100-80gb-hbm3-x8", R590), MigStrategy.DYNAMIC),
        "worker-2": (profile_nvml("worker-2", "a100-40gb-mig-mixed"), MigStrategy.STATIC),
    }
    async with agents(cluster, kube, nvmls) as out:
        yield out


def claim_pod(kube: SyncKube, ns: str, name: str, exactly: dict[str, Any]) -> None:
    kube.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
        }
    )
    kube.create(smoke.pod_with_template(ns, name, name))


async def allocation(kube: SyncKube, ns: str, pod: str, limit_s: float = 60) -> dict[str, Any]:
    with anyio.fail_after(limit_s):
        while True:
            p = kube.get("Pod", pod, ns)
            st = p.get("status", {}).get("resourceClaimStatuses") or []
            if p["spec"].get("nodeName") and st:
                claim = kube.get("ResourceClaim", st[0]["resourceClaimName"], ns)
                result: dict[str, Any] = claim["status"]["allocation"]["devices"]["results"][0]
                return result
            await anyio.sleep(0.2)


async def unschedulable(kube: SyncKube, ns: str, pod: str, limit_s: float = 60) -> str:
    with anyio.fail_after(limit_s):
        while True:
            conds = kube.get("Pod", pod, ns).get("status", {}).get("conditions") or []
            for c in conds:
                if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                    return str(c.get("message", ""))
            await anyio.sleep(0.2)


def scheduler_error(kube: SyncKube, ns: str, pod: str) -> str:
    """The message of the pod's `SchedulerError` condition: a filter failed, rather than
    no node fitting (a CEL runtime error, for one); "" while there is none."""
    for c in kube.get("Pod", pod, ns).get("status", {}).get("conditions") or []:
        if c["type"] == "PodScheduled" and c.get("reason") == "SchedulerError":
            return str(c.get("message", ""))
    return ""


async def published(kube: SyncKube, node: str) -> dict[str, dict[str, Any]]:
    """The node's devices by name, as the scheduler reads its pool: from the slices of
    the newest generation, once all of them are written. The agent writes a generation
    slice by slice, and a device tainted moves to a slice of its own (`plan_slices`),
    so a read between two writes can find it in none: it reads again then."""
    query = {"fieldSelector": f"spec.nodeName={node},spec.driver={DRIVER}"}
    with anyio.fail_after(30):
        while True:
            items = kube.request("GET", SLICES, query=query)["items"]
            newest = max((o["spec"]["pool"]["generation"] for o in items), default=None)
            current = [o for o in items if o["spec"]["pool"]["generation"] == newest]
            if current and len(current) == current[0]["spec"]["pool"]["resourceSliceCount"]:
                return {d["name"]: d for o in current for d in o["spec"].get("devices", [])}
            await anyio.sleep(0.05)


async def test_h100_node_publishes_upstream_names_and_attributes(
    nodes: dict[str, Node], kube: SyncKube
) -> None:
    devs = await published(kube, "worker-1")
    whole = {n for n, d in devs.items() if d["attributes"]["type"]["string"] == "gpu"}
    assert whole == {f"gpu-{i}" for i in range(8)}
    g0 = devs["gpu-0"]
    assert g0["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    # NVML reports 81559 MiB for an H100 80GB HBM3, as the real board does.
    assert int(g0["capacity"]["memory"]["value"]) == 81559 * 1024**2
    for key in (
        "resource.kubernetes.io/pciBusID",
        "resource.kubernetes.io/pcieRoot",
        "cudaComputeCapability",
        "driverVersion",
        "uuid",
        "architecture",
    ):
        assert key in g0["attributes"], key


async def test_cel_selector_on_product_and_memory_is_allocated(
    nodes: dict[str, Node], kube: SyncKube
) -> None:
    ns = smoke.make_namespace(kube, "inv")
    sel = (
        f'device.attributes["{DRIVER}"].productName == "NVIDIA H100 80GB HBM3" && '
        f'device.capacity["{DRIVER}"].memory.compareTo(quantity("40Gi")) >= 0'
    )
    claim_pod(
        kube,
        ns,
        "h100",
        {"deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": sel}}]},
    )
    res = await allocation(kube, ns, "h100")
    assert res["pool"] == "worker-1" and res["device"].startswith("gpu-")
    kube.delete("Namespace", ns)


async def test_static_mig_device_from_a100_profile_is_allocated(
    nodes: dict[str, Node], kube: SyncKube
) -> None:
    migs = {
        n: d
        for n, d in (await published(kube, "worker-2")).items()
        if d["attributes"]["type"]["string"] == "mig"
    }
    assert migs, "the A100 mixed profile has MIG devices"
    _, dev = sorted(migs.items())[0]
    profile = dev["attributes"]["profile"]["string"]
    ns = smoke.make_namespace(kube, "mig")
    sel = f'device.attributes["{DRIVER}"].profile == "{profile}"'
    claim_pod(
        kube,
        ns,
        "mig",
        {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": sel}}]},
    )
    res = await allocation(kube, ns, "mig")
    assert res["pool"] == "worker-2"
    assert migs[res["device"]]["attributes"]["profile"]["string"] == profile
    kube.delete("Namespace", ns)


R570 = "570.172.08"
"""A driver whose NVML has no addressing mode (nvmlDeviceGetAddressingMode is R580's)."""


@pytest.fixture
async def mixed_drivers(cluster: Cluster, kube: SyncKube) -> AsyncIterator[dict[str, Node]]:
    """Whole H100s on two drivers, as in a cluster partway through a driver upgrade:
    worker-1's on R590, worker-2's on R570."""
    nvmls = {
        node: (profile_nvml(node, "h100-80gb-hbm3-x8", driver), MigStrategy.DYNAMIC)
        for node, driver in (("worker-1", R590), ("worker-2", R570))
    }
    async with agents(cluster, kube, nvmls) as out:
        yield out


async def test_a_selector_on_the_addressing_mode_must_ask_for_the_key_first(
    mixed_drivers: dict[str, Node], kube: SyncKube
) -> None:
    """Upstream's `addressingMode`, through the real API server and scheduler. worker-1's
    GPUs carry it, one of them ATS; worker-2's, on a driver before R580, do not. A
    selector that reads the key outright fails the pod's scheduling on worker-2's GPUs
    (a CEL runtime error aborts the allocation), though worker-1 has the GPU it wants;
    asking for the key first, as docs/gpus.md says, gets that GPU."""
    modes = {
        node: {
            n: d["attributes"].get("addressingMode")
            for n, d in (await published(kube, node)).items()
        }
        for node in mixed_drivers
    }
    assert modes == {
        "worker-1": {f"gpu-{i}": {"string": "ATS" if i == ATS_GPU else "HMM"} for i in range(8)},
        "worker-2": {f"gpu-{i}": None for i in range(8)},
    }
    ns = smoke.make_namespace(kube, "addressing")
    attrs = f'device.attributes["{DRIVER}"]'
    wants_ats = f'{attrs}.addressingMode == "ATS"'
    for pod, sel in (
        ("outright", wants_ats),
        ("guarded", f'"addressingMode" in {attrs} && {wants_ats}'),
    ):
        claim_pod(
            kube,
            ns,
            pod,
            {"deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": sel}}]},
        )
    res = await allocation(kube, ns, "guarded")
    assert (res["pool"], res["device"]) == ("worker-1", f"gpu-{ATS_GPU}")
    with anyio.fail_after(60):
        while not (why := scheduler_error(kube, ns, "outright")):
            await anyio.sleep(0.2)
    assert "no such key: addressingMode" in why
    assert not kube.get("Pod", "outright", ns)["spec"].get("nodeName")
    kube.delete("Namespace", ns)


# Upstream's quickstart (demo/specs/quickstart/v1/gpu-test6.yaml) selects on `index`,
# which upstream published until v25.8.0 and gpudra publishes with --legacy-attributes.
QUICKSTART_INDEX_SELECTOR = "device.attributes['gpu.nvidia.com'].index == 0"


async def test_a_selector_on_the_legacy_index_needs_the_option(
    nodes: dict[str, Node], kube: SyncKube
) -> None:
    """Off by default, the quickstart's `index == 0` matches no device and its pod waits;
    once the node publishes with `--legacy-attributes` the scheduler gives it GPU index 0."""
    ns = smoke.make_namespace(kube, "legacy")
    sel = {"cel": {"expression": QUICKSTART_INDEX_SELECTOR}}
    claim_pod(kube, ns, "p", {"deviceClassName": "gpu.nvidia.com", "selectors": [sel]})
    # Not merely unschedulable: the scheduler's CEL evaluation fails on the missing key,
    # and says so on the pod, which is what a user of such a manifest sees.
    with anyio.fail_after(60):
        while not (why := scheduler_error(kube, ns, "p")):
            await anyio.sleep(0.2)
    assert "no such key: index" in why
    assert not kube.get("Pod", "p", ns)["spec"].get("nodeName")
    agent = nodes["worker-1"].agent
    agent.config = replace(agent.config, legacy_attributes=True)  # as after a restart with it
    agent.slices.trigger()
    res = await allocation(kube, ns, "p")
    assert (res["pool"], res["device"]) == ("worker-1", "gpu-0")
    assert (await published(kube, "worker-1"))["gpu-0"]["attributes"]["index"] == {"int": 0}
    kube.delete("Namespace", ns)


async def test_deleted_slice_is_restored(nodes: dict[str, Node], kube: SyncKube) -> None:
    items = kube.request("GET", SLICES, query={"fieldSelector": "spec.nodeName=worker-1"})["items"]
    victim = next(o for o in items if o["spec"]["driver"] == DRIVER)["metadata"]["name"]
    kube.delete("ResourceSlice", victim)
    with anyio.fail_after(30):
        while kube.get_or_none("ResourceSlice", victim) is None:
            await anyio.sleep(0.1)


async def tainted(kube: SyncKube, node: str, device: str) -> list[dict[str, Any]]:
    """The device's taints as the scheduler reads them, once it has any (30 s at most)."""
    with anyio.fail_after(30):
        while not (taints := (await published(kube, node))[device].get("taints")):
            await anyio.sleep(0.05)
    return list(taints)


async def test_xid_taint_steers_scheduler_and_clears(
    nodes: dict[str, Node], kube: SyncKube
) -> None:
    if reason := features.device_taints(kube):
        pytest.skip(reason)
    node = nodes["worker-1"]
    uuid = (await published(kube, "worker-1"))["gpu-3"]["attributes"]["uuid"]["string"]
    # An NVLink error: critical, but decoded first, with no GPU reset by default: it heals.
    node.nvml.inject_xid(3, 74)
    (taint,) = await tainted(kube, "worker-1", "gpu-3")
    assert taint["key"] == f"{DRIVER}/xid" and taint["value"] == "74"
    assert taint["effect"] == "NoSchedule"

    ns = smoke.make_namespace(kube, "taint")
    sel = {"cel": {"expression": f'device.attributes["{DRIVER}"].uuid == "{uuid}"'}}
    claim_pod(kube, ns, "plain", {"deviceClassName": "gpu.nvidia.com", "selectors": [sel]})
    claim_pod(
        kube,
        ns,
        "tolerant",
        {
            "deviceClassName": "gpu.nvidia.com",
            "selectors": [sel],
            "tolerations": [{"key": f"{DRIVER}/xid", "operator": "Exists", "effect": "NoSchedule"}],
        },
    )
    msg = await unschedulable(kube, ns, "plain")
    assert msg
    res = await allocation(kube, ns, "tolerant")
    assert res["device"] == "gpu-3"
    # After `recovery_after_s` without new errors the taint is removed, no restart.
    with anyio.fail_after(60):
        while (await published(kube, "worker-1"))["gpu-3"].get("taints"):
            await anyio.sleep(0.2)
    kube.delete("Namespace", ns)


async def on_worker_1_gpu(kube: SyncKube, device: str) -> dict[str, Any]:
    """A request for exactly that whole GPU of worker-1, selected by its UUID."""
    uuid = (await published(kube, "worker-1"))[device]["attributes"]["uuid"]["string"]
    sel = {"cel": {"expression": f'device.attributes["{DRIVER}"].uuid == "{uuid}"'}}
    return {"deviceClassName": "gpu.nvidia.com", "selectors": [sel]}


def taint_rule(kube: SyncKube, device: str, effect: str) -> AbstractContextManager[None]:
    """A maintenance DeviceTaintRule on that device of worker-1."""
    return features.device_taint_rule(kube, DRIVER, "worker-1", device, effect)


async def test_a_device_taint_rule_keeps_new_pods_off_a_device_for_maintenance(
    nodes: dict[str, Node], kube: SyncKube
) -> None:
    """NoSchedule keeps a new pod off the device until the rule is deleted."""
    ns = smoke.make_namespace(kube, "rule")
    with taint_rule(kube, "gpu-4", "NoSchedule"):
        claim_pod(kube, ns, "p", await on_worker_1_gpu(kube, "gpu-4"))
        assert await unschedulable(kube, ns, "p")
    res = await allocation(kube, ns, "p")
    assert (res["pool"], res["device"]) == ("worker-1", "gpu-4")
    kube.delete("Namespace", ns)


async def test_a_no_execute_device_taint_rule_evicts_the_pod_using_the_device(
    nodes: dict[str, Node], kube: SyncKube
) -> None:
    """Maintenance that cannot wait: a NoExecute rule makes the controller-manager evict
    the pod holding the device (its claim goes with it), and keeps new pods off it."""
    exactly = await on_worker_1_gpu(kube, "gpu-2")
    ns = smoke.make_namespace(kube, "evict")
    claim_pod(kube, ns, "user", exactly)
    assert (await allocation(kube, ns, "user"))["device"] == "gpu-2"
    claim = kube.get("Pod", "user", ns)["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    with taint_rule(kube, "gpu-2", "NoExecute"):
        with anyio.fail_after(90):
            while kube.get_or_none("Pod", "user", ns) is not None:
                await anyio.sleep(0.2)
            while kube.get_or_none("ResourceClaim", claim, ns) is not None:
                await anyio.sleep(0.2)
        claim_pod(kube, ns, "next", exactly)
        assert await unschedulable(kube, ns, "next")
    assert (await allocation(kube, ns, "next"))["device"] == "gpu-2"
    kube.delete("Namespace", ns)


async def test_a_prioritized_list_result_gets_the_config_named_for_its_parent_request(
    nodes: dict[str, Node], kube: SyncKube
) -> None:
    """The scheduler names the result `gpu/any`; a config bound to `gpu` applies to it
    (every subrequest), one bound to the subrequest not chosen does not."""
    if reason := features.prioritized_list(kube):
        pytest.skip(reason)
    ns = smoke.make_namespace(kube, "first")
    a100 = f'device.attributes["{DRIVER}"].productName.lowerAscii().matches("a100")'

    def config(requests: list[str], sharing: dict[str, Any]) -> dict[str, Any]:
        parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
        return {
            "requests": requests,
            "opaque": {"driver": DRIVER, "parameters": {**parameters, "sharing": sharing}},
        }

    long = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
    spec = {
        "devices": {
            "requests": [
                {
                    "name": "gpu",
                    "firstAvailable": [
                        # worker-2's A100s are MIG-enabled: no whole A100 to be had.
                        {
                            "name": "a100",
                            "deviceClassName": "gpu.nvidia.com",
                            "selectors": [{"cel": {"expression": a100}}],
                        },
                        {"name": "any", "deviceClassName": "gpu.nvidia.com"},
                    ],
                }
            ],
            "config": [config(["gpu"], long), config(["gpu/a100"], {"strategy": "MPS"})],
        }
    }
    kube.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "p", "namespace": ns},
            "spec": {"spec": spec},
        }
    )
    kube.create(smoke.pod_with_template(ns, "p", "p"))
    res = await allocation(kube, ns, "p")
    assert res["request"] == "gpu/any"
    name = kube.get("Pod", "p", ns)["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    obj = kube.get("ResourceClaim", name, ns)
    ref = ClaimRef(ns, obj["metadata"]["uid"], name)
    # What the kubelet plugin makes of the allocated claim.
    got = checked_claim(ref, obj, driver=DRIVER, pool=res["pool"])
    (device,) = got.devices
    sharing = resolve_sharing(
        "gpu", got.class_configs, got.claim_configs, device.request, memory_slice=False, where="p"
    )
    assert isinstance(sharing.config, GpuConfig) and sharing.mode == "TimeSlicing"
    assert sharing.time_slice == 3  # Long
    assert sharing.path == "status.allocation.devices.config[0].opaque.parameters"
    kube.delete("Namespace", ns)


ADMIN_LABEL = "resource.kubernetes.io/admin-access"


async def test_admin_access_needs_the_namespace_label_and_reaches_a_gpu_in_use(
    nodes: dict[str, Node], kube: SyncKube
) -> None:
    """A monitoring claim with adminAccess gets a GPU another pod holds, but only in a
    namespace labelled for it; elsewhere the API server refuses the template."""
    uuid = (await published(kube, "worker-1"))["gpu-7"]["attributes"]["uuid"]["string"]
    sel = {"cel": {"expression": f'device.attributes["{DRIVER}"].uuid == "{uuid}"'}}
    exactly: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com", "selectors": [sel]}
    users = smoke.make_namespace(kube, "user")
    claim_pod(kube, users, "user", exactly)
    assert (await allocation(kube, users, "user"))["device"] == "gpu-7"
    admin = {**exactly, "adminAccess": True}
    with pytest.raises(ApiError) as refused:
        claim_pod(kube, users, "admin", admin)
    assert refused.value.status == 422
    assert f"requires the `{ADMIN_LABEL}: true` label" in str(refused.value.body)
    monitoring = smoke.make_namespace(kube, "monitor")
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": monitoring, "labels": {ADMIN_LABEL: "true"}},
        }
    )
    claim_pod(kube, monitoring, "admin", admin)
    res = await allocation(kube, monitoring, "admin")
    assert (res["device"], res.get("adminAccess")) == ("gpu-7", True)
    for ns in (users, monitoring):
        kube.delete("Namespace", ns)


@pytest.mark.parametrize("xid", [13, 11, 83, 94])
async def test_application_xid_is_informational(
    nodes: dict[str, Node], kube: SyncKube, xid: int
) -> None:
    """A faulting kernel (13), a push buffer its process corrupted (11), a video
    decoder's exception (83) or a contained memory error (94) keeps no tenant off the
    GPU: NVIDIA's XID catalogue has the application restarted, and a workload raises
    the first three at will on a GPU others may share."""
    if reason := features.informational_taints(kube):
        pytest.skip(reason)
    nodes["worker-1"].nvml.inject_xid(5, xid)
    (taint,) = await tainted(kube, "worker-1", "gpu-5")
    assert taint["effect"] == "None" and taint["value"] == str(xid)


async def test_a_crashing_workload_does_not_rewrite_the_nodes_slices(
    nodes: dict[str, Node], kube: SyncKube
) -> None:
    """Every crash of a workload raises application XIDs (31 with 43, or 13): the first
    marks the device, informationally; the ones after it are counted and write no
    slice, so a workload crashing in a loop does not have the node's pool rewritten
    (and incomplete while it is) at every crash."""
    if reason := features.informational_taints(kube):
        pytest.skip(reason)
    node = nodes["worker-1"]
    node.nvml.inject_xid(6, 31)
    await tainted(kube, "worker-1", "gpu-6")

    def versions() -> dict[str, str]:
        query = {"fieldSelector": f"spec.nodeName=worker-1,spec.driver={DRIVER}"}
        items = kube.request("GET", SLICES, query=query)["items"]
        return {o["metadata"]["name"]: o["metadata"]["resourceVersion"] for o in items}

    before = versions()
    health = node.agent.health
    assert health is not None
    uuid = (await published(kube, "worker-1"))["gpu-6"]["attributes"]["uuid"]["string"]
    crashes = (43, 13, 31) * 4
    for xid in crashes:
        node.nvml.inject_xid(6, xid)
    with anyio.fail_after(30):
        while sum(n for (u, _), n in health.xid_counts().items() if u == uuid) <= len(crashes):
            await anyio.sleep(0.02)
    node.agent.slices.trigger()  # a reconcile now would write what differs
    await anyio.sleep(0.5)
    assert versions() == before
    (taint,) = (await published(kube, "worker-1"))["gpu-6"]["taints"]
    assert (taint["value"], taint["effect"]) == ("31", "None")


async def test_an_informational_taint_never_holds_up_the_slice(
    nodes: dict[str, Node], kube: SyncKube
) -> None:
    """Where the server has no effect None (1.34) the informational taint stays in the
    agent and the slice still takes the next critical one; elsewhere both are published."""
    nodes["worker-1"].nvml.inject_xid(2, 13)
    nodes["worker-1"].nvml.inject_xid(1, 74)
    (critical,) = await tainted(kube, "worker-1", "gpu-1")
    assert (critical["value"], critical["effect"]) == ("74", "NoSchedule")
    # Both XIDs are handled in order, so the first was dealt with by now.
    if features.informational_taints(kube):
        assert not (await published(kube, "worker-1"))["gpu-2"].get("taints")
        return
    with anyio.fail_after(30):
        while not (informational := (await published(kube, "worker-1"))["gpu-2"].get("taints")):
            await anyio.sleep(0.1)
    assert [(t["value"], t["effect"]) for t in informational] == [("13", "None")]


# Each GPU condition that needs service, as NVML reports it: its taint's value, and how
# the emulated GPU comes to report it or stops (the board was serviced).
NEEDS_SERVICE: dict[str, tuple[str | None, Callable[[Any, int, bool], None]]] = {
    "row-remap": ("failed", lambda nvml, gpu, on: nvml.fail_row_remapping(gpu, failed=on)),
    "unrepairable-memory": (
        None,
        lambda nvml, gpu, on: nvml.flag_unrepairable_memory(gpu, unrepairable=on),
    ),
}


@pytest.mark.parametrize("key", sorted(NEEDS_SERVICE))
async def test_a_gpu_nvml_says_needs_service_gets_no_new_claim(
    nodes: dict[str, Node], kube: SyncKube, key: str
) -> None:
    """NVIDIA's RMA threshold for a GPU's memory (the row remapper's failure flag) and
    unrepairable memory (R590, worker-1's driver) are read at each discovery: the
    scheduler hands the GPU to no new claim, past any quiet time, until a reading clears
    it (the board was serviced)."""
    if reason := features.device_taints(kube):
        pytest.skip(reason)
    value, report = NEEDS_SERVICE[key]
    node = nodes["worker-1"]
    report(node.nvml, 4, True)
    await node.agent.scan()
    with anyio.fail_after(30):
        while not (taints := (await published(kube, "worker-1"))["gpu-4"].get("taints")):
            await anyio.sleep(0.1)
    (taint,) = taints
    assert (taint["key"], taint.get("value"), taint["effect"]) == (
        f"{DRIVER}/{key}",
        value,
        "NoSchedule",
    )
    ns = smoke.make_namespace(kube, key)
    claim_pod(kube, ns, "next", await on_worker_1_gpu(kube, "gpu-4"))
    assert await unschedulable(kube, ns, "next")
    await anyio.sleep(RECOVERY_S + 1)  # no quiet time lifts it
    await node.agent.scan()
    assert (await published(kube, "worker-1"))["gpu-4"].get("taints")
    report(node.nvml, 4, False)
    await node.agent.scan()
    assert (await allocation(kube, ns, "next"))["device"] == "gpu-4"
    kube.delete("Namespace", ns)


async def test_gpu_lost_is_no_execute(nodes: dict[str, Node], kube: SyncKube) -> None:
    if reason := features.device_taints(kube):
        pytest.skip(reason)
    nodes["worker-1"].nvml.lose_gpu(6)
    await tainted(kube, "worker-1", "gpu-6")
    effects = {t["effect"] for t in (await published(kube, "worker-1"))["gpu-6"]["taints"]}
    assert "NoExecute" in effects
    nodes["worker-1"].nvml.recover_gpu(6)


async def test_with_health_checks_off_no_event_taints_and_a_lost_gpu_leaves(
    cluster: Cluster, kube: SyncKube, tmp_path: Path
) -> None:
    """`--no-health-checks` (the chart's `node.health.enabled: false`), as the flag
    configures the agent: a critical XID and a double-bit ECC error taint nothing, and
    a GPU that falls off the bus leaves the node's slices at the next rescan rather than
    staying published with no taint to say it is gone."""
    node = "worker-unchecked"
    args = ["node", f"--node-name={node}", f"--driver-name={DRIVER}", "--no-health-checks"]
    config = replace(_agent_config(build_parser().parse_args(args)), rescan_s=0.5)
    config = replace(config, state_dir=tmp_path)
    assert not config.health_events
    nvml = load_nvml("emulated:h100-80gb-hbm3-x8", uuid_salt=node)
    # A Node of its own (no kubelet), as the slices are owned by it: the other tests'
    # agents publish for worker-1 and worker-2.
    kube.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    every = [f"gpu-{i}" for i in range(8)]
    try:
        async with anyio.create_task_group() as tg:
            agent = NodeAgent(config, akube, nvml)
            await tg.start(agent.run)
            await agent.slices.converged.wait()
            assert sorted(await published(kube, node)) == every
            nvml.inject_xid(3, 74)
            nvml.inject_ecc(4)
            nvml.lose_gpu(6)
            with anyio.fail_after(30):
                while "gpu-6" in (devices := await published(kube, node)):
                    await anyio.sleep(0.1)
            assert sorted(devices) == [d for d in every if d != "gpu-6"]
            assert not any(d.get("taints") for d in devices.values())
            nvml.recover_gpu(6)
            with anyio.fail_after(30):
                while sorted(devices := await published(kube, node)) != every:
                    await anyio.sleep(0.1)
            assert not any(d.get("taints") for d in devices.values())
            assert not [p async for p in anyio.Path(tmp_path).iterdir()]  # none kept either
            tg.cancel_scope.cancel()
    finally:
        for o in kube.list("ResourceSlice"):
            if o["spec"].get("nodeName") == node:
                kube.delete("ResourceSlice", o["metadata"]["name"])
        kube.delete("Node", node)
        await akube.close()


def agent_kubeconfig(
    kube: SyncKube, ns: str, node: str, path: Path, *, sa: str, claim_status: bool
) -> Path:
    """A kubeconfig of ServiceAccount `sa` holding the node agent's ClusterRole as the
    chart renders it with `node.claimStatus=claim_status`, with a token bound to a pod
    on `node` as the agent's is, so the API server's authorization of the status write
    is the one a deployed agent meets (the admin certificate would pass everything)."""
    try:
        objects = helm.template(helm.helm_binary(), {"node": {"claimStatus": claim_status}})
    except helm.HelmUnavailable as e:
        pytest.skip(str(e))
    role = helm.find(objects, "ClusterRole", "gpudra-node")
    role["metadata"] = {"name": f"{ns}-{sa}"}
    kube.request("POST", f"{RBAC}/clusterroles", role)
    kube.request(
        "POST",
        f"/api/v1/namespaces/{ns}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}},
    )
    kube.request(
        "POST",
        f"{RBAC}/clusterrolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{ns}-{sa}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"{ns}-{sa}",
            },
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
        },
    )
    token = pod_bound_token(kube, ns, sa, node, f"agent-{sa}", expiration_s=None)
    return token_kubeconfig(kube.creds, token, sa, path)


async def test_claim_status_is_written_and_removed_where_the_server_keeps_it(
    nodes: dict[str, Node], kube: SyncKube, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's claim status writer, with the chart's RBAC, on a claim the scheduler
    allocated: where the server keeps `status.devices` the entry is there while prepared
    and gone after unprepare; where it drops or refuses it (always: with the RBAC of a
    chart without `node.claimStatus`), one log line and nothing else changes (the claim
    reads and checks as before), and the rest skips with what the server did."""
    ns = smoke.make_namespace(kube, "status")
    claim_pod(kube, ns, "held", {"deviceClassName": "gpu.nvidia.com"})
    result = await allocation(kube, ns, "held")
    pool, device = result["pool"], result["device"]
    name = kube.get("Pod", "held", ns)["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    obj = kube.get("ResourceClaim", name, ns)
    uuid = (await published(kube, pool))[device]["attributes"]["uuid"]["string"]
    config = tmp_path / "node.kubeconfig"
    akube = await Kube.connect(
        str(agent_kubeconfig(kube, ns, pool, config, sa="node", claim_status=True))
    )
    config = tmp_path / "plain.kubeconfig"
    plain = await Kube.connect(
        str(agent_kubeconfig(kube, ns, pool, config, sa="plain", claim_status=False))
    )
    try:
        # As the agent: the claim reader reads it for the prepare, the checkpoint then
        # holds it, and the writer reconciles the checkpoint with the claims' status.
        infos = ClaimInfos()
        ref = ClaimRef(namespace=ns, uid=obj["metadata"]["uid"], name=name)
        claim = await ApiClaims(akube, driver=DRIVER, pool=pool, infos=infos).read(ref)
        record = ClaimRecord(
            uid=ref.uid,
            namespace=ns,
            name=name,
            state=ClaimState.PREPARE_COMPLETED,
            devices=(
                DeviceRecord(
                    pool=pool,
                    device=device,
                    request_names=(result["request"],),
                    details=DeviceDetails(type="gpu", gpu_uuid=uuid, uuid=uuid, pod=claim.pod),
                ),
            ),
        )
        prepared = [record]

        def refused_once() -> str:
            """The one line a refusing or dropping server costs; the claim is untouched."""
            [line] = caplog.records  # once, however often the writer runs
            caplog.clear()
            stored = kube.get("ResourceClaim", name, ns)["status"]
            assert not stored.get("devices")
            assert stored["allocation"] == obj["status"]["allocation"]
            return f"{line.getMessage()} {getattr(line, 'fields', {}).get('error', '')}"

        denied = ClaimStatusWriter(
            plain, driver=DRIVER, pool=pool, prepared=lambda: prepared, claim_info=infos.snapshot
        )
        with caplog.at_level(logging.WARNING, logger="gpudra.driver.claimstatus"):
            await denied.sync_once()
            await denied.sync_once()
        assert "refused" in refused_once()
        assert await ApiClaims(plain, driver=DRIVER, pool=pool).read(ref) == claim

        writer = ClaimStatusWriter(
            akube, driver=DRIVER, pool=pool, prepared=lambda: prepared, claim_info=infos.snapshot
        )
        with caplog.at_level(logging.WARNING, logger="gpudra.driver.claimstatus"):
            await writer.sync_once()
            await writer.sync_once()
        if caplog.records:
            why = refused_once()
            assert await ApiClaims(akube, driver=DRIVER, pool=pool).read(ref) == claim
            pytest.skip(f"the API server kept no status.devices: {why}".strip())
        stored = kube.get("ResourceClaim", name, ns)["status"]
        assert stored["allocation"] == obj["status"]["allocation"]
        [entry] = stored["devices"]
        assert (entry["driver"], entry["pool"], entry["device"]) == (DRIVER, pool, device)
        assert entry["data"] == {"sharing": "Exclusive", "gpuUUID": uuid}

        prepared.clear()  # unprepared
        await writer.sync_once()
        stored = kube.get("ResourceClaim", name, ns)["status"]
        assert not stored.get("devices")
        assert stored["allocation"] == obj["status"]["allocation"]
        assert caplog.records == []
    finally:
        await akube.close()
        await plain.close()
        for kind in ("clusterrolebindings", "clusterroles"):
            for sa in ("node", "plain"):
                kube.request("DELETE", f"{RBAC}/{kind}/{ns}-{sa}")
        kube.delete("Namespace", ns)
