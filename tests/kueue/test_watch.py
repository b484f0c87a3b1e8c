"""The Job states `make demo-kueue` prints (e2e/kueue/watch.py), judged from one read of
the Job's pods."""

from __future__ import annotations

from typing import Any

from e2e.kueue.watch import ADMITTED, FINISHING, RUNNING, admitted_state


def _pod(phase: str, *, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-05T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase}}


def test_a_job_whose_pods_ended_is_finishing_not_admitted_again() -> None:
    # The Job controller has not counted the pod yet: Kueue still holds the quota.
    assert admitted_state([_pod("Succeeded")]) == FINISHING
    assert admitted_state([_pod("Failed")]) == FINISHING


def test_a_pending_pod_reads_admitted_and_a_running_one_running() -> None:
    assert admitted_state([]) == ADMITTED
    assert admitted_state([_pod("Pending")]) == ADMITTED
    assert admitted_state([_pod("Running")]) == RUNNING
    # A retry after a failed pod is not finished.
    assert admitted_state([_pod("Failed"), _pod("Pending")]) == ADMITTED
    assert admitted_state([_pod("Failed"), _pod("Running")]) == RUNNING


def test_pods_being_deleted_do_not_count() -> None:
    assert admitted_state([_pod("Running", deleting=True)]) == ADMITTED
    assert admitted_state([_pod("Succeeded"), _pod("Running", deleting=True)]) == FINISHING
