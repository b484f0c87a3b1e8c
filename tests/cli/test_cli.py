"""The `gpudra` entry point lists exactly the commands that exist, and bad input
gets one clear line."""

from __future__ import annotations

import subprocess
import sys

from gpudra.cli.main import build_parser


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpudra.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_help_lists_only_registered_commands() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    registered = set(sub.choices)  # type: ignore[arg-type]
    assert registered == {"node", "webhook"}
    out = run("--help").stdout
    for name in registered:
        assert f"    {name} " in out
        assert run(name, "--help").returncode == 0


def test_unknown_profile_is_one_clear_line() -> None:
    proc = run("node", "--node-name", "n1", "--nvml", "emulated:nope")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "gpudra node: --nvml: unknown NVML profile 'nope'; known profiles: a100-40gb-mig-mixed, "
        "h100-80gb-hbm3-x8, h100-80gb-hbm3-x8-mig, l4, t4"
    ]


def test_node_name_required() -> None:
    proc = run("node", "--nvml", "emulated:l4")
    assert "--node-name is required" in proc.stderr


def test_webhook_port_range() -> None:
    proc = run("webhook", "--cert-dir", "/nonexistent", "--port", "70000")
    assert proc.stderr.strip() == "gpudra webhook: --port 70000 is out of range (1-65535)"
