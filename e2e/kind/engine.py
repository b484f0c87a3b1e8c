"""A private Docker engine for kind on a machine that has none.

kind runs its nodes as Docker containers. Where no engine runs (the machines this suite
usually runs on), this module starts Debian's `dockerd` (package `docker.io`, installed
when missing) so that it changes nothing the host keeps:

- its own data root (images, the node image among them: kept between runs) and exec
  root under the cache folder, and its own socket there; every docker and kind call gets
  `DOCKER_HOST` from `Engine.env()`;
- a private mount namespace with a tmpfs on /run, so its overlay mounts and its
  containerd's shim sockets (under /run/containerd) never appear on the host and go away
  with the engine;
- no firewall rules, masquerading, IP forwarding or default bridge
  (`--iptables=false --ip-masq=false --ip-forward=false --bridge=none`): kind's nodes
  reach each other on kind's own network bridge and the host on its gateway address;
- containers under one cgroup parent, so `stop` finds and kills every process left;
- `e2e/kind/capfilter.py` as the default runtime: runc after dropping the capabilities
  the machine's bounding set lacks, without which privileged kind nodes cannot start
  in a sandbox that withholds some from root.

`stop` removes the containers and networks, stops dockerd, kills what is left in the
cgroup parent, removes the bridges and cgroups and any host folder the engine created.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from e2e.cache import cache_root
from e2e.node.realnode import (
    SYSCTLS,
    _restore_sysctls,
    cgroup_mounts,
    kill_cgroups,
    remove_cgroups,
)
from e2e.processes import alive, spawn_logged, stop_pid
from e2e.progress import step

REPO = Path(__file__).resolve().parents[2]
APT_INSTALL = REPO / "e2e" / "tools" / "apt-install.sh"
CAPFILTER = Path(__file__).resolve().parent / "capfilter.py"
PACKAGE = "docker.io"
RUNTIME = "gpudra-capfilter"
# Global sysctls a kind node can write through its privileged /proc/sys: the kubelet's
# kernel tunables (the real node's list) and what systemd-sysctl would set, were it not
# masked in our node image (kind's official image runs it). `stop` puts them back.
HOST_SYSCTLS = (
    *SYSCTLS,
    "fs/protected_fifos",
    "fs/protected_hardlinks",
    "fs/protected_regular",
    "fs/protected_symlinks",
)
# Folders `docker run -v` creates on the host when a bind source is missing; kind binds
# /lib/modules, which a container host may lack.
HOST_BIND_SOURCES = (Path("/lib/modules"),)
START_TIMEOUT = 60.0


class EngineError(Exception):
    """A one-line reason the engine could not be started, with the fix."""


@dataclass(frozen=True)
class EngineLayout:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def exec_root(self) -> Path:
        return self.root / "exec"

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def pidfile(self) -> Path:
        return self.root / "dockerd.pid"

    @property
    def log(self) -> Path:
        return self.root / "dockerd.log"

    @property
    def config(self) -> Path:
        return self.root / "daemon.json"

    @property
    def runtime(self) -> Path:
        return self.root / "runtime"

    @property
    def cgroup_parent(self) -> str:
        """The cgroup of every container, named by the root: `stop` kills what is in it,
        and must never reach another engine's containers."""
        return f"gpudra-kind-{hashlib.sha256(str(self.root).encode()).hexdigest()[:8]}"

    @property
    def sysctls(self) -> Path:
        """The host's global sysctls before the engine started, restored by `stop`."""
        return self.root / "sysctls.json"

    @property
    def created(self) -> Path:
        """Host folders the engine created (bind sources), removed by `stop`."""
        return self.root / "created.json"


def default_layout() -> EngineLayout:
    return EngineLayout(cache_root() / "kind-engine")


def daemon_config(layout: EngineLayout) -> dict[str, object]:
    """dockerd's config file: the capability filter as the default runtime, and one
    cgroup parent for every container."""
    return {
        "runtimes": {RUNTIME: {"path": str(layout.runtime)}},
        "default-runtime": RUNTIME,
        "cgroup-parent": f"/{layout.cgroup_parent}",
        "exec-opts": ["native.cgroupdriver=cgroupfs"],
        "log-driver": "json-file",
        "log-opts": {"max-size": "10m", "max-file": "2"},
    }


