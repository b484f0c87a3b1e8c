"""The harness itself: bad input fails with one clear line and starts nothing; a
crashed cluster is cleaned, and one an earlier harness started is replaced; `down`
stops every process and frees every port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from e2e.cluster.harness import REPO, Cluster, Layout, register_node
from e2e.cluster.kube import wait_for
from e2e.cluster.second import PORTS, harness, second_env
from e2e.processes import port_free
from e2e.provider import local_only

pytestmark = [
    pytest.mark.cluster,
    local_only("tests the local control-plane harness itself"),
]
BUILD = REPO / "e2e" / "cluster" / "build.sh"


def test_unknown_version_is_one_clear_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(BUILD)],
        env={**os.environ, "K8S_VERSION": "1.99"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "build: unknown K8S_VERSION '1.99': supported are 1.34,1.35,1.36,1.37; "
        "set K8S_VERSION to one of them"
    ]


def test_a_pre_release_of_a_pinned_minor_is_its_own_version(tmp_path: Path) -> None:
    """`K8S_VERSION=1.36.0-rc.1` (what a kubelet of a pre-release reports, less the v)
    is a version of the pinned minor 1.36, cached under its own name; one of a minor
    that is not pinned is refused in the same one line as any unknown version."""
    binaries = tmp_path / "k8s" / "v1.36.0-rc.1" / "bin"
    binaries.mkdir(parents=True)
    for name in (
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kubectl",
        "kubelet",
        "etcd",
    ):
        (binaries / name).write_text("#!/bin/sh\n")
        (binaries / name).chmod(0o755)
    env = {**os.environ, "GPUDRA_CACHE": str(tmp_path)}

    def build(version: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(BUILD)],
            env={**env, "K8S_VERSION": version},
            capture_output=True,
            text=True,
            check=False,
        )

    found = build("1.36.0-rc.1")
    assert (found.returncode, found.stdout.strip()) == (0, str(binaries))
    refused = build("1.99.0-beta.0")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "build: unknown K8S_VERSION '1.99.0-beta.0': supported are 1.34,1.35,1.36,1.37; "
        "set K8S_VERSION to one of them"
    ]


def test_missing_go_toolchain_is_reported(tmp_path: Path) -> None:
    # An empty cache forces a build; a PATH without go must say so, not fail obscurely.
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "GPUDRA_CACHE": str(tmp_path),
        "K8S_VERSION": "1.36",
    }
    if any(Path(d, "go").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("go is installed in /usr/bin; cannot hide it")
    proc = subprocess.run(
        ["bash", str(BUILD)], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert "no Go toolchain on PATH" in proc.stderr
    assert not (tmp_path / "k8s").exists() or not any((tmp_path / "k8s").rglob("kube-*"))


def test_busy_port_starts_nothing(tmp_path: Path, cluster: Cluster) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", PORTS["APISERVER"]))
        s.listen()
        proc = harness(second_env(tmp_path), "up")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"cluster-up: port {PORTS['APISERVER']} for apiserver is already in use "
        f"(`ss -ltnp 'sport = :{PORTS['APISERVER']}'` shows by what): stop that "
        "process or set GPUDRA_APISERVER_PORT to a free port"
    )
    assert not (tmp_path / "c" / "state.json").exists()
    assert port_free(PORTS["ETCD"])


def test_crash_is_cleaned_and_down_frees_everything(tmp_path: Path, cluster: Cluster) -> None:
    env = second_env(tmp_path, GPUDRA_NODES="1")
    assert harness(env, "up").returncode == 0
    second = Cluster(Layout(tmp_path / "c"))
    assert second.is_up()
    pids = second.status()["processes"]
    assert set(pids) == {
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "node-heartbeat",
    }
    # Simulate a crash: the API server dies; `up` must notice, clean and start afresh.
    state = (tmp_path / "c" / "state.json").read_text()
    old = json.loads(state)["pids"]
    os.kill(old["kube-apiserver"], signal.SIGKILL)
    again = harness(env, "up")
    assert again.returncode == 0, again.stderr
    assert "cleaning it up" in again.stdout
    new = json.loads((tmp_path / "c" / "state.json").read_text())["pids"]
    assert all(not Path(f"/proc/{p}").exists() or p in new.values() for p in old.values())
    # Idempotent: a second `up` of a healthy cluster changes nothing.
    assert "already up" in harness(env, "up").stdout
    assert json.loads((tmp_path / "c" / "state.json").read_text())["pids"] == new
    client = second.admission_client()
    assert client is not None
    assert client.user == f"gpudra-webhook.gpudra.svc:{PORTS['ADMISSION_WEBHOOK']}"
    # A cluster an earlier harness started, healthy but without the admission client
    # certificate the API server reads only at start, is replaced rather than reused.
    path = tmp_path / "c" / "state.json"
    earlier = json.loads(path.read_text())
    del earlier["ports"]["admission_webhook"]
    path.write_text(json.dumps(earlier))
    assert not second.is_up()
    assert second.admission_client() is None
    replaced = harness(env, "up")
    assert replaced.returncode == 0, replaced.stderr
    assert "cleaning it up" in replaced.stdout
    assert second.admission_client() == client
    new = json.loads(path.read_text())["pids"]
    assert new != earlier["pids"]
    down = harness(env, "down")
    assert down.returncode == 0, down.stderr
    for pid in new.values():
        assert (
            not Path(f"/proc/{pid}").exists()
            or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
        )
    assert all(port_free(p) for p in PORTS.values())
    # The shared test cluster is untouched.
    assert cluster.is_up()


def test_env_prints_kubeconfig_and_same_version_kubectl(cluster: Cluster) -> None:
    out = cluster.env()
    lines = out.strip().splitlines()
    assert lines[0] == f"export KUBECONFIG={cluster.layout.admin_kubeconfig}"
    bin_dir = lines[1].removeprefix("export PATH=").split(":")[0]
    version = subprocess.run(
        [f"{bin_dir}/kubectl", "version", "--client", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert cluster.status()["version"] in version


def test_nodes_stay_ready_and_schedulable(cluster: Cluster) -> None:
    kube = cluster.kube()
    for node in kube.list("Node"):
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"
        assert not node["spec"].get("taints")
        assert node["status"]["allocatable"]["pods"] == "110"


def test_heartbeat_renews_node_leases(cluster: Cluster) -> None:
    """Without renewals the node lifecycle controller would taint the nodes after ~40s."""
    kube = cluster.kube()
    path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/worker-1"
    first = kube.request("GET", path)["spec"]["renewTime"]
    wait_for(
        "the worker-1 lease to be renewed",
        lambda: kube.request("GET", path)["spec"]["renewTime"] != first,
        timeout=20,
    )


def test_deleting_a_fake_node_removes_its_lease(cluster: Cluster) -> None:
    """Benchmarks register hundreds of fake nodes and delete them; their Leases must go
    with them (owned by the Node, as the kubelet makes them), or every run leaves a
    namespace full of them behind."""
    kube = cluster.kube()
    name = "harness-lease-owner"
    register_node(kube, name)
    lease = kube.get_or_none("Lease", name, "kube-node-lease")
    node = kube.get_or_none("Node", name)
    assert lease is not None and node is not None
    owners = lease["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [
        ("Node", name, node["metadata"]["uid"])
    ]
    kube.delete("Node", name)
    wait_for(
        "the deleted node's Lease to be garbage-collected",
        lambda: kube.get_or_none("Lease", name, "kube-node-lease") is None,
        timeout=60,
    )
