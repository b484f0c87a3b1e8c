"""Sharing a GPU between the containers of one claim: time-slicing and MPS.

Neither goes through NVML: NVML has no call for the time-slice length, and MPS is a
daemon, not an API. So, like the upstream NVIDIA DRA driver, the backend runs
NVIDIA's own tools:

- time-slicing: `nvidia-smi compute-policy -i <uuid> --set-timeslice <0-3>`
  (Default/Short/Medium/Long), reset to 0 when the claim is unprepared. The compute
  mode it needs (DEFAULT) is the caller's, through NVML, which records and restores
  the mode it replaces. `compute-policy` needs an Ampere or newer GPU and a recent
  driver; on older GPUs (Turing and before) nvidia-smi refuses it, and the error
  says so rather than leaving the GPU silently unchanged.
- MPS: one control daemon per claim, `nvidia-cuda-mps-control` with its own
  `CUDA_MPS_PIPE_DIRECTORY`/`CUDA_MPS_LOG_DIRECTORY` and its own /dev/shm (a
  tmpfs per claim, as upstream mounts one), so claims never share a daemon nor
  shared memory with each other or the host; the pipe and log folders, which the
  claim's containers fill at will (the log through the daemon), are small tmpfs
  mounts too, off the disk the checkpoint is on; defaults
  (`set_default_active_thread_percentage`, `set_default_device_pinned_mem_limit`)
  are sent through its control pipe, and `quit` stops it.

Where the daemon runs is the caller's choice. Given `DaemonPods`, each daemon runs
in a pod of its own on this node (`nvidia-cuda-mps-control -f`, as upstream runs it),
so it outlives the agent's container: a new agent (an upgrade, a crash) takes over
claims whose clients still talk to it. Of the agent's folders the pod gets only its
claim's (pipe, log, /dev/shm): the claim's containers talk to the daemon, so a flaw in
it that they could drive reaches no other claim's folders nor the checkpoint. Without
`DaemonPods`, it is a child of this process (`-d`), which is what an agent run as a
host process (tests, demos) wants, and what dies with a containerised agent.

The pipe folder is mounted writable into the claim's containers, so nothing in it
is trusted at stop: the daemon is the process or pod `start_mps` returned (PID and
start time, or pod name and UID, which the caller records), a control file that is not
a FIFO or socket means no daemon listens, and a daemon that does not quit is signalled
or its pod deleted, never another process or pod. Nor does anything there decide
whether `quit` is sent, and so whether the stop waits for the daemon to quit: it goes
only to a control file the daemon holds itself, as the kernel shows it (its process's
descriptors; for a pod, whose processes this agent does not see, the file noted at its
start), never to one a container put there and reads (`NvidiaSharing._quit`); a
daemon not asked is signalled, or its pod deleted, at once.

Every call blocks (it runs a process) and is meant for a worker thread. Nothing here
knows about claims beyond the names it is given, nor about Kubernetes (`DaemonPods`
is the caller's) or gRPC.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final, Protocol

from gpudra.common.files import remove_tree
from gpudra.driver.driverroot import DRIVER_TOOL_DIRS, DriverRoot
from gpudra.driver.processes import ProcessIdentity
from inotify_simple import INotify
from inotify_simple import flags as iflags

__all__ = [
    "MPS_CONTROL",
    "MPS_SERVER",
    "NVIDIA_SMI",
    "DaemonPod",
    "DaemonPods",
    "MpsDaemon",
    "NvidiaSharing",
    "SharingBackend",
    "SharingError",
    "find_tool",
    "may_mount",
    "may_remove_anything",
    "server_path",
]

log = logging.getLogger(__name__)

NVIDIA_SMI: Final = "nvidia-smi"
MPS_CONTROL: Final = "nvidia-cuda-mps-control"
# The control daemon starts its server by name, with `execlp` (a PATH search): the
# symbol NVIDIA's control daemon imports, and the only name of the server it holds.
MPS_SERVER: Final = "nvidia-cuda-mps-server"
# nvidia-smi compute-policy --set-timeslice takes 0 (Default) to 3 (Long).
MAX_TIME_SLICE: Final = 3
_MIB: Final = 1024 * 1024
# The control daemon creates this named pipe in its pipe directory once it listens.
_CONTROL_PIPE: Final = "control"
_PID_FILE: Final = "nvidia-cuda-mps-control.pid"
_PID_FILE_BYTES: Final = 32
"""More than any PID and its line end take: a PID file is read no further."""
_OUTPUT_TAIL: Final = 500
# The claim's /dev/shm, mounted as the host's usually is; tmpfs's default size is
# half the memory, as upstream sets it.
_SHM_OPTIONS: Final = "rw,nosuid,nodev,noexec,mode=1777"
# The claim's pipe folder: its containers write there, so it is a tmpfs of its own,
# never a folder on the node's disk, where they could fill the file system the
# checkpoint is written to and fail every other claim's prepare. The daemon keeps a
# few pipes and its PID file in it; what a container writes beyond that is bounded
# here and charged to the memory of the container that writes it.
# `nosymfollow` (Linux 5.10+): no path through it follows a symbolic link, so a link a
# container plants there cannot send the agent's `quit` (run as root, in the agent's
# view of the node) to a file or socket elsewhere (`_quit`).
_PIPE_OPTIONS: Final = "rw,nosuid,nodev,noexec,nosymfollow,size=4m,nr_inodes=4096,mode=0755"
_NOSYMFOLLOW_OPTION: Final = ",nosymfollow"
_ST_NOSYMFOLLOW: Final = 0x2000
"""statvfs's flag of a mount with `nosymfollow` (Linux's ST_NOSYMFOLLOW)."""
# The daemon's log folder: the daemon appends to control.log every command a client
# sends it, and the claim's containers hold a client (the tool is mounted into them),
# so a tenant can grow the log at will. A tmpfs of its own too, for the same reason:
# a full log fails the daemon's own writes, never the checkpoint's. The daemon keeps
# two files there (control.log, server.log).
_LOG_OPTIONS: Final = "rw,nosuid,nodev,noexec,size=16m,nr_inodes=64,mode=0755"
_CONTROL_READER_TRIES: Final = 10
"""Looks, 0.1 s apart, for the daemon at its control file (holding it; for a FIFO,
reading it) before `quit`: a daemon may be between two opens of a FIFO."""
_SWAP_LOOK_S: Final = 0.02
"""How often the pipe folder's watch is read while NVIDIA's client sends `quit`."""
_PIPE_ENV: Final = "CUDA_MPS_PIPE_DIRECTORY"
# sock_diag(7) for UNIX sockets: which socket (its inode in sockfs, the name the
# socket's descriptors show in /proc/<pid>/fd) is bound to a file (dev, ino).
_NETLINK_SOCK_DIAG: Final = 4
_SOCK_DIAG_BY_FAMILY: Final = 20
_NLMSG_ERROR: Final = 2
_NLMSG_DONE: Final = 3
_NLM_F_REQUEST_DUMP: Final = 0x1 | 0x300
_UDIAG_SHOW_VFS: Final = 0x2
_UNIX_DIAG_VFS: Final = 1
_NLMSG_HEADER: Final = struct.Struct("=IHHII")
_UNIX_DIAG_REQ: Final = struct.Struct("=BBHIIIII")
_UNIX_DIAG_MSG: Final = struct.Struct("=BBBBIII")
_RTATTR: Final = struct.Struct("=HH")
_UNIX_DIAG_VFS_ATTR: Final = struct.Struct("=II")
_KERNEL_MINOR_BITS: Final = 20
"""A kernel dev_t (what sock_diag reports) is MAJOR << 20 | MINOR."""
# Bits in /proc/self/status CapEff. Mount and unshare need CAP_SYS_ADMIN; removing a
# folder's contents whoever made them, CAP_DAC_OVERRIDE (a folder without write
# permission) and CAP_FOWNER (another user's file in a sticky folder).
_CAP_DAC_OVERRIDE: Final = 1
_CAP_FOWNER: Final = 3
_CAP_SYS_ADMIN: Final = 21
# A daemon pod's command, the tool's path as $0 and its options after it: the daemon
# in the foreground, ended with the pod (TERM) or once its pipe folder is removed, both
# a normal end (exit 0: the pod Succeeded); otherwise the pod ends as the daemon does.
# An older release that knows nothing of daemon pods quits the daemon through its
# control pipe and removes the claim's folders at unprepare. The pod mounts the pipe
# folder itself, so a folder removed on the host may stay in the pod's view (a plain
# folder, deleted, or the tmpfs, lazily unmounted); the daemon's control pipe missing
# once the daemon has had the time to make it (five rounds, about ten seconds) ends the
# pod too.
_POD_SCRIPT: Final = (
    'end() { kill "$d" 2>/dev/null; wait "$d"; exit 0; }; trap end TERM INT; '
    '"$0" -f "$@" & d=$!; c="$CUDA_MPS_PIPE_DIRECTORY/control"; n=0; '
    'while kill -0 "$d" 2>/dev/null; do n=$((n + 1)); '
    '[ -d "$CUDA_MPS_PIPE_DIRECTORY" ] || end; [ -p "$c" ] || [ "$n" -le 5 ] || end; '
    "sleep 2 & wait $!; done; "
    'wait "$d"'
)


class SharingError(RuntimeError):
    """A sharing setting could not be applied or undone; the message names the GPU."""


@dataclass(frozen=True, slots=True)
class DaemonPod:
    """A daemon's pod: its name and the UID of the very pod created, so that a pod
    made later under the same name is never taken for it."""

    name: str
    uid: str


class DaemonPods(Protocol):
    """Runs daemons in pods of their own on this node. Calls block (worker threads).

    A pod gets `argv` and `env`, the agent's image, privileges and driver root (so
    the daemon sees the tools and devices the agent sees at the same paths); of the
    host's folders only `folders`, each at its own path (the agent sees them there
    too, so the paths in `env` mean the same in both), and `shm_dir` as its /dev/shm
    when given.
    """

    def run(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        shm_dir: Path | None,
        *,
        folders: Sequence[Path],
    ) -> DaemonPod:
        """Create the pod `name` (replacing a leftover of that name) and return it
        once created; whether the daemon started is the caller's to see."""
        ...

    def problem(self, pod: DaemonPod) -> str | None:
        """Why the pod cannot run or no longer runs (gone, ended, image or mount
        errors), or None while it runs or starts normally."""
        ...

    def remove(self, name: str, uid: str | None, timeout_s: float) -> None:
        """Delete the pod (only that very pod when `uid` is given) and wait until it
        is gone; a pod that outlives its grace period is deleted at once."""
        ...


