"""Which pods `gpudra top` and `gpudra report` take for node agents: only those a
DaemonSet controls in gpudra's namespace, never a tenant's pod that carries the
agent's labels and a `metrics` port, and no node that two pods claim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gpudra.cli.agents import endpoints

from tests.cli.stubs import agent_pod, api_server, gpudra, http_server, port_of, serving

# What a tenant's pod serves to pass for the agent: its namespace's GPU-hours moved to
# team-a's account.
LABELS = '{namespace="team-a",tenant="",device_class="gpu.nvidia.com",sharing="Exclusive"}'
FORGED = (
    "# TYPE gpudra_allocated_device_seconds counter\n"
    f"gpudra_allocated_device_seconds_total{LABELS} 3.6e7\n"
    "# TYPE gpudra_idle_device_seconds counter\n"
    f"gpudra_idle_device_seconds_total{LABELS} 0\n"
).encode()


def test_only_pods_a_daemonset_controls_are_agents() -> None:
    replicaset = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "controller": True}
    not_controller = {"apiVersion": "apps/v1", "kind": "DaemonSet", "controller": False}
    other_group = {"apiVersion": "example.com/v1", "kind": "DaemonSet", "controller": True}
    terminating = agent_pod("gpudra", "old", "e", 9477)
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"

    found = endpoints(
        [
            agent_pod("gpudra", "agent", "a", 9477),
            agent_pod("gpudra", "bare", "b", 9477, owner={}),
            agent_pod("gpudra", "deployed", "c", 9477, owner=replicaset),
            agent_pod("gpudra", "adopted", "d", 9477, owner=not_controller),
            agent_pod("gpudra", "lookalike", "f", 9477, owner=other_group),
            terminating,
        ]
    )

    assert found.urls == {"a": "http://127.0.0.1:9477/metrics"}
    assert found.contested == {}


def test_two_pods_claiming_one_node_leave_it_out_naming_both() -> None:
    found = endpoints(
        [
            agent_pod("gpudra", "gpudra-node-x1", "node-a", 9477),
            agent_pod("gpudra", "gpudra-node-y2", "node-a", 8080),
            agent_pod("gpudra", "gpudra-node-z3", "node-b", 9477),
        ]
    )

    assert found.urls == {"node-b": "http://127.0.0.1:9477/metrics"}
    why = found.contested["node-a"]
    assert "gpudra/gpudra-node-x1" in why
    assert "gpudra/gpudra-node-y2" in why


def test_report_reads_the_agent_not_a_tenant_pod_with_its_labels(
    endpoint: str, tmp_path: Path
) -> None:
    """The tenant's pod has the labels, the port, the node and even a DaemonSet of its
    own; it is in the tenant's namespace, which is not searched."""
    with http_server(serving(FORGED)) as forged:
        pods = [
            agent_pod("gpudra", "gpudra-node-x1", "node-a", port_of(endpoint)),
            agent_pod("team-b", "innocent", "node-a", forged),
        ]
        with api_server(pods, tmp_path) as (kubeconfig, asked):
            done = gpudra("report", "--kubeconfig", str(kubeconfig), "-o", "json")

    assert done.returncode == 0, done.stderr
    assert "/api/v1/namespaces/gpudra/pods" in asked
    [team] = json.loads(done.stdout)["usage"]
    assert team["namespace"] == "team-a"
    assert team["allocated_hours"] == pytest.approx(1200 / 3600)  # the agent's, not 10,000 h


def test_the_agent_namespace_flag_names_where_gpudra_runs(endpoint: str, tmp_path: Path) -> None:
    pods = [agent_pod("gpu-system", "gpudra-node-x1", "node-a", port_of(endpoint))]
    with api_server(pods, tmp_path) as (kubeconfig, asked):
        default = gpudra("report", "--kubeconfig", str(kubeconfig))
        moved = gpudra("report", "--kubeconfig", str(kubeconfig), "--agent-namespace", "gpu-system")

    assert default.returncode != 0
    [line] = default.stderr.splitlines()
    assert "no node agent found" in line
    assert "namespace gpudra" in line
    assert "--agent-namespace" in line
    assert moved.returncode == 0, moved.stderr
    assert "team-a" in moved.stdout
    assert "/api/v1/namespaces/gpu-system/pods" in asked


def test_a_bad_agent_namespace_names_the_flag() -> None:
    done = gpudra("top", "--agent-namespace", "../kube-system")
    assert done.returncode != 0
    assert "--agent-namespace" in done.stderr
    assert "DNS label" in done.stderr


def test_report_leaves_out_a_node_two_pods_claim_and_fails(endpoint: str, tmp_path: Path) -> None:
    with http_server(serving(FORGED)) as forged:
        pods = [
            agent_pod("gpudra", "gpudra-node-a1", "node-a", port_of(endpoint)),
            agent_pod("gpudra", "gpudra-node-a2", "node-a", forged),
            agent_pod("gpudra", "gpudra-node-b1", "node-b", port_of(endpoint)),
        ]
        with api_server(pods, tmp_path) as (kubeconfig, _asked):
            done = gpudra("report", "--kubeconfig", str(kubeconfig), "-o", "json")

    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("gpudra report: node node-a: pods gpudra/gpudra-node-a1, ")
    assert "gpudra/gpudra-node-a2" in line
    [team] = json.loads(done.stdout)["usage"]  # node-b's agent only
    assert team["allocated_hours"] == pytest.approx(1200 / 3600)


def test_top_warns_of_a_node_two_pods_claim_unless_given_its_url(
    endpoint: str, tmp_path: Path
) -> None:
    with http_server(serving(FORGED)) as forged:
        pods = [
            agent_pod("gpudra", "gpudra-node-a1", "node-a", forged),
            agent_pod("gpudra", "gpudra-node-a2", "node-a", forged),
            agent_pod("gpudra", "gpudra-node-b1", "node-b", port_of(endpoint)),
        ]
        with api_server(pods, tmp_path) as (kubeconfig, _asked):
            done = gpudra("top", "--kubeconfig", str(kubeconfig), "-o", "json")
            url = endpoint.partition("=")[2]
            given = gpudra(
                "top", "--kubeconfig", str(kubeconfig), "-o", "json", "--metrics", f"node-a={url}"
            )

    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("gpudra top: node node-a: pods gpudra/gpudra-node-a1, ")
    assert "--metrics node-a=URL" in line
    assert {r["node"] for r in json.loads(done.stdout)} == {"node-b"}
    assert given.returncode == 0, given.stderr
    assert given.stderr == ""
    assert {r["node"] for r in json.loads(given.stdout)} == {"node-a", "node-b"}
