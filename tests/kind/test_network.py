"""Pod networking on kind without kindnet (e2e/kind/network.py): what each node gets."""

from __future__ import annotations

import json
from typing import Any

import pytest

from e2e.kind import network


def _node(name: str, ip: str, cidr: str | None) -> dict[str, Any]:
    spec = {"podCIDR": cidr} if cidr else {}
    addresses = [{"type": "Hostname", "address": name}, {"type": "InternalIP", "address": ip}]
    return {"metadata": {"name": name}, "spec": spec, "status": {"addresses": addresses}}


def test_each_node_gets_its_cidr_and_routes_to_the_others() -> None:
    nets = network.node_nets(
        [_node("cp", "172.18.0.2", "10.244.0.0/24"), _node("w1", "172.18.0.3", "10.244.1.0/24")]
    )
    calls: dict[str, tuple[str, str]] = {}

    def run(node: str, script: str, stdin: str) -> str | None:
        calls[node] = (script, stdin)
        return None

    network.configure(nets, run)
    script, stdin = calls["cp"]
    assert "ip route replace 10.244.1.0/24 via 172.18.0.3" in script
    assert "10.244.0.0/24" not in script  # no route to itself
    plugins = json.loads(stdin)["plugins"]
    assert plugins[0]["type"] == "ptp"
    assert plugins[0]["ipam"]["ranges"] == [[{"subnet": "10.244.0.0/24"}]]
    assert "ip route replace 10.244.0.0/24 via 172.18.0.2" in calls["w1"][0]


def test_a_node_without_a_pod_cidr_is_not_ready_for_networking() -> None:
    with pytest.raises(ValueError, match="w1 has no pod CIDR"):
        network.node_nets([_node("w1", "172.18.0.3", None)])


def test_a_failing_node_names_itself() -> None:
    nets = network.node_nets([_node("w1", "172.18.0.3", "10.244.1.0/24")])
    with pytest.raises(RuntimeError, match="on w1 failed: no shell"):
        network.configure(nets, lambda _n, _s, _i: "no shell")
