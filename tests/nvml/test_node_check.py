"""The GPU node check runs the production code end to end, here on the emulator.

On a GPU node it runs against the real NVML (`e2e/gpu_node_check.py`); this keeps it
working between the times a GPU is at hand: discovery, slices, a whole-GPU claim
prepared and unprepared, sampling and accounting, the health watcher, a recording
that replays, and no call that changes the GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pynvml
from gpudra.driver.nvml.emulator import parse_profile
from gpudra.driver.nvml.series import SAMPLE_PERIOD_US, SAMPLE_RING

from e2e.gpu_node_check import main


def test_the_check_runs_end_to_end(tmp_path: Path) -> None:
    load = f"{sys.executable} -c pass"
    argv = [str(tmp_path), "--nvml", "emulated:h100-80gb-hbm3-x8", "--load", load]
    argv += ["--load-warmup", "0", "--sample-gap", "0.05", "--health-seconds", "0"]
    argv += ["--repeat", "2"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["refused"] == {}
    assert report["prepare"]["error"] is None
    assert report["prepare"]["spec"]["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0"}
    ]
    assert report["unprepare"] == {"error": None, "spec_left": False, "claims_left": 0}
    assert len(report["discovery"]["static"]["devices"]) == 8
    assert report["discovery"]["static"]["slices"]
    held = [d for d in report["samples"]["loaded"] if d["held_by"]]
    assert [(d["device"], d["held_by"]) for d in held] == [("gpu-0", ["whole-gpu"])]
    assert report["samples"]["load_exit"] == 0
    assert report["health"]["gpu-0"]["healthy"] is True
    costs = report["costs"]
    assert costs["sampling_pass"]["repeat"] == costs["sampling_pass_held"]["repeat"] == 2
    assert costs["discovery"]["cpu_ms"] > 0 and costs["discovery_held"]["cpu_ms"] > 0
    # Where a step's time went, by NVML call: a pass reads each GPU's utilization.
    for step in ("sampling_pass", "sampling_pass_held"):
        assert "nvmlDeviceGetSamples" in costs[step]["nvml_ms"]
        assert not any(name.startswith("nvmlEventSetWait") for name in costs[step]["nvml_ms"])
    assert "nvmlDeviceGetCount" in costs["discovery_held"]["nvml_ms"]
    assert report["nvml_call_ms"].keys() == report["nvml_calls"].keys()
    # The emulated buffers, as the real ones are read: one sample per period, oldest first.
    for kind in ("gpu", "memory"):
        buffer = report["sample_buffer"][kind]
        assert buffer["valueType"] == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        assert 2 <= buffer["count"] <= SAMPLE_RING and buffer["oldestFirst"]
        assert buffer["gapUs"]["median"] == SAMPLE_PERIOD_US
    assert report["nvml_calls"]["nvmlEventSetWait_v2"] >= 1
    metrics = (tmp_path / "metrics.txt").read_text()
    assert 'claim="whole-gpu"' in metrics
    recording = json.loads((tmp_path / "recording.json").read_text())
    assert parse_profile(recording).products
