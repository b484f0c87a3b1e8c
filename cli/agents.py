"""Where each node's agent serves its metrics, found from the cluster itself.

The chart runs the agent as a DaemonSet whose pods carry
`app.kubernetes.io/component=node` and expose the metrics endpoint as the container
port named `metrics` (absent when metrics are off). So the pods say, per node, which
address and port to scrape, without the user listing endpoints by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from gpudra.common.kube import Kube

__all__ = ["AGENT_SELECTOR", "endpoints", "read"]

AGENT_SELECTOR: Final = "app.kubernetes.io/name=gpudra,app.kubernetes.io/component=node"
PODS: Final = "/api/v1/pods"


def endpoints(pods: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """node -> metrics URL of the running agent pods that expose a `metrics` port.

    The pod IP is the host's under hostNetwork, so it is the address either way; the
    host IP stands in while a pod reports none."""
    found: dict[str, str] = {}
    for pod in pods:
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        node = spec.get("nodeName") or ""
        address = status.get("podIP") or status.get("hostIP") or ""
        ports = [
            p.get("containerPort")
            for c in spec.get("containers") or ()
            for p in c.get("ports") or ()
            if p.get("name") == "metrics"
        ]
        if node and address and ports and status.get("phase", "Running") == "Running":
            host = f"[{address}]" if ":" in address else address
            found[node] = f"http://{host}:{ports[0]}/metrics"
    return found


async def read(kube: Kube, selector: str = AGENT_SELECTOR) -> dict[str, str]:
    """node -> metrics URL of the agents matching `selector`, in every namespace."""
    pods = await kube.request("GET", PODS, query={"labelSelector": selector})
    return endpoints(pods.get("items") or [])
