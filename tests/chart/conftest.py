"""Shared by the chart tests: the real helm binary, built once and cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.tools import helm as h
from e2e.tools import prometheus as p


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return h.helm_binary()
    except h.HelmUnavailable as e:
        pytest.skip(f"helm could not be built: {e}")


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    """The folder with the pinned promtool and prometheus, built once and cached."""
    try:
        return p.bin_dir()
    except p.PrometheusUnavailable as e:
        pytest.skip(f"prometheus could not be built: {e}")
