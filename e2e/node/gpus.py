"""gpudra on the real node, as host processes: the node agent against emulated GPUs
whose `/dev/nvidia*` are real character devices, and the admission webhook.

Where the image cannot be run (no registry, no Docker), this is how the real kubelet
gets a real plugin: `gpudra node` with the node's kubelet root and the CDI folder
containerd reads, so every claim a pod on `real-1` uses goes kubelet -> gRPC -> CDI
spec -> containerd -> runc, as on a GPU node.

What stands in for the GPU machine, all under `<node dir>/gpudra/`:
- `host/dev/`: `nvidia<minor>`, `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools` and the
  `nvidia-caps/nvidia-cap<N>` MIG access nodes, made with mknod (major 195 as the
  kernel driver uses; no driver answers them, but runc creates them in the container
  from their numbers and the cgroup allows exactly them). The agent's `--dev-root`.
- `driver/`: the emulated GPUs' stand-in driver root (`gpudra.driver.nvml.standin`):
  `libcuda.so.<version>`, `libnvidia-ml.so.<version>` and the NVIDIA tools.
- `profile.json`: the first N (default 6) GPUs of the 8x H100 profile, the last third
  in MIG mode, so whole GPUs and dynamic MIG both exist on one node; the last whole
  GPU is published for memory slices (`--shared-gpus`).
- the NVIDIA tools the agent runs (nvidia-smi, nvidia-cuda-mps-control) are those
  stand-ins, recording their calls in `tools.log`.

This is the agent with every host path given explicitly, as on a GPU node; the chart
on the same node (`e2e/node/chart.py`) covers the emulated defaults instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from gpudra.api.deviceclasses import device_classes
from gpudra.api.tenants import crd_manifest
from gpudra.driver.checkpoint import document_of
from gpudra.driver.checkpoint_changes import ChangesFile
from gpudra.driver.nvml.emulator import load_builtin_profile
from gpudra.driver.nvml.standin import (
    CAPS_MAJOR,
    FAKEBIN,
    NVIDIA_MAJOR,
    NVIDIACTL_MINOR,
    UVM_MAJOR,
    install_driver_root,
)
from gpudra.webhook.registration import NAME as MUTATING_NAME

from e2e.cluster.harness import REPO
from e2e.cluster.kube import Kube, apply_crd, wait_for
from e2e.node.realnode import NodeError, NodeState, RealNode
from e2e.processes import alive, free_port, stop_pid

DRIVER = "gpu.nvidia.com"
PROFILE = "h100-80gb-hbm3-x8-mig"
# The kernel driver's fixed MIG capability table: 3 + minor*135 + gi*9 (+1+ci).
MIG_FIRST_MINOR = 3
MIG_GPU_INSTANCES = 15
MIG_COMPUTE_INSTANCES = 8
AGENT = "gpudra-node"
WEBHOOK = "gpudra-webhook"


def gpu_count() -> int:
    raw = os.environ.get("GPUDRA_REAL_NODE_GPUS", "6")
    if not raw.isdigit() or not 1 <= int(raw) <= 8:
        raise NodeError(f"GPUDRA_REAL_NODE_GPUS={raw!r}: set a number of GPUs from 1 to 8")
    return int(raw)


def mig_count(gpus: int) -> int:
    """How many of the node's GPUs (the last ones) are in MIG mode: a third."""
    return gpus // 3


def node_profile(gpus: int) -> dict[str, Any]:
    """The first `gpus` H100s; the last third in MIG mode, the others whole."""
    mig = mig_count(gpus)
    profile = load_builtin_profile(PROFILE).model_dump(mode="json", exclude_none=True)
    profile["description"] = (
        f"{gpus}x NVIDIA H100 80GB HBM3 for the real node: {gpus - mig} whole, {mig} in MIG mode"
    )
    profile["gpus"] = profile["gpus"][:gpus]
    for i, gpu in enumerate(profile["gpus"]):
        gpu["migEnabled"] = i >= gpus - mig
        gpu.pop("migPendingEnabled", None)
    return profile


def _mknod(path: Path, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))