@dataclass(frozen=True, slots=True)
class MpsDaemon:
    """One MPS control daemon: everything needed to start it and, later, to stop it.

    `pinned_memory_limits` are bytes per device UUID; MPS takes whole MiB, so they
    are rounded down (the config layer refuses limits below 1 MiB).
    `identity` is what stop trusts; without it (older records) a PID file that
    checks out (see `NvidiaSharing.stop_mps`) stands in.
    """

    name: str
    pipe_dir: Path
    log_dir: Path
    device_uuids: tuple[str, ...]
    active_thread_percentage: int | None = None
    pinned_memory_limits: Mapping[str, int] = field(default_factory=dict)
    # The claim's /dev/shm; None only for daemons recorded before it existed.
    shm_dir: Path | None = None
    # The running daemon, as `start_mps` returned it; None: not known.
    identity: ProcessIdentity | DaemonPod | None = None
    # Multi-user mode (`-M`): clients of every user share one MPS server, run as root.
    # A start's setting only: stop and adoption do not depend on it.
    multi_user: bool = False

    @property
    def options(self) -> tuple[str, ...]:
        """The control daemon's options beyond how it runs (`-d`, `-f`)."""
        return ("-M",) if self.multi_user else ()


class SharingBackend(Protocol):
    """What the device layer needs to share a GPU. All calls block; all undo calls are
    idempotent, because rollback and unprepare retry them after crashes."""

    def set_time_slice(self, gpu_uuid: str, interval: int) -> None:
        """Apply time-slice `interval` (0 Default, 1 Short, 2 Medium, 3 Long)."""
        ...

    def reset_time_slice(self, gpu_uuid: str) -> None:
        """Put the GPU back to the default time-slice."""
        ...

    def start_mps(self, daemon: MpsDaemon) -> ProcessIdentity | DaemonPod:
        """Start the daemon (or adopt one already running in its pipe dir), apply
        its defaults, and return the daemon process or pod, for the caller to record."""
        ...

    def stop_mps(self, daemon: MpsDaemon) -> None:
        """Stop the daemon if it runs and remove its directories; completes whatever
        the claim's containers left in the pipe folder."""
        ...


