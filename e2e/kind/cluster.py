"""The kind cluster provider: a Docker-based cluster offering the same surface as the
local harness's `Cluster` (`up`, `down`, `is_up`, `kube`, `kubectl`,
`layout.admin_kubeconfig`), so the end-to-end suite runs unchanged on either. The
GPU-pod suite (e2e/tests/test_realnode_gpus.py) installs the chart on a worker itself,
through `KindGpus` (e2e/kind/gpus.py), the same code that installs it on the local
cluster's real node.

It needs a Docker engine; the machines the suite usually runs on have none, which is
why the kind config is validated by tests/chart/test_kind_config.py instead.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.harness import BUILD_SCRIPT
from e2e.cluster.kube import Credentials, Kube
from e2e.node import images
from e2e.progress import BuildFailed, build_script

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONFIG = HERE / "cluster.yaml"
VALUES = HERE / "values.yaml"
KIND_BUILD = REPO / "e2e" / "tools" / "build-kind.sh"


class KindError(Exception):
    """A one-line reason the kind cluster could not be brought up, with the fix."""


@dataclass
class KindLayout:
    root: Path

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def pki(self) -> Path:
        return self.root / "pki"


def _pinned(name: str, file: Path) -> str:
    for line in file.read_text().splitlines():
        key, _, value = line.partition("=")
        if key == name:
            return value.strip()
    raise KindError(f"{name} is not set in {file.relative_to(REPO)}")


def node_image() -> str:
    """kindest/node for the harness's default Kubernetes pin, so both providers test
    the same version (override with KIND_NODE_IMAGE)."""
    versions = REPO / "e2e" / "cluster" / "versions.env"
    minor = os.environ.get("K8S_VERSION") or _pinned("K8S_DEFAULT_MINOR", versions)
    pin = _pinned(f"K8S_PIN_{minor.removeprefix('v').replace('.', '_')}", versions)
    return os.environ.get("KIND_NODE_IMAGE", f"kindest/node:{pin}")


class KindCluster:
    def __init__(self, name: str = "gpudra-e2e", root: Path | None = None) -> None:
        self.name = name
        self.layout = KindLayout(root or REPO / ".cluster-kind")

    def _kind(self) -> str:
        try:
            return str(build_script(KIND_BUILD, prefix="build-kind", what="building kind"))
        except BuildFailed as e:
            raise KindError(str(e)) from e

    def _run(self, *argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, **kw)
        if proc.returncode != 0:
            raise KindError(f"{' '.join(argv[:3])} failed: {proc.stderr.strip()[-500:]}")
        return proc

    def is_up(self) -> bool:
        if shutil.which("docker") is None or not self.layout.admin_kubeconfig.exists():
            return False
        out = subprocess.run(
            [self._kind(), "get", "clusters"], capture_output=True, text=True, check=False
        )
        return self.name in out.stdout.split()

    def up(self, log: Callable[[str], None] = print) -> None:
        if shutil.which("docker") is None:
            raise KindError(
                "make e2e-kind needs a Docker engine (kind runs nodes as containers); "
                "without one, use the local cluster: make test"
            )
        kind = self._kind()
        if not self.is_up():
            log(f"kind: creating cluster {self.name} ({node_image()})")
            self._run(
                kind, "create", "cluster", "--name", self.name, "--config", str(CONFIG),
                "--image", node_image(), "--wait", "120s",
            )  # fmt: skip
        self.layout.root.mkdir(parents=True, exist_ok=True)
        config = self._run(kind, "get", "kubeconfig", "--name", self.name).stdout
        self.layout.admin_kubeconfig.write_text(config)
        self._write_credentials(config)
        # The GPU pods' test image; the gpudra image is loaded by KindGpus.
        test_image = images.build_test_image(images.cache_dir())
        self._run(kind, "load", "image-archive", str(test_image), "--name", self.name)

    def down(self, log: Callable[[str], None] = print) -> None:
        if shutil.which("docker") is None:
            return
        self._run(self._kind(), "delete", "cluster", "--name", self.name)
        log(f"kind: deleted cluster {self.name}")

    def kubectl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """kubectl of the node image's Kubernetes version; never raises on failure."""
        env = {**os.environ, "K8S_VERSION": node_image().rsplit(":", 1)[1].removeprefix("v")}
        try:
            bin_dir = build_script(BUILD_SCRIPT, prefix="build", what="building kubectl", env=env)
        except BuildFailed as e:
            raise KindError(f"building kubectl failed: {e}") from e
        kubectl = bin_dir / "kubectl"
        return subprocess.run(
            [str(kubectl), *args],
            env={**os.environ, "KUBECONFIG": str(self.layout.admin_kubeconfig)},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def docker_exec(
        self, node: str, *argv: str, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A command inside a kind node's container; never raises on failure."""
        return subprocess.run(
            ["docker", "exec", *(["-i"] if stdin is not None else []), node, *argv],
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )

    def webhook_host(self) -> str:
        """The host's address on kind's Docker network, which the API server in the
        control-plane container reaches (its 127.0.0.1 is the container itself)."""
        proc = self._run(
            "docker", "network", "inspect", "kind",
            "--format", "{{range .IPAM.Config}}{{.Gateway}} {{end}}",
        )  # fmt: skip
        gateways = [g for g in proc.stdout.split() if ":" not in g]
        if not gateways:
            raise KindError("kind's Docker network has no IPv4 gateway for webhooks to listen on")
        return gateways[0]

    def kube(self) -> Kube:
        server = yaml.safe_load(self.layout.admin_kubeconfig.read_text())["clusters"][0]
        host, _, port = server["cluster"]["server"].removeprefix("https://").rpartition(":")
        pki = self.layout.pki
        return Kube(
            Credentials(host, int(port), pki / "ca.crt", pki / "admin.crt", pki / "admin.key")
        )

    def _write_credentials(self, kubeconfig: str) -> None:
        """The harness's client wants files; kind's kubeconfig embeds them."""
        cfg = yaml.safe_load(kubeconfig)
        cluster, user = cfg["clusters"][0]["cluster"], cfg["users"][0]["user"]
        self.layout.pki.mkdir(parents=True, exist_ok=True)
        for name, data in (
            ("ca.crt", cluster["certificate-authority-data"]),
            ("admin.crt", user["client-certificate-data"]),
            ("admin.key", user["client-key-data"]),
        ):
            path = self.layout.pki / name
            path.write_bytes(base64.b64decode(data))
            path.chmod(0o600)