def make_device_nodes(dev_root: Path, minors: list[int]) -> None:
    """The nodes the NVIDIA kernel driver would create for these GPUs."""
    dev = dev_root / "dev"
    for minor in minors:
        _mknod(dev / f"nvidia{minor}", NVIDIA_MAJOR, minor)
        first = MIG_FIRST_MINOR + minor * MIG_GPU_INSTANCES * (1 + MIG_COMPUTE_INSTANCES)
        for cap in range(first, first + MIG_GPU_INSTANCES * (1 + MIG_COMPUTE_INSTANCES)):
            _mknod(dev / "nvidia-caps" / f"nvidia-cap{cap}", CAPS_MAJOR, cap)
    _mknod(dev / "nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR)
    _mknod(dev / "nvidia-uvm", UVM_MAJOR, 0)
    _mknod(dev / "nvidia-uvm-tools", UVM_MAJOR, 1)
    (dev / "shm").mkdir(exist_ok=True)


class NodeGpus:
    """What the GPU-pod tests see of gpudra on the real node, however it was
    installed: its files on the node, the kubelet's view of the plugin, and the
    faults the tests inject. `GpuStack` (host processes) and `ChartStack` (the Helm
    chart, e2e/node/chart.py) fill in where the files are and how the agent runs."""

    name = "abstract"

    def __init__(self, node: RealNode) -> None:
        self.node = node

    # Where the agent keeps what the tests read.
    @property
    def state_dir(self) -> Path:
        raise NotImplementedError

    @property
    def tools_log(self) -> Path:
        raise NotImplementedError

    @property
    def nvml_state_path(self) -> Path:
        raise NotImplementedError

    @property
    def metrics_port(self) -> int:
        """Where the agent serves its metrics on the host's loopback, once started with
        `--metrics-address=127.0.0.1:<this port>` (`agent_flags`)."""
        raise NotImplementedError

    @property
    def telemetry_script(self) -> Path:
        """A file for the agent's `--nvml-script` (scripted telemetry of the emulated
        GPUs), at a path the agent sees as the test does."""
        return self.state_dir / "telemetry.json"

    def up(self, *, webhook: bool = True, log: Callable[[str], None] = print) -> None:
        raise NotImplementedError

    def down(self, log: Callable[[str], None] = print) -> None:
        """Removes what `up` installed that the node's own `down` does not."""

    def crashing_at(self, step: str) -> contextlib.AbstractContextManager[Callable[[], None]]:
        """The agent SIGKILLs itself right after `step` of a prepare while inside; the
        callable waits for that crash. Leaving starts the normal agent again and
        returns once the kubelet has reconnected to it."""
        raise NotImplementedError

    def api_unreachable(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the agent talks to a wrong API server address; leaving restores it
        and returns once the kubelet has reconnected to it."""
        raise NotImplementedError

    def agent_flags(self, *flags: str) -> contextlib.AbstractContextManager[None]:
        """Inside, the agent runs with these `gpudra node` flags added (e.g.
        `--gpu-shares=2`); leaving restores it. Both return once the kubelet is
        connected to the agent that runs."""
        raise NotImplementedError

    def agent_output(self) -> str:
        """What the agent that runs now has logged."""
        raise NotImplementedError

    # The same for every installation.
    def profile(self) -> dict[str, Any]:
        return node_profile(gpu_count())

    def gpu_minors(self) -> dict[str, int]:
        """GPU UUID -> device minor."""
        return {g["uuid"]: int(g["minor"]) for g in self.profile()["gpus"]}

    def shared_gpus(self) -> str:
        """The last whole GPU hands out memory slices when there are two or more."""
        gpus = gpu_count()
        whole = gpus - mig_count(gpus)
        return str(whole - 1) if whole >= 2 else "none"

    @property
    def cdi_root(self) -> Path:
        return self.node.layout.cdi

    @property
    def node_name(self) -> str:
        return str(self.node.name)

    # How the node's files are read: directly here, through the container on kind.
    def read_file(self, path: Path) -> str | None:
        return path.read_text() if path.exists() else None

    def list_names(self, folder: Path) -> list[str]:
        return [p.name for p in folder.iterdir()] if folder.is_dir() else []

    def cdi_specs(self) -> set[str]:
        prefix = f"k8s.{DRIVER}-claim_"
        return {n for n in self.list_names(self.cdi_root) if n.startswith(prefix)}

    def checkpoint(self) -> dict[str, Any]:
        """The claims of the node's checkpoint: its file with its changes file applied."""
        path = self.state_dir / "checkpoint.json"
        text = self.read_file(path)
        if not text:
            return {}
        changes = self.read_file(ChangesFile(path).path) or ""
        claims: dict[str, Any] = document_of(text.encode(), changes.encode())["claims"]
        return claims

    def tool_calls(self) -> list[str]:
        return (self.read_file(self.tools_log) or "").splitlines()

    def nvml_state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(self.read_file(self.nvml_state_path) or "{}")
        return state

    def restart_kubelet(self) -> None:
        """Restarts the node's kubelet; returns once it has reconnected to the plugin."""
        mark = self.kubelet_log_size()
        self.node.restart_kubelet()
        self.wait_registered(mark)

    def kubelet_log_size(self) -> int:
        return (self.node.layout.logs / "kubelet.log").stat().st_size

    def kubelet_log(self, since: int) -> str:
        with (self.node.layout.logs / "kubelet.log").open("rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")

    def plugin_registered(self, since: int = 0) -> bool:
        """The kubelet connected to our plugin (after byte `since` of its log)."""
        text = self.kubelet_log(since)
        return any(
            '"Connection changed"' in line
            and f'driverName="{DRIVER}"' in line
            and "connected=true" in line
            for line in text.splitlines()
        )

    def wait_registered(self, since: int, timeout: float = 90) -> None:
        wait_for(
            f"the kubelet of {self.node.name} to connect to {DRIVER}",
            lambda: self.plugin_registered(since),
            timeout=timeout,
        )

    def published(self, kube: Kube) -> bool:
        items = kube.list("ResourceSlice", fieldSelector=f"spec.nodeName={self.node.name}")
        return any(o["spec"]["driver"] == DRIVER and o["spec"].get("devices") for o in items)


G = TypeVar("G", bound="NodeGpus")


def installed(gpus: G) -> Iterator[G]:
    """`gpus` up for a fixture's lifetime, quietly; down again even when up failed
    half-way."""
    try:
        gpus.up(log=lambda _m: None)
        yield gpus
    finally:
        gpus.down(log=lambda _m: None)


class GpuStack(NodeGpus):
    """The driver's node agent (and optionally the webhook) for one real node."""

    name = "processes"

    def __init__(self, node: RealNode, *, flags: tuple[str, ...] = ()) -> None:
        super().__init__(node)
        self.root = node.layout.root / "gpudra"
        self.flags = flags  # on every start of the agent (the demo's shares)
        self._metrics_port: int | None = None

    @property
    def dev_root(self) -> Path:
        return self.root / "host"

    @property
    def driver_root(self) -> Path:
        return self.root / "driver"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def tools_log(self) -> Path:
        return self.root / "tools.log"

    @property
    def nvml_state_path(self) -> Path:
        return self.root / "nvml-state.json"

    @property
    def agent_log(self) -> Path:
        return self.node.layout.logs / f"{AGENT}.log"

    def agent_output(self) -> str:
        return self.agent_log.read_text(errors="replace")

    @property
    def metrics_port(self) -> int:
        if self._metrics_port is None:
            self._metrics_port = free_port()
        return self._metrics_port

    def up(self, *, webhook: bool = True, log: Callable[[str], None] = print) -> None:
        """Device nodes, driver root, DeviceClasses, then the agent (and webhook);
        returns once the node's pool is published and the kubelet has the plugin."""
        state = self._state()
        kube = self.node.cluster.kube()
        start = time.monotonic()
        gpus = gpu_count()
        profile = self.profile()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "profile.json").write_text(json.dumps(profile, indent=2))
        make_device_nodes(self.dev_root, [int(g["minor"]) for g in profile["gpus"]])
        install_driver_root(self.driver_root, str(profile["driverVersion"]))
        for dc in device_classes(DRIVER):
            kube.apply(dc)
        apply_crd(kube, crd_manifest())
        if not alive(state.pids.get(AGENT, 0), state.cmdlines.get(AGENT, "-")):
            self.start_agent()
        if webhook and not alive(state.pids.get(WEBHOOK, 0), state.cmdlines.get(WEBHOOK, "-")):
            self._start_webhook(kube)
        self.wait_registered(0, timeout=60)
        log(
            f"gpudra on {self.node.name}: {gpus} emulated H100s published and the plugin "
            f"registered in {time.monotonic() - start:.1f}s"
            + (" (webhook serving)" if webhook else "")
        )

    def agent_argv(self, *extra: str) -> list[str]:
        lay = self.node.layout
        return [
            sys.executable,
            "-m",
            "gpudra.cli",
            "node",
            "--node-name",
            self.node.name,
            "--driver-name",
            DRIVER,
            "--nvml",
            f"emulated:{self.root / 'profile.json'}",
            "--nvml-state",
            str(self.nvml_state_path),
            "--kubeconfig",
            str(self.node.cluster.layout.admin_kubeconfig),
            "--kubelet-root",
            str(lay.kubelet_root),
            "--cdi-root",
            str(lay.cdi),
            "--state-dir",
            str(self.state_dir),
            "--dev-root",
            str(self.dev_root),
            "--driver-root",
            str(self.driver_root),
            "--nvidia-smi",
            str(FAKEBIN / "nvidia-smi"),
            "--mps-control",
            str(FAKEBIN / "nvidia-cuda-mps-control"),
            "--no-toolkit-cdi",
            "--cleanup-interval",
            "5",
            "--metrics-address",
            "",
            "--shared-gpus",
            self.shared_gpus(),
            *self.flags,
            *extra,
        ]

    def start_agent(self, *extra: str) -> subprocess.Popen[bytes]:
        """`gpudra node` for this node; `extra` flags (e.g. a crash point) are appended."""
        state = self._state()
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "GPUDRA_FAKEBIN_LOG": str(self.tools_log),
        }
        mark = self.kubelet_log_size()
        proc = self.node._spawn(
            state, AGENT, self.agent_argv(*extra), env=env, hint="gpudra.cli node"
        )
        kube = self.node.cluster.kube()
        # Published, and connected to by the kubelet: a pod admitted before that gets
        # "driver not registered" and waits out the kubelet's retry backoff.
        self.node._wait(
            AGENT,
            proc,
            lambda: self.published(kube) and self.plugin_registered(mark),
            timeout=90,
        )
        return proc

    def stop_agent(self, sig: int | None = None) -> None:
        """SIGTERM (graceful) by default, or the given signal (e.g. SIGKILL)."""
        state = self._state()
        pid = state.pids.get(AGENT, 0)
        hint = state.cmdlines.get(AGENT, "-")
        if sig is None:
            stop_pid(pid, hint)
        elif alive(pid, hint):
            os.kill(pid, sig)
            wait_for("the agent to exit", lambda: not alive(pid, hint), timeout=10)

    @contextlib.contextmanager
    def crashing_at(self, step: str) -> Iterator[Callable[[], None]]:
        self.stop_agent()
        crashing = self.start_agent("--crash-at", step)

        def crashed() -> None:
            crashing.wait(timeout=120)
            assert crashing.returncode == -signal.SIGKILL, crashing.returncode

        try:
            yield crashed
        finally:
            if crashing.poll() is None:
                crashing.kill()
                crashing.wait(timeout=30)
        mark = self.kubelet_log_size()
        self.start_agent()
        self.wait_registered(mark)

    @contextlib.contextmanager
    def agent_flags(self, *flags: str) -> Iterator[None]:
        self.stop_agent()
        self.start_agent(*flags)
        try:
            yield
        finally:
            self.stop_agent()
            self.start_agent()

    @contextlib.contextmanager
    def api_unreachable(self) -> Iterator[None]:
        broken = json.loads(self.node.cluster.layout.admin_kubeconfig.read_text())
        for c in broken["clusters"]:
            c["cluster"]["server"] = "https://127.0.0.1:1"
        bad = self.root / "unreachable.kubeconfig"
        bad.write_text(json.dumps(broken))
        self.stop_agent()
        mark = self.kubelet_log_size()
        argv = [*self.agent_argv(), "--kubeconfig", str(bad)]
        agent = self.node._spawn(self._state(), AGENT, argv, hint="gpudra.cli node")
        try:
            self.wait_registered(mark)
            yield
        finally:
            self.stop_agent()
            agent.wait(timeout=30)
        mark = self.kubelet_log_size()
        self.start_agent()
        self.wait_registered(mark)

    def start_webhook(self, *extra: str) -> None:
        """`gpudra webhook` with `extra` flags (after `up(webhook=False)`); returns once
        it registered itself and is ready."""
        self._start_webhook(self.node.cluster.kube(), *extra)

    def _start_webhook(self, kube: Kube, *extra: str) -> None:
        state = self._state()
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "gpudra.cli",
            "webhook",
            "--cert-dir",
            str(self.root / "webhook-pki"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--url",
            f"https://127.0.0.1:{port}",
            "--kubeconfig",
            str(self.node.cluster.layout.admin_kubeconfig),
            *extra,
        ]
        proc = self.node._spawn(
            state, WEBHOOK, argv, env={**os.environ, "PYTHONPATH": str(REPO)}, hint="gpudra.cli"
        )
        # Registered, and ready: it refuses GPU objects until its tenant rules load.
        self.node._wait(
            WEBHOOK,
            proc,
            lambda: (
                _registered(kube, "MutatingWebhookConfiguration", MUTATING_NAME)
                and _ready(port, self.root / "webhook-pki" / "ca.crt")
            ),
            timeout=60,
        )

    def _state(self) -> NodeState:
        state = NodeState.load(self.node.layout.state)
        if state is None or not state.ready:
            raise NodeError(f"node {self.node.name} is not up: run `make node-up` first")
        return state


def _ready(port: int, ca: Path) -> bool:
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    with urllib.request.urlopen(
        f"https://127.0.0.1:{port}/readyz", context=context, timeout=5
    ) as resp:
        return bool(resp.status == 200)


def _registered(kube: Kube, kind: str, name: str) -> bool:
    obj = kube.get_or_none(kind, name)
    return bool(obj and all(w["clientConfig"].get("caBundle") for w in obj.get("webhooks", [])))
