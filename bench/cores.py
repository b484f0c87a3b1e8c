"""Holding benchmark processes to cores, and putting them back afterwards.

A process's affinity is per thread on Linux: `sched_setaffinity(pid)` moves only the
thread whose ID is `pid`, and a Go server or a Python one with worker threads keeps
the rest where they were. So every thread is moved; threads started later inherit
their creator's set. What a bench moves it puts back as it was, because the cluster's
processes outlive one bench and the next one must not find them confined.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType


def usable_cores() -> frozenset[int]:
    """The cores this process may run on (a container's cpuset, not the host's count)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return frozenset(range(os.cpu_count() or 1))


def split_cores(cores: frozenset[int]) -> tuple[frozenset[int], frozenset[int]] | None:
    """Two disjoint halves, the lower cores first; None with fewer than two cores."""
    if len(cores) < 2:
        return None
    ordered = sorted(cores)
    half = len(ordered) // 2
    return frozenset(ordered[:half]), frozenset(ordered[half:])


def affinity(pid: int) -> frozenset[int] | None:
    """The cores `pid`'s main thread may run on; None once it is gone."""
    try:
        return frozenset(os.sched_getaffinity(pid))
    except OSError:
        return None


def pin_threads(pid: int, cores: frozenset[int]) -> bool:
    """Hold every thread of `pid` (0: this process) to `cores`; False when none moved."""
    root = Path(f"/proc/{pid or os.getpid()}/task")
    try:
        tids = [int(task.name) for task in root.iterdir()]
    except OSError:
        return False
    moved = False
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            continue
        moved = True
    return moved


class Pinning:
    """Processes held to cores for the length of a `with` block, each put back on the
    cores its main thread had before."""

    def __init__(self) -> None:
        self._before: dict[int, frozenset[int]] = {}

    def pin(self, pid: int, cores: frozenset[int]) -> bool:
        before = affinity(pid)
        if before is None:
            return False
        self._before.setdefault(pid, before)
        return pin_threads(pid, cores)

    def restore(self) -> None:
        for pid, cores in self._before.items():
            pin_threads(pid, cores)
        self._before.clear()

    def __enter__(self) -> Pinning:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.restore()
