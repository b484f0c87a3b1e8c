"""The local control plane: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler built from the Go module proxy, started on loopback with TLS and RBAC.

State (PKI, etcd data, logs, PIDs) lives in `<repo>/.cluster/`. Every process is
recorded by PID the moment it starts, so `down` and crash recovery stop exactly what
we started and nothing else.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shlex
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from gpudra.common.files import atomic_write

from e2e.cluster import pki
from e2e.cluster.kube import ApiError, Credentials, Kube, wait_for
from e2e.processes import alive, port_free, spawn_logged, stop_pid
from e2e.progress import BuildFailed, build_script

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "e2e" / "cluster" / "build.sh"

# Gates DRA needs; each is enabled only where the binary knows it and it is not GA.
WANTED_GATES = (
    "DRAAdminAccess",
    "DRAConsumableCapacity",
    "DRADeviceTaints",
    "DRADeviceTaintRules",
    "DRAExtendedResource",
    "DRAPartitionableDevices",
    "DRAPrioritizedList",
    "DRAResourceClaimDeviceStatus",
    "DRASchedulerFilterTimeout",
    "ResourceHealthStatus",
    "ResourceHealthStatusMessage",
)
GATE_LINE = re.compile(
    r"^\s+(?:[a-z]+:)?([A-Za-z0-9]+)=true\|false \((ALPHA|BETA|GA|DEPRECATED) - default="
)


class ClusterError(Exception):
    """A one-line, actionable reason the cluster could not be brought up."""


@dataclass(frozen=True)
class Ports:
    etcd: int = 23790
    etcd_peer: int = 23800
    apiserver: int = 26443
    controller_manager: int = 20257
    scheduler: int = 20259
    # Not one of ours: the port of the webhook the API server presents its admission
    # client certificate to (`AdmissionClient`). The API server's configuration names
    # it at start, so it is fixed and checked free here, where a busy one has a fix.
    admission_webhook: int = 28443

    @classmethod
    def from_env(cls) -> Ports:
        def port(name: str, default: int) -> int:
            raw = os.environ.get(f"GPUDRA_{name.upper()}_PORT", str(default))
            if not raw.isdigit() or not 0 < int(raw) < 65536:
                raise ClusterError(f"GPUDRA_{name.upper()}_PORT={raw!r} is not a port number")
            return int(raw)

        base = cls()
        return cls(**{f: port(f, getattr(base, f)) for f in base.__dataclass_fields__})


@dataclass
class Layout:
    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def admission_config(self) -> Path:
        """The API server's `--admission-control-config-file`."""
        return self.pki / "admission.json"

    @property
    def admission_kubeconfig(self) -> Path:
        """The kubeConfigFile its webhook admission plugins read (`admission_files`)."""
        return self.pki / "admission.kubeconfig"

    @property
    def attached(self) -> Path:
        """One `<name>.json` per thing attached to this control plane (see `attach`)."""
        return self.root / "attached"

    def credentials(self, port: int) -> Credentials:
        return Credentials(
            "127.0.0.1", port, self.pki / "ca.crt", self.pki / "admin.crt", self.pki / "admin.key"
        )


@dataclass
class State:
    version: str
    bin_dir: str
    ports: dict[str, int]
    nodes: list[str]
    pids: dict[str, int] = field(default_factory=dict)
    cmdlines: dict[str, str] = field(default_factory=dict)
    ready: bool = False

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__, indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> State | None:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            return cls(version="?", bin_dir="", ports={}, nodes=[])


# Whom the API server presents its admission client certificate to: the Service of the
# chart's default release `gpudra` in the namespace `gpudra` (`<fullname>-webhook`), as
# the chart on the real node installs it (e2e/node/chart.py) and docs/install.md's
# example names it. Its own common name, so the webhook can tell it from every other
# certificate the cluster's CA signs.
ADMISSION_SERVICE = "gpudra-webhook"
ADMISSION_NAMESPACE = "gpudra"
ADMISSION_CLIENT_CN = "gpudra-admission-client"
ADMISSION_PLUGINS = ("MutatingAdmissionWebhook", "ValidatingAdmissionWebhook")