def dockerd_argv(layout: EngineLayout, dockerd: str) -> list[str]:
    """dockerd in a private mount namespace with its own /run (see the module doc)."""
    return [
        "unshare", "--mount", "--propagation", "private",
        "sh", "-c", 'mount -t tmpfs -o mode=0755 gpudra-kind-run /run && exec "$@"', "sh",
        dockerd,
        "--config-file", str(layout.config),
        "--data-root", str(layout.data),
        "--exec-root", str(layout.exec_root),
        "--pidfile", str(layout.pidfile),
        "--host", f"unix://{layout.socket}",
        "--iptables=false", "--ip-masq=false", "--ip-forward=false", "--bridge=none",
    ]  # fmt: skip


def runtime_script(python: str) -> str:
    """The runtime file dockerd execs: capfilter.py under the system Python."""
    return f"#!{python}\n" + CAPFILTER.read_text()


class Docker:
    """The docker CLI against one engine: `env()` is the environment every docker and
    kind call gets (DOCKER_HOST among it)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._environment = env

    def env(self) -> dict[str, str]:
        return dict(self._environment if self._environment is not None else os.environ)

    def docker(
        self, *args: str, stdin: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """A docker CLI call against this engine; never raises on failure."""
        return subprocess.run(
            ["docker", *args],
            env=self.env(),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


class Engine(Docker):
    """The private engine (see the module doc)."""

    def __init__(self, layout: EngineLayout | None = None) -> None:
        super().__init__()
        self.layout = layout or default_layout()

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.layout.socket}"}

    def _pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.layout.pidfile.read_text().strip())
            if alive(pid, str(self.layout.exec_root)):
                return pid
        return None

    def responds(self) -> bool:
        if not self.layout.socket.exists() or shutil.which("docker") is None:
            return False
        with contextlib.suppress(subprocess.TimeoutExpired):
            version = self.docker("version", "--format", "{{.Server.Version}}", timeout=10)
            return version.returncode == 0
        return False

    def is_running(self) -> bool:
        return self._pid() is not None and self.responds()

    # -- start ---------------------------------------------------------------------------

    def start(self, log: Callable[[str], None] = print) -> None:
        """Starts the engine unless it runs; a failed start leaves nothing running."""
        if self.is_running():
            return
        self.stop(log=lambda _m: None)  # what a crashed engine left
        problem = start_problem()
        if problem:
            raise EngineError(problem)
        dockerd = ensure_dockerd()
        layout = self.layout
        for d in (layout.root, layout.data, layout.exec_root):
            d.mkdir(parents=True, exist_ok=True)
        layout.config.write_text(json.dumps(daemon_config(layout), indent=2) + "\n")
        layout.runtime.write_text(runtime_script(system_python()))
        layout.runtime.chmod(0o755)
        self._create_bind_sources()
        if not layout.sysctls.exists():
            layout.sysctls.write_text(json.dumps(read_sysctls()))
        layout.socket.unlink(missing_ok=True)
        layout.pidfile.unlink(missing_ok=True)
        log(f"kind: starting a private Docker engine ({layout.socket})")
        proc = spawn_logged(dockerd_argv(layout, dockerd), layout.log, layout.root, None)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if self.responds():
                return
            time.sleep(0.3)
        tail = self._log_tail()
        self.stop(log=lambda _m: None)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        raise EngineError(
            f"the private Docker engine did not start ({tail}); see {layout.log}, "
            "or run kind against an engine of your own with DOCKER_HOST set"
        )

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = self.layout.log.read_text(errors="replace").strip().splitlines()
            errors = [ln for ln in lines if "level=error" in ln or "failed to start" in ln]
            return (errors or lines or ["no output"])[-1][-300:]
        return "no log"

    def _create_bind_sources(self) -> None:
        """Creates the bind sources the host lacks now and records them, so that `stop`
        removes exactly those (dockerd would create them itself and nobody would)."""
        created = [str(p) for p in HOST_BIND_SOURCES if not p.exists()]
        for p in created:
            Path(p).mkdir(parents=True)
        known = self._created()
        self.layout.created.write_text(json.dumps(sorted({*known, *created})))

    def _created(self) -> list[str]:
        with contextlib.suppress(OSError, ValueError):
            return [str(p) for p in json.loads(self.layout.created.read_text())]
        return []

    # -- stop ----------------------------------------------------------------------------

    def stop(self, log: Callable[[str], None] = print) -> None:
        """Stops everything `start` started; idempotent, and safe after a crash."""
        bridges: set[str] = set()
        if self.responds():
            bridges = self._remove_containers_and_networks()
        pid = self._pid()
        if pid is not None:
            stop_pid(pid, str(self.layout.exec_root), timeout=20)
        for pid in self._leftover_pids():
            stop_pid(pid, str(self.layout.root), timeout=5)
        kill_cgroup(self.layout.cgroup_parent)
        for bridge in bridges:
            subprocess.run(["ip", "link", "delete", bridge], capture_output=True, check=False)
        for d in self._created():
            with contextlib.suppress(OSError):
                Path(d).rmdir()
        self.layout.created.unlink(missing_ok=True)
        with contextlib.suppress(OSError, ValueError):
            _restore_sysctls(json.loads(self.layout.sysctls.read_text()))
        self.layout.sysctls.unlink(missing_ok=True)
        self.layout.socket.unlink(missing_ok=True)
        self.layout.pidfile.unlink(missing_ok=True)
        if pid is not None:
            log("kind: stopped the private Docker engine")

    def _remove_containers_and_networks(self) -> set[str]:
        """Removes every container and user network; returns the networks' bridge names
        (`br-<id>`), which a killed engine would leave on the host."""
        ids = self.docker("ps", "-aq").stdout.split()
        if ids:
            self.docker("rm", "-f", "-v", *ids, timeout=300)
        nets = self.docker("network", "ls", "--filter", "type=custom", "-q", "--no-trunc")
        net_ids = nets.stdout.split()
        if net_ids:
            self.docker("network", "rm", *net_ids)
        return {f"br-{n[:12]}" for n in net_ids if Path(f"/sys/class/net/br-{n[:12]}").exists()}

    def _leftover_pids(self) -> list[int]:
        """Processes that name the engine's folder (its containerd, shims, proxies)."""
        needle = str(self.layout.root).encode()
        out = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    if needle in (proc / "cmdline").read_bytes():
                        out.append(int(proc.name))
        return [p for p in out if p != os.getpid()]


