"""The benchmarks run and write the fields their comparisons need (short runs; a
benchmark's numbers are never asserted, only that it measured what it says)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from gpudra.webhook.admission import VALIDATE_CLAIMS_PATH

from bench import peers, prepare, schedule, slices, webhook
from bench.cores import split_cores, usable_cores
from bench.prepare import control_plane_pids
from bench.runinfo import run_context
from e2e.cluster.harness import Cluster
from e2e.provider import local_only

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.anyio,
    local_only("the benchmark runs the node agent and the peer as host processes"),
    pytest.mark.skipif(shutil.which("go") is None, reason="the Go client and peer need Go"),
]


async def test_bench_prepare_measures_gpudra_the_peer_the_floor_and_metadata_in_rounds(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {"BENCH_CYCLES": "24", "BENCH_WARMUP": "8", "BENCH_ROUNDS": "2"}.items():
        monkeypatch.setenv(name, value)
    result = await prepare.main()

    assert result["client"] == "go"
    floors = (result["floor_get_only"], result["floor_with_files"])
    assert (result["errors"], *(floor["errors"] for floor in floors)) == (0, 0, 0)
    assert "journal" in result["floor_with_files"]["what"]
    peer = result["peer"]
    assert (peer["name"], peer["version"], peer["errors"]) == (
        peers.PEER_NAME,
        peers.version(),
        0,
    )
    # The agent with device metadata, checked to mount and write its files before it
    # was measured (the bench stops otherwise), is measured beside the one without.
    metadata = result["device_metadata"]
    assert metadata["errors"] == 0
    assert metadata["ratio_to_gpudra"]["p50"] == round(metadata["p50_ms"] / result["p50_ms"], 3)
    # Every subject is measured in each round, interleaved.
    for subject in (result, peer, *floors, metadata):
        assert len(subject["by_round_p50_ms"]) == 2
    assert peer["cpu_ms_per_cycle"]["plugin"] > 0
    assert result["cpu_ms_per_cycle"]["node"] > 0
    assert metadata["cpu_ms_per_cycle"]["node"] > 0
    for ratios in (
        result["ratio_to_peer"],
        result["ratio_to_floor"],
        result["ratio_to_floor_with_files"],
        metadata["ratio_to_gpudra"],
    ):
        assert set(ratios) == {"p50", "p99", "claims_per_s", "plugin_cpu"}
        assert all(value > 0 for value in ratios.values())
    assert result["ratio_to_peer"]["p50"] == round(result["p50_ms"] / peer["p50_ms"], 3)
    assert {k: v["limit"] for k, v in result["targets"].items()} == {
        "p50_vs_peer": 1.0,
        "p99_vs_peer": 1.0,
        "claims_per_s_vs_peer": 1.0,
        "p50_vs_floor": 1.3,
    }
    assert result["kubernetes_version"].startswith("v1.")
    assert result["commit"] and result["cpus"] == os.cpu_count()
    assert result["load_avg_1m_at_start"] >= 0 and result["load_avg_1m_at_end"] >= 0


def test_profile_pass_says_where_the_node_spends_its_measured_cycles(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {"BENCH_CYCLES": "40", "BENCH_WARMUP": "8", "BENCH_ROUNDS": "1"}.items():
        monkeypatch.setenv(name, value)
    result: dict[str, Any] = {"targets": {"p50_vs_floor": {"met": False}}}
    prepare.profile_on_miss(result, None)

    profile = result["profile_node"]
    assert (profile["missed"], profile["cycles"]) == (["p50_vs_floor"], 40)
    threads = profile["threads_ms_per_cycle"]
    assert threads["event_loop_thread"]["user"] > 0
    # The profile covers the measured cycles only: the DRA calls' work (which runs as a
    # task of its own, so that a cancelled call does not cut it) tops gpudra's
    # functions. Over the process's whole life, start-up (the CLI's main, discovery,
    # recovery) would outweigh 40 cycles.
    functions = [row["function"] for row in profile["top_cumulative_gpudra"]]
    assert functions[0].startswith("driver/plugin.py:")
    assert any(f.startswith("driver/plugin.py:") and f.endswith("(prepare)") for f in functions)
    assert not any(f.startswith("cli/") for f in functions)
    assert profile["waiting_ms_per_cycle"] >= 0
    assert all(row["own_ms_per_cycle"] >= 0 for row in profile["top_own_time"])


def test_every_results_file_records_where_and_when_it_ran(cluster: Cluster) -> None:
    # One place gives every benchmark's results file these fields, under one set of names.
    context = run_context(cluster.kube(), load_at_start=0.456)
    assert context["kubernetes_version"].startswith("v1.") and context["commit"]
    assert context["cpus"] == os.cpu_count()
    assert context["load_avg_1m_at_start"] == 0.46
    assert context["load_avg_1m_at_end"] >= 0


def test_bench_webhook_compares_claim_validation_with_the_peer_on_the_same_claims(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BENCH_LATENCY_S", "1")
    monkeypatch.setenv("BENCH_STEP_S", "0.5")
    monkeypatch.setattr(webhook, "STEPS", (400,))
    result = webhook.claims_comparison(cluster, tmp_path, count=40)

    assert result is not None
    # Both servers allowed every (valid) claim: a denial or an HTTP error counts as one.
    assert (result["gpudra"]["errors"], result["peer"]["errors"]) == (0, 0)
    assert result["peer"]["version"] == peers.version()
    for name in ("gpudra", "peer"):
        assert result[name]["latency_phase"]["completed"] > 0
        assert [step["rate"] for step in result[name]["steps"]] == [400]
    assert set(result["ratio_to_peer"]) == {"p50", "p99", "max_rps"}
    assert isinstance(result["met"], bool)


def test_bench_webhook_measures_claims_whose_specs_never_repeat(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BENCH_LATENCY_S", "1")
    result = webhook.claims_comparison(cluster, tmp_path, count=40, new_specs=True)

    assert result is not None
    assert (result["gpudra"]["errors"], result["peer"]["errors"]) == (0, 0)
    for name in ("gpudra", "peer"):
        assert result[name]["latency_phase"]["completed"] > 0
        assert result[name]["steps"] == []
    assert set(result["ratio_to_peer"]) == {"p50", "p99"}


def test_the_claim_specs_repeat_unless_asked_to_be_new() -> None:
    """The bench's claims repeat three specs, as claims from a few templates do; with
    `new_specs` no two are the same, so gpudra remembers none of use."""

    def specs(requests: list[bytes]) -> list[bytes]:
        bodies = (json.loads(r.split(b"\r\n\r\n", 1)[1]) for r in requests)
        objects = (body["request"]["object"] for body in bodies)
        return [
            json.dumps(o["spec"].get("spec", o["spec"])["devices"], sort_keys=True).encode()
            for o in objects
        ]

    repeated = specs(webhook.build_claim_requests("gpudra", VALIDATE_CLAIMS_PATH, 60))
    assert len(set(repeated)) == 3
    new = specs(webhook.build_claim_requests("gpudra", VALIDATE_CLAIMS_PATH, 60, new_specs=True))
    assert len(set(new)) == 60


def test_the_claim_bodies_differ_only_in_the_drivers_config_names() -> None:
    ours = webhook.build_claim_requests("gpudra", VALIDATE_CLAIMS_PATH, 20)
    theirs = webhook.build_claim_requests("peer", webhook.PEER_VALIDATE_PATH, 20)
    for a, b in zip(ours, theirs, strict=True):
        body_a, body_b = a.split(b"\r\n\r\n", 1)[1], b.split(b"\r\n\r\n", 1)[1]
        for name, (driver, api_version) in webhook.CLAIM_CONFIGS.items():
            assert (name == "gpudra") == (driver.encode() in body_a)
            assert (name == "peer") == (api_version.encode() in body_b)
        swapped = body_b.replace(
            b"gpu.resource.example.com/v1alpha1", b"resource.nvidia.com/v1beta1"
        )
        assert swapped.replace(b"gpu.example.com", b"gpu.nvidia.com") == body_a


async def test_bench_schedule_binds_every_pod_each_of_the_four_ways(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BENCH_SCHED_NODES", "2")
    monkeypatch.setenv("BENCH_SCHED_PODS", "12")
    result = await schedule.main()

    assert set(result["ways"]) == set(schedule.WAYS)
    assert result["commit"] and result["load_avg_1m_at_end"] >= 0
    for name, way in result["ways"].items():
        if "skipped" in way:
            assert name == "class_extended_resource", way
            continue
        assert (way["pods"], way["bound"], way["create_errors"]) == (12, 12, {}), name
        assert (
            way["pods_per_s"] > 0 and way["create_to_bound_p99_ms"] >= way["create_to_bound_p50_ms"]
        )
    target = result["targets"]["converted_legacy_to_native_claims"]
    assert (
        target["limit"] == 0.9
        and target["value"] == result["ratios"]["converted_legacy_to_native_claims"]
    )
    # Nothing of the bench is left: its nodes; its namespaces are empty and going.
    kube = cluster.kube()
    assert not [n for n in kube.list("Node") if n["metadata"]["name"].startswith("sched-")]
    for ns in kube.list("Namespace"):
        if ns["metadata"]["name"].startswith("sched-"):
            assert ns["status"]["phase"] == "Terminating"
            assert not kube.list("Pod", ns["metadata"]["name"])


async def test_bench_schedule_refuses_more_pods_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_SCHED_NODES", "2")
    monkeypatch.setenv("BENCH_SCHED_PODS", "17")
    with pytest.raises(SystemExit, match="BENCH_SCHED_PODS=17 is more than the 16 GPUs"):
        await schedule.main()


def thread_cores(pid: int) -> set[frozenset[int]]:
    """The distinct core sets of a process's threads (one, unless some were moved)."""
    return {
        frozenset(os.sched_getaffinity(int(t.name))) for t in Path(f"/proc/{pid}/task").iterdir()
    }


