"""A real node next to the local control plane: containerd 2.x with runc and CNI, and
the kubelet of the cluster's own Kubernetes version, registered as `real-1`.

Everything lives under `<cluster dir>/<node>/` (containerd root and state, kubelet
root, CNI and CDI dirs, certificates), and every process is recorded by PID the moment
it starts, as in the harness. `down` deletes the node's pods, stops the kubelet, kills
what is left in the node's own cgroup subtree, stops the shims and containerd, unmounts
whatever is mounted under the node directory, removes its cgroups, restores the sysctls
the kubelet and the CNI plugin change, and removes the directory: nothing of it is
left on the host.

Why these settings (measured on a cgroup v1 machine; see docs/real-node.md):
- `cgroupfs` driver under a cgroup root of our own (`/gpudra-<hash>`), so the node's
  cgroups can be found and removed, and `failCgroupV1: false`, because the kubelet
  refuses cgroup v1 by default since 1.35.
- The kubelet refuses a loopback node IP, so it serves on the host's own address
  (the default route's source, or GPUDRA_NODE_IP); the API server reaches it through
  the InternalIP address (`--kubelet-preferred-address-types` in the harness).
- Without CAP_SYS_RESOURCE (some sandboxes drop it even for root) runc cannot lower
  a pod's oom_score_adj, so containerd clamps it (`restrict_oom_score_adj`).
- ptp CNI with host-local IPAM and no masquerading: no bridge shared with anything
  else on the host and no iptables needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpudra.webhook import registration

from e2e.cluster import pki
from e2e.cluster.harness import REPO, WANTED_GATES, Cluster, known_gates
from e2e.cluster.kube import ApiError, Kube, wait_for
from e2e.node import images
from e2e.processes import alive, naming, port_free, spawn_logged, stop_pid
from e2e.progress import BuildFailed, build_script

BUILD_SCRIPT = REPO / "e2e" / "node" / "build.sh"
DEFAULT_NODE = "real-1"
CGROUP_FS = Path("/sys/fs/cgroup")
# What the kubelet (setupKernelTunables) and the ptp plugin (ip_forward) write.
SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
)
CNI_BIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
# A shim socket is `<dir>/<64 hex>` and must fit a unix socket path (107 bytes).
MAX_SHIM_SOCKET_DIR = 42
LOG_CONTAINERS = Path("/var/log/containers")
CNI_RESULTS = Path("/var/lib/cni/results")
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
# Host paths written regardless of configuration: container log links (kubelet),
# the device-plugin socket (kubelet) and CNI result caches (containerd's CNI library).
# Those that did not exist before `up` are removed again by `down`.
HOST_DIRS = (
    LOG_CONTAINERS,
    CNI_RESULTS,
    CNI_RESULTS.parent,
    DEVICE_PLUGINS,
    DEVICE_PLUGINS.parent,
    Path("/run/containerd/s"),
    Path("/run/containerd"),
)
CAP_SYS_RESOURCE = 24
WEBHOOK_CONFIGURATIONS = (
    ("MutatingWebhookConfiguration", registration.NAME),
    ("ValidatingWebhookConfiguration", registration.VALIDATING_NAME),
)


class NodeError(Exception):
    """A one-line, actionable reason the real node could not be brought up."""


@dataclass(frozen=True)
class NodePorts:
    kubelet: int = 31250
    healthz: int = 31248

    @classmethod
    def from_env(cls) -> NodePorts:
        def port(env: str, default: int) -> int:
            raw = os.environ.get(env, str(default))
            if not raw.isdigit() or not 0 < int(raw) < 65536:
                raise NodeError(f"{env}={raw!r} is not a port number: set a free port")
            return int(raw)

        return cls(
            port("GPUDRA_KUBELET_PORT", cls.kubelet),
            port("GPUDRA_KUBELET_HEALTHZ_PORT", cls.healthz),
        )


@dataclass
class NodeLayout:
    root: Path

    @property
    def state(self) -> Path:
        return self.root / "node.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def containerd_sock(self) -> Path:
        return self.root / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        """Where DRA plugins put their sockets (`plugins_registry/`, `plugins/`)."""
        return self.root / "kubelet"

    @property
    def cdi(self) -> Path:
        return self.root / "cdi"

    @property
    def cni_conf(self) -> Path:
        return self.root / "cni" / "net.d"


@dataclass
class NodeState:
    name: str
    cgroup_root: str
    snapshotter: str
    pids: dict[str, int] = field(default_factory=dict)
    cmdlines: dict[str, str] = field(default_factory=dict)
    sysctls: dict[str, str] = field(default_factory=dict)
    created_host_dirs: list[str] = field(default_factory=list)
    ready: bool = False

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> NodeState | None:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            return cls(name="?", cgroup_root="", snapshotter="")


# -- machine checks ------------------------------------------------------------


def cgroup_mounts() -> list[Path]:
    """Every cgroup hierarchy (v1 controllers, named ones and the v2 unified one)."""
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] in ("cgroup", "cgroup2"):
            out.append(Path(parts[1].replace("\\040", " ")))
    return out


def machine_problem() -> str | None:
    """Why this machine cannot run a real node, or None. Cheap and side-effect free,
    so other tests can skip on it; build failures surface later from `RealNode.up`."""
    if sys.platform != "linux":
        return "a real node needs Linux (containerd, runc and cgroups)"
    if os.geteuid() != 0:
        return "a real node needs root (containerd, runc, mounts and cgroups): run as root"
    mounts = cgroup_mounts()
    if not mounts:
        return "no cgroup filesystem is mounted under /sys/fs/cgroup: mount cgroups first"
    probe = f"gpudra-probe-{os.getpid()}"
    for mp in mounts:
        try:
            (mp / probe).mkdir()
            (mp / probe).rmdir()
        except OSError as e:
            return (
                f"cannot create cgroups under {mp} ({e.strerror}): the kubelet needs a "
                "writable cgroup hierarchy (run in a VM or a privileged container)"
            )
    proc = subprocess.run(
        ["unshare", "--net", "--mount", "true"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return (
            f"cannot create network or mount namespaces ({proc.stderr.strip() or 'unshare'}"
            "): pods need them (run in a VM or a privileged container)"
        )
    if shutil.which("runc") is None and shutil.which("apt-get") is None:
        return "runc is missing and there is no apt-get to install it: install runc"
    return None


def _overlay_works(scratch: Path) -> bool:
    """overlayfs on the node's filesystem (it fails on overlay-on-overlay roots)."""
    dirs = {n: scratch / n for n in ("lower", "upper", "work", "merged")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={dirs['lower']},upperdir={dirs['upper']},workdir={dirs['work']}"
    ok = (
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, str(dirs["merged"])],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    if ok:
        subprocess.run(["umount", str(dirs["merged"])], check=False)
    shutil.rmtree(scratch, ignore_errors=True)
    return ok


def build() -> Path:
    """containerd's bin dir (built when missing); runc and CNI plugins installed."""
    try:
        return build_script(BUILD_SCRIPT, prefix="build", what="building containerd")
    except BuildFailed as e:
        raise NodeError(str(e)) from e


def prepare() -> tuple[Path, dict[str, Path]]:
    """Everything `up` needs built: containerd's bin dir and the image archives."""
    ctr_bin = build()
    try:
        return ctr_bin, images.build_all()
    except images.ImageError as e:
        raise NodeError(str(e)) from e


def unavailable_reason() -> str | None:
    """Why no real node can run here, or None: the machine check, then the builds
    (cached after the first run). For tests to skip on with this exact reason."""
    problem = machine_problem()
    if problem:
        return problem
    try:
        prepare()
    except NodeError as e:
        return f"building the real node's parts failed: {e}"
    return None


# -- host cleanup helpers ------------------------------------------------------


def mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if mp.startswith(prefix) or mp == str(root):
            out.append(mp)
    return out


def _unmount_all(root: Path) -> list[str]:
    """Deepest first, lazily, until nothing is left; returns what could not go."""
    for _ in range(5):
        left = mounts_under(root)
        if not left:
            return []
        for mp in sorted(set(left), key=lambda p: p.count("/"), reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True, check=False)
    return mounts_under(root)


def cgroup_dirs(cgroup_root: str) -> list[Path]:
    if not cgroup_root:
        return []
    return [mp / cgroup_root.lstrip("/") for mp in cgroup_mounts()]


def _procs_in(cg: Path) -> set[int]:
    """The pids in `cg` and every cgroup under it; none when it does not exist.

    Containers exit while this walks, and their cgroups go with them: `os.walk` skips
    a folder that vanished after it was listed, where `Path.rglob` raises.
    """
    pids: set[int] = set()
    for folder, _subfolders, files in os.walk(cg):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(p) for p in Path(folder, "cgroup.procs").read_text().split())
    return pids


