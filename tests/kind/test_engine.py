"""The private Docker engine's parts that need no engine: the refusal without root, the
command line that keeps the host unchanged, and the config that makes the capability
filter the default runtime. Starting it for real is e2e/tests/test_kind_host.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.kind import engine as eng

REPO = Path(__file__).resolve().parents[2]


def test_without_root_it_refuses_with_the_cause_and_the_fix() -> None:
    code = "from e2e.kind.engine import start_problem; print(start_problem())"
    argv = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv is missing to drop it")
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    if proc.returncode != 0 and "Permission denied" in proc.stderr:
        pytest.skip("this checkout is not readable by an unprivileged user")
    line = proc.stdout.strip()
    assert "needs root" in line and "DOCKER_HOST" in line
    assert "\n" not in line


def test_dockerd_changes_neither_firewall_nor_mounts_of_the_host(tmp_path: Path) -> None:
    layout = eng.EngineLayout(tmp_path)
    argv = eng.dockerd_argv(layout, "/usr/sbin/dockerd")
    assert argv[:4] == ["unshare", "--mount", "--propagation", "private"]
    assert "mount -t tmpfs" in argv[6] and "/run" in argv[6]
    for flag in ("--iptables=false", "--ip-masq=false", "--ip-forward=false", "--bridge=none"):
        assert flag in argv
    assert argv[argv.index("--host") + 1] == f"unix://{layout.socket}"
    for key, path in (("--data-root", layout.data), ("--exec-root", layout.exec_root)):
        assert Path(argv[argv.index(key) + 1]).is_relative_to(tmp_path) and path.parent == tmp_path


def test_the_capability_filter_is_the_default_runtime(tmp_path: Path) -> None:
    layout = eng.EngineLayout(tmp_path)
    config = eng.daemon_config(layout)
    runtimes = config["runtimes"]
    assert isinstance(runtimes, dict)
    assert runtimes[config["default-runtime"]] == {"path": str(layout.runtime)}
    assert config["cgroup-parent"] == f"/{layout.cgroup_parent}"
    assert layout.cgroup_parent != eng.EngineLayout(tmp_path / "other").cgroup_parent


def test_a_dockerd_that_fails_to_start_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in dockerd that exits at once: one line with its error and the log's
    place, and no socket, process, cgroup or bind source left."""
    if problem := eng.start_problem():
        pytest.skip(f"the engine cannot start here at all: {problem}")
    fake = tmp_path / "bin" / "dockerd"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'level=error msg=\"no storage driver\"' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    layout = eng.EngineLayout(tmp_path / "engine")
    bind_sources = [p for p in eng.HOST_BIND_SOURCES if p.exists()]
    with pytest.raises(eng.EngineError, match="no storage driver") as failed:
        eng.Engine(layout).start(log=lambda _m: None)
    assert "\n" not in str(failed.value) and str(layout.log) in str(failed.value)
    assert not layout.socket.exists() and not layout.pidfile.exists()
    assert [p for p in eng.HOST_BIND_SOURCES if p.exists()] == bind_sources
    assert not any((m / layout.cgroup_parent).exists() for m in eng.cgroup_mounts())
    needle = str(layout.root).encode()
    assert not [p for p in Path("/proc").glob("[0-9]*") if needle in _cmdline(p)]


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_engine_env_points_docker_at_its_own_socket(tmp_path: Path) -> None:
    engine = eng.Engine(eng.EngineLayout(tmp_path))
    assert engine.env()["DOCKER_HOST"] == f"unix://{tmp_path / 'docker.sock'}"
    assert not engine.is_running()
