"""Shared by the chart tests: the real helm binary, built once and cached."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from e2e.pins import REPO, TOOL_VERSIONS, pinned
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


@pytest.fixture(scope="session")
def previous_release_file() -> Callable[[str], str]:
    """A file of the previous release (pinned in versions.env by tag and commit), by its
    path in the repository, as that release's commit has it."""
    commit = pinned("GPUDRA_PREVIOUS_RELEASE_COMMIT", TOOL_VERSIONS)

    def show(path: str) -> str:
        shown = subprocess.run(
            ["git", "show", f"{commit}:{path}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
        assert shown.returncode == 0, f"the previous release is not in this clone: {shown.stderr}"
        return shown.stdout

    return show
