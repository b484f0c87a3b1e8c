"""`gpudra top` against a real metrics endpoint of the device metrics, fed by the
sampler reading emulated GPUs through NVML."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from gpudra.cli.agents import endpoints
from gpudra.cli.devices import Device, Holder
from gpudra.cli.scrape import parse_duration
from gpudra.cli.top import DeviceRow, merge, rows_from_devices


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
    by_device = {r["device"]: r for r in rows("--no-api", "--metrics", endpoint)}
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
    assert [r["device"] for r in rows("--no-api", "--metrics", endpoint, "--idle", "15m")] == [
        "gpu-0"
    ]
    assert rows("--no-api", "--metrics", endpoint, "--idle", "1h") == []
    assert [r["device"] for r in rows("--no-api", "--metrics", endpoint, "-n", "team-a")] == [
        "gpu-0"
    ]
    assert rows("--no-api", "--metrics", endpoint, "--node", "node-b") == []
    busiest = rows("--no-api", "--metrics", endpoint, "--sort", "utilization")
    assert busiest[0]["device"] == "gpu-1"


def test_the_table_has_no_colour_off_a_terminal(endpoint: str) -> None:
    done = top("--no-api", "--metrics", endpoint)
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
    done = top("--no-api", "--metrics", "http://127.0.0.1:9/metrics", "--timeout", "2")
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


def test_the_api_decides_holders_and_the_agent_adds_measurements() -> None:
    claims = [
        Holder(claim="team-a/train", pods=("trainer",), sharing="Exclusive"),
        Holder(claim="team-b/a", pods=("p-0", "p-1"), sharing="TimeSlicing"),
        Holder(claim="team-b/b", pods=(), sharing="TimeSlicing"),
    ]
    found = [
        Device("n1", "n1", "gpu-0", "gpu", model="H100", holders=claims[:1]),
        Device("n1", "n1", "gpu-1", "gpu", holders=claims[1:]),
        Device("n1", "n1", "gpu-2", "gpu", taints=("gpu.nvidia.com/xid:NoSchedule",)),
        Device("n2", "n2", "gpu-0", "gpu"),
    ]
    measured = [
        DeviceRow("n1", "gpu-0", "GPU-0", "H100", holders=["x/y"], utilization=3, idle_seconds=60),
        DeviceRow("n1", "gpu-1", "GPU-1", "H100", utilization=80, memory_used=1, memory_total=2),
        DeviceRow("n1", "gpu-2", "GPU-2", "H100", healthy=True, utilization=0),
        DeviceRow("n9", "gpu-0", "GPU-9", "A100", healthy=False),
    ]

    rows = {(r.node, r.device): r for r in merge(rows_from_devices(found), measured)}

    held = rows[("n1", "gpu-0")]
    assert (held.state, held.uuid, held.utilization, held.idle_seconds) == (
        "held by team-a/trainer",
        "GPU-0",
        3,
        60,
    )
    shared = rows[("n1", "gpu-1")]
    assert shared.holders == ["team-b/p-0", "team-b/p-1", "team-b/claim b"]
    assert shared.state == "shared by 3 pods"
    assert (shared.model, shared.memory_used, shared.memory_total) == ("H100", 1, 2)
    assert rows[("n1", "gpu-2")].state == "tainted"
    unmeasured = rows[("n2", "gpu-0")]
    assert (unmeasured.state, unmeasured.utilization) == ("free", None)
    assert rows[("n9", "gpu-0")].state == "tainted"  # only its agent knows it, unhealthy


def test_agent_endpoints_come_from_the_metrics_port_of_running_pods() -> None:
    def pod(node: str, ip: str, port_name: str = "metrics", phase: str = "Running") -> Any:
        ports = [{"name": port_name, "containerPort": 9477}]
        owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "controller": True}
        return {
            "metadata": {"name": f"agent-{node}", "ownerReferences": [owner]},
            "spec": {"nodeName": node, "containers": [{"name": "node", "ports": ports}]},
            "status": {"phase": phase, "podIP": ip, "hostIP": ip},
        }

    found = endpoints(
        [
            pod("a", "10.0.0.5"),
            pod("b", "fd00::6"),
            pod("c", "10.0.0.7", port_name="health"),
            pod("d", "10.0.0.8", phase="Pending"),
            pod("e", ""),
        ]
    )

    assert found.urls == {
        "a": "http://10.0.0.5:9477/metrics",
        "b": "http://[fd00::6]:9477/metrics",
    }


def test_no_api_without_urls_is_one_line() -> None:
    done = top("--no-api")
    assert done.returncode != 0
    assert done.stderr.strip() == "gpudra top: --no-api needs --metrics NODE=URL (repeatable)"
