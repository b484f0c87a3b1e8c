"""The `gpudra` entry point lists exactly the commands that exist, and bad input
gets one clear line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gpudra.cli.main import COMMANDS, build_parser, command_of
from gpudra.cli.node import (
    EMULATED_DRIVER_ROOT,
    EMULATED_NVML_STATE,
    EMULATED_TOOLS_LOG,
    _emulated_driver,
    _metrics_address,
    _nvml_state,
    _plugin_config,
)
from gpudra.driver.nvml import load_nvml
from gpudra.driver.nvml.standin import TOOLS_LOG_ENV

from tests.cli.stubs import gpudra

run = gpudra  # `gpudra ARGS` as the admin runs it


def test_help_lists_only_registered_commands() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    registered = set(sub.choices)  # type: ignore[arg-type]
    assert registered == {"devices", "migrate", "node", "report", "top", "webhook"}
    out = run("--help").stdout
    for name in registered:
        assert f"    {name} " in out
        assert run(name, "--help").returncode == 0


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["node", "--nvml", "emulated:l4"], "node"),
        (["--log-level", "debug", "webhook", "--cert-dir", "c"], "webhook"),
        (["--log-level=debug", "top", "-h"], "top"),
        (["--log", "debug", "report"], None),  # flags are taken in full only
        (["node", "--log-level", "nonsense"], "node"),
        # The full parser answers these, with every command in its usage.
        (["-h", "node"], None),
        (["--help"], None),
        ([], None),
        (["nodes"], None),
        (["--log-level"], None),
        (["--log-level", "nonsense", "node"], None),
    ],
)
def test_only_the_command_a_line_runs_is_registered(argv: list[str], command: str | None) -> None:
    """So `gpudra node` holds none of the other commands' code in memory."""
    assert command_of(argv) == command
    sub = next(a for a in build_parser(command)._actions if a.dest == "command")
    assert set(sub.choices) == ({command} if command else set(COMMANDS))  # type: ignore[arg-type]


def test_top_level_help_before_a_command_lists_every_command() -> None:
    out = run("-h", "node").stdout
    for name in COMMANDS:
        assert f"    {name} " in out


def test_unknown_profile_is_one_clear_line() -> None:
    proc = run("node", "--node-name", "n1", "--nvml", "emulated:nope")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "gpudra node: --nvml: unknown NVML profile 'nope'; known profiles: a100-40gb-mig-mixed, "
        "a100-40gb-mig-r535, a100-40gb-mig-r550, a100-40gb-mig-r570, a100-40gb-mig-r580, "
        "a100-40gb-mig-r590, h100-80gb-hbm3-x8, h100-80gb-hbm3-x8-mig, h100-80gb-mig-r535, "
        "h100-80gb-mig-r550, h100-80gb-mig-r570, h100-80gb-mig-r580, h100-80gb-mig-r590, "
        "l4, t4"
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


def test_emulated_gpus_get_a_stand_in_driver_and_numbered_nodes(tmp_path: Path) -> None:
    """No NVIDIA driver on the node: the plugin installs its own driver root under the
    state dir, numbers the device nodes, logs the tools' calls there, and keeps the
    emulated MIG state there; an explicit --driver-root is kept."""
    parser = build_parser()
    argv = ["node", "--node-name", "n1", "--nvml", "emulated:h100-80gb-hbm3-x8"]
    args = parser.parse_args([*argv, "--state-dir", str(tmp_path)])
    assert _nvml_state(args) == tmp_path / EMULATED_NVML_STATE
    nvml = load_nvml(args.nvml, state_path=_nvml_state(args))
    plugin = _emulated_driver(args, nvml, _plugin_config(args))
    assert plugin.driver_root == tmp_path / EMULATED_DRIVER_ROOT
    assert (plugin.driver_root / "usr/bin/nvidia-smi").is_file()
    assert plugin.device_numbers is not None
    assert plugin.device_numbers("/dev/nvidia0") == (195, 0)
    assert plugin.tool_env == {TOOLS_LOG_ENV: str(tmp_path / EMULATED_TOOLS_LOG)}

    given = parser.parse_args(
        [*argv, "--state-dir", str(tmp_path / "b"), "--driver-root", "/run/nvidia/driver"]
    )
    kept = _emulated_driver(given, nvml, _plugin_config(given))
    assert kept.driver_root == Path("/run/nvidia/driver")
    assert not (tmp_path / "b" / EMULATED_DRIVER_ROOT).exists()
    # Real GPUs keep their own state; without the plugin nothing is written.
    real = parser.parse_args(["node", "--node-name", "n1", "--state-dir", str(tmp_path)])
    assert _nvml_state(real) is None
    slices_only = parser.parse_args([*argv, "--no-kubelet-plugin"])
    assert _nvml_state(slices_only) is None


