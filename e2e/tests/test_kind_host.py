"""`make e2e-kind`'s promise on a machine without Docker: up and down on the private
engine leave the host as they found it. Its /run, its global sysctls (fs.protected_*,
which kind's nodes would change through systemd-sysctl, and the kubelet's kernel
tunables), its firewall, network links, mounts, cgroups and processes.

Marked `kind` (`make test-kind`): it creates a whole kind cluster (a minute or two warm,
the first run also builds the node image), so `make test` leaves it out. It skips where
the private engine cannot start, with the reason, and while one already runs (it would
stop someone's cluster).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from e2e.cluster.harness import FAKE_NODE_LABEL, node_names
from e2e.kind import engine as eng
from e2e.kind.cluster import HEARTBEAT_HINT, KindCluster
from e2e.node.realnode import cgroup_mounts
from e2e.processes import alive

pytestmark = [pytest.mark.cluster, pytest.mark.kind]


def _firewall() -> list[str]:
    """Every rule, without counters. Chains named KUBE-* are left out: they belong to
    the kubelets of real nodes on this host, which may change them meanwhile; kind's
    kube-proxies write theirs in the nodes' own network namespaces."""
    out: list[str] = []
    for tool in ("iptables-save", "ip6tables-save"):
        proc = subprocess.run([tool], capture_output=True, text=True, check=False)
        out += [
            ln.split(" [", 1)[0]
            for ln in proc.stdout.splitlines()
            if ln and not ln.startswith("#") and "KUBE-" not in ln
        ]
    return sorted(out)


def _links() -> list[str]:
    """Network links but the host ends of real nodes' pod veths (the ptp plugin gives
    each a /32 address; Docker's veths have none), which come and go with their pods."""
    proc = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                          check=False)  # fmt: skip
    pod_ends = {ln.split()[1] for ln in proc.stdout.splitlines() if "/32 " in ln}
    return sorted(p.name for p in Path("/sys/class/net").iterdir() if p.name not in pod_ends)


def _engine_processes(root: Path) -> list[str]:
    needle = str(root).encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if needle in cmd:
                found.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
    return found


def snapshot(layout: eng.EngineLayout) -> dict[str, object]:
    mounts = Path("/proc/self/mountinfo").read_text()
    return {
        "/run": sorted(p.name for p in Path("/run").iterdir()),
        "sysctls": eng.read_sysctls(),
        "firewall": _firewall(),
        "links": _links(),
        "mounts under the engine": [ln for ln in mounts.splitlines() if str(layout.root) in ln],
        "cgroups": [
            str(m / layout.cgroup_parent)
            for m in cgroup_mounts()
            if (m / layout.cgroup_parent).exists()
        ],
        "bind sources": [str(p) for p in eng.HOST_BIND_SOURCES if p.exists()],
        "engine processes": _engine_processes(layout.root),
        "engine socket": layout.socket.exists(),
    }


def test_up_and_down_leave_the_host_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = eng.Engine()
    if engine.is_running():
        pytest.skip("the private Docker engine already runs: `make e2e-kind-down` first")
    if problem := eng.start_problem():
        pytest.skip(f"no private Docker engine here: {problem}")
    before = snapshot(engine.layout)
    monkeypatch.setenv("GPUDRA_KIND_ENGINE", "private")
    cluster = KindCluster(name="gpudra-host-check", root=tmp_path / "kind")
    try:
        cluster.up(log=lambda _m: None)
        nodes = cluster.kube().list("Node", labelSelector=f"!{FAKE_NODE_LABEL}")
        assert len(nodes) == 3
        fake = cluster.kube().list("Node", labelSelector=FAKE_NODE_LABEL)
        assert {n["metadata"]["name"] for n in fake} == set(node_names())
        heartbeat = int(cluster.layout.heartbeat_pid.read_text())
        assert alive(heartbeat, HEARTBEAT_HINT)
        assert engine.is_running()
    finally:
        cluster.down(log=lambda _m: None)
    assert not alive(heartbeat, HEARTBEAT_HINT)
    after = snapshot(engine.layout)
    for key, value in before.items():
        assert after[key] == value, key