def find_tool(name: str, root: DriverRoot) -> Path | None:
    """`name` in the driver root's tool folders first (`DriverRoot.tool`), then on
    PATH: the executable file it resolves to inside the root (`DriverRoot.resolve`; Debian links
    `nvidia-smi` through the alternatives system), as this process sees it.

    The driver root comes first because with a containerised driver
    (`/run/nvidia/driver`) the tools on PATH, if any, may not match the running
    kernel module.
    """
    tool = root.tool(name)
    if tool is not None:
        return root.seen / tool[1].lstrip("/")
    found = shutil.which(name)
    return Path(found) if found else None


def server_path(root: DriverRoot, path: str) -> str | None:
    """`path` (a PATH) with the folder of the root's MPS server added at its end, or
    None where the root has no server or `path` names its folder already.

    The control daemon starts its server with `execlp`, so it runs only a server its
    PATH names: from a daemon pod, whose image holds no driver, or a host process
    whose driver is a driver container's root, none at all. At the end, not the start:
    the daemon pod's own shell and the programs of its image must not be the root's,
    which may need another C library. The folder is that of the file the server's
    name resolves to inside the root where it has the same name (Debian's links
    through /etc/alternatives name the agent's own files), else the name's own."""
    tool = root.tool(MPS_SERVER)
    if tool is None:
        return None
    named, resolved = (PurePosixPath(p) for p in tool)
    server = resolved if resolved.name == MPS_SERVER else named
    folder = str(root.seen / str(server.parent).lstrip("/"))
    if folder in path.split(os.pathsep):
        return None
    return f"{path}{os.pathsep}{folder}" if path else folder


def _effective_capabilities(status: Path) -> int:
    """This process's effective capabilities (none where they cannot be read)."""
    try:
        for line in status.read_text(encoding="ascii").splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _follows_no_links(folder: Path) -> bool:
    """Whether no path through `folder` follows a symbolic link: a mount made with
    `nosymfollow` (the agent's own, at a path the claim's containers cannot change)."""
    try:
        return bool(os.statvfs(folder).f_flag & _ST_NOSYMFOLLOW)
    except OSError:
        return False


