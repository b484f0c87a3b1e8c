"""Holding bench processes to cores: every thread moves, and each goes back after."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench.cores import Pinning, affinity, pin_threads, split_cores, usable_cores


def test_split_cores_gives_two_disjoint_halves_lower_first() -> None:
    assert split_cores(frozenset({0})) is None
    assert split_cores(frozenset({0, 1})) == (frozenset({0}), frozenset({1}))
    assert split_cores(frozenset({7, 2, 5, 3})) == (frozenset({2, 3}), frozenset({5, 7}))
    # An odd count gives the upper half the extra core: the side that runs the rest.
    assert split_cores(frozenset({0, 1, 2})) == (frozenset({0}), frozenset({1, 2}))


def thread_cores(pid: int) -> dict[int, frozenset[int]]:
    return {
        int(t.name): frozenset(os.sched_getaffinity(int(t.name)))
        for t in Path(f"/proc/{pid}/task").iterdir()
    }


@pytest.mark.skipif(len(usable_cores()) < 2, reason="needs two cores to move a process")
def test_pinning_moves_every_thread_and_puts_each_process_back() -> None:
    # A child with a second thread: moving only the pid's own thread would leave it out.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, sys; threading.Thread(target=sys.stdin.read).start(); "
            "print('up', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        before = affinity(child.pid)
        assert before is not None and len(thread_cores(child.pid)) >= 2
        one = frozenset({min(before)})
        with Pinning() as pinning:
            assert pinning.pin(child.pid, one)
            assert set(thread_cores(child.pid).values()) == {one}
        assert set(thread_cores(child.pid).values()) == {before}
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(len(usable_cores()) < 2, reason="needs two cores to move a process")
def test_pinning_this_process_covers_its_threads_and_a_thread_started_inside() -> None:
    before = affinity(0)
    assert before is not None
    one = frozenset({max(before)})
    seen: list[frozenset[int]] = []
    with Pinning() as pinning:
        assert pinning.pin(0, one)
        worker = threading.Thread(target=lambda: seen.append(frozenset(os.sched_getaffinity(0))))
        worker.start()
        worker.join()
        assert affinity(0) == one
    assert seen == [one]
    assert affinity(0) == before


def test_a_process_that_is_gone_is_not_pinned() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert affinity(child.pid) is None
    assert not pin_threads(child.pid, usable_cores())
    with Pinning() as pinning:
        assert not pinning.pin(child.pid, usable_cores())
