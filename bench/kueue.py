"""make bench-kueue: admission to Running per Job under Kueue, legacy and native.

On the real node with gpudra and Kueue (as `make demo-kueue` sets them up), Jobs from
demo/kueue/ — BENCH_KUEUE_JOBS of each kind, default 3: legacy ones converted by the
webhook, native ones with a ResourceClaimTemplate — queue under the quota of 2 GPUs.
For each Job, the time from the first poll that saw it admitted (unsuspended) to the
first that saw its pod Running: conversion, claim creation, scheduling, prepare on the
node and container start. `resolution_s` is the mean time between two polls, the
precision of those times. Writes bench/results/kueue.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from gpudra.common.files import atomic_write

from e2e.cluster.harness import Cluster, ClusterError
from e2e.cluster.kube import ApiError, Kube
from e2e.kueue import jobs
from e2e.kueue.demo import follow, queues_on_gpus, submit_all
from e2e.kueue.manager import KueueError, KueueManager
from e2e.kueue.watch import Timeline
from e2e.node.gpus import NodeGpus
from e2e.node.realnode import NodeError, unavailable_reason

OUT = Path(__file__).resolve().parent / "results" / "kueue.json"
JOBS_ENV = "BENCH_KUEUE_JOBS"
WORK = ["sh", "-c", "ls /dev | grep -q '^nvidia[0-9]' && sleep 2"]
KINDS = {"legacy": (jobs.LEGACY_JOB, "team-a"), "native": (jobs.NATIVE_JOB, "team-b")}


def jobs_per_kind() -> int:
    raw = os.environ.get(JOBS_ENV, "3")
    if not raw.isdigit() or not 1 <= int(raw) <= 20:
        raise ValueError(f"{JOBS_ENV}={raw!r}: set a number of Jobs per kind from 1 to 20")
    return int(raw)


def measure(kube: Kube, stack: NodeGpus, per_kind: int, out: Path) -> dict[str, Any]:
    """Runs `per_kind` Jobs of each kind at once, writes the results to `out`."""
    kind_of = {f"bench-{kind}-{i}": kind for i in range(per_kind) for kind in KINDS}
    specs = [(*KINDS[kind], name) for name, kind in kind_of.items()]
    names = submit_all(kube, stack, specs, WORK)
    timeline = Timeline(kube, names)
    try:
        rows = follow(timeline, lambda _rows: None)
    finally:
        for ns, name in names:
            jobs.delete_job(kube, ns, name)
    per_job = [
        {
            "job": f"{r.namespace}/{r.job}",
            "kind": kind_of[r.job],
            "state": r.state,
            "admitted_to_running_s": timeline.admitted_to_running_s(r.namespace, r.job),
        }
        for r in rows
    ]
    summary = {}
    for kind in KINDS:
        times = [j["admitted_to_running_s"] for j in per_job if j["kind"] == kind]
        seen = [t for t in times if t is not None]
        summary[kind] = {
            "jobs": len(times),
            "median_s": round(statistics.median(seen), 3) if seen else None,
            "max_s": max(seen) if seen else None,
        }
    result = {
        "what": "admission (Job unsuspended) to its pod Running, per Job, on the real node",
        "kueue": KueueManager(stack.node.cluster).status().get("version"),
        "quota_gpus": 2,
        "resolution_s": timeline.resolution_s(),
        "summary": summary,
        "jobs": per_job,
    }
    atomic_write(out, (json.dumps(result, indent=2) + "\n").encode(), mode=0o644)
    return result


def main() -> int:
    reason = unavailable_reason()
    if reason:
        print(f"bench-kueue: no real node on this machine ({reason})", file=sys.stderr)
        return 1
    try:
        per_kind = jobs_per_kind()
        kube, stack = queues_on_gpus(Cluster())
        result = measure(kube, stack, per_kind, OUT)
    except (ValueError, ClusterError, NodeError, KueueError, ApiError, TimeoutError) as e:
        print(f"bench-kueue: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result["summary"], indent=2))
    print("wrote bench/results/kueue.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
