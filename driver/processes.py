"""A process named so that it cannot be mistaken for another: PID and start time.

A PID alone is reused once its process exits, and a PID read from a file that
someone else can write names whatever process they like. So a process the agent
will later stop (an MPS control daemon) is recorded by the agent itself, in its
checkpoint, as its PID and its start time (field 22 of `/proc/<pid>/stat`, in
clock ticks since boot): a process with that PID but another start time is a
different one and is never signalled.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["ProcessIdentity", "start_time"]

_PROC: Final = Path("/proc")
# /proc/<pid>/stat after the ")" that closes the command name: field 3 (state) is
# the first, so field 22 (starttime) is the 20th.
_STATE: Final = 0
_STARTTIME: Final = 19


def start_time(pid: int, proc: Path = _PROC) -> int | None:
    """The start time of live process `pid`, or None when there is none (a zombie
    has exited: only its parent's wait is missing)."""
    if pid <= 0:
        return None
    try:
        stat = (proc / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name may hold spaces and parentheses; the last ")" ends it.
    fields = stat[stat.rfind(")") + 1 :].split()
    if len(fields) <= _STARTTIME or fields[_STATE] in ("Z", "X"):
        return None
    try:
        return int(fields[_STARTTIME])
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """One process: `pid` while it has `start_time`."""

    pid: int
    start_time: int

    @classmethod
    def of(cls, pid: int, proc: Path = _PROC) -> ProcessIdentity | None:
        """The identity of live process `pid` now, or None."""
        started = start_time(pid, proc)
        return None if started is None else cls(pid, started)

    def alive(self, proc: Path = _PROC) -> bool:
        """Whether this very process still runs (not merely its PID)."""
        return start_time(self.pid, proc) == self.start_time

    def signal(self, signum: signal.Signals, proc: Path = _PROC) -> bool:
        """Send `signum` if this process still runs; False when it is gone.

        The check and the kill are not atomic, but a PID is only reused after the
        process was reaped and the kernel hands PIDs out in turn, so the window is
        far shorter than a cycle through the PID space.
        """
        if not self.alive(proc):
            return False
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def wait_gone(self, timeout_s: float, proc: Path = _PROC) -> bool:
        """Wait up to `timeout_s` for the process to exit; whether it did."""
        deadline = time.monotonic() + timeout_s
        while self.alive(proc):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True
