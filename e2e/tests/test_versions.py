"""`make test-versions`: the pinned versions, the table it prints from a real pytest
report, and a clear line for a version that is not pinned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from e2e import versions
from e2e.cluster.harness import REPO


def test_every_pinned_minor_is_offered_in_order() -> None:
    pins = versions.pinned()
    assert list(pins) == ["1.34", "1.35", "1.36", "1.37"]
    assert all(pin.startswith(f"v{minor}.") for minor, pin in pins.items())


def test_unknown_version_names_the_supported_ones() -> None:
    with pytest.raises(SystemExit, match=r"unknown version\(s\) 1.99 .* supported are 1.34, "):
        versions.chosen("1.34,1.99", versions.pinned())
    assert versions.chosen("", versions.pinned()) == ["1.34", "1.35", "1.36", "1.37"]
    assert versions.chosen("v1.37, 1.34", versions.pinned()) == ["1.37", "1.34"]


def test_table_counts_a_real_report_with_skip_reasons(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_ok2(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('setup')\n"
        "def test_error(broken): pass\n"
        "def test_gone(): pytest.skip('the API server drops X: G is off')\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_gone2(n): pytest.skip('the API server drops X: G is off')\n"
    )
    report = tmp_path / "junit.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            str(tmp_path / "test_sample.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        check=False,
    )
    row = versions.Row("v1.34.12", seconds=75)
    versions.read_junit(report, row)
    assert (row.passed, row.failed, dict(row.skipped)) == (
        2,
        2,
        {"the API server drops X: G is off": 3},
    )
    assert versions.table([row, versions.Row("v1.37.1", failed=1, error="build failed: x")]) == (
        "| version | passed | failed | skipped | time |\n"
        "| --- | --- | --- | --- | --- |\n"
        "| v1.34.12 | 2 | 2 | 3 | 1m15s |\n"
        "| v1.37.1 | 0 | 1 (build failed: x) | 0 | 0s |\n"
        "- v1.34.12: 3 skipped: the API server drops X: G is off"
    )


def test_make_target_runs_the_matrix() -> None:
    out = subprocess.run(
        ["make", "-n", "test-versions", "VERSIONS=1.34"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert '-m e2e.versions --versions "1.34"' in out