@dataclass(frozen=True)
class AdmissionClient:
    """The client certificate the API server presents to gpudra's webhook, set up as
    docs/install.md ("Who may call the webhook") tells a cluster's admin to: signed by
    the cluster's CA (`ca`), with the clientAuth extended key usage and a common name
    of its own, under a kubeconfig user named for the webhook's Service host and port.
    The API server looks that user up by the host and port it calls, so every other
    webhook (those the tests register by URL among them) is called as before, with no
    certificate."""

    port: int
    ca: Path
    cert: Path
    key: Path
    service: str = ADMISSION_SERVICE
    namespace: str = ADMISSION_NAMESPACE
    common_name: str = ADMISSION_CLIENT_CN

    @property
    def user(self) -> str:
        """`<fullname>-webhook.<namespace>.svc:<webhook.port>`: the name the API server
        looks a Service-backed webhook's credentials up by (the Service port included)."""
        return f"{self.service}.{self.namespace}.svc:{self.port}"


def admission_files(
    client: AdmissionClient, kubeconfig: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The AdmissionConfiguration whose webhook plugins both read `kubeconfig`, and that
    kubeconfig: the two files docs/install.md shows, in the same shape."""
    webhook_config = {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "WebhookAdmissionConfiguration",
        "kubeConfigFile": str(kubeconfig),
    }
    config = {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "AdmissionConfiguration",
        "plugins": [{"name": p, "configuration": webhook_config} for p in ADMISSION_PLUGINS],
    }
    users = {
        "apiVersion": "v1",
        "kind": "Config",
        "users": [
            {
                "name": client.user,
                "user": {
                    "client-certificate": str(client.cert),
                    "client-key": str(client.key),
                },
            }
        ],
    }
    return config, users


def default_layout() -> Layout:
    # Absolute: processes run with the cluster dir as their working directory.
    return Layout(Path(os.environ.get("GPUDRA_CLUSTER_DIR", REPO / ".cluster")).resolve())


def node_names() -> list[str]:
    raw = os.environ.get("GPUDRA_NODES", "2")
    if not raw.isdigit() or not 0 < int(raw) <= 50:
        raise ClusterError(f"GPUDRA_NODES={raw!r}: give a node count from 1 to 50")
    return [f"worker-{i}" for i in range(1, int(raw) + 1)]


# -- feature gates -----------------------------------------------------------


def known_gates(binary: Path) -> dict[str, str]:
    """Feature gates and their stage, as the binary itself reports them."""
    out = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, check=False, timeout=60
    ).stdout
    return {m.group(1): m.group(2) for line in out.splitlines() if (m := GATE_LINE.match(line))}


EXTRA_GATES_ENV = "GPUDRA_EXTRA_GATES"
"""Gates beyond `WANTED_GATES` (comma-separated names) for a control plane of a test's
own: one that changes what every test runs on stays off the shared one.
DRAListTypeAttributes, alpha, moves the scheduler to its experimental allocator."""


def gates_flag(binary: Path) -> str:
    known = known_gates(binary)
    extra = [g for g in os.environ.get(EXTRA_GATES_ENV, "").split(",") if g]
    on = [g for g in (*WANTED_GATES, *extra) if known.get(g) in ("ALPHA", "BETA")]
    return ",".join(f"{g}=true" for g in on)


class Cluster:
    def __init__(self, layout: Layout | None = None) -> None:
        self.layout = layout or default_layout()

    # -- public --------------------------------------------------------------
    def webhook_host(self) -> str:
        """The address a webhook served on this machine listens on and is registered
        with, so that the API server reaches it (kind's is in a container)."""
        return "127.0.0.1"

    def bin_dir(self) -> Path:
        """Where the cluster's Kubernetes binaries (kubectl among them) are."""
        return Path(self.require_state().bin_dir)

    def kube(self) -> Kube:
        state = self.require_state()
        return Kube(self.layout.credentials(state.ports["apiserver"]))

    def admission_client(self) -> AdmissionClient | None:
        """The client certificate this cluster's API server presents to the webhook
        `AdmissionClient` names; None for a cluster an earlier harness started
        without one (`up` replaces such a cluster)."""
        state = self.require_state()
        port = state.ports.get("admission_webhook")
        if port is None:
            return None
        return self._admission_client(port)

    def is_up(self) -> bool:
        state = State.load(self.layout.state)
        return bool(state and self._current(state))

    def up(self, log: Any = print) -> State:
        version_bin = self._build()
        version = Path(version_bin).parent.name
        state = State.load(self.layout.state)
        if state is not None:
            if state.version == version and self._current(state):
                log(f"cluster already up (Kubernetes {version})")
                return state
            log("found an earlier cluster that is not healthy or differs; cleaning it up")
            self.down(log=lambda _msg: None)
        ports = Ports.from_env()
        nodes = node_names()
        self._check_ports(ports)
        start = time.monotonic()
        self._prepare_dirs()
        state = State(version, version_bin, ports.__dict__.copy(), nodes)
        state.save(self.layout.state)
        try:
            self._start_all(state, Path(version_bin), ports)
        except BaseException:
            self.down(log=lambda _msg: None, keep_logs=True)
            raise
        state.ready = True
        state.save(self.layout.state)
        log(
            f"cluster up in {time.monotonic() - start:.1f}s (Kubernetes {version}, "
            f"nodes: {', '.join(nodes)})"
        )
        log(f"  export KUBECONFIG={self.layout.admin_kubeconfig}")
        return state

    def attach(self, name: str, stop: list[str]) -> None:
        """Records the command that stops something running against this control plane
        (a real node), so that `down` runs it first, while the API server can still
        drain it. The harness knows nothing else of what it stops."""
        record = self.layout.attached / f"{name}.json"
        atomic_write(record, json.dumps({"stop": stop}).encode(), durable=False, folder_mode=0o700)

    def detach(self, name: str) -> None:
        """Forgets `name` once it stopped by itself."""
        (self.layout.attached / f"{name}.json").unlink(missing_ok=True)

    def down(self, log: Any = print, keep_logs: bool = False) -> None:
        self._stop_attached(log)
        state = State.load(self.layout.state)
        if state is None:
            log("no cluster state found; nothing to stop")
            return
        # Reverse start order: heartbeat, scheduler, controller-manager, apiserver, etcd.
        for name in reversed(list(state.pids)):
            stop_pid(state.pids[name], state.cmdlines.get(name, ""))
        for name, port in state.ports.items():
            deadline = time.monotonic() + 10
            while not port_free(port) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not port_free(port):
                log(f"warning: port {port} ({name}) is still in use")
        for sub in (
            ("attached", "data", "pki") if keep_logs else ("attached", "data", "logs", "pki")
        ):
            subprocess.run(["rm", "-rf", str(self.layout.root / sub)], check=False)
        self.layout.state.unlink(missing_ok=True)
        self.layout.admin_kubeconfig.unlink(missing_ok=True)
        log("cluster stopped")

    def kubectl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """The cluster's own kubectl with the admin kubeconfig; never raises on failure."""
        state = self.require_state()
        return subprocess.run(
            [str(Path(state.bin_dir) / "kubectl"), *args],
            env={**os.environ, "KUBECONFIG": str(self.layout.admin_kubeconfig)},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def env(self) -> str:
        state = self.require_state()
        return (
            f"export KUBECONFIG={self.layout.admin_kubeconfig}\nexport PATH={state.bin_dir}:$PATH\n"
        )

    def status(self) -> dict[str, Any]:
        state = State.load(self.layout.state)
        if state is None:
            return {"up": False}
        procs = {n: alive(p, state.cmdlines.get(n, "")) for n, p in state.pids.items()}
        return {
            "up": state.ready and self._healthy(state),
            "version": state.version,
            "processes": procs,
            "ports": state.ports,
            "nodes": state.nodes,
        }

    def require_state(self) -> State:
        """The state of a cluster that is up; ClusterError with the fix otherwise."""
        state = State.load(self.layout.state)
        if state is None or not state.ready:
            raise ClusterError("the local cluster is not up: run `make cluster-up` first")
        return state

    # -- internals -----------------------------------------------------------
    def _stop_attached(self, log: Any) -> None:
        """Runs each attached stop command (`attach`); one that fails keeps the control
        plane up, since what it failed to stop still needs the API server."""
        if not self.layout.attached.is_dir():
            return
        env = {**os.environ, "PYTHONPATH": str(REPO), "GPUDRA_CLUSTER_DIR": str(self.layout.root)}
        for record in sorted(self.layout.attached.glob("*.json")):
            stop = json.loads(record.read_text())["stop"]
            proc = subprocess.run(
                stop, capture_output=True, text=True, cwd=REPO, env=env, check=False
            )
            for line in proc.stdout.splitlines():
                log(line)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise ClusterError(
                    f"stopping {record.stem} failed: {last}; the control plane stays up "
                    f"until `{shlex.join(stop)}` succeeds, then run down again"
                )
            record.unlink(missing_ok=True)

    def _current(self, state: State) -> bool:
        """Ready, healthy, and started as this harness starts a cluster: one an earlier
        harness started lacks the admission client certificate (its ports name no
        `admission_webhook`), and the API server reads that only at start."""
        return state.ready and "admission_webhook" in state.ports and self._healthy(state)

    def _admission_client(self, port: int) -> AdmissionClient:
        pk = self.layout.pki
        return AdmissionClient(
            port, pk / "ca.crt", pk / "admission-client.crt", pk / "admission-client.key"
        )

    def _write_admission_config(self, ca: tuple[x509.Certificate, pki.CaKey], port: int) -> None:
        """The admission client certificate and the two files the API server reads it by
        (`admission_files`)."""
        client = self._admission_client(port)
        pki.issue(self.layout.pki, client.cert.stem, ca, client.common_name)
        config, users = admission_files(client, self.layout.admission_kubeconfig)
        for path, content in (
            (self.layout.admission_config, config),
            (self.layout.admission_kubeconfig, users),
        ):
            path.write_text(json.dumps(content, indent=2))
            path.chmod(0o600)

    def _build(self) -> str:
        """The Kubernetes bin dir, built on the first run (its progress on stderr)."""
        try:
            return str(
                build_script(BUILD_SCRIPT, prefix="build", what="building the Kubernetes binaries")
            )
        except BuildFailed as e:
            raise ClusterError(str(e)) from e

    def _check_ports(self, ports: Ports) -> None:
        for name, port in ports.__dict__.items():
            if not port_free(port):
                env = f"GPUDRA_{name.upper()}_PORT"
                raise ClusterError(
                    f"port {port} for {name.replace('_', '-')} is already in use "
                    f"(`ss -ltnp 'sport = :{port}'` shows by what): stop that process "
                    f"or set {env} to a free port"
                )

    def _prepare_dirs(self) -> None:
        for sub in ("data", "logs", "pki"):
            subprocess.run(["rm", "-rf", str(self.layout.root / sub)], check=False)
        for d in (self.layout.pki, self.layout.logs, self.layout.data):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _spawn(self, state: State, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(REPO), "GPUDRA_CLUSTER_DIR": str(self.layout.root)}
        proc = spawn_logged(argv, self.layout.logs / f"{name}.log", self.layout.root, env)
        state.pids[name] = proc.pid
        state.cmdlines[name] = argv[0]
        state.save(self.layout.state)
        return proc

    def _wait_ready(
        self, name: str, proc: subprocess.Popen[bytes], probe: Any, timeout: float = 60.0
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.layout.logs / f"{name}.log").read_text(errors="replace")
                last = [ln for ln in tail.strip().splitlines() if ln.strip()][-5:]
                raise ClusterError(
                    f"{name} exited with code {proc.returncode}: " + " | ".join(last)
                )
            with contextlib.suppress(Exception):
                if probe():
                    return
            time.sleep(0.1)
        raise ClusterError(
            f"{name} did not become ready in {timeout:.0f}s; see "
            f"{self.layout.logs / (name + '.log')}"
        )

    def _start_all(self, state: State, bin_dir: Path, ports: Ports) -> None:
        pk = self.layout.pki
        ca = pki.make_ca(pk)
        pki.issue(
            pk,
            "apiserver",
            ca,
            "kube-apiserver",
            server=True,
            dns=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ips=("127.0.0.1", "10.0.0.1"),
        )
        pki.issue(pk, "admin", ca, "gpudra-admin", org="system:masters")
        pki.issue(pk, "controller-manager", ca, "system:kube-controller-manager")
        pki.issue(pk, "scheduler", ca, "system:kube-scheduler")
        pki.issue(
            pk,
            "apiserver-kubelet-client",
            ca,
            "kube-apiserver-kubelet-client",
            org="kubeadm:cluster-admins",
        )
        pki.make_service_account_keys(pk)
        self._write_admission_config(ca, ports.admission_webhook)
        server = f"https://127.0.0.1:{ports.apiserver}"
        for who in ("admin", "controller-manager", "scheduler"):
            self._write_kubeconfig(who, server)

        etcd = self._spawn(
            state,
            "etcd",
            [
                str(bin_dir / "etcd"),
                "--name=default",
                f"--data-dir={self.layout.data / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{ports.etcd}",
                f"--advertise-client-urls=http://127.0.0.1:{ports.etcd}",
                f"--listen-peer-urls=http://127.0.0.1:{ports.etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{ports.etcd_peer}",
                f"--initial-cluster=default=http://127.0.0.1:{ports.etcd_peer}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        self._wait_ready("etcd", etcd, lambda: _http_ok(f"http://127.0.0.1:{ports.etcd}/health"))

        apiserver = self._spawn(
            state,
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{ports.etcd}",
                f"--secure-port={ports.apiserver}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # 1.37 refuses a loopback advertise address while it reconciles the
                # `kubernetes` Service endpoints; nothing here uses that Service.
                "--endpoint-reconciler-type=none",
                f"--tls-cert-file={pk / 'apiserver.crt'}",
                f"--tls-private-key-file={pk / 'apiserver.key'}",
                f"--client-ca-file={pk / 'ca.crt'}",
                f"--kubelet-client-certificate={pk / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pk / 'apiserver-kubelet-client.key'}",
                # A real node (e2e/node) is named `real-1`: only its InternalIP resolves.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--service-cluster-ip-range=10.0.0.0/24",
                # No kube-proxy routes ClusterIPs here, so webhooks behind a Service
                # (the chart on the real node) are called at their endpoint address.
                "--enable-aggregator-routing=true",
                "--allow-privileged=true",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--admission-control-config-file={self.layout.admission_config}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pk / 'sa.pub'}",
                f"--service-account-signing-key-file={pk / 'sa.key'}",
                f"--feature-gates={gates_flag(bin_dir / 'kube-apiserver')}",
                "--runtime-config=api/all=true",
                "--profiling=false",
                f"--cert-dir={pk / 'apiserver-generated'}",
            ],
        )
        kube = Kube(self.layout.credentials(ports.apiserver), timeout=5)
        self._wait_ready(
            "kube-apiserver",
            apiserver,
            lambda: kube.request("GET", "/readyz") is not None,
            timeout=90,
        )

        common = ["--bind-address=127.0.0.1", "--leader-elect=false"]
        cm_kc = self.layout.root / "controller-manager.kubeconfig"
        cm = self._spawn(
            state,
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                *common,
                f"--secure-port={ports.controller_manager}",
                f"--kubeconfig={cm_kc}",
                f"--authentication-kubeconfig={cm_kc}",
                f"--authorization-kubeconfig={cm_kc}",
                f"--service-account-private-key-file={pk / 'sa.key'}",
                f"--root-ca-file={pk / 'ca.crt'}",
                "--use-service-account-credentials=true",
                f"--cluster-signing-cert-file={pk / 'ca.crt'}",
                f"--cluster-signing-key-file={pk / 'ca.key'}",
                f"--cert-dir={pk / 'controller-manager-generated'}",
                f"--feature-gates={gates_flag(bin_dir / 'kube-controller-manager')}",
            ],
        )
        sc_kc = self.layout.root / "scheduler.kubeconfig"
        sched = self._spawn(
            state,
            "kube-scheduler",
            [
                str(bin_dir / "kube-scheduler"),
                *common,
                f"--secure-port={ports.scheduler}",
                f"--kubeconfig={sc_kc}",
                f"--authentication-kubeconfig={sc_kc}",
                f"--authorization-kubeconfig={sc_kc}",
                f"--cert-dir={pk / 'scheduler-generated'}",
                f"--feature-gates={gates_flag(bin_dir / 'kube-scheduler')}",
            ],
        )
        self._wait_ready(
            "kube-controller-manager",
            cm,
            lambda: _https_ok(f"https://127.0.0.1:{ports.controller_manager}/healthz"),
        )
        self._wait_ready(
            "kube-scheduler",
            sched,
            lambda: _https_ok(f"https://127.0.0.1:{ports.scheduler}/healthz"),
        )

        for name in state.nodes:
            register_node(kube, name)
        hb = self._spawn(
            state,
            "node-heartbeat",
            [
                sys.executable,
                "-m",
                "e2e.cluster",
                "heartbeat",
            ],
        )
        # The default ServiceAccount must exist before pods can be admitted.
        wait_for("the default service account", lambda: _sa_ready(kube), timeout=60)
        if hb.poll() is not None:
            raise ClusterError("node heartbeat exited early; see logs/node-heartbeat.log")

    def _write_kubeconfig(self, who: str, server: str) -> None:
        pk = self.layout.pki
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "gpudra",
            "clusters": [
                {
                    "name": "gpudra",
                    "cluster": {"server": server, "certificate-authority": str(pk / "ca.crt")},
                }
            ],
            "users": [
                {
                    "name": who,
                    "user": {
                        "client-certificate": str(pk / f"{who}.crt"),
                        "client-key": str(pk / f"{who}.key"),
                    },
                }
            ],
            "contexts": [{"name": "gpudra", "context": {"cluster": "gpudra", "user": who}}],
        }
        path = (
            self.layout.admin_kubeconfig
            if who == "admin"
            else self.layout.root / f"{who}.kubeconfig"
        )
        path.write_text(json.dumps(cfg, indent=2))
        path.chmod(0o600)

    def _healthy(self, state: State) -> bool:
        if not state.pids or not all(
            alive(p, state.cmdlines.get(n, "")) for n, p in state.pids.items()
        ):
            return False
        try:
            Kube(self.layout.credentials(state.ports["apiserver"]), timeout=3).request(
                "GET", "/readyz"
            )
        except (ApiError, OSError, KeyError):
            return False
        return True


def _sa_ready(kube: Kube) -> bool:
    try:
        kube.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")
    except ApiError:
        return False
    return True


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return bool(resp.status == 200)


def _https_ok(url: str) -> bool:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # self-signed serving certs of the components
    with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
        return bool(resp.status == 200)


# -- fake nodes ---------------------------------------------------------------

# On each node that no kubelet runs (its status is `heartbeat`'s).
FAKE_NODE_LABEL = "gpudra.dev/fake-node"
NODE_CAPACITY = {"cpu": "32", "memory": "256Gi", "pods": "110", "ephemeral-storage": "500Gi"}


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def register_node(
    kube: Kube,
    name: str,
    capacity: Mapping[str, str] = NODE_CAPACITY,
    labels: Mapping[str, str] | None = None,
) -> None:
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    FAKE_NODE_LABEL: "true",
                    **(labels or {}),
                },
            },
        },
        manager="gpudra-harness",
    )
    heartbeat(kube, name, capacity)


