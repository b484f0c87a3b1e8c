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


def test_bad_shared_gpus_is_one_line_naming_the_flag_and_the_forms() -> None:
    proc = run("node", "--node-name", "n1", "--nvml", "emulated:l4", "--shared-gpus", "first")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "gpudra node: --shared-gpus 'first': 'first' is neither a GPU index nor a GPU UUID; "
        "give none, all, or a comma-separated list of GPU indices and/or GPU UUIDs "
        "(e.g. 0,3 or GPU-86737bf0-609a-5b5b-b9e7-de8873112c51)"
    ]


def test_shared_gpus_reach_the_agent_config() -> None:
    from gpudra.cli.node import _agent_config  # noqa: PLC0415 - the unit under test
    from gpudra.driver.devices import SharedGpus  # noqa: PLC0415

    parser = build_parser()
    default = _agent_config(parser.parse_args(["node", "--node-name", "n1"]))
    assert default.shared_gpus == SharedGpus()
    args = parser.parse_args(["node", "--node-name", "n1", "--shared-gpus", "0,5"])
    assert _agent_config(args).shared_gpus == SharedGpus(indices=frozenset({0, 5}))
    args = parser.parse_args(["node", "--node-name", "n1", "--shared-gpus", "all"])
    assert _agent_config(args).shared_gpus.every
