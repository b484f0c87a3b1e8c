"""`gpudra top` and `gpudra report` against the real API server: the devices the agent
publishes (built by the agent's own `pool_content`), claims allocated and reserved as
the scheduler and kubelet leave them, and agent pods (made by DaemonSets, as the
chart's are) whose `metrics` port leads to a real metrics endpoint on one node and to
nothing on the other."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from gpudra.driver.devices import MigStrategy, discover
from gpudra.driver.nvml import load_nvml
from gpudra.driver.publish import pool_content

from e2e.cluster.harness import Cluster
from e2e.cluster.kube import Kube, wait_for

pytestmark = pytest.mark.cluster
TAINT = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}


class World:
    """One test's driver name, namespace and agent pod label, and what it created."""

    def __init__(self, kube: Kube) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.kube = kube
        self.driver = f"top-{suffix}.example.com"
        self.namespace = f"top-{suffix}"
        self.selector = f"gpudra-top-test={suffix}"
        self.slices: list[str] = []
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}})

    def publish(self, node: str, *, tainted: str = "") -> None:
        content = pool_content(
            discover(load_nvml("emulated:h100-80gb-hbm3-x8")), MigStrategy.STATIC
        )
        devices: list[dict[str, Any]] = [dict(d) for d in content.devices]
        for device in devices:
            if device["name"] == tainted:
                device["taints"] = [TAINT]
        name = f"{node}-{self.driver}"
        self.kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": name},
                "spec": {
                    "driver": self.driver,
                    "nodeName": node,
                    "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                    "devices": devices,
                },
            }
        )
        self.slices.append(name)

    def allocated(self, name: str, node: str, device: str, *pods: str) -> None:
        """A claim allocated `device` of `node` and reserved for `pods`."""
        self.kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": self.namespace},
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": self.driver}}]
                    }
                },
            }
        )
        result = {"request": "gpu", "driver": self.driver, "pool": node, "device": device}
        status = {
            "allocation": {"devices": {"results": [result]}},
            "reservedFor": [
                {"resource": "pods", "name": pod, "uid": self.pod(pod, node, claim=name)}
                for pod in pods
            ],
        }
        self.kube.patch_status("ResourceClaim", name, {"status": status}, self.namespace)

    def pod(self, name: str, node: str, *, claim: str) -> str:
        """A pod bound to `node` that uses `claim`; its UID (the claim controller drops
        reservations of pods that do not exist)."""
        created = self.kube.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace},
                "spec": {
                    "nodeName": node,
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                    "containers": [
                        {
                            "name": "main",
                            "image": "app:test",
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                },
            }
        )
        return str(created["metadata"]["uid"])

    def agent(self, node: str, port: int) -> None:
        """A running agent pod on `node` whose metrics port is `port` on 127.0.0.1: the
        pod a DaemonSet makes there (one DaemonSet per node, so that each has its port),
        given the status a kubelet would."""
        key, value = self.selector.split("=")
        labels = {key: value, "gpudra-top-test-node": node}
        self.kube.create(
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": f"agent-{node}", "namespace": self.namespace},
                "spec": {
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "nodeSelector": {"kubernetes.io/hostname": node},
                            "containers": [
                                {
                                    "name": "node",
                                    "image": "gpudra:test",
                                    "ports": [{"name": "metrics", "containerPort": port}],
                                }
                            ],
                        },
                    },
                },
            }
        )

        def scheduled() -> str:
            selector = ",".join(f"{k}={v}" for k, v in labels.items())
            pods = self.kube.list("Pod", self.namespace, labelSelector=selector)
            return next((p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")), "")

        name = wait_for(f"the DaemonSet's agent pod on {node}", scheduled)
        ip = [{"ip": "127.0.0.1"}]
        status = {
            "phase": "Running",
            "hostIP": "127.0.0.1",
            "hostIPs": ip,
            "podIP": "127.0.0.1",
            "podIPs": ip,
        }
        self.kube.patch_status("Pod", name, {"status": status}, self.namespace)

    def close(self) -> None:
        for name in self.slices:
            self.kube.delete("ResourceSlice", name)
        self.kube.delete("Namespace", self.namespace)


@pytest.fixture
def world(kube: Kube) -> Iterator[World]:
    w = World(kube)
    yield w
    w.close()


def top(cluster: Cluster, world: World, *args: str) -> subprocess.CompletedProcess[str]:
    return gpudra(cluster, world, "top", "--driver-name", world.driver, *args)


def gpudra(
    cluster: Cluster, world: World, command: str, *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "gpudra.cli",
            command,
            "--kubeconfig",
            str(cluster.layout.admin_kubeconfig),
            "--agent-namespace",
            world.namespace,
            "--agent-selector",
            world.selector,
            "--timeout",
            "5",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_rows_come_from_the_cluster_with_each_agents_measurements(
    cluster: Cluster, world: World, endpoint: str
) -> None:
    port = int(endpoint.rsplit(":", 1)[1].split("/", maxsplit=1)[0])  # the stand-in agent's metrics
    world.publish("worker-1")
    world.publish("worker-2", tainted="gpu-3")
    world.allocated("train", "worker-1", "gpu-0", "trainer")
    world.allocated("infer-a", "worker-2", "gpu-1", "infer-0")
    world.allocated("infer-b", "worker-2", "gpu-1", "infer-1")
    world.allocated("waiting", "worker-2", "gpu-2")
    world.agent("worker-1", port)
    world.agent("worker-2", 9)  # nothing listens there

    done = top(cluster, world, "-o", "json")

    # worker-2's agent does not answer: one line naming it, a failure, and still the rows.
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1
    assert "node worker-2" in done.stderr
    assert "did not answer" in done.stderr
    rows = {(r["node"], r["device"]): r for r in json.loads(done.stdout)}
    assert len(rows) == 16
    trainer = rows[("worker-1", "gpu-0")]
    assert trainer["state"] == f"held by {world.namespace}/trainer"
    assert trainer["model"] == "NVIDIA H100 80GB HBM3"
    assert trainer["utilization"] == 1  # from the agent
    assert trainer["idle_seconds"] == 1200
    assert trainer["uuid"]
    assert rows[("worker-1", "gpu-1")]["state"] == "free"
    assert rows[("worker-1", "gpu-1")]["utilization"] == 90
    shared = rows[("worker-2", "gpu-1")]
    assert shared["state"] == "shared by 2 pods"
    assert shared["utilization"] is None
    assert rows[("worker-2", "gpu-2")]["state"] == f"held by {world.namespace}/claim waiting"
    assert rows[("worker-2", "gpu-3")]["state"] == "tainted"
    assert rows[("worker-2", "gpu-3")]["model"] == "NVIDIA H100 80GB HBM3"  # from the slice
    assert rows[("worker-2", "gpu-3")]["taints"] == ["gpu.nvidia.com/xid:NoSchedule"]

    idle = json.loads(top(cluster, world, "-o", "json", "--idle", "10m").stdout)
    assert [(r["node"], r["device"]) for r in idle] == [("worker-1", "gpu-0")]
    mine = json.loads(top(cluster, world, "-o", "json", "-n", world.namespace).stdout)
    assert len(mine) == 3

    # Only worker-1: its agent answers, so the command succeeds; the table has no colour.
    done = top(cluster, world, "--node", "worker-1")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "\033[" not in done.stdout
    assert len(done.stdout.splitlines()) == 9
    (line,) = [ln for ln in done.stdout.splitlines() if " gpu-0 " in ln]
    assert f"held by {world.namespace}/trainer" in line
    assert line.endswith("20m00s")


def test_an_explicit_url_stands_in_for_the_agent_found(
    cluster: Cluster, world: World, endpoint: str
) -> None:
    url = endpoint.partition("=")[2]
    world.publish("worker-2")
    world.agent("worker-2", 9)

    done = top(cluster, world, "-o", "json", "--metrics", f"worker-2={url}")

    assert done.returncode == 0, done.stderr
    rows = {r["device"]: r for r in json.loads(done.stdout)}
    assert rows["gpu-1"]["utilization"] == 90
    # The API decides the holders: the agent's own holder of gpu-0 is not this cluster's.
    assert rows["gpu-0"]["state"] == "free"


def test_a_node_without_an_agent_endpoint_is_one_warning(cluster: Cluster, world: World) -> None:
    world.publish("worker-1")

    done = top(cluster, world, "-o", "json")

    assert done.returncode == 0
    assert done.stderr.count("\n") == 1
    assert "--metrics worker-1=URL" in done.stderr
    assert {r["utilization"] for r in json.loads(done.stdout)} == {None}


def test_report_reads_the_counters_of_the_agents_found_in_the_cluster(
    cluster: Cluster, world: World, endpoint: str
) -> None:
    port = int(endpoint.rsplit(":", 1)[1].split("/", maxsplit=1)[0])
    world.agent("worker-1", port)
    world.agent("worker-2", 9)  # nothing listens there

    done = gpudra(cluster, world, "report", "-o", "json")

    # worker-2's agent does not answer: one line naming it, a failure, and the others.
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("gpudra report: node worker-2: ")
    assert "did not answer" in line
    doc = json.loads(done.stdout)
    assert "since each agent started" in doc["span"]
    [team] = doc["usage"]
    assert (team["namespace"], team["allocated_hours"]) == ("team-a", 1200 / 3600)


def test_report_without_agents_in_the_cluster_says_how_to_fix_it(
    cluster: Cluster, world: World
) -> None:
    done = gpudra(cluster, world, "report")

    assert done.returncode != 0
    [line] = done.stderr.splitlines()
    assert line.startswith("gpudra report: no node agent found")
    assert world.selector in line
    assert "--metrics NODE=URL or --prometheus URL" in line


def test_a_tenants_pod_with_the_agents_labels_is_not_read_as_its_agent(
    cluster: Cluster, world: World, endpoint: str, kube: Kube
) -> None:
    """Labels, a port named metrics and spec.nodeName are any tenant's to write. A
    tenant's pod carrying the agent's, on the agent's node, in a namespace listed after
    gpudra's, is not taken for the agent: the report has the real agent's counters."""
    port = int(endpoint.rsplit(":", 1)[1].split("/", maxsplit=1)[0])
    world.agent("worker-1", port)
    tenant = f"zz-{world.namespace}"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": tenant}})
    try:
        key, value = world.selector.split("=")
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "fake-agent", "namespace": tenant, "labels": {key: value}},
                "spec": {
                    "nodeName": "worker-1",
                    "containers": [
                        {
                            "name": "node",
                            "image": "tenant:latest",
                            "ports": [{"name": "metrics", "containerPort": 9}],
                        }
                    ],
                },
            }
        )
        ip = [{"ip": "127.0.0.1"}]
        status = {"phase": "Running", "hostIP": "127.0.0.1", "podIP": "127.0.0.1", "podIPs": ip}
        kube.patch_status("Pod", "fake-agent", {"status": status}, tenant)

        done = gpudra(cluster, world, "report", "-o", "json")

        assert done.returncode == 0, done.stderr
        [team] = json.loads(done.stdout)["usage"]
        assert (team["namespace"], team["allocated_hours"]) == ("team-a", 1200 / 3600)
    finally:
        kube.delete("Namespace", tenant)
