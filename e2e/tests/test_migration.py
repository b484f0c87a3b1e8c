"""A cluster in the middle of a migration (docs/migration.md): one node still served by
the device plugin (a Node object advertising `nvidia.com/gpu`, as the kubelet reports a
device plugin's GPUs) and the real node running gpudra. No pod is stranded:

- with conversion limited to the moved namespaces (`--conversion-namespace-selector`,
  the chart's webhook.conversion.namespaceSelector), pods elsewhere keep `nvidia.com/gpu`
  and land on the device-plugin node, pods in a moved namespace are converted and run on
  the gpudra node;
- with the `gpu.nvidia.com` DeviceClass mapping `nvidia.com/gpu`
  (`extendedResourceName`), the scheduler serves the same unconverted request from the
  device plugin on one node and from gpudra's devices on the other; a NoExecute device
  taint evicts such a pod from Kubernetes 1.37 on, and a converted one on every version.

And `gpudra migrate` reads the device plugin's ConfigMap and the pods from the API.

Skips with the exact reason when the machine cannot run a real node.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpudra.api.deviceclasses import device_classes

from e2e import features
from e2e.claims import claim_name, running, wait_allocated
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import Kube, wait_for
from e2e.node import images
from e2e.node.gpus import DRIVER, GpuStack
from e2e.node.realnode import RealNode, unavailable_reason
from e2e.provider import local_only

pytestmark = pytest.mark.cluster
ON_THE_REAL_NODE = local_only(
    "runs gpudra's agent on the local real node beside a device-plugin node"
)
DP_NODE = "device-plugin-node"
DP_GPUS = 8
MOVED = {"gpudra.nvidia.com/dra": "true"}
SELECTOR = json.dumps({"matchLabels": MOVED})
GPU_RESOURCE = "nvidia.com/gpu"


def device_plugin_node(kube: Kube) -> None:
    """A node as the kubelet reports it while the device plugin serves its GPUs."""
    meta = {"name": DP_NODE, "labels": {"kubernetes.io/hostname": DP_NODE}}
    kube.apply({"apiVersion": "v1", "kind": "Node", "metadata": meta})
    capacity = {"cpu": "8", "memory": "32Gi", "pods": "110", GPU_RESOURCE: str(DP_GPUS)}
    kube.patch_status("Node", DP_NODE, {"status": {"capacity": capacity, "allocatable": capacity}})


@pytest.fixture(scope="module")
def gpudra_node(cluster: Cluster, kube: Kube) -> Iterator[GpuStack]:
    """The real node with gpudra's agent, and its webhook converting only the moved
    namespaces; beside it the device-plugin node."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no real node on this machine: {reason}")
    node = RealNode(cluster)
    node.up(log=lambda _m: None)
    stack = GpuStack(node)
    try:
        stack.up(webhook=False, log=lambda _m: None)
        stack.start_webhook(f"--conversion-namespace-selector={SELECTOR}")
        device_plugin_node(kube)
        yield stack
    finally:
        kube.delete("Node", DP_NODE)
        stack.down(log=lambda _m: None)
        node.down(log=lambda _m: None)


@pytest.fixture
def namespaces(gpudra_node: GpuStack, kube: Kube) -> Iterator[tuple[str, str]]:
    """(not yet moved, moved)."""
    names = (f"old-{uuid.uuid4().hex[:6]}", f"moved-{uuid.uuid4().hex[:6]}")
    for name, labels in zip(names, ({}, MOVED), strict=True):
        kube.create(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
        )
    yield names
    for name in names:
        for pod in kube.list("Pod", name):
            kube.delete("Pod", pod["metadata"]["name"], name, grace=0)
    for name in names:
        wait_for(f"pods of {name} gone", lambda n=name: not kube.list("Pod", n), timeout=60)
        kube.delete("Namespace", name)


