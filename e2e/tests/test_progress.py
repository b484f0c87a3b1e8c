"""Long first-run steps say what they do: a start line, a heartbeat while they run and an
end line with the time, on stderr, for the bash build scripts (e2e/progress.sh) and the
Python steps (e2e/progress.py). The fake steps run until their own heartbeat appears,
so the tests last seconds and assert only which lines are there."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from e2e.progress import BuildFailed, build_script, step

E2E = Path(__file__).resolve().parents[1]
PROGRESS_SH = E2E / "progress.sh"
# A heartbeat every second, so the fake steps wait about a second for theirs.
FAST = {**os.environ, "GPUDRA_PROGRESS_INTERVAL": "1"}


def _bash(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f". {PROGRESS_SH}\n{script}", "bash", *args],
        capture_output=True,
        text=True,
        env=FAST,
        timeout=60,
        check=False,
    )


def test_bash_step_prints_start_heartbeat_and_end_on_stderr(tmp_path: Path) -> None:
    log = tmp_path / "stderr"
    proc = _bash(
        'progress_run "waiting for a heartbeat" "a fake slow step" "a few seconds" '
        'bash -c \'until grep -q "still waiting" "$1"; do sleep 0.1; done\' _ "$1" 2>>"$1"',
        str(log),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # callers read a build's result from stdout
    lines = log.read_text().splitlines()
    assert lines[0] == "waiting for a heartbeat: a fake slow step (first run: a few seconds)"
    assert any(ln.startswith("  still waiting for a heartbeat (") for ln in lines[1:-1])
    assert lines[-1].startswith("waiting for a heartbeat: done in ")


def test_bash_step_that_fails_says_so_and_returns_its_status() -> None:
    proc = _bash('progress_run "failing" "a fake step" "no time" bash -c "exit 3"; echo "rc=$?"')
    assert proc.stdout == "rc=3\n"
    assert proc.stderr.splitlines()[-1].startswith("failing: failed after ")


def test_python_step_prints_start_heartbeat_and_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUDRA_PROGRESS_INTERVAL", "1")
    out = io.StringIO()
    with step("waiting for a heartbeat", "a fake slow step", "a few seconds", out=out):
        deadline = time.monotonic() + 30
        while "still" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = out.getvalue().splitlines()
    assert lines[0] == "waiting for a heartbeat: a fake slow step (first run: a few seconds)"
    assert any(ln.startswith("  still waiting for a heartbeat (") for ln in lines[1:-1])
    assert lines[-1].startswith("waiting for a heartbeat: done in ")


def test_python_step_that_raises_says_so() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), step("failing", "a fake step", "no time", out=out):
        raise RuntimeError("boom")
    assert out.getvalue().splitlines()[-1].startswith("failing: failed after ")


def _fake_go(bin_dir: Path) -> None:
    """`go install pkg@v`: writes an empty executable named after pkg into GOBIN."""
    bin_dir.mkdir()
    go = bin_dir / "go"
    go.write_text(
        "#!/usr/bin/env bash\n"
        "pkg=${@: -1}; name=${pkg%@*}; name=${name##*/}\n"
        'mkdir -p "$GOBIN" && printf "#!/bin/sh\\n" > "$GOBIN/$name" && chmod +x "$GOBIN/$name"\n'
    )
    go.chmod(0o755)


def test_cold_build_script_keeps_stdout_for_its_result(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The helm build with a stand-in `go`: the progress reaches our stderr as it comes,
    and the caller still gets the binary's path from stdout."""
    _fake_go(tmp_path / "bin")
    env = {
        **FAST,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "GPUDRA_CACHE": str(tmp_path / "cache"),
    }
    helm = build_script(E2E / "tools" / "build-helm.sh", prefix="build-helm", what="helm", env=env)
    assert helm.is_file()
    assert helm.is_relative_to(tmp_path / "cache")
    err = capfd.readouterr().err.splitlines()
    assert err[0].startswith("building helm v")
    assert "(first run: " in err[0]
    assert err[-1].startswith("building helm v")
    assert ": done in " in err[-1]


def test_failed_build_script_raises_its_own_last_error_line(tmp_path: Path) -> None:
    script = tmp_path / "build.sh"
    script.write_text(
        'echo "fake: fetching" >&2\necho "other output" >&2\n'
        'echo "fake: no toolchain: install one" >&2\nexit 2\n'
    )
    with pytest.raises(BuildFailed, match=r"^no toolchain: install one$"):
        build_script(script, prefix="fake", what="the fake build")
    quiet = tmp_path / "quiet.sh"
    quiet.write_text("exit 1\n")
    with pytest.raises(BuildFailed, match=r"^the fake build failed \(see above\)$"):
        build_script(quiet, prefix="fake", what="the fake build")


def test_progress_py_runs_without_the_venv() -> None:
    """e2e/bootstrap_venv.py uses it with the system python, before the venv exists."""
    proc = subprocess.run(
        [sys.executable, "-S", "-c", "import sys; sys.path.insert(0, '.'); import e2e.progress"],
        cwd=E2E.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_the_per_test_limit_leaves_a_fixtures_first_build_alone(tmp_path: Path) -> None:
    """A fresh machine builds each pinned tool in the session fixture of the first test
    that asks for it, for minutes: the project's pytest settings bound the test's body,
    not its fixtures. Run here with a 1 s limit, a fixture of 2 s passes and a body of
    3 s is cut."""
    options = tomllib.loads((E2E.parent / "pyproject.toml").read_text())["tool"]["pytest"]
    func_only = options["ini_options"]["timeout_func_only"]
    (tmp_path / "pytest.ini").write_text(
        f"[pytest]\ntimeout = 1\ntimeout_func_only = {str(func_only).lower()}\n"
    )
    (tmp_path / "test_limits.py").write_text(
        "import time\n"
        "import pytest\n\n"
        "@pytest.fixture(scope='session')\n"
        "def built():\n"
        "    time.sleep(2)\n\n"
        "def test_after_a_long_build(built):\n"
        "    pass\n\n"
        "def test_a_long_body():\n"
        "    time.sleep(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert "PASSED test_limits.py::test_after_a_long_build" in proc.stdout, proc.stdout
    assert "FAILED test_limits.py::test_a_long_body - Failed: Timeout" in proc.stdout
