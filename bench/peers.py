"""The Go reference DRA driver, run beside gpudra so that benchmarks compare like with like.

`sigs.k8s.io/dra-example-driver` (pinned in e2e/tools/versions.env, built from the Go
module proxy by build-dra-example.sh and cached) is the reference implementation on the
upstream kubelet plugin helper. Its kubelet plugin publishes its own devices
(`gpu.example.com`) and prepares claims with CDI specs and a checkpoint, so it does the
same kind of node work as gpudra's agent. It is measured, never modified: only its
command-line flags are set (its client QPS limits raised so that they do not throttle
it, its CDI root and plugin folders placed where gpudra's are).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from e2e.cluster.harness import REPO
from e2e.pins import TOOL_VERSIONS, pinned
from e2e.processes import spawn_logged, stop_pid
from e2e.progress import BuildFailed, build_script

BUILD_SCRIPT = REPO / "e2e" / "tools" / "build-dra-example.sh"
PEER_DRIVER = "gpu.example.com"
PEER_NAME = "dra-example-driver"

# What differs between the two plugins' work per cycle, recorded beside the numbers so
# that a reader can weigh them (read from the peer's source at the pinned version).
PEER_DIFFERENCES = (
    "the upstream helper serialises prepare and unprepare calls; gpudra runs claims "
    "on different devices concurrently",
    "the peer reads its whole checkpoint file and writes it anew (a temporary file, "
    "fsync, rename) once per prepare and once per unprepare, under the helper's lock; "
    "gpudra records the plan before any side effect and the result after, through a "
    "group commit that claims in flight share, and appends a prepare's end and a "
    "removal to a changes file without an fsync (a power loss may take them; a "
    "restarted agent reads them)",
    "the peer's CDI spec per claim holds a few environment variables; gpudra's holds "
    "the device nodes, driver mounts and hooks a real GPU container needs",
    "the peer has no device layer (no NVML, no sharing, no MIG); gpudra's emulated "
    "NVML is called as on a real node",
)


def version() -> str:
    """The pinned release, read from the one place that pins it."""
    return pinned("DRA_EXAMPLE_DRIVER_VERSION", TOOL_VERSIONS)


def bin_dir() -> Path | None:
    """The cached folder with the peer's binaries, built on first use; None (and why,
    on stderr) where it cannot be built, so that the benchmark still measures gpudra."""
    try:
        return build_script(BUILD_SCRIPT, prefix="build-dra-example", what="building the peer")
    except BuildFailed as e:
        print(f"bench: no peer measured: {e}", file=sys.stderr)
        return None


@dataclass(frozen=True)
class PeerPlugin:
    """A running peer kubelet plugin: its PID (for the CPU meter) and its DRA socket."""

    pid: int
    socket: Path


@contextlib.contextmanager
def kubelet_plugin(
    bins: Path,
    root: Path,
    cdi_root: Path,
    kubeconfig: Path,
    node: str,
    devices: int,
    timeout_s: float = 60.0,
) -> Iterator[PeerPlugin]:
    """Runs the peer's kubelet plugin for `node` until the block ends.

    Its plugin and registration folders live under `root` (as gpudra's do under its
    kubelet root), its checkpoint in its plugin folder on the same disk, its CDI specs
    under `cdi_root` (the same tmpfs as gpudra's)."""
    plugins, registry = root / "plugins", root / "plugins_registry"
    for folder in (plugins, registry, cdi_root):
        folder.mkdir(parents=True, exist_ok=True)
    argv = [
        str(bins / "dra-example-kubeletplugin"),
        f"--node-name={node}",
        f"--kubeconfig={kubeconfig}",
        f"--cdi-root={cdi_root}",
        f"--kubelet-plugins-directory-path={plugins}",
        f"--kubelet-registrar-directory-path={registry}",
        f"--num-devices={devices}",
        "--kube-api-qps=100000",
        "--kube-api-burst=100000",
    ]
    proc = spawn_logged(argv, root / "peer.log", root, dict(os.environ))
    socket = plugins / PEER_DRIVER / "dra.sock"
    try:
        deadline = time.monotonic() + timeout_s
        while not socket.is_socket():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (root / "peer.log").read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(
                    f"{PEER_NAME} kubelet plugin did not serve {socket}: " + " | ".join(tail)
                )
            time.sleep(0.1)
        yield PeerPlugin(proc.pid, socket)
    finally:
        stop_pid(proc.pid, "dra-example", timeout=15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
