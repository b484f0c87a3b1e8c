"""Kueue's manager as a host process against the local control plane (`make kueue-up`).

Why a host process: the local control plane runs no pods of its own and no kube-proxy,
so Kueue runs the way the real node's gpudra processes do, recorded by PID in
`<cluster dir>/kueue/` and attached to the cluster, whose `down` stops it first.
Its CRDs, webhook configurations and certificate secret are installed as its release
installs them (see `manifests.py` for the one rewrite: webhooks by `url`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from e2e.cluster import pki
from e2e.cluster.harness import REPO, Cluster
from e2e.cluster.kube import Kube, apply_crd
from e2e.kueue import manifests
from e2e.processes import alive, free_port, spawn_logged, stop_pid
from e2e.progress import BuildFailed, build_script

BUILD_SCRIPT = REPO / "e2e" / "tools" / "build-kueue.sh"
FRAMEWORKS_ENV = "GPUDRA_KUEUE_FRAMEWORKS"
DEFAULT_FRAMEWORKS = ("batch/job",)
ATTACH_NAME = "kueue"


class KueueError(Exception):
    """A one-line, actionable reason Kueue could not be brought up or down."""


@dataclass
class KueueState:
    version: str
    binary: str
    pid: int
    webhook_port: int
    health_port: int
    frameworks: list[str]
    custom: bool = False  # started with mappings or waitForPodsReady of a test's own

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> KueueState | None:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            return cls(version="?", binary="-", pid=0, webhook_port=0, health_port=0, frameworks=[])


def kueue_home() -> Path:
    """The cached build: `bin/kueue` and the module's `config/` (built on first use)."""
    try:
        return build_script(BUILD_SCRIPT, prefix="build-kueue", what="building Kueue")
    except BuildFailed as e:
        raise KueueError(f"build-kueue: {e}") from e


def frameworks_from_env() -> list[str]:
    """GPUDRA_KUEUE_FRAMEWORKS (comma-separated), default `batch/job`."""
    raw = os.environ.get(FRAMEWORKS_ENV, "")
    chosen = [f.strip() for f in raw.split(",") if f.strip()] or list(DEFAULT_FRAMEWORKS)
    unknown = sorted(set(chosen) - set(manifests.FRAMEWORK_PATHS))
    if unknown:
        raise KueueError(
            f"{FRAMEWORKS_ENV}={raw!r} names {unknown}: use a comma-separated list of "
            f"{sorted(manifests.FRAMEWORK_PATHS)}"
        )
    return chosen


