"""`gpudra top` against a real metrics endpoint of the device metrics, fed by the
sampler reading emulated GPUs through NVML."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gpudra.cli.scrape import parse_duration


def top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpudra.cli", "top", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def rows(*args: str) -> list[dict[str, object]]:
    done = top(*args, "-o", "json")
    assert done.returncode == 0, done.stderr
    found: list[dict[str, object]] = json.loads(done.stdout)
    return found


def test_json_names_each_device_its_holder_and_idle_time(endpoint: str) -> None:
    by_device = {r["device"]: r for r in rows("--metrics", endpoint)}
    assert len(by_device) == 8
    gpu0, gpu1 = by_device["gpu-0"], by_device["gpu-1"]
    assert gpu0["node"] == "node-a"
    assert gpu0["state"] == "held by team-a/trainer"
    assert gpu0["utilization"] == 1
    assert gpu0["idle_seconds"] == 1200
    assert gpu0["model"] == "NVIDIA H100 80GB HBM3"
    assert gpu1["state"] == "free"
    assert gpu1["utilization"] == 90
    assert gpu1["idle_seconds"] is None


def test_filters_find_the_pods_holding_gpus_and_doing_nothing(endpoint: str) -> None:
    assert [r["device"] for r in rows("--metrics", endpoint, "--idle", "15m")] == ["gpu-0"]
    assert rows("--metrics", endpoint, "--idle", "1h") == []
    assert [r["device"] for r in rows("--metrics", endpoint, "-n", "team-a")] == ["gpu-0"]
    assert rows("--metrics", endpoint, "--node", "node-b") == []
    busiest = rows("--metrics", endpoint, "--sort", "utilization")
    assert busiest[0]["device"] == "gpu-1"


def test_the_table_has_no_colour_off_a_terminal(endpoint: str) -> None:
    done = top("--metrics", endpoint)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == [
        "NODE",
        "DEVICE",
        "MODEL",
        "STATE",
        "UTIL%",
        "MEM",
        "GiB",
        "IDLE",
        "FOR",
    ]
    assert "\033[" not in done.stdout
    (gpu0,) = [ln for ln in lines if " gpu-0 " in ln]
    assert "held by team-a/trainer" in gpu0
    assert gpu0.endswith("20m00s")


def test_an_agent_that_does_not_answer_is_one_line_and_a_failure() -> None:
    done = top("--metrics", "http://127.0.0.1:9/metrics", "--timeout", "2")
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0
    assert "did not answer" in done.stderr


def test_bad_flags_name_the_flag() -> None:
    done = top("--metrics", "http://127.0.0.1:9/metrics", "--idle", "soon")
    assert done.returncode != 0
    assert "--idle" in done.stderr
    assert "30m" in done.stderr
    done = top("--metrics", "localhost:9477")
    assert done.returncode != 0
    assert "NODE=URL" in done.stderr


def test_durations() -> None:
    assert parse_duration("1h30m") == 5400
    assert parse_duration("45s") == 45
    with pytest.raises(ValueError, match="duration"):
        parse_duration("")