def test_crash_point_kills_even_as_pid_1() -> None:
    """In a container the agent may be PID 1, which ignores SIGKILL sent from inside its
    PID namespace; the test hook still ends the process at once, with SIGKILL's status."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare to start a process as PID 1")
    code = "from gpudra.cli.node import _crash_at; _crash_at('x')('x'); print('survived')"
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 128 + 9, proc.stderr
    assert "survived" not in proc.stdout


def test_emulated_state_goes_into_a_state_dir_that_does_not_exist_yet(
    tmp_path: Path, short_tmp: Path
) -> None:
    """A fresh node has no state dir: the agent makes it for the emulated GPUs' state
    and driver root before it needs the API server (here: none reachable)."""
    state = tmp_path / "new" / "state"
    proc = run(
        "node", "--node-name", "n1", "--nvml", "emulated:l4", "--state-dir", str(state),
        "--kubelet-root", str(short_tmp), "--kubeconfig", str(tmp_path / "none"),
    )  # fmt: skip
    assert proc.returncode != 0
    assert "nvml-state" not in proc.stderr
    assert (state / EMULATED_NVML_STATE).is_file()
    assert (state / EMULATED_DRIVER_ROOT / "usr/bin/nvidia-smi").is_file()


def test_sampling_flags_reach_the_plugin_config_and_bad_ones_name_the_flag() -> None:
    parser = build_parser()
    config = _plugin_config(parser.parse_args(["node", "--node-name", "n1"]))
    assert (config.sample_interval_s, config.idle_below) == (10.0, 5.0)
    assert not config.claim_status
    claim_status = ["node", "--node-name", "n1", "--claim-status"]
    assert _plugin_config(parser.parse_args(claim_status)).claim_status
    assert not config.device_metadata
    metadata = ["node", "--node-name", "n1", "--device-metadata"]
    assert _plugin_config(parser.parse_args(metadata)).device_metadata
    args = ["node", "--node-name", "n1", "--sample-interval", "0", "--idle-threshold", "12"]
    config = _plugin_config(parser.parse_args(args))
    assert (config.sample_interval_s, config.idle_below) == (0.0, 12.0)
    with pytest.raises(SystemExit, match="--sample-interval -1: give seconds, or 0 for off"):
        _plugin_config(parser.parse_args(["node", "--node-name", "n1", "--sample-interval", "-1"]))
    with pytest.raises(SystemExit, match="--idle-threshold 101: give a percentage"):
        _plugin_config(parser.parse_args(["node", "--node-name", "n1", "--idle-threshold", "101"]))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metrics-max-connections", "0"], "--metrics-max-connections 0: give at least 1"),
        (["--metrics-deadline", "0"], "--metrics-deadline 0: give seconds, more than 0"),
        (["--metrics-deadline", "nan"], "--metrics-deadline nan: give seconds, more than 0"),
        (["--metrics-max-per-client", "0"], "--metrics-max-per-client 0: give at least 1"),
        (["--metrics-head-deadline", "0"], "--metrics-head-deadline 0: give seconds, more than 0"),
        (["--metrics-address", "9477"], "--metrics-address '9477': give HOST:PORT"),
    ],
)
def test_bad_metrics_listener_flags_name_the_flag(flags: list[str], message: str) -> None:
    args = build_parser().parse_args(["node", "--node-name", "n1", *flags])
    with pytest.raises(SystemExit, match=message):
        _metrics_address(args)


def test_the_metrics_address_and_off() -> None:
    parser = build_parser()
    assert _metrics_address(parser.parse_args(["node", "--node-name", "n1"])) == ("0.0.0.0", 9477)
    off = ["node", "--node-name", "n1", "--metrics-address", ""]
    assert _metrics_address(parser.parse_args(off)) is None


def test_the_mps_daemon_pod_template_is_read_and_bad_ones_name_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    parser = build_parser()
    assert _plugin_config(parser.parse_args(["node", "--node-name", "n1"])).mps_pod_template is None
    template = tmp_path / "pod.json"
    pod = {"kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [{"image": "i"}]}}
    template.write_text(json.dumps(pod))
    flags = ["node", "--node-name", "n1", "--mps-daemon-pod-template", str(template)]
    with pytest.raises(SystemExit, match="needs --namespace"):
        _plugin_config(parser.parse_args(flags))
    config = _plugin_config(parser.parse_args([*flags, "--namespace", "gpudra"]))
    assert (config.mps_pod_template, config.namespace) == (pod, "gpudra")
    template.write_text(json.dumps({**pod, "spec": {"containers": []}}))
    with pytest.raises(SystemExit, match=r"spec\.containers must hold exactly one container"):
        _plugin_config(parser.parse_args([*flags, "--namespace", "gpudra"]))


def test_the_dra_api_flag_narrows_what_the_plugin_offers() -> None:
    parser = build_parser()
    config = _plugin_config(parser.parse_args(["node", "--node-name", "n1"]))
    assert config.dra_apis == ("v1.DRAPlugin", "v1beta1.DRAPlugin")
    args = ["node", "--node-name", "n1", "--dra-api", "v1beta1.DRAPlugin"]
    assert _plugin_config(parser.parse_args(args)).dra_apis == ("v1beta1.DRAPlugin",)


def test_a_bad_telemetry_script_is_one_line_naming_the_value(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text('{"0": {"utilization": 300}}')
    proc = run("node", "--node-name", "n1", "--nvml", "emulated:l4", "--nvml-script", str(script))
    assert proc.returncode == 1
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("gpudra node: --nvml: l4: telemetry script: ")
    assert line.endswith("utilization: 300 is not a percentage (0 to 100)")