def may_mount(status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process may mount and make mount namespaces (CAP_SYS_ADMIN)."""
    return bool(_effective_capabilities(status) >> _CAP_SYS_ADMIN & 1)


def may_remove_anything(status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process may empty a folder whatever its containers made there: a
    folder they left without write permission, another user's file in a sticky one."""
    caps = _effective_capabilities(status)
    return bool(caps >> _CAP_DAC_OVERRIDE & 1 and caps >> _CAP_FOWNER & 1)


def _read_pid_file(path: Path) -> int | None:
    """The PID a daemon's PID file holds; None for anything else there.

    The claim's containers can replace the file: a FIFO would block a plain open until
    someone writes to it, a link could lead to /dev/zero, and opening a device node
    they made (in a plain folder, which is not `nodev`) may act on the device. So it
    is opened only if it is a regular file (`_opened_as`), and read only as far as a
    PID goes.
    """
    fd = _opened_as(path, stat.S_ISREG, os.O_RDONLY)
    if fd is None:
        return None
    try:
        text = os.read(fd, _PID_FILE_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None


def _opened_as(path: Path, kind: Callable[[int], bool], flags: int) -> int | None:
    """`path` opened with `flags` if it is a file of `kind` (a link is not followed),
    else None. It is looked at through a descriptor that opens nothing (O_PATH) and
    opened again through that descriptor, so a file swapped in between by the claim's
    containers is never the one opened."""
    try:
        handle = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not kind(os.fstat(handle).st_mode):
            return None
        return os.open(f"/proc/self/fd/{handle}", flags | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        os.close(handle)


@dataclass(frozen=True, slots=True)
class _ControlFile:
    """The file at a pipe folder's `control` as it is now: a FIFO or a UNIX socket."""

    dev: int
    ino: int
    is_socket: bool


def _control_file(pipe_dir: Path) -> _ControlFile | None:
    """The FIFO or socket at `pipe_dir/control` (a link is not followed, nothing is
    opened), or None for anything else there, or nothing."""
    try:
        handle = os.open(pipe_dir / _CONTROL_PIPE, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        found = os.fstat(handle)
    finally:
        os.close(handle)
    if not (stat.S_ISFIFO(found.st_mode) or stat.S_ISSOCK(found.st_mode)):
        return None
    return _ControlFile(found.st_dev, found.st_ino, stat.S_ISSOCK(found.st_mode))


def _socket_bound_to(control: _ControlFile) -> int | None:
    """The sockfs inode of the UNIX socket bound to the socket file `control`, among
    the sockets of this process's network namespace (sock_diag, UNIX_DIAG_VFS), or None.

    A socket file is not the socket: a process that listens on it holds a descriptor
    of a socket whose own inode (`socket:[N]` in /proc/<pid>/fd) is another number.
    The kernel reports the file each bound socket was bound to; that, not the path a
    process names, says whose socket sits at the path. One dump request of our own:
    the kept netlink library (pyroute2) marks its sock_diag call as work in progress,
    its signature to change."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            request = _UNIX_DIAG_REQ.pack(
                socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, _UDIAG_SHOW_VFS, 0, 0
            )
            header = _NLMSG_HEADER.pack(
                _NLMSG_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, 1, 0
            )
            nl.sendall(header + request)
            while True:
                data = nl.recv(1 << 16)
                offset = 0
                while offset + _NLMSG_HEADER.size <= len(data):
                    length, kind = _NLMSG_HEADER.unpack_from(data, offset)[:2]
                    if length < _NLMSG_HEADER.size or kind in (_NLMSG_DONE, _NLMSG_ERROR):
                        return None
                    found = _bound_socket(
                        data[offset + _NLMSG_HEADER.size : offset + length], control
                    )
                    if found is not None:
                        return found
                    offset += (length + 3) & ~3
                if not data:
                    return None
    except (OSError, struct.error):
        return None


def _bound_socket(message: bytes, control: _ControlFile) -> int | None:
    """The socket's inode if one sock_diag answer is the socket bound to `control`."""
    inode = _UNIX_DIAG_MSG.unpack_from(message)[4]
    offset = _UNIX_DIAG_MSG.size
    while offset + _RTATTR.size <= len(message):
        length, kind = _RTATTR.unpack_from(message, offset)
        if length < _RTATTR.size:
            return None
        if kind == _UNIX_DIAG_VFS and length >= _RTATTR.size + _UNIX_DIAG_VFS_ATTR.size:
            vfs_ino, vfs_dev = _UNIX_DIAG_VFS_ATTR.unpack_from(message, offset + _RTATTR.size)
            dev = os.makedev(
                vfs_dev >> _KERNEL_MINOR_BITS, vfs_dev & ((1 << _KERNEL_MINOR_BITS) - 1)
            )
            # The kernel reports 32 bits of the file's inode number.
            if dev == control.dev and vfs_ino == control.ino & 0xFFFFFFFF:
                return int(inode)
        offset += (length + 3) & ~3
    return None


def _holds(pid: int, control: _ControlFile) -> bool:
    """Whether process `pid` holds a descriptor of `control` itself: the FIFO (its
    device and inode), or the socket bound to the socket file. What /proc/<pid>/fd
    shows is the kernel's, not anything the claim's containers write."""
    try:
        held_fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    socket_name = None
    if control.is_socket:
        inode = _socket_bound_to(control)
        if inode is None:
            return False
        socket_name = f"socket:[{inode}]"
    for fd in held_fds:
        try:
            if socket_name is not None:
                if str(fd.readlink()) == socket_name:
                    return True
            else:
                held = fd.stat()  # the file the descriptor is of: nothing is opened
                if (held.st_dev, held.st_ino) == (control.dev, control.ino):
                    return True
        except OSError:
            continue
    return False


def _in_this_pid_namespace(pid: int) -> bool:
    """Whether process `pid` is in this process's PID namespace. A daemon this agent
    started is; a process of a pod's container is not (pods get a PID namespace of
    their own, and the agent's container sees no other pod's processes), but for a
    pod run with `hostPID` while the agent runs in the host's PID namespace (a host
    process agent: tests and demos, never the chart's)."""
    try:
        return Path(f"/proc/{pid}/ns/pid").readlink() == Path("/proc/self/ns/pid").readlink()
    except OSError:
        return False


class _NewEntries:
    """Whether an entry `name` was made in `folder` (created, linked, or moved or
    exchanged there) while the watch was open: inotify(7), so what the kernel saw,
    through any mount of the folder, the claim's containers' included.

    NVIDIA's client opens the control pipe by its path, a moment after the agent
    looked at what is there: the claim's containers could swap another file in
    between, and swap it back after. Any such swap makes a new entry under that name,
    which the watch reports (a lost event counts as one)."""

    def __init__(self, folder: Path, name: str) -> None:
        self._name = name
        self._made = False
        self._watch = INotify(nonblocking=True)
        try:
            self._watch.add_watch(folder, iflags.CREATE | iflags.MOVED_TO)
        except BaseException:
            self._watch.close()
            raise

    def close(self) -> None:
        self._watch.close()

    def made(self) -> bool:
        """Whether an entry of that name was made since the watch was opened."""
        self._made = self._made or any(
            e.mask & iflags.Q_OVERFLOW or e.name == self._name for e in self._watch.read(timeout=0)
        )
        return self._made


def _started_for(pid: int, daemon: MpsDaemon) -> ProcessIdentity | None:
    """Process `pid` if it is a live process of this PID namespace started for the
    daemon's very pipe folder (its environment says so), never this process or init.

    A process of a pod's container does not pass, whatever its environment says
    (`_in_this_pid_namespace`)."""
    if pid in (1, os.getpid()):
        return None
    identity = ProcessIdentity.of(pid)
    if identity is None or not _in_this_pid_namespace(pid):
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    wanted = f"{_PIPE_ENV}={daemon.pipe_dir}".encode()
    return identity if wanted in environ and identity.alive() else None


def _tail(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _OUTPUT_TAIL else "..." + text[-_OUTPUT_TAIL:]


class NvidiaSharing:
    """`SharingBackend` that runs nvidia-smi and nvidia-cuda-mps-control.

    Paths given explicitly win; otherwise each tool is looked up on first use (see
    `find_tool`) in the driver root as this process sees it (`driver_root` under
    `host_view`, see `DriverRoot`), so a node without MPS tools still serves claims
    that do not ask for MPS, and the error appears only on a claim that needs the
    missing tool. Every tool, in this process or a daemon pod, runs with the root's
    NVML and CUDA libraries preloaded (`DriverRoot.tool_preload`), and with `env`,
    which wins.
    """

    def __init__(
        self,
        *,
        driver_root: Path = Path("/"),
        host_view: Path = Path("/"),
        nvidia_smi: Path | None = None,
        mps_control: Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
        ready_timeout_s: float = 10.0,
        pods: DaemonPods | None = None,
        pod_ready_timeout_s: float = 60.0,
    ) -> None:
        self._root = DriverRoot(driver_root, host_view)
        self._env = dict(env or {})
        self._paths: dict[str, Path | None] = {NVIDIA_SMI: nvidia_smi, MPS_CONTROL: mps_control}
        self._timeout_s = timeout_s
        self._ready_timeout_s = ready_timeout_s
        self._pods = pods
        # The control file each daemon pod made, by daemon name, as this process saw it
        # once the daemon listened, before any container of the claim could (`_quit_pod`).
        self._pod_controls: dict[str, _ControlFile] = {}
        # A pod's image is normally on the node already (it is the agent's), but the
        # kubelet still sets up a sandbox: seconds, not the moment a fork takes.
        self._pod_ready_timeout_s = pod_ready_timeout_s

    # --- plumbing ---

    def _tool(self, name: str, purpose: str) -> Path:
        path = self._paths.get(name) or find_tool(name, self._root)
        if path is None:
            dirs = ", ".join(str(self._root.seen / d) for d in DRIVER_TOOL_DIRS)
            raise SharingError(
                f"{purpose}: {name} not found in {dirs} or on PATH; install the NVIDIA "
                f"driver utilities on the node, or pass the path of {name} explicitly"
            )
        return path

    def _tool_env(self) -> dict[str, str]:
        """What every tool's environment gets: the driver's libraries, and the folder
        of the root's MPS server after the PATH this process has (`server_path`),
        looked up at each run (a driver container may mount its root after the agent
        started), then `env`."""
        preload = self._root.tool_preload()
        path = server_path(self._root, os.environ.get("PATH", os.defpath))
        return {
            **({"LD_PRELOAD": preload} if preload else {}),
            **({"PATH": path} if path is not None else {}),
            **self._env,
        }

    def _run(
        self,
        argv: Sequence[str],
        purpose: str,
        *,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> str:
        """Run a tool to its end, within the timeout; `stop`, asked while it runs,
        says when to kill it and fail instead (`_quit_if_own`)."""
        full_env = {**os.environ, **self._tool_env(), **(env or {})}
        try:
            process = subprocess.Popen(
                list(argv),
                stdin=None if stdin is None else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=full_env,
            )
        except OSError as exc:
            raise SharingError(f"{purpose}: cannot run {argv[0]}: {exc}") from None
        deadline = time.monotonic() + self._timeout_s
        pending = stdin
        with process:
            while True:
                left = deadline - time.monotonic()
                try:
                    stdout, stderr = process.communicate(
                        pending, timeout=max(0.0, left if stop is None else min(left, _SWAP_LOOK_S))
                    )
                    break
                except subprocess.TimeoutExpired:
                    pending = None  # sent once; communicate goes on with what is left
                stopped = stop is not None and stop()
                if stopped or time.monotonic() >= deadline:
                    process.kill()
                    process.communicate()
                    raise SharingError(
                        f"{purpose}: {' '.join(argv)} "
                        + (
                            "was stopped"
                            if stopped
                            else f"did not finish within {self._timeout_s:.0f}s"
                        )
                    )
        if process.returncode != 0:
            output = _tail(stderr or stdout or "")
            raise SharingError(
                f"{purpose}: {' '.join(argv)} exited with status {process.returncode}"
                + (f": {output}" if output else "")
            )
        return stdout

    # --- time-slicing ---

    def set_time_slice(self, gpu_uuid: str, interval: int) -> None:
        if not 0 <= interval <= MAX_TIME_SLICE:
            raise SharingError(
                f"time-slice interval {interval} for GPU {gpu_uuid} is not between 0 and "
                f"{MAX_TIME_SLICE}"
            )
        smi = str(self._tool(NVIDIA_SMI, f"time-slicing GPU {gpu_uuid}"))
        try:
            self._run(
                [smi, "compute-policy", "-i", gpu_uuid, "--set-timeslice", str(interval)],
                f"setting time-slice {interval} on GPU {gpu_uuid}",
            )
        except SharingError as exc:
            raise SharingError(
                f"{exc}; time-slice intervals need an Ampere or newer GPU and a driver "
                "with `nvidia-smi compute-policy` (older GPUs cannot change it): remove "
                "the timeSlicingConfig interval for this GPU"
            ) from None
        log.info("time-slice set", extra={"fields": {"gpu": gpu_uuid, "interval": interval}})

    def reset_time_slice(self, gpu_uuid: str) -> None:
        smi = str(self._tool(NVIDIA_SMI, f"resetting the time-slice of GPU {gpu_uuid}"))
        self._run(
            [smi, "compute-policy", "-i", gpu_uuid, "--set-timeslice", "0"],
            f"resetting the time-slice of GPU {gpu_uuid}",
        )

    # --- MPS ---

    @staticmethod
    def _mps_env(daemon: MpsDaemon) -> dict[str, str]:
        return {
            _PIPE_ENV: str(daemon.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(daemon.log_dir),
            "CUDA_VISIBLE_DEVICES": ",".join(daemon.device_uuids),
        }

    def _control(
        self,
        daemon: MpsDaemon,
        command: str,
        purpose: str,
        stop: Callable[[], bool] | None = None,
    ) -> str:
        tool = str(self._tool(MPS_CONTROL, purpose))
        return self._run(
            [tool], purpose, env=self._mps_env(daemon), stdin=command + "\n", stop=stop
        )

    @staticmethod
    def _host_tool(name: str, purpose: str) -> str:
        found = shutil.which(name)
        if found is None:
            raise SharingError(f"{purpose}: {name} not found on PATH; install util-linux")
        return found

    def _make_tmpfs(self, folder: Path, options: str, mode: int, purpose: str) -> None:
        """A folder of the claim's that its containers may write: a fresh tmpfs where
        this process may mount one (as upstream does for /dev/shm), else a plain
        folder, which still keeps claims apart but not off the node's disk."""
        folder.mkdir(mode=mode, parents=True, exist_ok=True)
        if may_mount():
            if not os.path.ismount(folder):
                mount = self._host_tool("mount", purpose)
                argv = [mount, "-t", "tmpfs", "-o", options, "gpudra-mps", str(folder)]
                try:
                    self._run(argv, purpose)
                except SharingError:
                    if _NOSYMFOLLOW_OPTION not in options:
                        raise
                    # A kernel before 5.10 (or a mount(8) that passes the option to
                    # tmpfs, which refuses it): the daemon is then ended without `quit`.
                    log.warning(
                        "cannot mount a claim's MPS folder with nosymfollow; its daemon "
                        "will be ended without quit",
                        extra={"fields": {"folder": str(folder)}},
                    )
                    argv[4] = options.replace(_NOSYMFOLLOW_OPTION, "")
                    self._run(argv, purpose)
        else:
            log.warning(
                "a claim's MPS folder is a plain folder on the node's disk, which its "
                "containers can fill: a tmpfs of its own needs CAP_SYS_ADMIN",
                extra={"fields": {"folder": str(folder)}},
            )
            if not may_remove_anything():
                # Nothing unmounts it at unprepare: what is in it must be removed.
                log.warning(
                    "what a claim's containers leave in its MPS folder that this process "
                    "may not remove (a folder without write permission, another user's "
                    "files) keeps the claim prepared until removed by hand: give the "
                    "agent CAP_DAC_OVERRIDE and CAP_FOWNER",
                    extra={"fields": {"folder": str(folder)}},
                )
        folder.chmod(mode)  # exact, whatever the umask

    def _remove_tmpfs(self, folder: Path, purpose: str) -> None:
        """Unmount (lazily: a process still holding it cannot keep the claim) and remove."""
        if os.path.ismount(folder):
            umount = self._host_tool("umount", purpose)
            self._run([umount, "--lazy", str(folder)], purpose)
        remove_tree(folder)

    def _daemonize(self, daemon: MpsDaemon, tool: str, purpose: str) -> None:
        """`tool -d` with the claim's shm folder as the daemon's /dev/shm.

        The daemon and the MPS servers it starts inherit a private mount namespace
        in which /dev/shm is the claim's folder, the one its containers get too.
        Without the right to make one (emulated GPUs run unprivileged) the daemon
        keeps this process's /dev/shm; the containers still get the claim's folder.
        """
        argv = [tool, "-d", *daemon.options]
        if daemon.shm_dir is not None and may_mount():
            argv = [
                self._host_tool("unshare", purpose),
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                '"$1" --bind "$2" /dev/shm && t="$3" && shift 3 && exec "$t" -d "$@"',
                "mps-start",
                self._host_tool("mount", purpose),
                str(daemon.shm_dir),
                tool,
                *daemon.options,
            ]
        elif daemon.shm_dir is not None:
            log.warning(
                "MPS daemon keeps this process's /dev/shm: a private one needs CAP_SYS_ADMIN",
                extra={"fields": {"daemon": daemon.name}},
            )
        self._run(argv, purpose, env=self._mps_env(daemon))

    @staticmethod
    def _control_listens(daemon: MpsDaemon, tries: int = _CONTROL_READER_TRIES) -> bool:
        """Whether the control file is one a daemon could listen on: a socket, or a
        FIFO something reads. Whose it is, this does not say: it serves the start,
        before any container has seen the folder, and `quit` once the daemon is known
        to hold the file (`_quit`). Anything else there means no daemon answers."""
        control = daemon.pipe_dir / _CONTROL_PIPE
        try:
            mode = control.lstat().st_mode
        except OSError:
            return False
        if stat.S_ISSOCK(mode):
            return True
        if not stat.S_ISFIFO(mode):
            return False
        # A FIFO nobody reads: writing `quit` to it would wait out the tool's whole
        # timeout, holding a thread. A daemon may be between two opens of its FIFO:
        # asked again, `tries` times 0.1 s apart.
        for attempt in range(tries):
            fd = _opened_as(control, stat.S_ISFIFO, os.O_WRONLY)
            if fd is not None:
                os.close(fd)
                return True
            if attempt + 1 < tries:  # ENXIO: nobody reads it now
                time.sleep(0.1)
        return False

    @staticmethod
    def _from_pid_file(daemon: MpsDaemon) -> ProcessIdentity | None:
        """The daemon the PID file names, if it checks out: a live process started
        for this very pipe folder (its environment says so). Trusted at start, when
        no container has seen the folder yet, and for records that predate the
        recorded identity; never a reason to signal anything else."""
        pid = _read_pid_file(daemon.pipe_dir / _PID_FILE)
        if pid is None:
            return None
        return _started_for(pid, daemon)

    @staticmethod
    def _find_daemon(daemon: MpsDaemon) -> ProcessIdentity | None:
        """For a record that names no daemon process and a PID file that names none
        (the claim's containers may remove or rewrite it): the process, among those of
        this PID namespace, started for this very pipe folder. Only the kernel's view
        of the processes decides, never a file of the pipe folder."""
        try:
            pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
        except OSError:
            return None
        for pid in pids:
            found = _started_for(pid, daemon)
            if found is not None:
                return found
        return None

    def start_mps(self, daemon: MpsDaemon) -> ProcessIdentity | DaemonPod:
        gpus = ", ".join(daemon.device_uuids)
        purpose = f"starting the MPS control daemon {daemon.name} for {gpus}"
        tool = str(self._tool(MPS_CONTROL, purpose))
        self._make_tmpfs(daemon.log_dir, _LOG_OPTIONS, 0o755, purpose)
        self._make_tmpfs(daemon.pipe_dir, _PIPE_OPTIONS, 0o755, purpose)
        if daemon.shm_dir is not None:
            # As /dev/shm: every user of the claim's containers may use it.
            self._make_tmpfs(daemon.shm_dir, _SHM_OPTIONS, 0o1777, purpose)
        identity = self._running(daemon)
        if identity is not None:
            # A retry after a crash: the daemon from the first attempt still listens.
            log.info("adopting running MPS daemon", extra={"fields": {"daemon": daemon.name}})
        else:
            if isinstance(daemon.identity, ProcessIdentity) and daemon.identity.alive():
                # Recorded by a first attempt but not adoptable (it no longer listens,
                # or this agent runs daemons in pods): never two daemons for a claim.
                asked = self._quit(daemon, daemon.identity, purpose)
                self._end(daemon.identity, daemon, purpose, asked=asked)
            for stale in (_CONTROL_PIPE, _PID_FILE):
                (daemon.pipe_dir / stale).unlink(missing_ok=True)
            try:
                if self._pods is not None:
                    identity = self._start_pod(self._pods, daemon, tool, purpose)
                else:
                    self._daemonize(daemon, tool, purpose)
                    identity = self._wait_for_daemon(daemon, purpose)
            except SharingError:
                # Nothing of a start that failed is left: no half-started daemon or its
                # pod (removed by name), no mounted /dev/shm, no folders (the caller's
                # rollback finds nothing).
                self._stop_quietly(dataclasses.replace(daemon, identity=None))
                raise
        try:
            if daemon.active_thread_percentage is not None:
                self._control(
                    daemon,
                    f"set_default_active_thread_percentage {daemon.active_thread_percentage}",
                    f"setting the MPS active thread percentage for {gpus}",
                )
            for uuid, limit in daemon.pinned_memory_limits.items():
                self._control(
                    daemon,
                    f"set_default_device_pinned_mem_limit {uuid} {limit // _MIB}M",
                    f"setting the MPS pinned memory limit of {uuid}",
                )
        except SharingError:
            self._stop_quietly(dataclasses.replace(daemon, identity=identity))
            raise
        where = {"pod": identity.name} if isinstance(identity, DaemonPod) else {"pid": identity.pid}
        log.info(
            "MPS daemon started",
            extra={"fields": {"daemon": daemon.name, "pipeDir": str(daemon.pipe_dir), **where}},
        )
        return identity

    def _running(self, daemon: MpsDaemon) -> ProcessIdentity | DaemonPod | None:
        """The daemon a first attempt started, if it still runs and listens."""
        if not self._control_listens(daemon):
            return None
        if isinstance(daemon.identity, DaemonPod):
            if self._pods is not None and self._pods.problem(daemon.identity) is None:
                self._note_pod_control(daemon)
                return daemon.identity
            return None
        if self._pods is not None:
            return None  # a process daemon cannot be adopted by an agent that runs pods
        identity = daemon.identity or self._from_pid_file(daemon)
        return identity if identity is not None and identity.alive() else None

    def _start_pod(self, pods: DaemonPods, daemon: MpsDaemon, tool: str, purpose: str) -> DaemonPod:
        """The daemon in a pod of its own, in the foreground under a small shell that
        also ends it once its pipe folder is gone (an older agent that knows nothing
        of pods removes the folder at unprepare) and passes SIGTERM on."""
        env = {**self._tool_env(), **self._mps_env(daemon)}
        # What the daemon writes to: the folders its environment names. A record of an
        # older release may name one folder as both.
        folders = tuple(dict.fromkeys((daemon.pipe_dir, daemon.log_dir)))
        pod = pods.run(
            daemon.name,
            ["sh", "-c", _POD_SCRIPT, tool, *daemon.options],
            env,
            daemon.shm_dir,
            folders=folders,
        )
        deadline = time.monotonic() + self._pod_ready_timeout_s
        next_look = 0.0
        while not self._control_listens(daemon):
            now = time.monotonic()
            if now >= next_look:
                if (problem := pods.problem(pod)) is not None:
                    raise SharingError(f"{purpose}: its pod {pod.name} {problem}")
                next_look = now + 1.0
            if now >= deadline:
                raise SharingError(
                    f"{purpose}: the daemon in pod {pod.name} did not listen on its "
                    f"control pipe {daemon.pipe_dir / _CONTROL_PIPE} within "
                    f"{self._pod_ready_timeout_s:.0f}s; see the pod's events and the logs "
                    f"in {daemon.log_dir}"
                )
            time.sleep(0.05)
        self._note_pod_control(daemon)
        return pod

    def _note_pod_control(self, daemon: MpsDaemon) -> None:
        """Note the control file the daemon pod made, while no container of the claim
        has seen its pipe folder (a start, or a retried one): the agent cannot see a
        pod's processes, so this note is what tells the daemon's control file from one
        a container swaps in later (`_quit_pod`)."""
        control = _control_file(daemon.pipe_dir)
        if control is not None:
            self._pod_controls[daemon.name] = control

    def _wait_for_daemon(self, daemon: MpsDaemon, purpose: str) -> ProcessIdentity:
        """`-d` returns once the daemon forked; it listens a moment later."""
        deadline = time.monotonic() + self._ready_timeout_s
        while True:
            identity = self._from_pid_file(daemon)
            if identity is not None and self._control_listens(daemon):
                return identity
            if time.monotonic() >= deadline:
                raise SharingError(
                    f"{purpose}: the daemon did not create its control pipe "
                    f"{daemon.pipe_dir / _CONTROL_PIPE} and PID file within "
                    f"{self._ready_timeout_s:.0f}s; see the logs in {daemon.log_dir}"
                )
            time.sleep(0.02)

    def _stop_quietly(self, daemon: MpsDaemon) -> None:
        try:
            self.stop_mps(daemon)
        except SharingError as exc:
            log.warning(
                "could not stop MPS daemon after a failed start",
                extra={"fields": {"daemon": daemon.name, "error": str(exc)}},
            )

    def stop_mps(self, daemon: MpsDaemon) -> None:
        """Ask the daemon to quit, then make sure it did, then remove its folders.

        Only the recorded identity (or, for records without one, a process of this
        PID namespace started for this pipe folder) decides which process or pod is
        the daemon, and only the kernel's view of that daemon decides whether `quit` is
        sent (`_quit`, `_quit_pod`): what the claim's containers can write (the
        control file, the PID file) never makes this fail or wait without bound, nor
        signal another process, nor buys a container a longer wait.
        """
        purpose = f"stopping the MPS control daemon {daemon.name}"
        identity = daemon.identity
        if isinstance(identity, DaemonPod):
            if self._pods is None:
                raise SharingError(
                    f"{purpose}: it runs in pod {identity.name}, and this agent runs without "
                    "daemon pods; start it with --mps-daemon-pod-template as the chart does"
                )
            if self._quit_pod(daemon, purpose):
                self._wait_pod_ended(self._pods, identity)
            self._pods.remove(daemon.name, identity.uid, self._ready_timeout_s)
        else:
            identity = identity or self._from_pid_file(daemon) or self._find_daemon(daemon)
            if identity is not None and identity.alive():
                asked = self._quit(daemon, identity, purpose)
                self._end(identity, daemon, purpose, asked=asked)
            elif daemon.identity is None and _control_file(daemon.pipe_dir) is not None:
                # A record of a release that kept no identity (or an orphaned folder),
                # and no process of this namespace started for it: whatever listens
                # at the control file, if anything, is nobody `quit` may be sent to (a
                # container can put a FIFO of its own there and read it).
                log.warning(
                    "no MPS daemon process found for a claim's pipe folder, whose record "
                    "names none; removing its files. A daemon an earlier release started "
                    "outside this agent's processes may still run: find it with "
                    f"`grep -l {_PIPE_ENV}={daemon.pipe_dir} /proc/*/environ` on the "
                    "node and end it",
                    extra={"fields": {"daemon": daemon.name, "pipeDir": str(daemon.pipe_dir)}},
                )
            else:
                log.info(
                    "MPS daemon not running; removing its files",
                    extra={"fields": {"daemon": daemon.name}},
                )
            if self._pods is not None:
                # Created by an attempt that crashed before it could record the pod.
                self._pods.remove(daemon.name, None, self._ready_timeout_s)
        self._pod_controls.pop(daemon.name, None)
        # A record of an older release may name one folder as both pipe and log
        # folder: the second removal then finds nothing to do.
        for folder in (daemon.pipe_dir, daemon.shm_dir, daemon.log_dir):
            if folder is not None:
                self._remove_tmpfs(folder, purpose)
        log.info("MPS daemon stopped", extra={"fields": {"daemon": daemon.name}})

    def _quit(self, daemon: MpsDaemon, identity: ProcessIdentity, purpose: str) -> bool:
        """`quit` through the control pipe, if it is the daemon's own; whether it was
        taken. Bounded, and a daemon that does not take it is ended by its caller all
        the same, by signal and at once.

        The claim's containers may still run at unprepare (a pod force-deleted, its
        claim swept) and write their pipe folder. Two things of theirs must not decide
        what `quit` does:
        - where it goes: NVIDIA's client opens the control pipe by its path, as root
          and in this process's view of the node, so a symbolic link swapped in would
          take `quit` to any file or socket the agent sees (the checkpoint, a CDI
          spec). So `quit` goes only through a pipe folder that follows no symbolic
          links (a tmpfs mounted `nosymfollow`); a hard link cannot leave that file
          system, nor a device node open (`nodev`). Otherwise the daemon is ended by
          signal, as the pod's deletion ends a daemon pod.
        - how long the stop waits: a daemon asked to quit is given the ready timeout
          to do so. A container that puts a FIFO (or socket) of its own at `control`
          and reads it would take the `quit` and hold the stop for that long. So
          `quit` is sent only to a control file the daemon process itself holds open
          (/proc/<pid>/fd: the FIFO's device and inode, or the socket the kernel says
          is bound to the socket file), and only if no entry named `control` was made
          in the folder between that look and the client's end (`_NewEntries`): else
          the file the client opened may not be the one looked at. A control file not
          the daemon's is logged as a tampered pipe folder.
        What stays open: a FIFO is not the daemon's alone. A container may open the
        daemon's own FIFO and read it too, and take the `quit` written to it; NVIDIA's
        current daemons listen on a UNIX socket instead, whose connections only the
        process holding it accepts.
        """
        return self._quit_if_own(
            daemon,
            purpose,
            lambda: self._daemon_listens(daemon, identity),
            unwatched="cannot watch a claim's MPS pipe folder; its daemon is ended without quit",
        )

    def _quit_if_own(
        self,
        daemon: MpsDaemon,
        purpose: str,
        own: Callable[[], bool],
        *,
        unwatched: str,
    ) -> bool:
        """`quit` through the control pipe if `own()`, looking while the pipe folder is
        watched, says the control file is the daemon's; whether it was taken. A daemon
        process (`_quit`) and a daemon pod (`_quit_pod`) differ only in how they know
        their daemon's file; what keeps a link or a swap from redirecting `quit` (see
        `_quit`) is the same for both: the folder follows no links, and an entry named
        `control` made between `own()`'s look and the client's end means the `quit`
        may have gone elsewhere, so it is not taken as the daemon's. `unwatched` is the
        warning logged when the folder cannot be watched."""
        if not _follows_no_links(daemon.pipe_dir):
            return False
        try:
            watch = _NewEntries(daemon.pipe_dir, _CONTROL_PIPE)
        except OSError as exc:
            log.warning(unwatched, extra={"fields": {"daemon": daemon.name, "error": str(exc)}})
            return False
        try:
            if not own():
                return False
            # The client is stopped as soon as the watch sees a new `control`: a FIFO
            # nobody reads, or a socket whose backlog is full, swapped in after the look
            # would otherwise hold it, and the stop, for the tool's whole timeout.
            sent = self._send_quit(daemon, purpose, stop=watch.made)
            if watch.made():
                self._tampered(daemon, "was replaced while quit was sent")
                return False
            return sent
        finally:
            watch.close()

    def _daemon_listens(self, daemon: MpsDaemon, identity: ProcessIdentity) -> bool:
        """Whether the control file is one the daemon process itself listens on. The
        daemon may be between two opens of a FIFO: looked at again for a second."""
        control = None
        for attempt in range(_CONTROL_READER_TRIES):
            if not identity.alive():
                return False
            control = _control_file(daemon.pipe_dir)
            if control is not None and _holds(identity.pid, control):
                return control.is_socket or self._control_listens(daemon, tries=1)
            if attempt + 1 < _CONTROL_READER_TRIES:
                time.sleep(0.1)
        if identity.alive():
            self._tampered(
                daemon,
                "is gone or not a FIFO or socket" if control is None else "is not the daemon's own",
            )
        return False

    def _quit_pod(self, daemon: MpsDaemon, purpose: str) -> bool:
        """`quit` to a daemon pod, if the control file is the one its daemon made, as
        noted at its start (`_note_pod_control`); whether it was taken. The agent sees
        no process of a pod, so that note, never anything the claim's containers
        write, says whose the file is. Without the note (the pod was started or
        adopted by an earlier run of the agent) no `quit` is sent: the pod's deletion
        ends the daemon, as the upstream driver ends its daemons. See `_quit` for the
        link and the swap that could redirect `quit`, and for what a FIFO leaves open."""
        noted = self._pod_controls.get(daemon.name)
        if noted is None:
            return False
        return self._quit_if_own(
            daemon,
            purpose,
            lambda: self._pod_listens(daemon, noted),
            unwatched=(
                "cannot watch a claim's MPS pipe folder; its daemon pod is deleted without quit"
            ),
        )

    def _pod_listens(self, daemon: MpsDaemon, noted: _ControlFile) -> bool:
        """Whether the control file is the one the daemon pod made (`noted`) and it
        listens on it."""
        if _control_file(daemon.pipe_dir) != noted:
            self._tampered(daemon, "is not the one its daemon pod made")
            return False
        return noted.is_socket or self._control_listens(daemon)

    def _send_quit(
        self, daemon: MpsDaemon, purpose: str, stop: Callable[[], bool] | None = None
    ) -> bool:
        try:
            self._control(daemon, "quit", purpose, stop=stop)
        except SharingError as exc:
            log.warning(
                "MPS daemon did not take quit; ending it",
                extra={"fields": {"daemon": daemon.name, "error": str(exc)}},
            )
            return False
        return True

    @staticmethod
    def _tampered(daemon: MpsDaemon, what: str) -> None:
        log.warning(
            "tampered MPS pipe folder: its control file is not its daemon's; the daemon "
            "is ended without quit",
            extra={
                "fields": {"claim": daemon.name, "pipeDir": str(daemon.pipe_dir), "control": what}
            },
        )

    def _wait_pod_ended(self, pods: DaemonPods, pod: DaemonPod) -> None:
        """Give a daemon that took `quit` the time to shut its server down and end
        its pod, rather than cutting it short with the pod's deletion."""
        deadline = time.monotonic() + self._ready_timeout_s
        while pods.problem(pod) is None and time.monotonic() < deadline:
            time.sleep(0.2)

    def _end(
        self, identity: ProcessIdentity, daemon: MpsDaemon, purpose: str, *, asked: bool = True
    ) -> None:
        """Wait for the daemon to exit (when it was `asked` to quit), then TERM, then KILL."""
        for signum in (
            (None, signal.SIGTERM, signal.SIGKILL)
            if asked
            else (
                signal.SIGTERM,
                signal.SIGKILL,
            )
        ):
            if signum is not None:
                identity.signal(signum)
            if identity.wait_gone(self._ready_timeout_s):
                return
        raise SharingError(
            f"{purpose}: process {identity.pid} still runs after SIGKILL; it is stuck in "
            "the kernel, check the GPU driver's state on the node"
        )
