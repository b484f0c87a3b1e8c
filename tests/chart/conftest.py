"""Shared by the chart tests: the real helm binary, built once and cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.tools import helm as h


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return h.helm_binary()
    except h.HelmUnavailable as e:
        pytest.skip(f"helm could not be built: {e}")