def kill_cgroups(dirs: list[Path], timeout: float = 10.0) -> None:
    """Kills every process in `dirs` and the cgroups under them, until none is left.

    For cgroups that hold only what a test node started (its containers, or a
    private engine's), never a host's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = set().union(*(_procs_in(d) for d in dirs))
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def remove_cgroups(dirs: list[Path]) -> list[str]:
    """Removes `dirs` and the cgroups under them, deepest first; returns those of
    `dirs` that could not go (a process still in them)."""
    left = []
    for top in dirs:
        if not top.is_dir():
            continue
        # Bottom-up: each cgroup after the ones under it; one that vanished is skipped.
        for folder, _subfolders, _files in os.walk(top, topdown=False):
            if folder != str(top):
                with contextlib.suppress(OSError):
                    Path(folder).rmdir()
        try:
            top.rmdir()
        except OSError:
            left.append(str(top))
    return left


def _make_cgroups(cgroup_root: str) -> None:
    """The kubelet insists the cgroup root exists; cpuset children start empty."""
    for d in cgroup_dirs(cgroup_root):
        d.mkdir(exist_ok=True)
        for f in ("cpuset.cpus", "cpuset.mems"):
            if (d / f).exists() and not (d / f).read_text().strip():
                (d / f).write_text((d.parent / f).read_text())


def _shim_pids(sock: Path) -> list[int]:
    """Shims re-parent away from containerd; their `-address` names our socket."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and str(sock).encode() in argv:
                out.append(int(proc.name))
    return out


