"""bench-compare's table: each comparison, its ratio, its target and whether it is met."""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any

from bench.compare import (
    BENCHES,
    NOISE,
    RESULTS,
    SLICES_1000,
    Bench,
    Row,
    against,
    compared,
    rows,
    run_all,
    table,
)


def test_rows_compare_gpudra_with_the_peer_and_the_floor() -> None:
    results = {
        "prepare": {
            "p50_ms": 6.0,
            "p99_ms": 15.0,
            "claims_per_s": 600.0,
            "peer": {"p50_ms": 8.0, "p99_ms": 12.0, "claims_per_s": 500.0},
            "floor_get_only": {"p50_ms": 4.0},
            "floor_with_files": {"p50_ms": 5.0},
        },
        "webhook": None,
        "schedule": {
            "ways": {
                "extended_resource": {"pods_per_s": 200.0},
                "native_claims": {"pods_per_s": 50.0},
                "converted_legacy": {"pods_per_s": 40.0},
                "class_extended_resource": {"pods_per_s": 45.0},
            }
        },
        "slices": {
            "nodes": 200,
            "profile": "h100-80gb-hbm3-x8-mig",
            "converge_s": 30.0,
            "floor": {"converge_s": 27.0},
            "steady_writes": 0,
        },
        SLICES_1000: {
            "nodes": 1000,
            "profile": "h100-80gb-hbm3-x8",
            "converge_s": 7.0,
            "floor": {"converge_s": 5.0},
            "steady_writes": 2,
        },
    }
    by_metric = {(r.metric, r.other_name): r for r in rows(results)}

    p50 = by_metric[("prepare p50 ms", "peer")]
    assert (p50.ratio, p50.target, p50.met) == (0.75, "ratio <= 1.0", True)
    assert by_metric[("prepare p99 ms", "peer")].met is False
    assert by_metric[("prepare claims/s", "peer")].met is True
    assert by_metric[("prepare p50 ms", "floor")].ratio == 1.5
    assert by_metric[("prepare p50 ms", "floor")].met is False
    # The floor with files is there to read the floor's row by, without a target.
    files = by_metric[("prepare p50 ms", "floor with files")]
    assert (files.other, files.ratio, files.target, files.met) == (5.0, 1.2, "", None)
    # Not measured: no ratio, no verdict.
    admission = by_metric[("claim admission p50 ms at 200/s", "peer")]
    assert (admission.gpudra, admission.ratio, admission.met) == (None, None, None)
    converted = by_metric[("schedule pods/s, converted legacy", "native claims")]
    assert (converted.ratio, converted.met) == (0.8, False)
    # The price of DRA itself is reported without a target.
    native = by_metric[("schedule pods/s, native claims", "extended resource")]
    assert (native.ratio, native.target, native.met) == (0.25, "", None)
    # The DeviceClass mapping's pods beside native claims, also without a target.
    mapped = by_metric[("schedule pods/s, DeviceClass extended resource", "native claims")]
    assert (mapped.gpudra, mapped.ratio, mapped.target, mapped.better) == (45.0, 0.9, "", "higher")
    # Each slices run is named by its scale, with its own verdicts.
    mig = by_metric[("slices converge s, 200 nodes, every MIG placement", "floor")]
    assert (mig.ratio, mig.met) == (1.111, True)
    assert by_metric[("slice writes at rest, 200 nodes, every MIG placement", "")].met is True
    whole = by_metric[("slices converge s, 1,000 nodes, whole GPUs", "floor")]
    assert (whole.ratio, whole.met) == (1.4, False)
    assert by_metric[("slice writes at rest, 1,000 nodes, whole GPUs", "")].met is False
    assert by_metric[("agent RSS MiB, one node", "")].met is None


def test_a_slices_run_that_did_not_happen_still_has_its_rows_unmeasured() -> None:
    by_metric = {r.metric: r for r in rows({})}
    whole = by_metric["slices converge s, 1,000 nodes, whole GPUs"]
    assert (whole.gpudra, whole.ratio, whole.met) == (None, None, None)
    assert by_metric["slices converge s"].met is None


def test_compare_runs_slices_at_the_issues_scale_into_a_file_of_its_own() -> None:
    runs = {b.name: b for b in BENCHES}
    assert set(runs) == {"prepare", "webhook", "schedule", "slices", SLICES_1000}
    thousand = runs[SLICES_1000]
    assert thousand.module == "bench.slices"
    assert thousand.env["BENCH_NODES"] == "1000"
    assert not thousand.env["BENCH_PROFILE"].endswith("-mig")
    assert thousand.env["BENCH_OUT"] == str(RESULTS / f"{SLICES_1000}.json")
    assert runs["slices"].env == {}