def legacy_pod(name: str, namespace: str, node: str | None = None) -> dict[str, Any]:
    """A pod as written for the device plugin: one `nvidia.com/gpu`. It tolerates the
    taints a node without a kubelet gets, so the device-plugin node can take it."""
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 1,
        "tolerations": [{"operator": "Exists"}],
        "containers": [
            {
                "name": "main",
                "image": images.TEST_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", "sleep 86400"],
                "resources": {"limits": {GPU_RESOURCE: "1"}},
            }
        ],
    }
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def wait_bound(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = wait_for(
        f"pod {name} scheduled",
        lambda: (p := kube.get("Pod", name, namespace))["spec"].get("nodeName") and p,
        timeout=60,
    )
    return pod


def wait_running_on(kube: Kube, namespace: str, name: str, node: str) -> dict[str, Any]:
    pod: dict[str, Any] = wait_for(
        f"pod {name} running", lambda: running(kube, namespace, name), timeout=120
    )
    assert pod["spec"]["nodeName"] == node
    return pod


@ON_THE_REAL_NODE
def test_only_moved_namespaces_are_converted_and_every_pod_lands(
    gpudra_node: GpuStack, kube: Kube, namespaces: tuple[str, str]
) -> None:
    old, moved = namespaces
    # Not moved: the webhook never sees the pods; they keep nvidia.com/gpu and the
    # device-plugin node takes them (the gpudra node advertises no nvidia.com/gpu).
    for i in range(2):
        created = kube.create(legacy_pod(f"legacy-{i}", old))
        assert not created["spec"].get("resourceClaims")
        assert created["spec"]["containers"][0]["resources"]["limits"] == {GPU_RESOURCE: "1"}
        assert wait_bound(kube, old, f"legacy-{i}")["spec"]["nodeName"] == DP_NODE
    # Moved: converted to a claim and running on the gpudra node.
    created = kube.create(legacy_pod("converted", moved))
    assert [c["name"] for c in created["spec"]["resourceClaims"]]
    assert GPU_RESOURCE not in created["spec"]["containers"][0]["resources"].get("limits", {})
    wait_running_on(kube, moved, "converted", gpudra_node.node_name)


@pytest.fixture
def gpu_class_maps_the_resource(gpudra_node: GpuStack, kube: Kube) -> Iterator[None]:
    """gpu.nvidia.com with extendedResourceName (deviceClasses.gpu.extendedResourceName)."""
    (whole,) = [c for c in device_classes(DRIVER) if c["metadata"]["name"] == "gpu.nvidia.com"]
    mapped = {**whole, "spec": {**whole["spec"], "extendedResourceName": GPU_RESOURCE}}
    stored = kube.apply(mapped)
    try:
        if stored["spec"].get("extendedResourceName") != GPU_RESOURCE:
            pytest.skip("the API server drops extendedResourceName: DRAExtendedResource is off")
        yield
    finally:
        kube.apply(whole)


@ON_THE_REAL_NODE
def test_the_scheduler_serves_nvidia_gpu_per_node_with_the_class_mapping(
    gpudra_node: GpuStack,
    kube: Kube,
    namespaces: tuple[str, str],
    gpu_class_maps_the_resource: None,
) -> None:
    old, _moved = namespaces
    kube.create(legacy_pod("on-device-plugin", old, DP_NODE))
    kube.create(legacy_pod("on-gpudra", old, gpudra_node.node_name))
    assert wait_bound(kube, old, "on-device-plugin")["spec"]["nodeName"] == DP_NODE
    pod = wait_running_on(kube, old, "on-gpudra", gpudra_node.node_name)
    # Served by DRA: the claim the scheduler made for the extended resource.
    assert not pod["spec"].get("resourceClaims")
    assert pod["status"].get("extendedResourceClaimStatus", {}).get("resourceClaimName")


def _allocated_device(kube: Kube, namespace: str, claim: str) -> str:
    allocated = wait_allocated(kube, claim, namespace)
    (result,) = allocated["status"]["allocation"]["devices"]["results"]
    device: str = result["device"]
    return device


def _evicted(kube: Kube, namespace: str, name: str) -> bool:
    pod = kube.get_or_none("Pod", name, namespace)
    return pod is None or bool(pod["metadata"].get("deletionTimestamp"))


@ON_THE_REAL_NODE
def test_a_no_execute_device_taint_evicts_a_pod_served_by_the_mapping_from_kubernetes_1_37(
    gpudra_node: GpuStack,
    kube: Kube,
    namespaces: tuple[str, str],
    gpu_class_maps_the_resource: None,
) -> None:
    """A NoExecute taint on a GPU (a DeviceTaintRule here; gpudra's `gpu-lost` and the
    XIDs set to NoExecute take the same path) makes the controller-manager evict the pod
    using it. A converted pod names its claim in `spec.resourceClaims`; a pod served by
    the class mapping has it only in `status.extendedResourceClaimStatus`, which the
    eviction controller of Kubernetes 1.36 does not read (kubernetes#142289, fixed in
    1.37): there such a pod stays on a GPU its admin is draining. docs/migration.md says
    so, and the chart's notes warn on 1.36."""
    old, moved = namespaces
    node = gpudra_node.node_name
    kube.create(legacy_pod("mapped", old, node))
    kube.create(legacy_pod("converted", moved, node))
    mapped = wait_running_on(kube, old, "mapped", node)
    converted = wait_running_on(kube, moved, "converted", node)
    mapped_claim = mapped["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    converted_claim = claim_name(converted, converted["spec"]["resourceClaims"][0]["name"])
    devices = (
        _allocated_device(kube, old, mapped_claim),
        _allocated_device(kube, moved, converted_claim),
    )
    minor = int(str(kube.request("GET", "/version")["minor"]).rstrip("+"))
    with contextlib.ExitStack() as rules:
        for device in devices:
            rules.enter_context(features.device_taint_rule(kube, DRIVER, node, device, "NoExecute"))
        # The converted pod is evicted on every version: the controller has acted.
        wait_for("the converted pod evicted", lambda: _evicted(kube, moved, "converted"), 90)
        if minor >= 37:
            wait_for("the mapped pod evicted", lambda: _evicted(kube, old, "mapped"), 90)
            wait_for(
                "the mapped pod's claim gone (unprepared and deallocated)",
                lambda: kube.get_or_none("ResourceClaim", mapped_claim, old) is None,
                120,
            )
        else:
            # Both claims were tainted in the same pass; give the controller a moment
            # more than it took for the converted pod, then read the mapped one.
            time.sleep(5)
            assert not _evicted(kube, old, "mapped"), "1.36 now evicts it: update the docs"
            assert running(kube, old, "mapped")


def test_migrate_reads_the_device_plugin_configmap_and_pods(
    cluster: Cluster, kube: Kube, tmp_path: Path
) -> None:
    """`gpudra migrate --configmap --cluster-nodes --cluster-pods` against the API: the
    device plugin chart's ConfigMap (one config per node label value), the cluster's
    nodes (none labelled: each runs the chart's default config) and pods."""
    ns = f"dp-{uuid.uuid4().hex[:6]}"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    try:
        config = (
            "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n"
            "    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"
        )
        configmap = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "nvidia-device-plugin-configs", "namespace": ns},
            "data": {"default": "version: v1\n", "shared": config},
        }
        kube.request("POST", f"/api/v1/namespaces/{ns}/configmaps", configmap)
        # Written for the renamed device plugin: nvidia.com/gpu was no longer advertised.
        kube.create(legacy_pod("whole", ns))
        out = tmp_path / "plan"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpudra.cli",
                "migrate",
                f"--configmap={ns}/nvidia-device-plugin-configs",
                "--config-key=shared",  # the device plugin chart's config.default
                "--cluster-nodes",
                "--cluster-pods",
                f"--out={out}",
            ],
            env={**os.environ, "KUBECONFIG": str(cluster.layout.admin_kubeconfig)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert yaml.safe_load((out / "values.yaml").read_text())["node"] == {"gpuShares": 4}
        assert not (out / "tenants.yaml").exists()  # renamed: nvidia.com/gpu stays whole
        assert f"#   {ns}/whole: asks for nvidia.com/gpu, which nodes with renameByDefault" in (
            proc.stdout
        )
    finally:
        for pod in kube.list("Pod", ns):
            kube.delete("Pod", pod["metadata"]["name"], ns, grace=0)
        kube.delete("Namespace", ns)
