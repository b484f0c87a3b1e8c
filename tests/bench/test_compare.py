"""bench-compare's table: each comparison, its ratio, its target and whether it is met."""

from __future__ import annotations

from bench.compare import Row, rows, table


def test_rows_compare_gpudra_with_the_peer_and_the_floor() -> None:
    results = {
        "prepare": {
            "p50_ms": 6.0,
            "p99_ms": 15.0,
            "claims_per_s": 600.0,
            "peer": {"p50_ms": 8.0, "p99_ms": 12.0, "claims_per_s": 500.0},
            "floor_get_only": {"p50_ms": 4.0},
        },
        "webhook": None,
        "schedule": {
            "ways": {
                "extended_resource": {"pods_per_s": 200.0},
                "native_claims": {"pods_per_s": 50.0},
                "converted_legacy": {"pods_per_s": 40.0},
            }
        },
        "slices": {"converge_s": 30.0, "floor": {"converge_s": 27.0}, "steady_writes": 0},
    }
    by_metric = {(r.metric, r.other_name): r for r in rows(results)}

    p50 = by_metric[("prepare p50 ms", "peer")]
    assert (p50.ratio, p50.target, p50.met) == (0.75, "ratio <= 1.0", True)
    assert by_metric[("prepare p99 ms", "peer")].met is False
    assert by_metric[("prepare claims/s", "peer")].met is True
    assert by_metric[("prepare p50 ms", "floor")].ratio == 1.5
    assert by_metric[("prepare p50 ms", "floor")].met is False
    # Not measured: no ratio, no verdict.
    admission = by_metric[("claim admission p50 ms at 200/s", "peer")]
    assert (admission.gpudra, admission.ratio, admission.met) == (None, None, None)
    converted = by_metric[("schedule pods/s, converted legacy", "native claims")]
    assert (converted.ratio, converted.met) == (0.8, False)
    # The price of DRA itself is reported without a target.
    native = by_metric[("schedule pods/s, native claims", "extended resource")]
    assert (native.ratio, native.target, native.met) == (0.25, "", None)
    assert by_metric[("slices converge s", "floor")].met is True
    assert by_metric[("slice writes at rest", "")].met is True
    assert by_metric[("agent RSS MiB, one node", "")].met is None


def test_table_has_one_line_per_row_and_says_no_plainly() -> None:
    lines = [
        Row("a metric", 1.0, 2.0, "peer", 0.5, "ratio <= 1.0", True),
        Row("another", 3.0, None, "", None, "0", False),
    ]
    text = table(lines).splitlines()
    assert text[0].split() == ["METRIC", "GPUDRA", "PEER/FLOOR", "OF", "RATIO", "TARGET", "MET"]
    assert text[1].split()[-1] == "yes" and text[2].split()[-1] == "NO"
    assert len(text) == 3
