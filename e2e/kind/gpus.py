"""The GPU-pod suite's node on kind: a labelled worker of the kind cluster, with the
chart installed by the same `ChartStack` that installs it on the local cluster's real
node (same release, values file, fault injection). Only the node access differs: the
image goes in with `kind load`, files are read with `docker exec`, the kubelet is
restarted with systemctl and its log read from the journal, and the chart keeps its
default host paths and pod networking (kind has kube-proxy).
"""

from __future__ import annotations

import copy
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.kube import wait_for
from e2e.kind.cluster import VALUES, KindCluster, KindError
from e2e.node.chart import IMAGE_REPOSITORY, IMAGE_TAG, ChartStack

EMULATED_LABEL = "gpudra.dev/emulated-gpus"
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


def gpu_worker(cluster: KindCluster) -> KindNode:
    """The first worker the kind config labels for emulated GPUs."""
    nodes = cluster.kube().list("Node", labelSelector=f"{EMULATED_LABEL}=true")
    if not nodes:
        raise KindError(
            f"no kind node is labelled {EMULATED_LABEL}=true (see e2e/kind/cluster.yaml)"
        )
    return KindNode(cluster, sorted(n["metadata"]["name"] for n in nodes)[0])


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
        self, *, node_args: list[str] | None = None, api_port: int | None = None
    ) -> dict[str, Any]:
        """e2e/kind/values.yaml, pinned to this worker with this node's GPU profile."""
        values: dict[str, Any] = copy.deepcopy(yaml.safe_load(VALUES.read_text()))
        values["image"] = {
            **values.get("image", {}),
            "repository": IMAGE_REPOSITORY,
            "tag": IMAGE_TAG,
        }
        node = values.setdefault("node", {})
        node.update(
            nvml=f"emulated:{STATE_DIR / 'profile.json'}",
            sharedGpus=self.shared_gpus(),
            nodeSelector={"kubernetes.io/hostname": self.node.name},
            extraArgs=["--cleanup-interval=5", *(node_args or [])],
        )
        if api_port is not None:
            values["kubernetesApi"] = {"host": "127.0.0.1", "port": api_port}
        return values

    def prepare_node(self) -> None:
        archive = self.build_image()
        kind = self.node.cluster._kind()
        # Into every node: the chart's webhook may land on any of them.
        self.node.cluster._run(
            kind, "load", "image-archive", str(archive), "--name", self.node.cluster.name
        )
        profile = json.dumps(self.profile(), indent=2)
        # A fresh state dir, as a new real node has: a reused cluster would otherwise
        # keep the last run's emulated GPU state and tool-call log.
        script = f"rm -rf {STATE_DIR} && mkdir -p {STATE_DIR} && cat > {STATE_DIR / 'profile.json'}"
        proc = self.node.run("sh", "-c", script, stdin=profile)
        if proc.returncode != 0:
            raise KindError(f"writing the GPU profile on {self.node.name}: {proc.stderr.strip()}")

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
