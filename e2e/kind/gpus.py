"""The GPU-pod suite's node on kind: a labelled worker of the kind cluster, with the
chart installed by the same `ChartStack` that installs it on the local cluster's real
node (same release, values file, fault injection). Only the node access differs: the
image goes in with `kind load`, files are read with `docker exec`, the kubelet is
restarted with systemctl and its log read from the journal, and the chart keeps its
default host paths and pod networking (kind has kube-proxy).

`KindFleet` installs the chart as a user would with e2e/kind/values.yaml: one release
on every labelled worker, each agent on the emulated profile its node's label names
(`nodes[].labels` in e2e/kind/cluster.yaml), for the scheduling tests across nodes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.kube import Kube, wait_for
from e2e.kind.cluster import VALUES, KindCluster, KindError
from e2e.node.chart import (
    IMAGE_REPOSITORY,
    IMAGE_TAG,
    ChartStack,
    webhook_ready,
    webhook_replicas,
)

EMULATED_LABEL = "gpudra.dev/emulated-gpus"
# The label whose value names a worker's emulated profile (values.yaml's
# node.emulatedProfileLabel, set on the workers by cluster.yaml).
PROFILE_LABEL = "gpudra.dev/emulated-profile"
STATE_DIR = Path("/var/lib/gpudra")
CDI_ROOT = Path("/var/run/cdi")


@dataclass
class _Layout:
    root: Path


class KindNode:
    """A kind worker: its container is named like the node."""

    def __init__(self, cluster: KindCluster, name: str) -> None:
        self.cluster = cluster
        self.name = name
        self.layout = _Layout(cluster.layout.root / name)

    def run(self, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.cluster.docker_exec(self.name, *argv, stdin=stdin)

    def restart_kubelet(self) -> None:
        proc = self.run("systemctl", "restart", "kubelet")
        if proc.returncode != 0:
            raise KindError(f"restarting the kubelet of {self.name} failed: {proc.stderr.strip()}")


def gpu_workers(cluster: KindCluster) -> list[KindNode]:
    """The workers the kind config labels for emulated GPUs, by name."""
    nodes = cluster.kube().list("Node", labelSelector=f"{EMULATED_LABEL}=true")
    if not nodes:
        raise KindError(
            f"no kind node is labelled {EMULATED_LABEL}=true (see e2e/kind/cluster.yaml)"
        )
    return [KindNode(cluster, name) for name in sorted(n["metadata"]["name"] for n in nodes)]


def gpu_worker(cluster: KindCluster) -> KindNode:
    """The first worker the kind config labels for emulated GPUs."""
    return gpu_workers(cluster)[0]


def chart_values() -> dict[str, Any]:
    """e2e/kind/values.yaml with the image the suite builds and loads."""
    values: dict[str, Any] = copy.deepcopy(yaml.safe_load(VALUES.read_text()))
    values["image"] = {
        **values.get("image", {}),
        "repository": IMAGE_REPOSITORY,
        "tag": IMAGE_TAG,
    }
    return values


class KindGpus(ChartStack):
    name = "kind"

    node: KindNode  # type: ignore[assignment]

    @property
    def state_dir(self) -> Path:
        return STATE_DIR

    @property
    def cdi_root(self) -> Path:
        return CDI_ROOT

    def values(
        self,
        *,
        node_args: list[str] | None = None,
        api_port: int | None = None,
        webhook: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """e2e/kind/values.yaml, pinned to this worker with this node's GPU profile (the
        suite's own, in place of the one the worker's label names); `webhook` replaces
        the webhook's values it names."""
        values = chart_values()
        values["webhook"].update(webhook or {})
        node = values.setdefault("node", {})
        node.update(
            nvml=f"emulated:{STATE_DIR / 'profile.json'}",
            emulatedProfileLabel="",
            sharedGpus=self.shared_gpus(),
            nodeSelector={"kubernetes.io/hostname": self.node.name},
            extraArgs=["--cleanup-interval=5", *(node_args or [])],
        )
        if api_port is not None:
            values["kubernetesApi"] = {"host": "127.0.0.1", "port": api_port}
        return values

    @contextlib.contextmanager
    def webhook_on_node_network(self) -> Iterator[None]:
        """Inside, the one webhook replica on its node's network (values.yaml puts it on
        the pod network, the chart's default): a rollout replaces it without a surge
        pod. After, the release is as it was."""
        kube = self.node.cluster.kube()
        self._helm_upgrade(self.values(webhook={"hostNetwork": True}), wait=True)
        try:
            wait_for("the webhook registered", lambda: webhook_ready(kube), timeout=90)
            yield
        finally:
            self._helm_upgrade(self.values(), wait=True)
            wait_for("the webhook registered", lambda: webhook_ready(kube), timeout=90)

    def pod_network_unreachable(self, kube: Kube) -> str | None:
        del kube  # kind's kube-proxy routes the `kubernetes` Service for every pod
        return None

    @contextlib.contextmanager
    def webhook_on_pod_network(self) -> Iterator[Callable[[int], None]]:
        """As `ChartStack.webhook_on_pod_network`, where values.yaml runs the webhook
        already: on the pod network, its replicas free to land on either GPU worker
        (the chart spreads two of them over nodes), reaching the API server through
        kube-proxy. Only the replicas and the CA's source change; the agent stays as it
        is. After, the release is as it was."""
        kube = self.node.cluster.kube()

        def upgrade(webhook: dict[str, Any], force_conflicts: bool, first: bool) -> None:
            del first  # the agent stays as it is
            values = self.values(webhook=webhook)
            self._helm_upgrade(values, wait=True, force_conflicts=force_conflicts)

        try:
            yield webhook_replicas(kube, str(chart_values()["webhook"]["tls"]["source"]), upgrade)
        finally:
            self._helm_upgrade(self.values(), wait=True)
            wait_for("the webhook registered", lambda: webhook_ready(kube), timeout=90)

    def prepare_node(self) -> None:
        self.load_image()
        profile = json.dumps(self.profile(), indent=2)
        fresh_state(self.node, f"cat > {STATE_DIR / 'profile.json'}", stdin=profile)

    def load_image(self) -> None:
        """The image `make image` builds, into every node: the chart's webhook may land
        on any of them."""
        archive = self.build_image()
        kind = self.node.cluster._kind()
        self.node.cluster._run(
            kind, "load", "image-archive", str(archive), "--name", self.node.cluster.name
        )

    def read_file(self, path: Path) -> str | None:
        proc = self.node.run("cat", str(path))
        return proc.stdout if proc.returncode == 0 else None

    def list_names(self, folder: Path) -> list[str]:
        proc = self.node.run("ls", "-1", str(folder))
        return proc.stdout.split() if proc.returncode == 0 else []

    def _journal(self) -> bytes:
        proc = self.node.run("journalctl", "-u", "kubelet", "--no-pager", "-o", "cat")
        return proc.stdout.encode()

    def kubelet_log_size(self) -> int:
        return len(self._journal())

    def kubelet_log(self, since: int) -> str:
        return self._journal()[since:].decode(errors="replace")

    def restart_kubelet(self) -> None:
        super().restart_kubelet()
        kube = self.node.cluster.kube()
        wait_for(
            f"{self.node.name} Ready",
            lambda: any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in kube.get("Node", self.node.name)["status"]["conditions"]
            ),
            timeout=60,
        )


