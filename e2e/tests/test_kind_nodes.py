"""Two GPU nodes, two products, on kind's real kubelets: the chart installed once with
e2e/kind/values.yaml, each worker's agent on the emulated profile its node's label
names (an H100 node in MIG mode and an L4 node, e2e/kind/cluster.yaml). The scheduler
picks the node by what each publishes: a MIG claim can only be met on the H100 node,
an L4 claim only on the other; each pod then runs through that node's kubelet, our
plugin and containerd's CDI injection.

Marked `kind`: it needs kind's workers (`make e2e-kind`, which runs it with the rest of
the suite), so `make test` leaves it out and it skips, with the reason, on the local
control plane.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gpudra.driver.nvml.emulator import load_builtin_profile

from e2e.claims import attr, claim_template, node_devices, wait_running
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import Kube
from e2e.gpu_pods import (
    allocation,
    busybox_pod,
    cap_nodes,
    claim_uid,
    scratch_namespace,
    seen,
    spec_of,
)
from e2e.node.gpus import installed

pytestmark = [pytest.mark.cluster, pytest.mark.kind]

MIG_PRODUCT = "NVIDIA H100 80GB HBM3"
L4_PRODUCT = "NVIDIA L4"


@pytest.fixture(scope="module")
def fleet(cluster: Cluster) -> Iterator[Any]:
    from e2e.kind.cluster import KindCluster  # noqa: PLC0415 - only with Docker

    if not isinstance(cluster, KindCluster):
        pytest.skip("needs kind's GPU workers: make e2e-kind (GPUDRA_CLUSTER_PROVIDER=kind)")
    from e2e.kind.gpus import KindFleet, gpu_workers  # noqa: PLC0415 - only with Docker

    yield from installed(KindFleet(gpu_workers(cluster)))


@pytest.fixture
def namespace(fleet: Any, kube: Kube) -> Iterator[str]:
    yield from scratch_namespace(kube, "nodes")


def profile_of(kube: Kube, node: str) -> str:
    from e2e.kind.gpus import PROFILE_LABEL  # noqa: PLC0415 - only with Docker

    return str(kube.get("Node", node)["metadata"]["labels"][PROFILE_LABEL])


def worker_of(fleet: Any, kube: Kube, product: str) -> Any:
    """The worker whose label names a profile of `product`."""
    (worker,) = [
        w
        for w in fleet.workers
        if {
            p.products[g.product].name
            for p in [load_builtin_profile(profile_of(kube, w.node_name))]
            for g in p.gpus
        }
        == {product}
    ]
    return worker


def test_each_worker_publishes_its_own_products(fleet: Any, kube: Kube) -> None:
    published = {}
    for worker in fleet.workers:
        profile = load_builtin_profile(profile_of(kube, worker.node_name))
        devices = node_devices(kube, worker.node_name).values()
        products = {attr(d, "productName") for d in devices}
        assert products == {profile.products[g.product].name for g in profile.gpus}
        uuids = {attr(d, "uuid") for d in devices if attr(d, "type") == "gpu"}
        parents = {attr(d, "parentUUID") for d in devices if attr(d, "type") == "mig"}
        # MIG-enabled GPUs publish their placements; the others publish whole GPUs.
        assert parents == {g.uuid for g in profile.gpus if g.migEnabled}
        assert uuids == {g.uuid for g in profile.gpus if not g.migEnabled}
        published[worker.node_name] = products
    assert {frozenset(p) for p in published.values()} >= {
        frozenset({MIG_PRODUCT}),
        frozenset({L4_PRODUCT}),
    }


def test_the_scheduler_sends_a_mig_pod_and_an_l4_pod_to_their_nodes(
    fleet: Any, kube: Kube, cluster: Cluster, namespace: str
) -> None:
    mig_node = worker_of(fleet, kube, MIG_PRODUCT)
    l4_node = worker_of(fleet, kube, L4_PRODUCT)
    kube.create(
        claim_template(
            "mig-1g", namespace, 'device.attributes["gpu.nvidia.com"].profile == "1g.10gb"',
            device_class="mig.nvidia.com",
        )
    )  # fmt: skip
    kube.create(
        claim_template(
            "l4", namespace, f'device.attributes["gpu.nvidia.com"].productName == "{L4_PRODUCT}"'
        )
    )
    # Neither pod names a node: only the devices each node publishes decide.
    kube.create(busybox_pod("mig", namespace, None, template="mig-1g"))
    kube.create(busybox_pod("l4", namespace, None, template="l4"))
    wait_running(kube, namespace, "mig", "l4", timeout=180)

    for pod, worker, kind in (("mig", mig_node, "mig"), ("l4", l4_node, "gpu")):
        assert kube.get("Pod", pod, namespace)["spec"]["nodeName"] == worker.node_name
        (result,) = allocation(kube, namespace, pod)
        assert result["pool"] == worker.node_name
        device = node_devices(kube, worker.node_name)[result["device"]]
        assert attr(device, "type") == kind
        # That node's kubelet had our plugin prepare the claim and containerd injected
        # its CDI spec: the spec is on that node, and the container sees the devices.
        assert spec_of(claim_uid(kube, namespace, pod)) in worker.cdi_specs()
        nodes, env = seen(cluster, namespace, pod)
        (uuid,) = [v for k, v in env.items() if k.startswith("GPUDRA_DEVICE_")]
        caps = cap_nodes(nodes)
        if kind == "mig":
            # A MIG device gets its UUID when the plugin creates it: its access nodes too.
            assert uuid.startswith("MIG-") and len(caps) == 2, (nodes, env)
        else:
            assert uuid == attr(device, "uuid") and not caps, (nodes, env)
