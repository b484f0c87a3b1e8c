"""Where each node's agent serves its metrics, found from the cluster itself.

The chart runs the agent as a DaemonSet in the namespace it is installed in; its pods
carry `app.kubernetes.io/component=node` and expose the metrics endpoint as the
container port named `metrics` (absent when metrics are off). So the pods say, per
node, which address and port to scrape, without the user listing endpoints by hand.
`gpudra top` and `gpudra report` both find and read the agents through this module.

Labels, a port's name and `spec.nodeName` are anyone's to write: a tenant's pod can
carry them all, and what it served would be read as the agent's (another tenant's
GPU-hours, the rows of `top`). So agents are looked for only in gpudra's namespace
(`--agent-namespace`), where tenants run no pods, and only pods a DaemonSet controls
count. Two such pods on one node leave that node out with a warning naming both:
picking one of them would be a guess.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from gpudra.api.names import dns_label_problem
from gpudra.cli.cluster import add_kubeconfig, connect
from gpudra.cli.scrape import Unanswered, get, metric_samples
from gpudra.common.kube import ApiError, Kube
from prometheus_client.samples import Sample

__all__ = [
    "AGENT_NAMESPACE",
    "AGENT_SELECTOR",
    "Agents",
    "add_arguments",
    "endpoints",
    "find",
    "looked_for",
    "read",
    "scrape",
]

AGENT_SELECTOR: Final = "app.kubernetes.io/name=gpudra,app.kubernetes.io/component=node"
# The namespace docs/install.md installs the chart into.
AGENT_NAMESPACE: Final = "gpudra"


@dataclass(frozen=True)
class Agents:
    """The agents the pods name: each node's metrics URL, and, for each node that more
    than one pod claims, why it is left out (one warning line)."""

    urls: dict[str, str] = field(default_factory=dict)
    contested: dict[str, str] = field(default_factory=dict)


def endpoints(pods: Iterable[Mapping[str, Any]]) -> Agents:
    """The running, not terminating pods a DaemonSet controls that expose a `metrics`
    port, by node.

    The pod IP is the host's under hostNetwork, so it is the address either way; the
    host IP stands in while a pod reports none."""
    claims: dict[str, list[tuple[str, str]]] = {}  # node -> [(namespace/name, URL)]
    for pod in pods:
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        status = pod.get("status") or {}
        node = spec.get("nodeName") or ""
        address = status.get("podIP") or status.get("hostIP") or ""
        ports = [
            p.get("containerPort")
            for c in spec.get("containers") or ()
            for p in c.get("ports") or ()
            if p.get("name") == "metrics"
        ]
        running = status.get("phase", "Running") == "Running" and not meta.get("deletionTimestamp")
        if node and address and ports and running and _daemon_pod(meta):
            host = f"[{address}]" if ":" in address else address
            name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
            claims.setdefault(node, []).append((name, f"http://{host}:{ports[0]}/metrics"))
    found = Agents()
    for node, claimed in claims.items():
        if len(claimed) == 1:
            found.urls[node] = claimed[0][1]
        else:
            names = ", ".join(sorted(name for name, _ in claimed))
            found.contested[node] = (
                f"pods {names} each claim to be its agent; none is read: delete the one "
                "that is not gpudra's"
            )
    return found


def _daemon_pod(meta: Mapping[str, Any]) -> bool:
    """Whether a DaemonSet controls the pod, as it does each of the agent's."""
    return any(
        ref.get("kind") == "DaemonSet"
        and ref.get("controller") is True
        and str(ref.get("apiVersion", "")).startswith("apps/")
        for ref in meta.get("ownerReferences") or ()
    )


def looked_for(namespace: str, selector: str) -> str:
    """What counts as an agent pod, in words, for the messages that found none."""
    return (
        f"no running pod of a DaemonSet in namespace {namespace} matching {selector} "
        "with a port named metrics"
    )


async def read(
    kube: Kube, namespace: str = AGENT_NAMESPACE, selector: str = AGENT_SELECTOR
) -> Agents:
    """The agents among the pods in `namespace` matching `selector`."""
    path = f"/api/v1/namespaces/{namespace}/pods"
    pods = await kube.request("GET", path, query={"labelSelector": selector})
    return endpoints(pods.get("items") or [])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that say where the cluster and its agents are."""
    add_kubeconfig(p)
    p.add_argument(
        "--agent-namespace",
        default=AGENT_NAMESPACE,
        type=namespace_argument,
        metavar="NAMESPACE",
        help="the namespace gpudra is installed in: only pods there that a DaemonSet "
        f"controls are taken for node agents (default: {AGENT_NAMESPACE})",
    )
    p.add_argument(
        "--agent-selector",
        default=AGENT_SELECTOR,
        metavar="LABELS",
        help="label selector of the node agent pods, whose port named metrics is scraped",
    )


def namespace_argument(raw: str) -> str:
    """A `--namespace` flag's value: the namespace gpudra is (or will be) installed in."""
    if problem := dns_label_problem(raw):
        raise argparse.ArgumentTypeError(
            f"{raw!r} {problem}; give the namespace gpudra is (or will be) installed in"
        )
    return raw


async def find(
    kubeconfig: str | None, namespace: str, selector: str, *, command: str, otherwise: str
) -> Agents:
    """The agents in `namespace`; one line and an exit when the cluster cannot be read
    or has none."""
    kube = await connect(kubeconfig, command=command, otherwise=otherwise)
    try:
        found = await read(kube, namespace, selector)
    except (ApiError, aiohttp.ClientError, OSError) as e:
        raise SystemExit(
            f"gpudra {command}: cannot list the agent pods ({e}); give {otherwise}"
        ) from None
    finally:
        await kube.close()
    if not found.urls and not found.contested:
        raise SystemExit(
            f"gpudra {command}: no node agent found ({looked_for(namespace, selector)}: "
            f"is gpudra installed in {namespace}, with node.metricsPort not 0?); give "
            f"--agent-namespace, --agent-selector, or {otherwise}"
        )
    return found


def scrape(
    found: Mapping[str, str], timeout_s: float, wanted: Callable[[str], bool]
) -> tuple[dict[str, list[Sample]], dict[str, str]]:
    """Each agent's samples that `wanted` names, by node, and why, by node, for each
    that did not answer or answered what is not its metrics."""
    answers: dict[str, list[Sample]] = {}
    failed: dict[str, str] = {}
    for node, url in sorted(found.items()):
        try:
            answers[node] = metric_samples(url, get(url, timeout_s), wanted)
        except Unanswered as e:
            failed[node] = str(e)
    return answers, failed
