"""Pod networking for kind clusters made without kind's default CNI.

kindnet, kind's CNI, is an image no offline build can make (the module proxy does not
serve it), so e2e/kind/cluster.yaml sets `disableDefaultCNI` and this does what
kindnet does, once, when the nodes have their pod CIDRs: on every node a CNI config
with the `ptp` plugin (a veth per pod, routed by the node) and `host-local` addresses
from the node's pod CIDR, and a route to every other node's pod CIDR through that
node's address on kind's network. The same on every engine, so both providers of the
node image (ours and kind's own) get the same pod network.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

CONF_PATH = "/etc/cni/net.d/10-gpudra-ptp.conflist"
NETWORK = "gpudra-ptp"


@dataclass(frozen=True)
class NodeNet:
    name: str
    address: str  # InternalIP on kind's network
    pod_cidr: str


def node_nets(nodes: Sequence[dict[str, Any]]) -> list[NodeNet]:
    """Each Node's name, InternalIP and pod CIDR; a node without a pod CIDR yet (the
    controller manager assigns them) is an error the caller waits out."""
    out = []
    for node in nodes:
        name = node["metadata"]["name"]
        cidr = node.get("spec", {}).get("podCIDR")
        addresses = node.get("status", {}).get("addresses", [])
        ip = next((a["address"] for a in addresses if a["type"] == "InternalIP"), None)
        if not cidr or not ip:
            raise ValueError(f"node {name} has no pod CIDR or InternalIP yet")
        out.append(NodeNet(name, ip, cidr))
    return out


def conflist(pod_cidr: str) -> dict[str, Any]:
    """kindnet's CNI config: ptp with host-local addresses, and portmap for hostPorts."""
    return {
        "cniVersion": "0.4.0",
        "name": NETWORK,
        "plugins": [
            {
                "type": "ptp",
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def node_script(others: Sequence[NodeNet]) -> str:
    """The shell one node runs: the config from stdin, routes to the other nodes."""
    routes = "".join(f" && ip route replace {o.pod_cidr} via {o.address}" for o in others)
    write = f"cat > {CONF_PATH}.tmp && mv {CONF_PATH}.tmp {CONF_PATH}"
    return f"mkdir -p /etc/cni/net.d && {write}{routes}"


def configure(nets: Sequence[NodeNet], run: Callable[[str, str, str], str | None]) -> None:
    """Applies the network on every node through `run(node, script, stdin)`, which
    returns an error text or None."""
    for me in nets:
        others = [o for o in nets if o.name != me.name]
        error = run(me.name, node_script(others), json.dumps(conflist(me.pod_cidr)))
        if error is not None:
            raise RuntimeError(f"configuring pod networking on {me.name} failed: {error}")
