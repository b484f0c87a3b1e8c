"""bench-compare's table: each comparison, its ratio, its target and whether it is met."""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

import bench.compare
from bench.compare import (
    BENCHES,
    KEEP,
    NOISE,
    RESULTS,
    SLICES_1000,
    WINDOW,
    Across,
    Bench,
    Row,
    against,
    compared,
    recorded,
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
            "device_metadata": {"p50_ms": 6.6, "p99_ms": 15.0},
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
    # So is the agent with device metadata, over the agent without it.
    metadata = by_metric[("prepare p50 ms, device metadata on", "metadata off")]
    assert (metadata.gpudra, metadata.other, metadata.ratio, metadata.met) == (6.6, 6.0, 1.1, None)
    assert by_metric[("prepare p99 ms, device metadata on", "metadata off")].ratio == 1.0
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
        Row(
            "a metric",
            1.0,
            2.0,
            "peer",
            0.5,
            "ratio <= 1.0",
            True,
            was=0.4,
            moved="worse",
            across=Across(runs=3, median=0.45, low=0.4, high=0.5, met=2),
        ),
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
        "LAST",
        "RUNS",
    ]
    assert text[1].split()[-3:] == ["runs)", "met", "2/3"]
    assert "yes  0.4  worse  0.45 (0.4-0.5, 3 runs) met 2/3" in text[1]
    assert text[2].split()[-4:] == ["NO", "-", "-", "-"]
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


def _prepare_at(p50: float, peer: float = 10.0) -> dict[str, Any]:
    """Results with prepare measured at `p50` against the peer's `peer`."""
    return {"prepare": {"p50_ms": p50, "peer": {"p50_ms": peer}}}


def _history(*p50s: float) -> list[Any]:
    """The recorded runs of prepare at each of `p50s`, in that order."""
    history: list[Any] = []
    for p50 in p50s:
        history = recorded(history, compared(_prepare_at(p50), None, [])[1])
    return history


def test_each_row_is_read_over_the_last_runs_with_how_often_its_target_was_met() -> None:
    # Seven recorded runs, 0.6 to 1.2 of the peer; the window takes the last ones.
    history = _history(6.0, 7.0, 13.0, 9.0, 11.0, 12.0, 8.0)
    lines, doc = compared(_prepare_at(10.5), None, [], history)
    by_metric = {r.key: r for r in lines}
    p50 = by_metric[("prepare p50 ms", "peer")]
    # This run and the four before it: 0.9, 1.1, 1.2, 0.8 and now 1.05.
    assert WINDOW == 5
    assert p50.across == Across(runs=5, median=1.05, low=0.8, high=1.2, met=2)
    assert doc["rows"][0]["across"] == asdict(p50.across)
    # Never measured: nothing over the runs either.
    assert by_metric[("claim admission p50 ms at 200/s", "peer")].across is None


def _peer_release(p50: float, version: str) -> dict[str, Any]:
    """Prepare and admission measured against the peer's release `version`."""
    return {
        "prepare": {"p50_ms": p50, "peer": {"p50_ms": 10.0, "version": version}},
        "webhook": {
            "claims_vs_peer": {
                "gpudra": {"p50_ms": p50 / 10},
                "peer": {"p50_ms": 1.0, "version": version},
            }
        },
    }


def test_a_new_release_of_the_peer_starts_its_rows_anew() -> None:
    # Runs against one release; the next against another, whose ratio is far off.
    history = recorded([], compared(_peer_release(6.0, "v0.2.1"), None, [])[1])
    history = recorded(history, compared(_peer_release(6.5, "v0.2.1"), None, [])[1])
    before = compared(_peer_release(6.5, "v0.2.1"), None, [])[1]
    lines, _ = compared(_peer_release(9.0, "v0.3.0"), before, [], history)
    by_key = {r.key: r for r in lines}
    assert ("prepare p50 ms", "peer") not in by_key
    for key in (
        ("prepare p50 ms", "peer v0.3.0"),
        ("claim admission p50 ms at 200/s", "peer v0.3.0"),
    ):
        row = by_key[key]
        # Not a move of gpudra's, and not read with the other release's runs.
        assert (row.ratio, row.was, row.moved) == (0.9, None, "")
        assert row.across == Across(runs=1, median=0.9, low=0.9, high=0.9, met=1)
    # The same release again is compared as before.
    again, _ = compared(_peer_release(9.0, "v0.2.1"), before, [], history)
    (p50,) = [r for r in again if r.key == ("prepare p50 ms", "peer v0.2.1")]
    assert (p50.was, p50.moved) == (0.65, "worse")
    assert p50.across is not None and p50.across.runs == 3


