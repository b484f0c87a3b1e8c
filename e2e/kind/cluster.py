"""The kind cluster provider: a Docker-based cluster offering the same surface as the
local harness's `Cluster` (`up`, `down`, `is_up`, `kube`, `kubectl`,
`layout.admin_kubeconfig`), so the end-to-end suite runs unchanged on either. The
GPU-pod suite (e2e/tests/test_realnode_gpus.py) installs the chart on a worker itself,
through `KindGpus` (e2e/kind/gpus.py), the same code that installs it on the local
cluster's real node.

Which Docker engine and node image (GPUDRA_KIND_ENGINE, GPUDRA_KIND_NODE):
- the engine: one already running (DOCKER_HOST, or the default socket) when there is
  one, else a private one this starts (e2e/kind/engine.py, root);
- the node image: KIND_NODE_IMAGE when set; kind's official `kindest/node` of the pinned
  Kubernetes version where the engine can pull it; else one built here from the
  binaries the local harness builds (e2e/kind/nodeimage.py). Each run says which.
Pod networking is ours on every engine (e2e/kind/network.py): kindnet cannot be built
offline, and one network for both images keeps the two providers alike.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.harness import BUILD_SCRIPT, FAKE_NODE_LABEL, node_names, register_node
from e2e.cluster.kube import Credentials, Kube, wait_for
from e2e.kind import network, nodeimage
from e2e.kind.engine import Docker, Engine, EngineError, engine_step
from e2e.node import images
from e2e.pins import CLUSTER_VERSIONS, PinMissing, pinned
from e2e.processes import alive, spawn_logged, stop_pid
from e2e.progress import BuildFailed, build_script

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONFIG = HERE / "cluster.yaml"
VALUES = HERE / "values.yaml"
KIND_BUILD = REPO / "e2e" / "tools" / "build-kind.sh"
HEARTBEAT_HINT = "e2e.kind heartbeat"


class KindError(Exception):
    """A one-line reason the kind cluster could not be brought up, with the fix."""


@dataclass
class KindLayout:
    root: Path

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def kind_kubeconfig(self) -> Path:
        return self.root / "kind.kubeconfig"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def heartbeat_pid(self) -> Path:
        return self.root / "heartbeat.pid"


def k8s_pin() -> str:
    """The Kubernetes pin (v1.Y.Z) of K8S_VERSION's minor, or the harness's default, so
    both providers test the same version."""
    try:
        minor = os.environ.get("K8S_VERSION") or pinned("K8S_DEFAULT_MINOR", CLUSTER_VERSIONS)
        return pinned(f"K8S_PIN_{minor.removeprefix('v').replace('.', '_')}", CLUSTER_VERSIONS)
    except PinMissing as e:
        raise KindError(str(e)) from e


def node_image() -> str:
    """kindest/node for the pinned version (override with KIND_NODE_IMAGE)."""
    return os.environ.get("KIND_NODE_IMAGE", f"kindest/node:{k8s_pin()}")


ENGINE_CHOICES = ("private", "existing")
NODE_CHOICES = ("official", "built")
NODES_READY_TIMEOUT = 240.0


def _choice(var: str, allowed: tuple[str, ...]) -> str | None:
    value = os.environ.get(var, "").strip()
    if value and value not in allowed:
        raise KindError(f"{var}={value!r} is not one of {', '.join(allowed)}: set one or unset it")
    return value or None


def _default_engine_answers() -> bool:
    """Whether `docker` reaches an engine as the environment stands (DOCKER_HOST or the
    default socket)."""
    if shutil.which("docker") is None:
        return False
    try:
        proc = Docker().docker("version", "--format", "{{.Server.Version}}", timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


class KindCluster:
    def __init__(self, name: str = "gpudra-e2e", root: Path | None = None) -> None:
        self.name = name
        self.layout = KindLayout(root or REPO / ".cluster-kind")
        self._engine: Engine | None = None
        self._env: dict[str, str] | None = None

    # -- the engine ------------------------------------------------------------------------

    def _select_engine(self) -> tuple[dict[str, str], Engine | None]:
        """The docker environment, and the private engine when that is the one used."""
        choice = _choice("GPUDRA_KIND_ENGINE", ENGINE_CHOICES)
        private = Engine()
        if choice == "private" or (choice is None and private.is_running()):
            return private.env(), private
        if choice == "existing" or os.environ.get("DOCKER_HOST") or _default_engine_answers():
            return dict(os.environ), None
        return private.env(), private

    def env(self) -> dict[str, str]:
        """The environment every docker and kind call of this cluster runs with."""
        if self._env is None:
            self._env, self._engine = self._select_engine()
        return self._env

    def private_engine(self) -> Engine | None:
        self.env()
        return self._engine

    def _kind(self) -> str:
        try:
            return str(build_script(KIND_BUILD, prefix="build-kind", what="building kind"))
        except BuildFailed as e:
            raise KindError(str(e)) from e

    def _run(self, *argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            argv, capture_output=True, text=True, check=False, env=self.env(), **kw
        )
        if proc.returncode != 0:
            raise KindError(f"{' '.join(argv[:3])} failed: {proc.stderr.strip()[-500:]}")
        return proc

    def is_up(self) -> bool:
        if shutil.which("docker") is None or not self.layout.admin_kubeconfig.exists():
            return False
        engine = self.private_engine()
        if engine is not None and not engine.is_running():
            return False
        out = subprocess.run(
            [self._kind(), "get", "clusters"],
            capture_output=True, text=True, check=False, env=self.env(),
        )  # fmt: skip
        return self.name in out.stdout.split()

    def up(self, log: Callable[[str], None] = print) -> None:
        """Creates the cluster (or reuses it); on failure removes what this call made:
        the fake nodes' heartbeat when it started it, and the engine when it started
        it, else the cluster when it created it."""
        if shutil.which("docker") is None:
            raise KindError(
                "make e2e-kind needs the docker CLI (kind runs nodes as containers): "
                "apt-get install docker.io, or use the local cluster: make test"
            )
        engine = self.private_engine()
        started = engine is not None and not engine.is_running()
        created = False
        beating = self._heartbeat() is not None
        try:
            if engine is not None:
                engine_step(engine, log)
            kind = self._kind()
            if not self.is_up():
                created = True
                self._create(kind, engine, log)
            self._after_create(kind)
        except (KindError, EngineError, nodeimage.NodeImageError, TimeoutError) as e:
            if not beating:
                self._stop_heartbeat()
            if engine is not None and started:
                engine.stop(log=lambda _m: None)
            elif created:
                self._delete(kind)
            raise KindError(str(e)) from e

    def _image(self, engine: Engine | None, log: Callable[[str], None]) -> str:
        """The node image by GPUDRA_KIND_NODE / KIND_NODE_IMAGE, else by what is reachable."""
        choice = _choice("GPUDRA_KIND_NODE", NODE_CHOICES)
        if os.environ.get("KIND_NODE_IMAGE") and choice != "built":
            return node_image()
        if choice != "built" and (choice == "official" or engine is None):
            official = node_image()
            pulled = Docker(self.env()).docker("pull", official, timeout=600)
            if pulled.returncode == 0:
                log(f"kind: node image {official} (kind's official image, pulled)")
                return official
            if choice == "official":
                raise KindError(
                    f"docker pull {official} failed ({pulled.stderr.strip()[-200:]}): "
                    "unset GPUDRA_KIND_NODE to build the node image here"
                )
            log(f"kind: {official} cannot be pulled; building the node image here")
        builder = engine or Docker(self.env())
        image = nodeimage.ensure(builder, k8s_pin(), log)
        log(f"kind: node image {image} (built here from the local harness's binaries)")
        return image

    def _create(self, kind: str, engine: Engine | None, log: Callable[[str], None]) -> None:
        image = self._image(engine, log)
        log(f"kind: creating cluster {self.name} ({image})")
        # Without --wait: the nodes are Ready only once the pod network is configured.
        self._run(
            kind, "create", "cluster", "--name", self.name, "--config", str(CONFIG),
            "--image", image, "--kubeconfig", str(self.layout.kind_kubeconfig),
        )  # fmt: skip

    def _delete(self, kind: str) -> None:
        """kind's own kubeconfig is ours (kind would edit ~/.kube/config otherwise)."""
        self._run(kind, "delete", "cluster", "--name", self.name,
                  "--kubeconfig", str(self.layout.kind_kubeconfig))  # fmt: skip

    def _after_create(self, kind: str) -> None:
        self.layout.root.mkdir(parents=True, exist_ok=True)
        config = self._run(kind, "get", "kubeconfig", "--name", self.name).stdout
        self.layout.admin_kubeconfig.write_text(config)
        self._write_credentials(config)
        kube = self.kube()
        nets = wait_for("every kind node's pod CIDR", lambda: _node_nets(kube), timeout=120)
        network.configure(nets, self._node_shell)
        wait_for("every kind node Ready", lambda: _all_ready(kube), timeout=NODES_READY_TIMEOUT)
        self._fake_nodes(kube)
        # The GPU pods' test image; the gpudra image is loaded by KindGpus.
        test_image = images.build_test_image(images.cache_dir())
        self._run(kind, "load", "image-archive", str(test_image), "--name", self.name)

    def _fake_nodes(self, kube: Kube) -> None:
        """The local harness's fake nodes (worker-1.., GPUDRA_NODES), beside kind's own
        and kept Ready by a heartbeat process of this cluster, as the local harness keeps
        them: the suites that publish emulated slices for them, or schedule pods onto
        them, then run on kind unchanged. Nothing runs on them; deleted pods are
        confirmed by the heartbeat."""
        for name in node_names():
            register_node(kube, name)
        pid = self._heartbeat()
        if pid is not None:
            return
        proc = spawn_logged(
            [sys.executable, "-m", "e2e.kind", "heartbeat", str(self.layout.root)],
            self.layout.root / "heartbeat.log",
            REPO,
            {**os.environ, "PYTHONPATH": str(REPO)},
        )
        self.layout.heartbeat_pid.write_text(str(proc.pid))

    def _heartbeat(self) -> int | None:
        """The running heartbeat's PID, if it runs."""
        try:
            pid = int(self.layout.heartbeat_pid.read_text())
        except (OSError, ValueError):
            return None
        return pid if alive(pid, HEARTBEAT_HINT) else None

    def _stop_heartbeat(self) -> None:
        if (pid := self._heartbeat()) is not None:
            stop_pid(pid, HEARTBEAT_HINT)
        self.layout.heartbeat_pid.unlink(missing_ok=True)

    def _node_shell(self, node: str, script: str, stdin: str) -> str | None:
        proc = self.docker_exec(node, "sh", "-c", script, stdin=stdin)
        return None if proc.returncode == 0 else (proc.stderr.strip() or "exit status nonzero")

    def down(self, log: Callable[[str], None] = print) -> None:
        """Deletes the cluster and, when it ran on the private engine, stops that engine
        (removing its networks, mounts and processes)."""
        self._stop_heartbeat()
        if shutil.which("docker") is None:
            return
        engine = self.private_engine()
        if engine is None or engine.is_running():
            self._delete(self._kind())
            log(f"kind: deleted cluster {self.name}")
        if engine is not None:
            engine.stop(log=log)
        shutil.rmtree(self.layout.root, ignore_errors=True)

    def bin_dir(self) -> Path:
        """Where kubectl of the node image's Kubernetes version is (built on first use)."""
        env = {**os.environ, "K8S_VERSION": k8s_pin().removeprefix("v")}
        try:
            return build_script(BUILD_SCRIPT, prefix="build", what="building kubectl", env=env)
        except BuildFailed as e:
            raise KindError(f"building kubectl failed: {e}") from e

    def kubectl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """kubectl of the node image's Kubernetes version; never raises on failure."""
        return subprocess.run(
            [str(self.bin_dir() / "kubectl"), *args],
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
        interactive = ["-i"] if stdin is not None else []
        return Docker(self.env()).docker("exec", *interactive, node, *argv, stdin=stdin)

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


def _kind_nodes(kube: Kube) -> list[dict[str, Any]]:
    """kind's own nodes: those with a kubelet, not the suite's fake ones."""
    return kube.list("Node", labelSelector=f"!{FAKE_NODE_LABEL}")


def _node_nets(kube: Kube) -> list[network.NodeNet] | None:
    try:
        return network.node_nets(_kind_nodes(kube))
    except ValueError:
        return None


def _all_ready(kube: Kube) -> bool:
    nodes = _kind_nodes(kube)
    return bool(nodes) and all(
        any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
        for n in nodes
    )