def _read_sysctls() -> dict[str, str]:
    out = {}
    for key in SYSCTLS:
        with contextlib.suppress(OSError):
            out[key] = (Path("/proc/sys") / key).read_text().strip()
    return out


def _restore_sysctls(saved: dict[str, str]) -> None:
    for key, value in saved.items():
        with contextlib.suppress(OSError):
            path = Path("/proc/sys") / key
            if path.read_text().strip() != value:
                path.write_text(value)


# -- the node ------------------------------------------------------------------


class RealNode:
    def __init__(self, cluster: Cluster, name: str = DEFAULT_NODE) -> None:
        self.cluster = cluster
        self.name = name
        self.layout = NodeLayout(cluster.layout.root.resolve() / name)

    # -- public --------------------------------------------------------------
    def is_up(self) -> bool:
        state = NodeState.load(self.layout.state)
        return bool(state and state.ready and self._healthy(state))

    def up(self, log: Any = print) -> NodeState:
        problem = machine_problem()
        if problem:
            raise NodeError(problem)
        kube = self.cluster.kube()  # raises when the control plane is not up
        self._check_apiserver()
        ctr_bin, archives = prepare()
        state = NodeState.load(self.layout.state)
        if state is not None:
            if state.ready and self._healthy(state):
                log(f"node {self.name} already up")
                return state
            log(f"found an earlier node {self.name} that is not healthy; cleaning it up")
            self.down(log=lambda _m: None)
        ports = NodePorts.from_env()
        for what, port in (
            ("GPUDRA_KUBELET_PORT", ports.kubelet),
            (
                "GPUDRA_KUBELET_HEALTHZ_PORT",
                ports.healthz,
            ),
        ):
            if not port_free(port):
                raise NodeError(
                    f"port {port} for the kubelet is already in use: stop that process or "
                    f"set {what} to a free port"
                )
        start = time.monotonic()
        lay = self.layout
        for d in (lay.logs, lay.pki, lay.kubelet_root, lay.cdi, lay.cni_conf):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        snapshotter = "overlayfs" if _overlay_works(lay.root / "ovl-probe") else "native"
        digest = hashlib.sha256(str(lay.root).encode()).hexdigest()[:10]
        state = NodeState(self.name, f"/gpudra-{digest}", snapshotter, sysctls=_read_sysctls())
        state.created_host_dirs = [str(d) for d in HOST_DIRS if not d.exists()]
        state.save(lay.state)
        # From here on the control plane's `down` stops this node first.
        self.cluster.attach(self.name, [sys.executable, "-m", "e2e.node", "down", self.name])
        try:
            _make_cgroups(state.cgroup_root)
            self._start_containerd(state, ctr_bin)
            for archive in archives.values():
                self.ctr(ctr_bin, "images", "import", "--snapshotter", snapshotter, str(archive))
            self._start_kubelet(state, kube, ports)
        except BaseException:
            self.down(log=lambda _m: None, keep_logs=True)
            raise
        state.ready = True
        state.save(lay.state)
        log(
            f"node {self.name} Ready in {time.monotonic() - start:.1f}s "
            f"(containerd {ctr_bin.parent.name}, snapshotter {snapshotter}, "
            f"kubelet root {lay.kubelet_root})"
        )
        return state

    def down(self, log: Any = print, keep_logs: bool = False) -> None:
        state = NodeState.load(self.layout.state)
        if state is None:
            self.cluster.detach(self.name)
            log(f"no state for node {self.name}; nothing to stop")
            return
        kube = self._kube_or_none()
        if kube is not None and "kubelet" in state.pids:
            self._drain(kube, state)
        if "kubelet" in state.pids:
            stop_pid(state.pids["kubelet"], state.cmdlines.get("kubelet", ""))
        # The driver's processes (gpudra node, webhook) outlive the kubelet's drain,
        # which still needs the plugin to unprepare.
        for name, pid in state.pids.items():
            if name not in ("kubelet", "containerd"):
                stop_pid(pid, state.cmdlines.get(name, ""))
        kill_cgroups(cgroup_dirs(state.cgroup_root))
        for pid in _shim_pids(self.layout.containerd_sock):
            stop_pid(pid, "containerd-shim", timeout=3)
        if "containerd" in state.pids:
            stop_pid(state.pids["containerd"], state.cmdlines.get("containerd", ""))
        # With every process of the node stopped, what still names a path of it was
        # started by one and left detached, in no cgroup of the node's: the MPS control
        # daemon of a claim still prepared when the agent went. A real node's shutdown
        # ends it with everything else; here nothing else would.
        strays = naming(self.layout.root)
        for pid in strays:
            stop_pid(pid, str(self.layout.root), timeout=3)
        if strays:
            log(f"stopped {len(strays)} processes left running from {self.layout.root}")
        stuck = _unmount_all(self.layout.root)
        left = remove_cgroups(cgroup_dirs(state.cgroup_root))
        _restore_sysctls(state.sysctls)
        self._clean_host_paths(state)
        if kube is not None:
            self._forget(kube, state)
        if stuck:
            raise NodeError(
                f"could not unmount {stuck[0]} (and {len(stuck) - 1} more); kept "
                f"{self.layout.root}: unmount them by hand, then run down again"
            )
        if keep_logs:
            for child in self.layout.root.iterdir():
                if child != self.layout.logs:
                    subprocess.run(["rm", "-rf", str(child)], check=False)
        else:
            subprocess.run(["rm", "-rf", str(self.layout.root)], check=False)
        self.cluster.detach(self.name)
        if left:
            log(f"warning: cgroups still busy: {', '.join(left)}")
        log(f"node {self.name} stopped")

    def status(self) -> dict[str, Any]:
        state = NodeState.load(self.layout.state)
        if state is None:
            return {"up": False, "name": self.name}
        return {
            "up": state.ready and self._healthy(state),
            "name": self.name,
            "processes": {n: alive(p, state.cmdlines.get(n, "")) for n, p in state.pids.items()},
            "snapshotter": state.snapshotter,
            "cgroup_root": state.cgroup_root,
            "kubelet_root": str(self.layout.kubelet_root),
            "cdi_dir": str(self.layout.cdi),
            "containerd_socket": str(self.layout.containerd_sock),
        }

    def restart_kubelet(self) -> None:
        """Stops the kubelet (SIGTERM, as systemd does) and starts it again; its
        containers keep running under containerd meanwhile."""
        state = NodeState.load(self.layout.state)
        if state is None or not state.ready:
            raise NodeError(f"node {self.name} is not up: run `make node-up` first")
        stop_pid(state.pids["kubelet"], state.cmdlines.get("kubelet", ""))
        self._start_kubelet(state, self.cluster.kube(), NodePorts.from_env())

    # -- internals -----------------------------------------------------------
    def _check_apiserver(self) -> None:
        """A control plane started before real-node support cannot reach the kubelet."""
        state = self.cluster.require_state()
        pid = state.pids.get("kube-apiserver", 0)
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"--kubelet-preferred-address-types=InternalIP" not in cmdline:
                raise NodeError(
                    "the running API server would look the kubelet up by node name "
                    "(it predates --kubelet-preferred-address-types): restart the "
                    "control plane with `make cluster-down cluster-up`"
                )

    def _kube_or_none(self) -> Kube | None:
        with contextlib.suppress(Exception):
            kube = self.cluster.kube()
            kube.request("GET", "/readyz")
            return kube
        return None

    def _healthy(self, state: NodeState) -> bool:
        if not state.pids or not all(
            alive(p, state.cmdlines.get(n, "")) for n, p in state.pids.items()
        ):
            return False
        kube = self._kube_or_none()
        return kube is not None and _node_ready(kube, self.name)

    def _spawn(
        self,
        state: NodeState,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        hint: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """Started in its own session, logging to `logs/<name>.log`, and recorded with
        `hint` (default argv[0]), the part of its command line that tells it apart."""
        proc = spawn_logged(argv, self.layout.logs / f"{name}.log", self.layout.root, env)
        state.pids[name] = proc.pid
        state.cmdlines[name] = hint or argv[0]
        state.save(self.layout.state)
        return proc

    def _wait(self, name: str, proc: subprocess.Popen[bytes], probe: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise NodeError(f"{name} exited with code {proc.returncode}: {self._tail(name)}")
            with contextlib.suppress(Exception):
                if probe():
                    return
            time.sleep(0.2)
        raise NodeError(
            f"{name} did not become ready in {timeout:.0f}s: {self._tail(name)} "
            f"(full log: {self.layout.logs / (name + '.log')})"
        )

    def _tail(self, name: str) -> str:
        text = (self.layout.logs / f"{name}.log").read_text(errors="replace")
        errors = [ln for ln in text.splitlines() if " E" in ln[:6] or "level=error" in ln]
        return " | ".join((errors or text.strip().splitlines())[-3:])

    def ctr(self, ctr_bin: Path, *args: str) -> str:
        """`ctr` on this node's containerd in the kubelet's namespace (image imports)."""
        proc = subprocess.run(
            [
                str(ctr_bin / "ctr"),
                "--address",
                str(self.layout.containerd_sock),
                "-n",
                "k8s.io",
                *args,
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        if proc.returncode != 0:
            raise NodeError(f"ctr {' '.join(args[:2])} failed: {proc.stderr.strip()}")
        return proc.stdout

    def _shim_socket_dir(self) -> str:
        """Under the node dir when short enough, else containerd's default (/run)."""
        d = self.layout.root / "s"
        return str(d) if len(str(d)) <= MAX_SHIM_SOCKET_DIR else ""

    def _start_containerd(self, state: NodeState, ctr_bin: Path) -> None:
        lay = self.layout
        cni_bins = [d for d in CNI_BIN_DIRS if Path(d, "ptp").exists()]
        if not cni_bins:
            raise NodeError(
                "CNI plugins (ptp, host-local, loopback) not found in /usr/lib/cni or "
                "/opt/cni/bin: apt-get install containernetworking-plugins"
            )
        cni = {
            "cniVersion": "1.0.0",
            "name": _cni_network(state),
            "plugins": [
                {
                    "type": "ptp",
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": _pod_cidr(state)}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(lay.root / "cni" / "ipam"),
                    },
                }
            ],
        }
        (lay.cni_conf / "10-gpudra.conflist").write_text(json.dumps(cni, indent=2))
        shim_dir = self._shim_socket_dir()
        q = json.dumps  # TOML basic strings accept JSON string escapes
        toml = f"""version = 3
root = {q(str(lay.root / "ctd"))}
state = {q(str(lay.root / "run"))}
imports = []

[grpc]
  address = {q(str(lay.containerd_sock))}

[ttrpc]
  address = {q(str(lay.containerd_sock) + ".ttrpc")}

[plugins."io.containerd.cri.v1.images"]
  snapshotter = {q(state.snapshotter)}
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = {q(images.PAUSE_IMAGE)}

[plugins."io.containerd.cri.v1.runtime"]
  cdi_spec_dirs = [{q(str(lay.cdi))}]
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = {str(not has_capability(CAP_SYS_RESOURCE)).lower()}
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = {json.dumps(cni_bins)}
    conf_dir = {q(str(lay.cni_conf))}
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
      Root = {q(str(lay.root / "runc"))}
      SystemdCgroup = false

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.internal.v1.opt"]
  path = {q(str(lay.root / "opt"))}

[plugins."io.containerd.image-verifier.v1.bindir"]
  bin_dir = {q(str(lay.root / "opt" / "image-verifier"))}

[plugins."io.containerd.shim.v1.manager"]
  socket_dir = {q(shim_dir)}
"""
        config = lay.root / "containerd.toml"
        config.write_text(toml)
        if shim_dir:
            Path(shim_dir).mkdir(mode=0o700, exist_ok=True)
        # containerd finds containerd-shim-runc-v2 (next to it) and runc on PATH.
        env = {**os.environ, "PATH": f"{ctr_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        proc = self._spawn(
            state, "containerd", [str(ctr_bin / "containerd"), "--config", str(config)], env
        )
        self._wait(
            "containerd",
            proc,
            lambda: lay.containerd_sock.exists() and self.ctr(ctr_bin, "version"),
            timeout=60,
        )

    def _start_kubelet(self, state: NodeState, kube: Kube, ports: NodePorts) -> None:
        lay, name = self.layout, self.name
        cl = self.cluster.layout
        cluster_state = self.cluster.require_state()
        kubelet = Path(cluster_state.bin_dir) / "kubelet"
        ip = node_ip()
        ca = pki.load_ca(cl.pki)
        (lay.pki / "ca.crt").write_bytes((cl.pki / "ca.crt").read_bytes())
        pki.issue(lay.pki, "client", ca, f"system:node:{name}", org="system:nodes")
        pki.issue(
            lay.pki,
            "serving",
            ca,
            f"system:node:{name}",
            org="system:nodes",
            server=True,
            dns=(name, "localhost"),
            ips=(ip, "127.0.0.1"),
        )
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "node",
            "clusters": [
                {
                    "name": "gpudra",
                    "cluster": {
                        "server": f"https://127.0.0.1:{cluster_state.ports['apiserver']}",
                        "certificate-authority": str(lay.pki / "ca.crt"),
                    },
                }
            ],
            "users": [
                {
                    "name": name,
                    "user": {
                        "client-certificate": str(lay.pki / "client.crt"),
                        "client-key": str(lay.pki / "client.key"),
                    },
                }
            ],
            "contexts": [{"name": "node", "context": {"cluster": "gpudra", "user": name}}],
        }
        (lay.root / "kubelet.kubeconfig").write_text(json.dumps(kubeconfig, indent=2))
        # Logs and exec go API server -> kubelet; the kubelet asks the API server
        # (Webhook authorization) whether that client may, so grant it.
        kube.request(
            "PATCH",
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/gpudra:apiserver-kubelet",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": "gpudra:apiserver-kubelet"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "system:kubelet-api-admin",
                },
                "subjects": [
                    {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "User",
                        "name": "kube-apiserver-kubelet-client",
                    }
                ],
            },
            content_type="application/apply-patch+yaml",
            query={"fieldManager": "gpudra-realnode", "force": "true"},
        )
        known = known_gates(kubelet)
        config: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": ip,
            "port": ports.kubelet,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": ports.healthz,
            "tlsCertFile": str(lay.pki / "serving.crt"),
            "tlsPrivateKeyFile": str(lay.pki / "serving.key"),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(lay.pki / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{lay.containerd_sock}",
            "imageServiceEndpoint": f"unix://{lay.containerd_sock}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": state.cgroup_root,
            "failSwapOn": False,
            "podLogsDir": str(lay.root / "pod-logs"),
            "resolvConf": "/etc/resolv.conf",
            # A shared development disk is often past the defaults: a node that
            # evicts pods or deletes the imported (unpullable) images is useless here.
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            # The kubelet retries a failed prepare only at its next sync of the pod
            # (SyncPod records the event and returns without an error, so the pod
            # worker's 10 s error backoff does not apply): 60 to 90 s with the default
            # of 1m. The tests that fail a prepare and then see it recover (the agent
            # killed mid-prepare, the API server out of reach) waited that long each;
            # 10s keeps the kubelet's own retry path and makes it 10 to 15 s.
            "syncFrequency": "10s",
            "featureGates": {g: True for g in WANTED_GATES if known.get(g) in ("ALPHA", "BETA")},
        }
        if _cgroup_v1():
            config["failCgroupV1"] = False
        cfg_path = lay.root / "kubelet.yaml"
        cfg_path.write_text(json.dumps(config, indent=2))
        proc = self._spawn(
            state,
            "kubelet",
            [
                str(kubelet),
                f"--config={cfg_path}",
                f"--kubeconfig={lay.root / 'kubelet.kubeconfig'}",
                f"--root-dir={lay.kubelet_root}",
                f"--cert-dir={lay.pki}",
                f"--hostname-override={name}",
                f"--node-ip={ip}",
                "--node-labels=gpudra.dev/real-node=true",
                "--v=2",
            ],
        )
        self._wait("kubelet", proc, lambda: _node_ready(kube, name), timeout=120)

    def _drain(self, kube: Kube, state: NodeState) -> None:
        """Let the kubelet stop pods itself (CNI DEL, volume unmounts) while it runs."""
        if not alive(state.pids["kubelet"], state.cmdlines.get("kubelet", "")):
            return
        with contextlib.suppress(ApiError, OSError):
            for pod in _pods_on(kube, self.name):
                meta = pod["metadata"]
                kube.delete("Pod", meta["name"], meta["namespace"], grace=1)
            with contextlib.suppress(TimeoutError):
                wait_for(
                    f"pods on {self.name} to stop",
                    lambda: not _pods_on(kube, self.name),
                    timeout=30,
                )

    def _forget(self, kube: Kube, state: NodeState) -> None:
        with contextlib.suppress(ApiError, OSError):
            for pod in _pods_on(kube, self.name):
                meta = pod["metadata"]
                kube.delete("Pod", meta["name"], meta["namespace"], grace=0)
            for o in kube.list("ResourceSlice", fieldSelector=f"spec.nodeName={self.name}"):
                kube.delete("ResourceSlice", o["metadata"]["name"])
            if "gpudra-webhook" in state.pids:
                # A registration whose server is gone would fail every GPU pod.
                for kind, name in WEBHOOK_CONFIGURATIONS:
                    kube.delete(kind, name)
            kube.delete("Node", self.name)
            kube.delete("Lease", self.name, "kube-node-lease")

    def _clean_host_paths(self, state: NodeState) -> None:
        """What a forced stop leaves in hard-coded host paths (a graceful pod deletion
        removes it itself): our log links and CNI results, then the dirs we created."""
        prefix = str(self.layout.root) + "/"
        if LOG_CONTAINERS.is_dir():
            for link in LOG_CONTAINERS.iterdir():
                with contextlib.suppress(OSError):
                    if link.is_symlink() and str(link.readlink()).startswith(prefix):
                        link.unlink()
        if CNI_RESULTS.is_dir():
            net = _cni_network(state)
            ours = {f.name.split("-")[-2] for f in CNI_RESULTS.glob(f"{net}-*")}
            for f in CNI_RESULTS.iterdir():
                parts = f.name.split("-")
                if f.name.startswith(f"{net}-") or (
                    f.name.startswith("cni-loopback-") and parts[-2] in ours
                ):
                    f.unlink(missing_ok=True)
        if str(DEVICE_PLUGINS) in state.created_host_dirs:
            (DEVICE_PLUGINS / "kubelet.sock").unlink(missing_ok=True)
        for d in state.created_host_dirs:
            with contextlib.suppress(OSError):
                Path(d).rmdir()