def fresh_state(node: KindNode, then: str = "true", stdin: str | None = None) -> None:
    """An empty state dir, as a new real node has (then `then`, a shell command run in
    it): a reused cluster would otherwise keep the last run's emulated GPU state, which
    another profile's agent refuses as another machine's, and its tool-call log."""
    script = f"rm -rf {STATE_DIR} && mkdir -p {STATE_DIR} && {then}"
    proc = node.run("sh", "-c", script, stdin=stdin)
    if proc.returncode != 0:
        raise KindError(f"preparing {STATE_DIR} on {node.name}: {proc.stderr.strip()}")


class KindFleet(KindGpus):
    """The chart on every labelled worker, installed with e2e/kind/values.yaml as it is
    (no node pin, no profile of the suite's): each agent runs the emulated profile its
    node's label names. Files and the kubelet are read on the first worker as for
    `KindGpus`; `workers` gives each worker's own view."""

    name = "kind-fleet"

    def __init__(self, workers: list[KindNode]) -> None:
        super().__init__(workers[0])
        self.workers = [KindGpus(w) for w in workers]

    def values(
        self,
        *,
        node_args: list[str] | None = None,
        api_port: int | None = None,
        webhook: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        del node_args, api_port, webhook  # the fleet runs as installed; faults are KindGpus's
        return chart_values()

    def prepare_node(self) -> None:
        self.load_image()
        for worker in self.workers:
            fresh_state(worker.node)

    def up(self, *, webhook: bool = True, log: Callable[[str], None] = print) -> None:
        """As `ChartStack.up`, and then every worker's pool published and its kubelet
        connected to its agent (a pod admitted before that waits out a retry)."""
        marks = [w.kubelet_log_size() for w in self.workers]
        super().up(webhook=webhook, log=log)
        kube = self.node.cluster.kube()
        for worker, mark in zip(self.workers, marks, strict=True):
            published = functools.partial(worker.published, kube)
            wait_for(f"{worker.node_name}'s pool published", published, timeout=90)
            worker.wait_registered(mark)