def read_sysctls() -> dict[str, str]:
    """The host's values of HOST_SYSCTLS."""
    values = {}
    for key in HOST_SYSCTLS:
        with contextlib.suppress(OSError):
            values[key] = (Path("/proc/sys") / key).read_text().strip()
    return values


def kill_cgroup(name: str, timeout: float = 10.0) -> None:
    """Kills every process under cgroup `name` in each hierarchy, then removes the
    cgroups, deepest first."""
    dirs = [mp / name for mp in cgroup_mounts() if (mp / name).is_dir()]
    kill_cgroups(dirs, timeout)
    remove_cgroups(dirs)


def start_problem() -> str | None:
    """Why no private engine can start here, or None (cheap, changes nothing)."""
    if sys.platform != "linux":
        return "the private Docker engine needs Linux: start Docker yourself and set DOCKER_HOST"
    if os.geteuid() != 0:
        return (
            "starting a private Docker engine needs root (mounts, cgroups, network "
            "bridges): run make e2e-kind as root, or set DOCKER_HOST to an engine of yours"
        )
    if not cgroup_mounts():
        return "no cgroup filesystem is mounted under /sys/fs/cgroup: mount cgroups first"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return (
            f"cannot create a mount namespace ({probe.stderr.strip() or 'unshare failed'}): "
            "run in a VM or a privileged container"
        )
    return None


def ensure_dockerd() -> str:
    """dockerd's path; installs Debian's docker.io when it is missing."""
    found = shutil.which("dockerd")
    if found:
        return found
    why = "kind's nodes are Docker containers and no engine runs here"
    with services_not_started():
        installed = subprocess.run(["bash", str(APT_INSTALL), why, PACKAGE], check=False)
    if installed.returncode != 0:
        raise EngineError(
            f"dockerd is missing and {PACKAGE} could not be installed: apt-get install "
            f"{PACKAGE}, or set DOCKER_HOST to a running Docker engine"
        )
    found = shutil.which("dockerd")
    if not found:
        raise EngineError(f"{PACKAGE} is installed but dockerd is not on PATH: add /usr/sbin")
    return found


@contextlib.contextmanager
def services_not_started() -> Iterator[None]:
    """A policy-rc.d that forbids starting services while a package installs, unless
    one exists: docker.io's install would start the host's dockerd, with its firewall
    rules and bridge, which is what the private engine avoids."""
    policy = Path("/usr/sbin/policy-rc.d")
    if policy.exists():
        yield
        return
    policy.write_text("#!/bin/sh\n# gpudra e2e/kind/engine.py, while installing\nexit 101\n")
    policy.chmod(0o755)
    try:
        yield
    finally:
        policy.unlink(missing_ok=True)


def system_python() -> str:
    """The interpreter behind this venv (stdlib only is what the runtime needs)."""
    return os.path.realpath(sys.executable)


def engine_step(engine: Engine, log: Callable[[str], None] = print) -> None:
    """`Engine.start` with a progress line when it really starts one."""
    if engine.is_running():
        return
    with step("starting the private Docker engine", "kind runs its nodes in it", "seconds"):
        engine.start(log=log)