def has_capability(bit: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def node_ip() -> str:
    """The address other hosts would see: the source of the default route."""
    if ip := os.environ.get("GPUDRA_NODE_IP"):
        return ip
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # UDP connect sends nothing; it picks a route
            ip = str(s.getsockname()[0])
        except OSError:
            ip = ""
    if not ip or ip.startswith("127."):
        raise NodeError(
            "no non-loopback IPv4 address (the kubelet refuses a loopback node IP): "
            "set GPUDRA_NODE_IP to an address of this host"
        )
    return ip


def _cgroup_v1() -> bool:
    return not (CGROUP_FS / "cgroup.controllers").exists()


def _cni_network(state: NodeState) -> str:
    """Unique per node dir: CNI caches results in /var/lib/cni under this name."""
    return state.cgroup_root.strip("/")


def _pod_cidr(state: NodeState) -> str:
    """ptp routes each pod IP on the host: nodes of different cluster dirs get
    different /24s so they do not hand out the same address."""
    third = int(hashlib.sha256(state.cgroup_root.encode()).hexdigest()[:2], 16)
    return os.environ.get("GPUDRA_NODE_POD_CIDR", f"10.244.{third}.0/24")


def _pods_on(kube: Kube, node: str) -> list[Any]:
    return kube.list("Pod", fieldSelector=f"spec.nodeName={node}")


def _node_ready(kube: Kube, name: str) -> bool:
    node = kube.get_or_none("Node", name)
    conds = ((node or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
