"""The open-files limit: raised to the hard one at the webhook's start, and the bound on
the webhook's connections follows what it leaves."""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterator

import pytest
from gpudra.common.openfiles import raise_open_files_limit
from gpudra.webhook.transport import connection_bound


@pytest.fixture
def low_soft_limit() -> Iterator[int]:
    """The process's soft limit lowered to 200 for the test, put back after it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 200:
        pytest.skip(f"the hard open-files limit is {hard}; the test needs more than 200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_is_raised_to_the_hard_one(low_soft_limit: int) -> None:
    assert raise_open_files_limit() == (200, low_soft_limit)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (low_soft_limit, low_soft_limit)
    assert raise_open_files_limit() == (low_soft_limit, low_soft_limit)  # nothing left to do


def test_the_connection_bound_leaves_room_under_the_limit(
    low_soft_limit: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gpudra.webhook.transport"):
        # Served connections and as many handshakes, one descriptor each.
        assert connection_bound(1024) == (200 - 64) // 2
    [record] = caplog.records
    assert "RLIMIT_NOFILE" in record.getMessage()
    caplog.clear()
    assert connection_bound(60) == 60  # within the limit: as configured, nothing said
    assert not caplog.records
    assert connection_bound(60, listeners=2) == (200 - 64) // 4  # and the health port's