class KueueManager:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.root = cluster.layout.root / "kueue"

    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    @property
    def log_path(self) -> Path:
        return self.root / "kueue.log"

    @property
    def pki_dir(self) -> Path:
        return self.root / "pki"

    def is_up(self) -> bool:
        state = KueueState.load(self.state_path)
        return bool(state and self._healthy(state))

    def up(
        self,
        *,
        frameworks: Sequence[str] | None = None,
        mappings: Mapping[str, Sequence[str]] | None = None,
        pods_ready_timeout_s: int | None = None,
        log: Callable[[str], None] = print,
    ) -> KueueState:
        """Idempotent: a healthy manager with the same integrations is kept. `mappings`
        (quota name -> device classes) replaces the default deviceClassMappings, and
        `pods_ready_timeout_s` turns on waitForPodsReady; either always restarts the
        manager."""
        self.cluster.require_state()
        chosen = list(frameworks) if frameworks is not None else frameworks_from_env()
        home = kueue_home()
        state = KueueState.load(self.state_path)
        if state is not None:
            default = mappings is None and pods_ready_timeout_s is None
            same = state.frameworks == chosen and default and not state.custom
            if self._healthy(state) and same:
                log(f"Kueue already up ({state.version})")
                return state
            self.down(log=lambda _m: None)
        start = time.monotonic()
        kube = self.cluster.kube()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        webhook_port, health_port = free_port(), free_port()
        endpoint = self._install(kube, home, webhook_port, chosen)
        config = manifests.configuration(
            webhook_port=webhook_port,
            health_port=health_port,
            cert_dir=self.pki_dir,
            frameworks=chosen,
            mappings=manifests.DEFAULT_MAPPINGS if mappings is None else mappings,
            pods_ready_timeout_s=pods_ready_timeout_s,
        )
        config_path = self.root / "config.yaml"
        config_path.write_text(json.dumps(config, indent=2))
        binary = home / "bin" / "kueue"
        # Attached first: a manager that starts but never gets ready is still stopped
        # by `make cluster-down`.
        self.cluster.attach(ATTACH_NAME, [sys.executable, "-m", "e2e.kueue", "down"])
        proc = spawn_logged(
            [
                str(binary),
                f"--config={config_path}",
                f"--kubeconfig={self.cluster.layout.admin_kubeconfig}",
            ],
            self.log_path,
            self.root,
            {**os.environ, "KUBECONFIG": str(self.cluster.layout.admin_kubeconfig)},
        )
        state = KueueState(
            version=home.name,
            binary=str(binary),
            pid=proc.pid,
            webhook_port=webhook_port,
            health_port=health_port,
            frameworks=chosen,
            custom=mappings is not None or pods_ready_timeout_s is not None,
        )
        state.save(self.state_path)
        self._wait_ready(proc, state, endpoint)
        log(
            f"Kueue {state.version} up in {time.monotonic() - start:.1f}s "
            f"(integrations: {', '.join(chosen)}; webhooks at {endpoint.url})"
        )
        return state

    def down(self, log: Callable[[str], None] = print) -> None:
        """Stops the manager and removes its webhook configurations, so nothing waits on
        a webhook that is gone; its CRDs and objects stay (the cluster's `down` wipes
        them)."""
        state = KueueState.load(self.state_path)
        if state is not None:
            stop_pid(state.pid, state.binary)
        with contextlib.suppress(Exception):
            kube = self.cluster.kube()
            for kind, name in _configuration_names():
                kube.delete(kind, name)
        self.state_path.unlink(missing_ok=True)
        self.cluster.detach(ATTACH_NAME)
        log("Kueue stopped" if state is not None else "Kueue was not running; nothing to stop")

    def status(self) -> dict[str, Any]:
        state = KueueState.load(self.state_path)
        if state is None:
            return {"up": False}
        return {"up": self._healthy(state), **asdict(state), "log": str(self.log_path)}

    # -- internals -----------------------------------------------------------
    def _install(
        self, kube: Kube, home: Path, webhook_port: int, frameworks: Sequence[str]
    ) -> manifests.Endpoint:
        """Namespace, certificate secret, CRDs and webhook configurations."""
        self.pki_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        ca = pki.make_ca(self.pki_dir, "kueue-ca", dns=("kueue-ca",), rsa_key=True)
        service_dns = f"{manifests.SERVICE}.{manifests.NAMESPACE}.svc"
        pki.issue(
            self.pki_dir,
            "tls",
            ca,
            service_dns,
            dns=(service_dns,),
            ips=("127.0.0.1",),
            server=True,
        )
        # The secret's keys are the rotator's: it keeps a CA and certificate it finds valid.
        files = {
            n: (self.pki_dir / n).read_bytes() for n in ("ca.crt", "ca.key", "tls.crt", "tls.key")
        }
        endpoint = manifests.Endpoint(
            url=f"https://127.0.0.1:{webhook_port}",
            ca_bundle_b64=base64.b64encode(files["ca.crt"]).decode(),
        )
        kube.apply(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": manifests.NAMESPACE}}
        )
        kube.apply(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": manifests.SECRET, "namespace": manifests.NAMESPACE},
                "data": {k: base64.b64encode(v).decode() for k, v in files.items()},
            }
        )
        config = home / "config"
        for crd in manifests.crds(config, endpoint):
            apply_crd(kube, crd)
        for obj in manifests.webhook_configurations(config, endpoint, frameworks):
            kube.apply(obj)
        return endpoint

    def _wait_ready(
        self, proc: subprocess.Popen[bytes], state: KueueState, endpoint: manifests.Endpoint
    ) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise KueueError(
                    f"the Kueue manager exited with code {proc.returncode}: {self._tail()} "
                    f"(full log: {self.log_path})"
                )
            with contextlib.suppress(OSError):
                if self._healthy(state) and _serves(endpoint, self.pki_dir / "ca.crt"):
                    return
            time.sleep(0.3)
        raise KueueError(
            f"the Kueue manager did not become ready in 120s: {self._tail()} "
            f"(full log: {self.log_path})"
        )

    def _healthy(self, state: KueueState) -> bool:
        if not alive(state.pid, state.binary):
            return False
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{state.health_port}/readyz", timeout=3
            ) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def _tail(self) -> str:
        """The manager's last errors (its log is JSON lines): message and error only."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        lines = []
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                lines.append(line)
                continue
            if isinstance(entry, dict) and entry.get("level") == "error":
                lines.append(f"{entry.get('msg')}: {entry.get('error', '')}")
        return " | ".join(lines[-3:])[:600] or "no error in its log"


def _serves(endpoint: manifests.Endpoint, ca: Path) -> bool:
    """The webhook server answers TLS with a certificate the API server will accept for
    the registered `url` (a refused or mismatched one raises)."""
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(f"{endpoint.url}/readyz", context=context, timeout=3):
            return True
    except urllib.error.HTTPError:
        return True  # it answered over verified TLS; only the path is not one of its own


def _configuration_names() -> list[tuple[str, str]]:
    return [
        ("MutatingWebhookConfiguration", f"{manifests.NAME_PREFIX}mutating-webhook-configuration"),
        (
            "ValidatingWebhookConfiguration",
            f"{manifests.NAME_PREFIX}validating-webhook-configuration",
        ),
    ]