def test_bench_slices_runs_nodes_in_worker_processes_and_measures_the_floor(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    settings = {
        "BENCH_NODES": "4",
        "BENCH_PROCESSES": "2",
        "BENCH_STEADY_S": "2",
        "BENCH_WORKER_THREADS": "3",
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    api_pids = control_plane_pids(cluster)
    before = {pid: thread_cores(pid) for pid in api_pids.values()}
    result = slices.main()

    # The API server's side had its own cores during the convergence, as seen from
    # both sides, and the floor is over those; afterwards every thread is back.
    halves = split_cores(usable_cores())
    cores = result["cores"]
    if halves is None:
        assert cores["layout"] == "shared"
    else:
        assert cores["layout"] == "split"
        assert (cores["api_server"], cores["nodes"]) == tuple(sorted(h) for h in halves)
        assert set(cores["api_server_seen"]) == {"kube-apiserver", "etcd"}
        assert all(seen == cores["api_server"] for seen in cores["api_server_seen"].values())
        assert cores["workers_seen"] == [cores["nodes"]] * 2
        assert result["floor"]["cores"] == len(cores["api_server"])
    assert {pid: thread_cores(pid) for pid in api_pids.values()} == before

    assert (result["nodes"], result["processes"]) == (4, 2)
    # Each worker's discoveries shared the threads asked for, as the worker saw it.
    assert result["worker_threads"] == [3, 3]
    assert result["commit"] and result["load_avg_1m_at_start"] >= 0
    # Every placement of 8 MIG-capable H100s, on each of the 4 nodes, one write per slice.
    assert result["devices"] > 0 and result["slices"] >= 4
    assert result["writes_to_converge"] >= result["slices"]
    assert (result["steady_writes"], result["steady_changed_slices"]) == (0, 0)
    floor = result["floor"]
    assert floor["writes_needed"] == result["slices"]
    assert floor["control_plane_cpu_ms_per_write"] > 0 and floor["converge_s"] > 0
    assert result["ratio_to_floor"] == pytest.approx(
        result["converge_s"] / floor["converge_s"], rel=0.05
    )
    assert result["agent_rss_mib"] > 0
    rss = result["control_plane_rss_mib_at_start"]
    assert set(rss) == {"kube-apiserver", "etcd"} and all(v > 0 for v in rss.values())
    assert set(result["targets"]) == {"converge_vs_floor", "steady_writes", "agent_rss_mib"}
    # The workers log as the agent does: a warning's line carries its fields (a failed
    # watch, its error), here the one each simulated node gives for its health checks.
    logged = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line[:1] == "{"]
    warned = {e.get("node") for e in logged if e.get("logger") == "gpudra.driver.agent"}
    assert set(slices.node_names(4)) <= warned
    # Nothing of the bench is left.
    kube = cluster.kube()
    assert not [n for n in kube.list("Node") if n["metadata"]["name"].startswith("bench-")]