def heartbeat(kube: Kube, name: str, capacity: Mapping[str, str] = NODE_CAPACITY) -> None:
    """What a kubelet reports: Ready with capacity (a device plugin's resources
    included, where a caller adds them), plus a renewed node Lease. The Lease is owned
    by its Node, as the kubelet makes it, so deleting a fake node removes its Lease."""
    now = _now()
    node = kube.patch_status(
        "Node",
        name,
        {
            "status": {
                "capacity": dict(capacity),
                "allocatable": dict(capacity),
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "gpudra fake node",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
                "nodeInfo": {
                    "kubeletVersion": "v0.0.0-fake",
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "containerRuntimeVersion": "fake://0",
                    "kernelVersion": "",
                    "osImage": "",
                    "kubeProxyVersion": "",
                    "machineID": name,
                    "systemUUID": name,
                    "bootID": name,
                },
            }
        },
    )
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": "kube-node-lease",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}
            ],
        },
        "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": _micro_now()},
    }
    kube.apply(lease, manager="gpudra-harness")


def finalize_terminating_pods(kube: Kube, nodes: list[str]) -> None:
    """A kubelet confirms deletion once containers stop; fake nodes have none to stop."""
    for node in nodes:
        for pod in kube.list("Pod", fieldSelector=f"spec.nodeName={node}"):
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                kube.delete("Pod", meta["name"], meta["namespace"], grace=0)


def run_heartbeat(layout: Layout) -> None:
    state = State.load(layout.state)
    if state is None:
        raise ClusterError("no cluster state")
    beat_forever(Kube(layout.credentials(state.ports["apiserver"]), timeout=5), state.nodes)


def beat_forever(kube: Kube, nodes: list[str]) -> None:
    """What the fake nodes' kubelets would do, until killed: Ready and a renewed Lease
    every 10 s, and deleted pods confirmed. Both cluster providers run it (kind's fake
    nodes sit beside its real ones, as the real node sits beside these here)."""
    last_beat = 0.0
    while True:
        try:
            if time.monotonic() - last_beat >= 10:
                for n in nodes:
                    heartbeat(kube, n)
                last_beat = time.monotonic()
            finalize_terminating_pods(kube, nodes)
        except (ApiError, OSError) as e:
            print(f"heartbeat: {e}", file=sys.stderr, flush=True)
        time.sleep(0.5)
