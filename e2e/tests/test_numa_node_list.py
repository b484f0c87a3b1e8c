"""`--numa-node-list` on the real API server and scheduler: with DRAListTypeAttributes
the GPUs' NUMA node lists are kept and `matchAttribute` pairs GPUs whose lists share a
node; without the gate the API server refuses them, and the agent says what to do."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import NUMA_NODE_ATTRIBUTE, MigStrategy
from gpudra.driver.nvml import NvmlEmulator, load_nvml
from gpudra.driver.nvml.emulator import load_builtin_profile
from gpudra.driver.nvml.topology import SysfsTopology

from e2e import smoke
from e2e.cluster.harness import Cluster, Layout
from e2e.cluster.kube import Kube as SyncKube
from e2e.cluster.second import harness, second_env
from e2e.provider import local_only
from e2e.sysfs import sysfs_numa_machine, sysfs_numa_nodes
from e2e.tests.test_inventory import agents, allocation, claim_pod, published, unschedulable

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
DRIVER = "gpu.nvidia.com"
NODE = "worker-1"
PROFILE = "h100-80gb-hbm3-x8"
# Two sockets of two nodes each (sub-NUMA clustering): 11 within a socket, 21 across.
SNC2 = [[10, 11, 21, 21], [11, 10, 21, 21], [21, 21, 10, 11], [21, 21, 11, 10]]


def on_snc2(root: Path) -> NvmlEmulator:
    """The 8-H100 profile on a machine whose first socket holds NUMA nodes 0 and 1:
    GPUs 0 to 3 on node 0, 4 to 7 on node 1, read from a sysfs as on a real node."""
    bus_ids = [g.busId.lower().removeprefix("0000") for g in load_builtin_profile(PROFILE).gpus]
    sysfs_numa_nodes(root, {b: i // 4 for i, b in enumerate(bus_ids)})
    sysfs_numa_machine(root, [0, 0, 1, 1], SNC2)
    nvml = load_nvml(f"emulated:{PROFILE}", uuid_salt=NODE)
    assert isinstance(nvml, NvmlEmulator)
    nvml.pci_topology = SysfsTopology(root)
    return nvml


async def allocations(kube: SyncKube, ns: str, pod: str) -> list[dict[str, Any]]:
    """Every device result of the pod's claim, once it is scheduled."""
    await allocation(kube, ns, pod)
    [status] = kube.get("Pod", pod, ns)["status"]["resourceClaimStatuses"]
    claim = kube.get("ResourceClaim", status["resourceClaimName"], ns)
    results: list[dict[str, Any]] = claim["status"]["allocation"]["devices"]["results"]
    return results


async def numa_nodes(kube: SyncKube) -> dict[str, Any]:
    """The published NUMA node attribute of each of the node's devices."""
    devices = await published(kube, NODE)
    return {n: d["attributes"][NUMA_NODE_ATTRIBUTE] for n, d in devices.items()}


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[Cluster]:
    """A control plane of this test's own with DRAListTypeAttributes on, which the shared
    one keeps off (it moves the scheduler to its experimental allocator)."""
    env = second_env(tmp_path, GPUDRA_NODES="1", GPUDRA_EXTRA_GATES="DRAListTypeAttributes")
    up = harness(env, "up")
    assert up.returncode == 0, up.stderr
    try:
        yield Cluster(Layout(tmp_path / "c"))
    finally:
        harness(env, "down")


def gpus_on_one_node(ns: str, name: str, count: int) -> dict[str, Any]:
    """A template asking `count` GPUs that share a NUMA node (`matchAttribute`)."""
    request = {
        "name": "gpus",
        "exactly": {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": count},
    }
    constraint = {"requests": ["gpus"], "matchAttribute": NUMA_NODE_ATTRIBUTE}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"spec": {"devices": {"requests": [request], "constraints": [constraint]}}},
    }


@local_only("starts a control plane of its own with the local harness")
async def test_with_the_gate_gpus_whose_lists_share_a_node_meet_match_attribute(
    gated: Cluster, tmp_path: Path
) -> None:
    """Five GPUs that share a NUMA node, asked with `matchAttribute`: neither node has
    five while the attribute is an int. Published as lists ([0, 1] and [1, 0], one
    socket), the API server keeps them and a CEL selector reads them. From 1.37 the
    same pending pod then gets five GPUs across both nodes. 1.36's scheduler does not
    tell its allocator of the gate (1.37 does), so there no list meets `matchAttribute`,
    not even two GPUs with the same list, which as ints two GPUs of one node did."""
    kube = gated.kube()
    minor = int(kube.request("GET", "/version")["minor"].rstrip("+"))
    nvmls = {NODE: (on_snc2(tmp_path / "sys"), MigStrategy.DYNAMIC)}
    async with agents(gated, kube, nvmls) as nodes:
        ns = smoke.make_namespace(kube, "numa")
        kube.create(gpus_on_one_node(ns, "five", 5))
        kube.create(smoke.pod_with_template(ns, "five", "five"))
        await unschedulable(kube, ns, "five")
        agent = nodes[NODE].agent
        agent.config = replace(agent.config, numa_node_list=True)  # as after a restart with it
        agent.slices.trigger()
        with anyio.fail_after(30):
            while "int" in (lists := await numa_nodes(kube)).get("gpu-0", {"int": 0}):
                await anyio.sleep(0.1)
        assert lists == {f"gpu-{i}": {"ints": [0, 1] if i < 4 else [1, 0]} for i in range(8)}
        given: list[str] = []
        if minor >= 37:
            given = [r["device"] for r in await allocations(kube, ns, "five")]
            assert len(given) == 5 and {lists[g]["ints"][0] for g in given} == {0, 1}
        # CEL reads the list: a GPU whose own node (the list's first) is one with a GPU left.
        node = next(lists[g]["ints"][0] for g in sorted(lists) if g not in given)
        selector = f'device.attributes["resource.kubernetes.io"].numaNode[0] == {node}'
        claim_pod(
            kube,
            ns,
            "cel",
            {"deviceClassName": DRIVER, "selectors": [{"cel": {"expression": selector}}]},
        )
        [result] = await allocations(kube, ns, "cel")
        assert lists[result["device"]]["ints"][0] == node
        if minor < 37:
            kube.create(gpus_on_one_node(ns, "two", 2))
            kube.create(smoke.pod_with_template(ns, "two", "two"))
            await unschedulable(kube, ns, "two")
            assert not kube.get("Pod", "five", ns)["spec"].get("nodeName")


async def test_without_the_gate_the_agent_names_the_gate_and_the_option(
    cluster: Cluster, kube: SyncKube, tmp_path: Path
) -> None:
    """The shared control plane keeps DRAListTypeAttributes off: it refuses the slice,
    and the agent's reconcile error says which gate and which option."""
    akube = await Kube.connect(str(cluster.layout.admin_kubeconfig))
    config = AgentConfig(node_name=NODE, driver_name=DRIVER, numa_node_list=True)
    agent = NodeAgent(config, akube, on_snc2(tmp_path / "sys"))
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            with anyio.fail_after(30):
                while "DRAListTypeAttributes" not in (agent.slices.last_error or ""):
                    await anyio.sleep(0.1)
            tg.cancel_scope.cancel()
    finally:
        await akube.close()
    error = agent.slices.last_error or ""
    assert "the API server rejected slice" in error
    assert "--numa-node-list" in error and "node.numaNodeList" in error
    query = {"fieldSelector": f"spec.nodeName={NODE},spec.driver={DRIVER}"}
    slices = kube.request("GET", "/apis/resource.k8s.io/v1/resourceslices", query=query)
    assert slices["items"] == []
