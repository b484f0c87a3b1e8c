"""bench-prepare's profile of the node's event loop, as the results print it: the call
counts its note explains must mean what the note says on the Python we run."""

from __future__ import annotations

import asyncio
import cProfile
from pathlib import Path

from bench.prepare import CALLS_NOTE, profile_summary

CYCLES = 50


async def _one_request() -> None:
    """A coroutine shaped like a GET: called once, suspended once while it waits."""
    await asyncio.sleep(0)


async def _cycles() -> None:
    for _ in range(CYCLES):
        await _one_request()


def test_a_coroutine_that_awaits_once_counts_two_entries_per_call(tmp_path: Path) -> None:
    profiler = cProfile.Profile()
    profiler.runcall(asyncio.run, _cycles())
    path = tmp_path / "node.prof"
    profiler.dump_stats(path)

    summary = profile_summary(path, CYCLES, top=10_000)

    rows = [r for r in summary["top_own_time"] if r["function"].endswith("(_one_request)")]
    assert len(rows) == 1
    # Called once a cycle, yet entered twice: the second entry is its resumption.
    assert rows[0]["calls_per_cycle"] == 2.0
    assert "awaits once per call shows two" in CALLS_NOTE
    assert set(rows[0]) == {
        "function",
        "calls_per_cycle",
        "own_ms_per_cycle",
        "cumulative_ms_per_cycle",
    }
