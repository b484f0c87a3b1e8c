"""What a queue of Jobs looks like from moment to moment: each Job's state as Kueue and
the node see it, its pods and the devices they hold, and when each state was first
seen. `make demo-kueue` prints these rows; `make bench-kueue` times admission to
Running from them, so both read a Job the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from e2e.cluster.kube import Kube
from e2e.kueue import jobs

WAITING = "Waiting"
PREEMPTED = "Preempted"
ADMITTED = "Admitted"
RUNNING = "Running"
FINISHING = "Finishing"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
FINISHED = (SUCCEEDED, FAILED)


@dataclass(frozen=True)
class JobRow:
    namespace: str
    job: str
    queue: str
    state: str
    pods: str
    devices: str

    def cells(self) -> tuple[str, ...]:
        return (f"{self.namespace}/{self.job}", self.queue, self.state, self.pods, self.devices)


HEADER = ("JOB", "QUEUE", "STATE", "PODS", "DEVICES")


_POD_DONE = ("Succeeded", "Failed")


def state_of(kube: Kube, job: dict[str, Any], pods: list[dict[str, Any]]) -> str:
    """The Job's state, judged from `pods`, the same read of its pods that the row
    shows, so that a row never says Running beside a Pending pod.

    Finishing: every pod has ended but the Job controller has not yet counted it, so
    Kueue still holds the Job's quota; without it such a Job read as Admitted again
    between Running and Succeeded.
    """
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    status = job.get("status") or {}
    if status.get("succeeded"):
        return SUCCEEDED
    if status.get("failed"):
        return FAILED
    if job["spec"].get("suspend"):
        wl = jobs.workload_of(kube, ns, name)
        evicted = jobs.condition(wl, "Evicted")
        return PREEMPTED if evicted and evicted["status"] == "True" else WAITING
    return admitted_state(pods)


def admitted_state(pods: list[dict[str, Any]]) -> str:
    """An admitted Job's state from its pods: Running while one runs, Finishing once
    every one has ended, Admitted before (pods being deleted do not count)."""
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    phases = [(p.get("status") or {}).get("phase") for p in live]
    if "Running" in phases:
        return RUNNING
    if phases and all(phase in _POD_DONE for phase in phases):
        return FINISHING
    return ADMITTED


def devices_of(kube: Kube, pods: list[dict[str, Any]]) -> list[str]:
    """The devices allocated to the pods' claims, as `pool/device`."""
    out = []
    for pod in pods:
        ns = pod["metadata"]["namespace"]
        for entry in (pod.get("status") or {}).get("resourceClaimStatuses") or ():
            claim = kube.get_or_none("ResourceClaim", entry.get("resourceClaimName") or "", ns)
            allocation = ((claim or {}).get("status") or {}).get("allocation") or {}
            out += (
                [f"{r['pool']}/{r['device']}" for r in allocation["devices"]["results"]]
                if allocation
                else []
            )
    return out


def row_of(kube: Kube, namespace: str, name: str) -> JobRow:
    job = kube.get("Job", name, namespace)
    pods = jobs.pods_of(kube, namespace, name)
    phases = [(p.get("status") or {}).get("phase", "?") for p in pods]
    return JobRow(
        namespace=namespace,
        job=name,
        queue=job["metadata"]["labels"].get(jobs.QUEUE_LABEL, "-"),
        state=state_of(kube, job, pods),
        pods=" ".join(phases) or "-",
        devices=" ".join(devices_of(kube, pods)) or "-",
    )


@dataclass
class Timeline:
    """Polls the Jobs and keeps, per Job, the first monotonic time each state was seen."""

    kube: Kube
    names: list[tuple[str, str]]  # (namespace, job)
    first_seen: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    polled_at: list[float] = field(default_factory=list)

    def poll(self) -> list[JobRow]:
        rows = [row_of(self.kube, ns, name) for ns, name in self.names]
        now = time.monotonic()
        self.polled_at.append(now)
        for r in rows:
            self.first_seen.setdefault((r.namespace, r.job), {}).setdefault(r.state, now)
        return rows

    def resolution_s(self) -> float:
        """The mean time between two polls: how finely the first-seen times are known."""
        gaps = [b - a for a, b in zip(self.polled_at, self.polled_at[1:], strict=False)]
        return round(sum(gaps) / len(gaps), 3) if gaps else 0.0

    def finished(self, rows: list[JobRow]) -> bool:
        return all(r.state in FINISHED for r in rows)

    def admitted_to_running_s(self, namespace: str, job: str) -> float | None:
        """From the first poll that saw the Job admitted (unsuspended) to the first that
        saw its pod Running; None where either was never seen."""
        seen = self.first_seen.get((namespace, job), {})
        if RUNNING not in seen:
            return None
        admitted = seen.get(ADMITTED, seen[RUNNING])
        return round(seen[RUNNING] - admitted, 3)
