"""The slices benchmark's thread limit per worker: a bad value is refused by name."""

from __future__ import annotations

import pytest

from bench.slices import worker_threads


def test_worker_threads_takes_a_positive_whole_number() -> None:
    assert worker_threads("1") == 1
    assert worker_threads("40") == 40


@pytest.mark.parametrize("value", ["0", "-2", "two", ""])
def test_worker_threads_refuses_anything_else_naming_the_setting(value: str) -> None:
    with pytest.raises(SystemExit, match=r"BENCH_WORKER_THREADS=.*1 or more \(default 1\)"):
        worker_threads(value)
