"""bench-compare's table: each comparison, its ratio, its target and whether it is met."""

from __future__ import annotations

from bench.compare import BENCHES, RESULTS, SLICES_1000, Row, rows, table


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


def test_table_has_one_line_per_row_and_says_no_plainly() -> None:
    lines = [
        Row("a metric", 1.0, 2.0, "peer", 0.5, "ratio <= 1.0", True),
        Row("another", 3.0, None, "", None, "0", False),
    ]
    text = table(lines).splitlines()
    assert text[0].split() == ["METRIC", "GPUDRA", "PEER/FLOOR", "OF", "RATIO", "TARGET", "MET"]
    assert text[1].split()[-1] == "yes" and text[2].split()[-1] == "NO"
    assert len(text) == 3