def test_each_benchmark_starts_after_its_own_restart_and_failures_are_named() -> None:
    events: list[str] = []

    def run(bench: Bench) -> bool:
        events.append(f"run {bench.name}")
        return bench.name != "webhook"

    failed = run_all(BENCHES, run, lambda: events.append("fresh"))
    assert failed == ["webhook"]
    assert events == [e for b in BENCHES for e in ("fresh", f"run {b.name}")]
    # BENCH_FRESH=0: one control plane for every run.
    events.clear()
    assert run_all(BENCHES, run, None) == ["webhook"]
    assert events == [f"run {b.name}" for b in BENCHES]


def test_table_has_one_line_per_row_and_says_no_plainly() -> None:
    lines = [
        Row("a metric", 1.0, 2.0, "peer", 0.5, "ratio <= 1.0", True, was=0.4, moved="worse"),
        Row("another", 3.0, None, "", None, "0", False),
    ]
    text = table(lines).splitlines()
    assert text[0].split() == [
        "METRIC",
        "GPUDRA",
        "PEER/FLOOR",
        "OF",
        "RATIO",
        "TARGET",
        "MET",
        "WAS",
        "MOVED",
    ]
    assert text[1].split()[-3:] == ["yes", "0.4", "worse"]
    assert text[2].split()[-3:] == ["NO", "-", "-"]
    assert len(text) == 3


def _previous(results: dict[str, Any]) -> dict[str, Any]:
    """A published compare.json of `results`, as main writes it."""
    return {"rows": [asdict(r) for r in rows(results)], "runs": {}}


def test_each_row_says_whether_it_moved_beyond_the_noise_since_the_last_table() -> None:
    before: dict[str, Any] = {
        "prepare": {
            "p50_ms": 6.0,
            "peer": {"p50_ms": 12.0, "p99_ms": 20.0, "claims_per_s": 500.0},
            "p99_ms": 18.0,
            "claims_per_s": 600.0,
        },
        "schedule": {
            "ways": {
                "extended_resource": {"pods_per_s": 40.0},
                "native_claims": {"pods_per_s": 8.0},
            }
        },
        "slices": {"agent_rss_mib": 80.0},
    }
    now = copy.deepcopy(before)
    now["prepare"]["p50_ms"] = 9.0  # 0.5 -> 0.75 of the peer: a latency ratio up by half
    now["prepare"]["p99_ms"] = 19.0  # 0.9 -> 0.95: within the noise
    now["schedule"]["ways"]["native_claims"]["pods_per_s"] = 10.0  # 0.2 -> 0.25, higher is better
    now["slices"]["agent_rss_mib"] = 120.0  # no ratio: gpudra's own value, lower is better
    lines = against(rows(now), _previous(before))
    by_metric = {r.key: r for r in lines}

    p50 = by_metric[("prepare p50 ms", "peer")]
    assert (p50.was, p50.ratio, p50.moved) == (0.5, 0.75, "worse")
    assert by_metric[("prepare p99 ms", "peer")].moved == ""
    assert by_metric[("schedule pods/s, native claims", "extended resource")].moved == "better"
    assert by_metric[("agent RSS MiB, one node", "")].moved == "worse"
    # Unmeasured then or now: nothing to compare.
    admission = by_metric[("claim admission p50 ms at 200/s", "peer")]
    assert (admission.was, admission.moved) == (None, "")


def test_without_a_previous_table_no_row_has_moved() -> None:
    lines = against(rows({"prepare": {"p50_ms": 6.0, "peer": {"p50_ms": 8.0}}}), None)
    assert all((r.was, r.moved) == (None, "") for r in lines)
    assert NOISE == 0.2


def test_tabulating_the_same_results_again_keeps_the_table_they_were_compared_with() -> None:
    old = {"prepare": {"p50_ms": 6.0, "peer": {"p50_ms": 12.0}}}
    new = {"prepare": {"p50_ms": 9.0, "peer": {"p50_ms": 12.0}}}
    newer = {"prepare": {"p50_ms": 9.5, "peer": {"p50_ms": 12.0}}}
    _, first = compared(old, None, [])
    lines, second = compared(new, first, [])
    assert {(r.key, r.was, r.moved) for r in lines} >= {(("prepare p50 ms", "peer"), 0.5, "worse")}
    # `--no-run` on the same files: still against the table before, not against itself.
    again, third = compared(new, second, [])
    assert again == lines and third["baseline"] == second["baseline"]
    # A new measurement is compared with the last table.
    (p50,) = [r for r in compared(newer, third, [])[0] if r.key == ("prepare p50 ms", "peer")]
    assert (p50.was, p50.moved) == (0.75, "")
