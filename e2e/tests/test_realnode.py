"""A real node (kubelet + containerd + runc) next to the local control plane: it
registers and goes Ready, runs an ordinary pod whose logs and exec work through the
API server, cleans up after a deleted pod, and `down` leaves nothing behind.

Skips with the exact reason when the machine cannot run a kubelet (not root, no
writable cgroups, no namespaces) or the node's parts cannot be built.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from gpudra.driver.nvml.standin import FAKEBIN

from e2e.claims import running
from e2e.cluster.harness import Cluster, State
from e2e.cluster.kube import Kube, wait_for
from e2e.gpu_pods import daemon_alive
from e2e.node import images
from e2e.node.realnode import (
    CNI_RESULTS,
    LOG_CONTAINERS,
    NodeState,
    RealNode,
    cgroup_dirs,
    mounts_under,
    unavailable_reason,
)
from e2e.processes import alive
from e2e.provider import local_only

pytestmark = [
    pytest.mark.cluster,
    local_only("the real node joins only the local control plane"),
]


@pytest.fixture(scope="module")
def node(cluster: Cluster) -> Iterator[RealNode]:
    """The test run's cluster is shared with other modules: the node lives only here."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no real node on this machine: {reason}")
    real = RealNode(cluster)
    real.up(log=lambda _m: None)
    yield real
    real.down(log=lambda _m: None)


def _pod(name: str, command: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": "real-1",
            # sh as PID 1 ignores SIGTERM; no need to wait the default 30 s for it.
            "terminationGracePeriodSeconds": 1,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "c",
                    "image": images.TEST_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", command],
                }
            ],
        },
    }


@pytest.fixture
def pod(node: RealNode, kube: Kube) -> Iterator[str]:
    name = f"hello-{uuid.uuid4().hex[:6]}"
    kube.create(_pod(name, "echo hello; sleep 3600"))
    yield name
    kube.delete("Pod", name, "default", grace=0)


def test_node_registers_and_goes_ready(node: RealNode, kube: Kube, cluster: Cluster) -> None:
    obj = kube.get("Node", "real-1")
    ready = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
    assert ready["Ready"] == "True"
    info = obj["status"]["nodeInfo"]
    assert info["containerRuntimeVersion"].startswith("containerd://2.")
    state = State.load(cluster.layout.state)
    assert state is not None
    assert info["kubeletVersion"] == state.version
    assert obj["metadata"]["labels"]["gpudra.dev/real-node"] == "true"
    # The fake nodes are still there and Ready next to it.
    assert all(
        kube.get("Node", n)["status"]["conditions"][0]["status"] == "True" for n in state.nodes
    )


def test_pod_runs_with_logs_and_exec(
    node: RealNode, kube: Kube, cluster: Cluster, pod: str
) -> None:
    obj = wait_for(f"pod {pod} Running", lambda: running(kube, "default", pod), timeout=90)
    assert obj["spec"]["nodeName"] == "real-1"
    assert obj["status"]["podIP"]
    # The container log file the kubelet writes, under the node's own directory.
    logs = list((node.layout.root / "pod-logs").glob(f"default_{pod}_*/c/*.log"))
    assert logs, "no container log file under the node's pod-logs dir"
    wait_for("hello in the log file", lambda: "hello" in logs[0].read_text())
    # API server -> kubelet: logs and exec.
    out = cluster.kubectl("logs", pod)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello"
    out = cluster.kubectl("exec", pod, "--", "sh", "-c", "cat /etc/hostname; ls /bin/env; env")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == pod
    assert "/bin/env" in lines
    assert f"HOSTNAME={pod}" in lines


def test_deleted_pod_is_cleaned_up(node: RealNode, kube: Kube) -> None:
    name = f"bye-{uuid.uuid4().hex[:6]}"
    kube.create(_pod(name, "sleep 3600"))
    uid = wait_for(f"pod {name} Running", lambda: running(kube, "default", name), timeout=90)[
        "metadata"
    ]["uid"]
    state = node.status()
    pod_cgroups = [
        p for d in cgroup_dirs(state["cgroup_root"]) for p in d.rglob(f"pod{uid}") if p.is_dir()
    ]
    assert pod_cgroups, "the pod has no cgroup under the node's cgroup root"
    kube.delete("Pod", name, "default")
    wait_for(f"pod {name} gone", lambda: kube.get_or_none("Pod", name, "default") is None)
    assert not [p for p in pod_cgroups if p.exists()]
    netns = node.layout.root / "run" / "io.containerd.grpc.v1.cri" / "netns"
    assert not [m for m in mounts_under(node.layout.root) if m.startswith(str(netns))]


def test_down_leaves_nothing_behind(node: RealNode, kube: Kube) -> None:
    kube.create(_pod(f"left-{uuid.uuid4().hex[:6]}", "sleep 3600"))
    wait_for("a pod running on real-1", lambda: _pods_running_on(kube, "real-1"), timeout=90)
    # What the agent leaves running when it goes with an MPS claim still prepared: the
    # claim's control daemon, detached, in no cgroup of the node's.
    pipe = node.layout.root / "mps" / "claim" / "pipe"
    pipe.mkdir(parents=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    subprocess.run([str(FAKEBIN / "nvidia-cuda-mps-control"), "-d"], env=env, check=True)
    wait_for("the claim's MPS daemon", lambda: daemon_alive(str(pipe)))
    status = node.status()
    saved = NodeState.load(node.layout.state)
    assert saved is not None
    node.down(log=lambda _m: None)
    assert not any(alive(pid, saved.cmdlines[n]) for n, pid in saved.pids.items())
    assert not daemon_alive(str(pipe))
    assert not node.layout.root.exists()
    assert not [d for d in cgroup_dirs(status["cgroup_root"]) if d.exists()]
    assert not mounts_under(node.layout.root)
    prefix = f"{node.layout.root}/"
    if LOG_CONTAINERS.is_dir():
        assert not [f for f in LOG_CONTAINERS.iterdir() if str(f.readlink()).startswith(prefix)]
    if CNI_RESULTS.is_dir():
        assert not list(CNI_RESULTS.glob(f"{status['cgroup_root'].strip('/')}-*"))
    assert kube.get_or_none("Node", "real-1") is None
    assert not kube.list("Pod", fieldSelector="spec.nodeName=real-1")


def _pods_running_on(kube: Kube, node: str) -> bool:
    pods = kube.list("Pod", fieldSelector=f"spec.nodeName={node}")
    return any(p.get("status", {}).get("phase") == "Running" for p in pods)
