"""Stopping a claim's MPS control daemon while the claim's containers still run (a pod
force-deleted, its claim swept) and write its pipe folder: `quit` goes only to a
control file the daemon itself holds, whatever the containers put at `control`, and
what they put there neither buys them a longer stop nor keeps the claim prepared.

The daemons are the stand-in `nvidia-cuda-mps-control` (a FIFO, as older daemons use)
or, below, a stand-in that listens on a UNIX socket as NVIDIA's current daemon does.
The node-side escape suite (e2e/tests/escape/test_node.py) needs a cluster whose
tenant containers outlive their claim; these attacks are made here, on the backend
and the preparer, by the test process standing in for the tenant's container.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from gpudra.driver.checkpoint import load as load_checkpoint
from gpudra.driver.nvml.standin import FAKEBIN, TOOLS_LOG_ENV
from gpudra.driver.prepare import MPS_THREADS
from gpudra.driver.processes import ProcessIdentity
from gpudra.driver.sharing import DaemonPod, MpsDaemon, NvidiaSharing, may_mount
from inotify_simple import INotify
from inotify_simple import flags as iflags

from tests.driver.test_mps_pods import ProcessPods, calls
from tests.driver.test_mps_pods import daemon as pod_daemon
from tests.driver.test_mps_pods import sharing as pod_sharing
from tests.driver.test_prepare import (
    _MPS_CLAIM,
    Node,
    _as_an_older_release_recorded,
    _daemon_in,
    _ended,
    _fixture_claim,
    _mps_base,
    _mps_control_tool,
    _recorded_daemon,
    _running_daemon,
    discover,
    h100,
    node,
    node_preparer,
    offline_claim,
)

__all__ = ["node"]  # the fixture, used by name

pytestmark = pytest.mark.skipif(
    not may_mount(),
    reason="quit goes only through a pipe folder mounted nosymfollow: needs CAP_SYS_ADMIN",
)

SHARING_LOG = "gpudra.driver.sharing"


@pytest.fixture
def tools_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "tools.log"
    monkeypatch.setenv(TOOLS_LOG_ENV, str(log))
    return log


def _backend(
    tools_log: Path, mps_control: Path | None = None, timeout_s: float = 10.0, **env: str
) -> NvidiaSharing:
    return NvidiaSharing(
        nvidia_smi=FAKEBIN / "nvidia-smi",
        mps_control=mps_control or FAKEBIN / "nvidia-cuda-mps-control",
        env={TOOLS_LOG_ENV: str(tools_log), **env},
        timeout_s=timeout_s,
        ready_timeout_s=10.0,
    )


_TOOL_TIMEOUT_S = 600.0
"""A tool timeout no test waits out: a stop held for it fails the test's guard."""
_GUARD_S = 60.0


def _stopped_within_the_guard(backend: NvidiaSharing, daemon: MpsDaemon) -> None:
    """`stop_mps`, failing the test if it is still waiting after the guard (the tool's
    timeout is ten times that): a guard against a hang, not a measure of speed."""
    errors: list[BaseException] = []

    def stop() -> None:
        try:
            backend.stop_mps(daemon)
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    thread = threading.Thread(target=stop, daemon=True)
    thread.start()
    thread.join(_GUARD_S)
    assert not thread.is_alive(), "the stop still waits on the client the tenant holds"
    assert errors == []


def _quits(tools_log: Path) -> list[str]:
    """The `quit` commands NVIDIA's client (the stand-in) was run with."""
    if not tools_log.exists():
        return []
    return [c for c in calls(tools_log) if c == "mps-control quit"]


