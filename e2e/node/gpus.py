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
- `driver/`: a driver root with the library and utility names the plugin mounts
  (`libcuda.so.<version>`, `libnvidia-ml.so.<version>`, `nvidia-smi`).
- `profile.json`: the first N (default 6) GPUs of the 8x H100 profile, the last third
  in MIG mode, so whole GPUs and dynamic MIG both exist on one node; the last whole
  GPU is published for memory slices (`--shared-gpus`).
- the NVIDIA tools the agent runs (nvidia-smi, nvidia-cuda-mps-control) are the test
  stand-ins that record their calls in `tools.log`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpudra.api.deviceclasses import device_classes
from gpudra.api.tenants import crd_manifest
from gpudra.driver.nvml.emulator import load_builtin_profile
from gpudra.webhook.registration import NAME as MUTATING_NAME

from e2e.cluster.harness import REPO, _alive, _stop_pid
from e2e.cluster.kube import Kube, apply_crd, wait_for
from e2e.node.realnode import NodeError, NodeState, RealNode

DRIVER = "gpu.nvidia.com"
PROFILE = "h100-80gb-hbm3-x8-mig"
FAKEBIN = REPO / "tests" / "driver" / "fakebin"
NVIDIA_MAJOR = 195
# Character majors the kernel hands out dynamically; these are free on a machine
# without the NVIDIA driver, and the container only needs the node to exist.
UVM_MAJOR = 510
CAPS_MAJOR = 511
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
    _mknod(dev / "nvidiactl", NVIDIA_MAJOR, 255)
    _mknod(dev / "nvidia-uvm", UVM_MAJOR, 0)
    _mknod(dev / "nvidia-uvm-tools", UVM_MAJOR, 1)
    (dev / "shm").mkdir(exist_ok=True)


def make_driver_root(root: Path, version: str) -> list[str]:
    """A driver root with what the plugin mounts; returns the in-root paths."""
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True, exist_ok=True)
    files = []
    for name in (f"libcuda.so.{version}", f"libnvidia-ml.so.{version}"):
        (lib / name).write_text(f"stand-in for {name}\n")
        files.append(f"/usr/lib/x86_64-linux-gnu/{name}")
    bin_dir = root / "usr/bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(FAKEBIN / "nvidia-smi", bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    files.append("/usr/bin/nvidia-smi")
    return files


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GpuStack:
    """The driver's node agent (and optionally the webhook) for one real node."""

    def __init__(self, node: RealNode) -> None:
        self.node = node
        self.root = node.layout.root / "gpudra"

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
    def agent_log(self) -> Path:
        return self.node.layout.logs / f"{AGENT}.log"

    def up(self, *, webhook: bool = True, log: Callable[[str], None] = print) -> None:
        """Device nodes, driver root, DeviceClasses, then the agent (and webhook);
        returns once the node's pool is published and the kubelet has the plugin."""
        state = self._state()
        kube = self.node.cluster.kube()
        start = time.monotonic()
        gpus = gpu_count()
        profile = node_profile(gpus)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "profile.json").write_text(json.dumps(profile, indent=2))
        make_device_nodes(self.dev_root, [int(g["minor"]) for g in profile["gpus"]])
        make_driver_root(self.driver_root, str(profile["driverVersion"]))
        for dc in device_classes(DRIVER):
            kube.apply(dc)
        apply_crd(kube, crd_manifest())
        if not _alive(state.pids.get(AGENT, 0), state.cmdlines.get(AGENT, "-")):
            self.start_agent()
        if webhook and not _alive(state.pids.get(WEBHOOK, 0), state.cmdlines.get(WEBHOOK, "-")):
            self._start_webhook(kube)
        wait_for(
            f"the kubelet of {self.node.name} to register {DRIVER}",
            self.plugin_registered,
            timeout=60,
        )
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
            str(self.root / "nvml-state.json"),
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
            *self._shared(),
            *extra,
        ]

    def _shared(self) -> list[str]:
        """The last whole GPU hands out memory slices when there are two or more."""
        gpus = gpu_count()
        whole = gpus - mig_count(gpus)
        return ["--shared-gpus", str(whole - 1)] if whole >= 2 else []

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
            lambda: self._published(kube) and self.plugin_registered(mark),
            timeout=90,
        )
        return proc

    def stop_agent(self, sig: int | None = None) -> None:
        """SIGTERM (graceful) by default, or the given signal (e.g. SIGKILL)."""
        state = self._state()
        pid = state.pids.get(AGENT, 0)
        hint = state.cmdlines.get(AGENT, "-")
        if sig is None:
            _stop_pid(pid, hint)
        elif _alive(pid, hint):
            os.kill(pid, sig)
            wait_for("the agent to exit", lambda: not _alive(pid, hint), timeout=10)

    def kubelet_log_size(self) -> int:
        return (self.node.layout.logs / "kubelet.log").stat().st_size

    def plugin_registered(self, since: int = 0) -> bool:
        """The kubelet connected to our plugin (after byte `since` of its log)."""
        with (self.node.layout.logs / "kubelet.log").open("rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return any(
            '"Connection changed"' in line
            and f'driverName="{DRIVER}"' in line
            and "connected=true" in line
            for line in text.splitlines()
        )

    def _published(self, kube: Kube) -> bool:
        items = kube.list("ResourceSlice", fieldSelector=f"spec.nodeName={self.node.name}")
        return any(o["spec"]["driver"] == DRIVER and o["spec"].get("devices") for o in items)

    def _start_webhook(self, kube: Kube) -> None:
        state = self._state()
        port = _free_port()
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