def test_a_row_without_a_target_has_a_range_and_no_count_of_runs_met() -> None:
    files = {"prepare": {"p50_ms": 6.0, "floor_with_files": {"p50_ms": 5.0}}}
    history = recorded([], compared(files, None, [])[1])
    files["prepare"]["p50_ms"] = 7.0
    lines, _ = compared(files, None, [], history)
    (row,) = [r for r in lines if r.key == ("prepare p50 ms", "floor with files")]
    assert row.across == Across(runs=2, median=1.3, low=1.2, high=1.4, met=None)


def test_tabulating_a_recorded_run_again_counts_it_once_and_records_it_once() -> None:
    history = _history(8.0, 12.0)
    lines, doc = compared(_prepare_at(12.0), None, [], history)
    (p50,) = [r for r in lines if r.key == ("prepare p50 ms", "peer")]
    assert p50.across is not None and p50.across.runs == 2
    assert recorded(history, doc) == history


def test_the_history_keeps_the_last_runs_only() -> None:
    history = _history(*(5.0 + i / 100 for i in range(KEEP + 3)))
    assert len(history) == KEEP
    first = history[0]["rows"][0]
    assert (first["metric"], first["value"]) == ("prepare p50 ms", 0.503)


def _main(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str], p50: float) -> Path:
    """Run `python -m bench.compare` with `argv`, results under `tmp_path`, each
    benchmark 'run' by writing its results file; prepare comes out at `p50`; the
    webhook fails when the argv says so. Returns the history file."""
    monkeypatch.setattr(bench.compare, "RESULTS", tmp_path)
    monkeypatch.setattr(bench.compare, "OUT", tmp_path / "compare.json")
    monkeypatch.setattr(bench.compare, "HISTORY", tmp_path / "compare-history.json")
    monkeypatch.setattr(bench.compare, "_fresh_control_plane", lambda: None)
    fail = "--fail-webhook" in argv

    def run(one: Bench) -> bool:
        doc = _prepare_at(p50)["prepare"] if one.name == "prepare" else {"commit": "c"}
        (tmp_path / f"{one.name}.json").write_text(json.dumps(doc))
        return not (fail and one.name == "webhook")

    monkeypatch.setattr(bench.compare, "_run", run)
    monkeypatch.setattr(sys, "argv", ["compare", *(a for a in argv if a != "--fail-webhook")])
    bench.compare.main()
    return tmp_path / "compare-history.json"


def test_a_complete_run_is_recorded_and_a_retabulation_or_a_failed_run_is_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    history = _main(monkeypatch, tmp_path, [], 8.0)
    assert len(json.loads(history.read_text())["runs"]) == 1
    _main(monkeypatch, tmp_path, [], 9.0)
    assert len(json.loads(history.read_text())["runs"]) == 2
    # A failed benchmark leaves its old file, which a record would count again.
    _main(monkeypatch, tmp_path, ["--fail-webhook"], 10.0)
    assert len(json.loads(history.read_text())["runs"]) == 2
    (tmp_path / "prepare.json").write_text(json.dumps(_prepare_at(11.0)["prepare"]))
    _main(monkeypatch, tmp_path, ["--no-run"], 0.0)
    runs = json.loads(history.read_text())["runs"]
    assert [r["rows"][0]["value"] for r in runs] == [0.8, 0.9]
    # The re-tabulated table still reads its rows over the recorded runs and itself.
    table_doc = json.loads((tmp_path / "compare.json").read_text())
    assert table_doc["rows"][0]["across"] == asdict(
        Across(runs=3, median=0.9, low=0.8, high=1.1, met=2)
    )
    # A row whose other side was never measured has no ratio to read over the runs,
    # and gpudra's own value does not stand in for one.
    floor = next(r for r in table_doc["rows"] if r["other_name"] == "floor")
    assert (floor["was"], floor["across"]) == (None, None)