def _tampered(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    """The fields of each tampered-pipe-folder warning."""
    return [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == SHARING_LOG and r.getMessage().startswith("tampered MPS pipe folder")
    ]


class FifoReader:
    """The tenant's container: a FIFO of its own at `control`, which it reads."""

    def __init__(self, pipe_dir: Path) -> None:
        control = pipe_dir / "control"
        control.unlink(missing_ok=True)
        os.mkfifo(control, 0o600)
        self._fd = os.open(control, os.O_RDWR | os.O_NONBLOCK)  # a reader, as a daemon
        self.got = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.wait(0.01):
            with contextlib.suppress(BlockingIOError):
                self.got += os.read(self._fd, 100)

    def close(self) -> bytes:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(BlockingIOError):
            self.got += os.read(self._fd, 100)
        os.close(self._fd)
        return self.got


# --- a recorded daemon process --------------------------------------------------------


def test_a_fifo_a_tenant_swaps_in_and_reads_never_gets_the_quit(
    tmp_path: Path, tools_log: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tenant's FIFO has a reader, so it looks like a daemon's: it is not the
    daemon's (the daemon holds another), so no `quit` is sent through it and the
    daemon is signalled at once, rather than given the ready timeout to quit."""
    caplog.set_level(logging.INFO, SHARING_LOG)
    backend = _backend(tools_log)
    with _running_daemon(backend, _daemon_in(tmp_path / "claim-a")) as (daemon, identity):
        tenant = FifoReader(daemon.pipe_dir)
        try:
            backend.stop_mps(daemon)
        finally:
            got = tenant.close()
    assert got == b""
    assert _quits(tools_log) == []
    assert not identity.alive()
    assert [f["claim"] for f in _tampered(caplog)] == ["claim-a"]
    assert not daemon.pipe_dir.exists()


def test_the_daemons_own_fifo_still_gets_the_quit(
    tmp_path: Path, tools_log: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing tampered: the daemon holds the FIFO at `control`, takes `quit` and
    exits by itself (the stand-in removes its PID file only then)."""
    daemon = _daemon_in(tmp_path / "claim-a")
    pid_file = daemon.pipe_dir / "nvidia-cuda-mps-control.pid"
    removed = threading.Event()

    class Observed(NvidiaSharing):
        def _remove_tmpfs(self, folder: Path, purpose: str) -> None:
            if folder == daemon.pipe_dir and not pid_file.exists():
                removed.set()  # the daemon removed its own files: it took the quit
            super()._remove_tmpfs(folder, purpose)

    backend = Observed(
        mps_control=FAKEBIN / "nvidia-cuda-mps-control",
        env={TOOLS_LOG_ENV: str(tools_log)},
        ready_timeout_s=10.0,
    )
    with _running_daemon(backend, daemon) as (recorded, _):
        backend.stop_mps(recorded)
    assert _quits(tools_log) == ["mps-control quit"]
    assert removed.is_set()
    assert _tampered(caplog) == []


_RACING_CLIENT = """#!/bin/sh
# NVIDIA's client, as a container racing the agent makes it act: between the agent's
# look at the control pipe and the client's open of it by path, the container renames
# a FIFO it reads over `control`. Other calls go to the stand-in tool.
case "$1" in -d|-f) exec "$STANDIN" "$@" ;; esac
read -r line
if [ "$line" = quit ]; then
    p="$CUDA_MPS_PIPE_DIRECTORY"
    mkfifo -m 600 "$p/theirs"
    (exec 3<>"$p/theirs"; exec sleep 600) </dev/null >/dev/null 2>&1 &
    echo $! > "$READER_PID"
    exec 4>"$p/theirs"  # returns once the reader has it open
    mv "$p/theirs" "$p/control"
    printf 'quit\\n' > "$p/control" || exit 1
    exit 0
fi
printf '%s\\n' "$line" | exec "$STANDIN"
"""


def test_a_fifo_swapped_in_while_quit_is_sent_buys_no_wait(
    tmp_path: Path, tools_log: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The swap made after the agent's look: the client writes `quit` to the tenant's
    FIFO. The agent sees a new `control` made meanwhile, so it does not take the
    `quit` as the daemon's, and signals the daemon without waiting for it to quit."""
    caplog.set_level(logging.INFO, SHARING_LOG)
    reader_pid = tmp_path / "reader.pid"
    backend = _backend(
        tools_log,
        _mps_control_tool(tmp_path, _RACING_CLIENT),
        STANDIN=str(FAKEBIN / "nvidia-cuda-mps-control"),
        READER_PID=str(reader_pid),
    )
    try:
        with _running_daemon(backend, _daemon_in(tmp_path / "claim-a")) as (daemon, identity):
            backend.stop_mps(daemon)
    finally:
        if reader_pid.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(reader_pid.read_text()), signal.SIGKILL)
    assert reader_pid.exists()  # the client did send `quit`, to the tenant's FIFO
    assert [f["control"] for f in _tampered(caplog)] == ["was replaced while quit was sent"]
    assert not identity.alive()
    assert not daemon.pipe_dir.exists()


class SwapAfterTheLook:
    """The tenant's container, racing the agent's look at the control FIFO: the look
    opens `control` for writing (is anything reading?), and its close is what the
    container waits for, through inotify, to rename a FIFO of its own that nobody
    reads over `control`. NVIDIA's client, run a moment later, opens that FIFO by its
    path and blocks until a reader comes, which none does."""

    def __init__(self, pipe_dir: Path) -> None:
        self._pipe = pipe_dir
        os.mkfifo(pipe_dir / ".theirs", 0o600)
        self._watch = INotify()
        self._watch.add_watch(pipe_dir, iflags.CLOSE_WRITE)
        self.swapped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.swapped.is_set():
            for event in self._watch.read(timeout=100):
                if event.name == "control" and not self.swapped.is_set():
                    (self._pipe / ".theirs").rename(self._pipe / "control")
                    self.swapped.set()

    def close(self) -> None:
        self.swapped.set()
        self._thread.join(5)
        self._watch.close()


def test_a_fifo_nobody_reads_swapped_in_after_the_look_cannot_hold_the_stop(
    tmp_path: Path, tools_log: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The client blocked on the tenant's FIFO would hold the stop, and one of the
    node's stop slots, for the tool's whole timeout. The watch of the pipe folder sees
    the new `control` while the client runs: the client is killed, the folder named as
    tampered, and the daemon ended by signal."""
    caplog.set_level(logging.INFO, SHARING_LOG)
    backend = _backend(tools_log, timeout_s=_TOOL_TIMEOUT_S)
    with _running_daemon(backend, _daemon_in(tmp_path / "claim-a")) as (daemon, identity):
        tenant = SwapAfterTheLook(daemon.pipe_dir)
        try:
            _stopped_within_the_guard(backend, daemon)
        finally:
            tenant.close()
    assert tenant.swapped.is_set()
    assert [f["control"] for f in _tampered(caplog)] == ["was replaced while quit was sent"]
    assert not identity.alive()
    assert not daemon.pipe_dir.exists()


@pytest.mark.anyio
async def test_a_tenants_swapped_fifos_take_no_quit_from_the_unprepare_of_its_claims(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """As many tampered claims as stops may run at once, unprepared together: none of
    the tenant's FIFOs gets a `quit` (which would hold each stop slot for the ready
    timeout), each claim is named as tampered, and every daemon is ended."""
    caplog.set_level(logging.INFO, SHARING_LOG)
    emu = h100()
    gpus = discover(emu).gpus
    preparer = node_preparer(
        node, emu, sharing=NvidiaSharing(
            nvidia_smi=FAKEBIN / "nvidia-smi", mps_control=FAKEBIN / "nvidia-cuda-mps-control"
        )
    )  # fmt: skip
    slice_of = {"device": gpus[5].device.name, "consumedCapacity": {"memory": "1Gi"}}
    claims = [
        offline_claim("tenant-a", [("mem", {**slice_of, "shareID": str(uuid.uuid4())})], {})
        for _ in range(MPS_THREADS)
    ]
    assert [r.error for r in (await preparer.prepare(claims)).values()] == [None] * len(claims)
    daemons = [_recorded_daemon(node, c.uid) for c in claims]
    tenants = [FifoReader(_mps_base(node, c.uid) / "pipe") for c in claims]
    try:
        out = await preparer.unprepare([c.ref for c in claims])
    finally:
        got = [t.close() for t in tenants]
        for d in daemons:
            _ended(d)
    assert out == {c.uid: None for c in claims}
    assert got == [b""] * len(claims)
    assert sorted(f["claim"] for f in _tampered(caplog)) == sorted(c.uid for c in claims)
    assert not any(d.alive() for d in daemons)


# --- a daemon that listens on a UNIX socket, as NVIDIA's current one does ---------------

_SOCKET_TOOL = """#!{python}
# nvidia-cuda-mps-control as current releases are: the daemon (-d) listens on a UNIX
# socket `control`; the client sends each line of its input through a connection.
import os, socket, sys
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
path = os.path.join(pipe, "control")
if sys.argv[1:] == ["-d"]:
    if os.fork():
        sys.exit(0)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    with open(os.path.join(pipe, "nvidia-cuda-mps-control.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        conn, _ = server.accept()
        line = conn.makefile().readline().strip()
        with open(os.environ["TAKEN"], "a") as f:
            f.write(line + "\\n")
        if line == "quit":
            os.unlink(path)
            sys.exit(0)
for line in sys.stdin:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    client.sendall(line.encode())
    client.close()
"""


@pytest.fixture
def socket_tool(tmp_path: Path) -> Path:
    return _mps_control_tool(tmp_path, _SOCKET_TOOL.format(python=sys.executable))


def test_a_socket_daemon_gets_the_quit_and_a_socket_a_tenant_swaps_in_does_not(
    tmp_path: Path, tools_log: Path, socket_tool: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon's socket file is not the socket its descriptor shows: the kernel's
    record of which socket is bound to which file says whose the file at `control`
    is. The daemon's own gets `quit`; one a tenant binds there gets no connection."""
    caplog.set_level(logging.INFO, SHARING_LOG)
    taken = tmp_path / "taken"
    backend = _backend(tools_log, socket_tool, TAKEN=str(taken))
    with _running_daemon(backend, _daemon_in(tmp_path / "claim-a")) as (own, _):
        backend.stop_mps(own)
    assert taken.read_text() == "quit\n"  # the daemon took it and quit by itself

    taken.unlink()
    with (
        _running_daemon(backend, _daemon_in(tmp_path / "claim-b")) as (swapped, second),
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as tenant,
    ):
        (swapped.pipe_dir / "control").unlink()
        tenant.bind(str(swapped.pipe_dir / "control"))
        tenant.listen()
        tenant.setblocking(False)
        backend.stop_mps(swapped)
        with pytest.raises(BlockingIOError):
            tenant.accept()  # no connection came
    assert not taken.exists()
    assert not second.alive()
    assert [f["claim"] for f in _tampered(caplog)] == ["claim-b"]


class ExchangedSockets:
    """The tenant's container against a socket daemon, whose look opens nothing it can
    see: it keeps exchanging (renameat2 RENAME_EXCHANGE) the daemon's socket file with
    one of its own whose backlog is full, so a client connecting by path to it blocks."""

    _EXCHANGE: Final = 2

    def __init__(self, pipe_dir: Path) -> None:
        self._theirs = pipe_dir / ".theirs"
        self._control = pipe_dir / "control"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self._theirs))
        self._server.listen(0)
        self._filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._filler.connect(str(self._theirs))  # the backlog is full: connect() blocks
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.exchanges = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        at_cwd = -100
        while not self._stop.wait(0.0005):
            if (
                self._libc.renameat2(
                    at_cwd, bytes(self._theirs), at_cwd, bytes(self._control), self._EXCHANGE
                )
                == 0
            ):
                self.exchanges += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._filler.close()
        self._server.close()


def test_a_socket_exchanged_back_and_forth_with_the_daemons_cannot_hold_the_stop(
    tmp_path: Path, tools_log: Path, socket_tool: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """However the exchanges fall against the look and the client's connect, the stop
    ends without waiting for the client the tenant's full backlog holds: a look that
    sees the tenant's socket sends no `quit`; one that sees the daemon's sends it while
    the watch sees every exchange, and the client is killed at the first. Each of a
    few rounds ends the daemon and names the folder as tampered."""
    caplog.set_level(logging.INFO, SHARING_LOG)
    backend = _backend(
        tools_log, socket_tool, timeout_s=_TOOL_TIMEOUT_S, TAKEN=str(tmp_path / "taken")
    )
    for round_ in range(3):
        with _running_daemon(backend, _daemon_in(tmp_path / f"claim-{round_}")) as (
            daemon,
            identity,
        ):
            tenant = ExchangedSockets(daemon.pipe_dir)
            try:
                _stopped_within_the_guard(backend, daemon)
            finally:
                tenant.close()
            assert tenant.exchanges > 0
            assert not identity.alive()
    assert [f["claim"] for f in _tampered(caplog)] == [f"claim-{i}" for i in range(3)]


# --- a daemon pod ------------------------------------------------------------------------


def test_a_daemon_pods_fifo_a_tenant_swaps_in_and_reads_never_gets_the_quit(
    tmp_path: Path, tools_log: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent sees no process of a pod: the control file the daemon pod made, as
    noted at its start, is the daemon's. The tenant's FIFO is not: no `quit`, and the
    pod is deleted at once rather than waited for."""
    caplog.set_level(logging.INFO, SHARING_LOG)
    pods = ProcessPods()
    backend = pod_sharing(pods, tools_log)
    daemon = pod_daemon(tmp_path)
    pod = backend.start_mps(daemon)
    assert isinstance(pod, DaemonPod)
    tenant = FifoReader(daemon.pipe_dir)
    try:
        backend.stop_mps(pod_daemon(tmp_path, pod))
    finally:
        got = tenant.close()
        pods.remove(daemon.name, None, 5.0)
    assert got == b""
    assert "mps-control quit" not in calls(tools_log)
    assert [f["claim"] for f in _tampered(caplog)] == [daemon.name]
    assert not pods.pods


def test_a_daemon_pod_an_earlier_run_started_is_deleted_without_quit(
    tmp_path: Path, tools_log: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent that did not start the pod (a restart, an upgrade) has no note of its
    control file, so nothing tells the daemon's from a tenant's: the pod's deletion
    ends the daemon."""
    caplog.set_level(logging.INFO, SHARING_LOG)
    pods = ProcessPods()
    pod = pod_sharing(pods, tools_log).start_mps(pod_daemon(tmp_path))
    assert isinstance(pod, DaemonPod)
    pod_sharing(pods, tools_log).stop_mps(pod_daemon(tmp_path, pod))
    assert "mps-control quit" not in calls(tools_log)
    assert not pods.pods
    assert _tampered(caplog) == []
    assert not (tmp_path / "pipe").exists()


# --- a record that names no daemon (an older release's, an orphaned folder) -------------


@contextlib.contextmanager
def _reader_in_a_pod(pipe_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The tenant's container: in a PID namespace of its own, it reads a FIFO of its
    own at `control`, and its environment names the pipe folder as the agent sees it,
    as a daemon's does."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) for a PID namespace")
    control = pipe_dir / "control"
    control.unlink(missing_ok=True)
    os.mkfifo(control, 0o600)
    script = 'exec 3<>"$1" && echo ready && exec sleep 600'
    proc = subprocess.Popen(
        [unshare, "--pid", "--fork", "--kill-child", "--", "env",
         f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}", "sh", "-c", script, "sh", str(control)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_without_a_recorded_daemon_a_tenants_reader_neither_gets_quit_nor_keeps_the_claim(
    tmp_path: Path, tools_log: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon is gone and the record names none; the tenant reads a FIFO of its
    own at `control`, its environment made to look like a daemon's. No process of the
    agent's PID namespace was started for the folder: no `quit`, the stop completes
    (every time, not once the reader is gone), and the log says a daemon may be left
    and how to find one, without calling the reader the daemon."""
    caplog.set_level(logging.INFO, SHARING_LOG)
    backend = _backend(tools_log)
    daemon = _daemon_in(tmp_path / "claim-a")
    identity = backend.start_mps(daemon)
    assert isinstance(identity, ProcessIdentity)
    _ended(identity)
    (daemon.pipe_dir / "nvidia-cuda-mps-control.pid").unlink(missing_ok=True)
    with _reader_in_a_pod(daemon.pipe_dir) as tenant:
        backend.stop_mps(daemon)
        assert tenant.poll() is None  # the tenant's process was not signalled
    assert _quits(tools_log) == []
    assert not daemon.pipe_dir.exists()
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("no MPS daemon process found")
    ]
    assert len(warnings) == 1
    assert f"CUDA_MPS_PIPE_DIRECTORY={daemon.pipe_dir}" in warnings[0]
    assert "nvidia-cuda-mps-control process" not in caplog.text


@pytest.mark.anyio
async def test_an_older_releases_record_is_unprepared_while_a_tenant_reads_its_control(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """A record from before daemons were recorded, its PID file removed, its control
    pipe swapped by a container that still runs and reads it: the unprepare completes
    and forgets the claim. The daemon, a process of the agent's namespace started for
    the folder, is found and signalled; `quit` goes nowhere."""
    caplog.set_level(logging.INFO, SHARING_LOG)
    claim = _fixture_claim(_MPS_CLAIM)
    assert (await node_preparer(node, h100()).prepare([claim]))[claim.uid].error is None
    daemon = _recorded_daemon(node, claim.uid)
    pipe = _mps_base(node, claim.uid) / "pipe"
    try:
        _as_an_older_release_recorded(node, claim.uid)
        with _reader_in_a_pod(pipe):
            upgraded = node_preparer(node, h100())
            assert (await upgraded.recover()).errors == ()
            assert await upgraded.unprepare([claim.ref]) == {claim.uid: None}
    finally:
        _ended(daemon)
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).get(claim.uid) is None
    assert not any(line.startswith("mps-control quit") for line in node.tool_calls())
    assert not daemon.alive()
    assert [f["claim"] for f in _tampered(caplog)] == [claim.uid]
    assert not _mps_base(node, claim.uid).exists()
