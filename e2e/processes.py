"""Host processes the harness starts itself (the control plane, a real node, the driver
run as host processes) and the loopback ports they listen on.

One module for the control plane (`e2e.cluster.harness`) and the real node
(`e2e.node`), so both tell their own processes apart and stop them the same way: by
PID plus a part of the command line, because PIDs get reused and a bare PID could name
someone else's process after a crash.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def alive(pid: int, cmdline_hint: str) -> bool:
    """True if `pid` runs and is still the process we started (PIDs get reused)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    return cmdline_hint in cmd


def commands() -> Iterator[tuple[int, list[bytes]]]:
    """Each process's PID and argv; one that exits while this reads is skipped."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        yield int(proc.name), argv


def naming(root: Path) -> list[int]:
    """The processes, other than this one and its parent, with an argument that is
    `root` or a path under it: what a node's own processes started there."""
    whole = str(root).encode()
    under = whole + b"/"
    ours = {os.getpid(), os.getppid()}
    return sorted(
        pid
        for pid, argv in commands()
        if pid not in ours and any(a == whole or a.startswith(under) for a in argv)
    )


def spawn_logged(
    argv: list[str], log: Path, cwd: Path, env: dict[str, str] | None
) -> subprocess.Popen[bytes]:
    """A background process in its own session (a signal to us does not reach it), its
    output appended to `log`; the caller records its PID."""
    with log.open("ab") as logf:
        return subprocess.Popen(
            argv,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=cwd,
            env=env,
        )


def stop_pid(pid: int, hint: str, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; nothing when `pid` is no longer ours."""
    if not alive(pid, hint):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive(pid, hint):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    if alive(pid, hint):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def port_free(port: int) -> bool:
    """Whether a listener could bind `port` on loopback now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def free_port() -> int:
    """A loopback port no one listens on now, for a server the caller starts next."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
