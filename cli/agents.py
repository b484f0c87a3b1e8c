"""Where each node's agent serves its metrics, found from the cluster itself.

The chart runs the agent as a DaemonSet whose pods carry
`app.kubernetes.io/component=node` and expose the metrics endpoint as the container
port named `metrics` (absent when metrics are off). So the pods say, per node, which
address and port to scrape, without the user listing endpoints by hand. `gpudra top`
and `gpudra report` both find and read the agents through this module.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any, Final

import aiohttp
from gpudra.cli.scrape import Unanswered, get
from gpudra.common.kube import ApiError, Kube, KubeConfigError

__all__ = [
    "AGENT_SELECTOR",
    "add_arguments",
    "connect",
    "endpoints",
    "find",
    "read",
    "scrape",
]

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that say where the cluster and its agents are."""
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, else in-cluster)"
    )
    p.add_argument(
        "--agent-selector",
        default=AGENT_SELECTOR,
        metavar="LABELS",
        help="label selector of the node agent pods, whose port named metrics is scraped",
    )


async def connect(kubeconfig: str | None, *, command: str, otherwise: str) -> Kube:
    """The cluster's API client; one line naming the fix (`otherwise`) when there is none."""
    try:
        return await Kube.connect(kubeconfig)
    except (KubeConfigError, OSError) as e:
        raise SystemExit(
            f"gpudra {command}: no cluster to read ({e}); give --kubeconfig, or {otherwise}"
        ) from None


async def find(
    kubeconfig: str | None, selector: str, *, command: str, otherwise: str
) -> dict[str, str]:
    """node -> metrics URL of the running agents; one line and an exit when the cluster
    cannot be read or has none."""
    kube = await connect(kubeconfig, command=command, otherwise=otherwise)
    try:
        found = await read(kube, selector)
    except (ApiError, aiohttp.ClientError, OSError) as e:
        raise SystemExit(
            f"gpudra {command}: cannot list the agent pods ({e}); give {otherwise}"
        ) from None
    finally:
        await kube.close()
    if not found:
        raise SystemExit(
            f"gpudra {command}: no node agent found (no running pod matching {selector} with "
            f"a port named metrics: is gpudra installed, with node.metricsPort not 0?); "
            f"give --agent-selector, or {otherwise}"
        )
    return found


def scrape(found: Mapping[str, str], timeout_s: float) -> tuple[dict[str, str], dict[str, str]]:
    """Each agent's metrics text by node, and why, by node, for each that did not answer."""
    texts: dict[str, str] = {}
    failed: dict[str, str] = {}
    for node, url in sorted(found.items()):
        try:
            texts[node] = get(url, timeout_s)
        except Unanswered as e:
            failed[node] = str(e)
    return texts, failed
