"""The queueing manifests of demo/kueue/ and what tests, the demo and the benchmark read
of a queued Job: its Workload, whether Kueue admitted it, and why not.

One source for the manifests: docs/kueue.md shows these files, the tests and the demo
apply them, so what is documented is what was tested.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.harness import REPO
from e2e.cluster.kube import ApiError, Kube

MANIFESTS = REPO / "demo" / "kueue"
QUEUES = MANIFESTS / "00-queues.yaml"
LEGACY_JOB = MANIFESTS / "01-legacy-job.yaml"
NATIVE_JOB = MANIFESTS / "02-native-job.yaml"
PRIORITIES = MANIFESTS / "03-priorities.yaml"
MEMORY_SLICE_JOB = MANIFESTS / "04-memory-slice-job.yaml"
MIG_JOB = MANIFESTS / "05-mig-job.yaml"
MIG_PROFILE_QUEUE = MANIFESTS / "06-mig-profile-queue.yaml"
MIG_PROFILE_JOB = MANIFESTS / "07-mig-profile-job.yaml"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def one(objects: Iterable[dict[str, Any]], kind: str) -> dict[str, Any]:
    """A copy of the one object of `kind` (a file's Job, its template)."""
    hits = [o for o in objects if o["kind"] == kind]
    if len(hits) != 1:
        raise LookupError(f"expected one {kind}, found {len(hits)}")
    return copy.deepcopy(hits[0])


def job_from(
    path: Path,
    name: str,
    namespace: str,
    *,
    image: str | None = None,
    command: list[str] | None = None,
    node: str | None = None,
    priority: str | None = None,
) -> dict[str, Any]:
    """The file's Job renamed, moved, and (for a node without a registry) given a local
    image, a command and a node to run on; what Kueue and gpudra read is unchanged.
    `priority` names both the WorkloadPriorityClass and the PriorityClass (the
    03-priorities.yaml pairs)."""
    job = one(load(path), "Job")
    job["metadata"].update(name=name, namespace=namespace)
    pod = job["spec"]["template"]["spec"]
    if priority is not None:
        job["metadata"]["labels"][PRIORITY_LABEL] = priority
        pod["priorityClassName"] = priority
    container = pod["containers"][0]
    if image is not None:
        container.update(image=image, imagePullPolicy="Never")
    if command is not None:
        container["command"] = command
    if node is not None:
        pod["nodeSelector"] = {"kubernetes.io/hostname": node}
    return job


def submit(kube: Kube, path: Path, name: str, namespace: str, **options: Any) -> None:
    """Creates the file's Job as `job_from` makes it, after the ResourceClaimTemplates
    of the file, moved to `namespace` too (kept where they exist)."""
    for template in (o for o in load(path) if o["kind"] == "ResourceClaimTemplate"):
        template["metadata"]["namespace"] = namespace
        kube.apply(template)
    kube.create(job_from(path, name, namespace, **options))


def classes(path: Path = PRIORITIES) -> list[dict[str, Any]]:
    """The file's objects but its example Jobs: the priority classes."""
    return [o for o in load(path) if o["kind"] != "Job"]


def pods_of(kube: Kube, namespace: str, job: str) -> list[dict[str, Any]]:
    return kube.list("Pod", namespace, labelSelector=f"job-name={job}")


def running_pods(kube: Kube, namespace: str, job: str) -> list[dict[str, Any]]:
    """The Job's pods in phase Running, not being deleted."""
    return [
        p
        for p in pods_of(kube, namespace, job)
        if (p.get("status") or {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    ]


def workload_of(
    kube: Kube, namespace: str, owner: str, owner_kind: str = "Job"
) -> dict[str, Any] | None:
    """The Workload Kueue made for Job (or plain Pod) `owner`, owned by it, or None yet."""
    for wl in kube.list("Workload", namespace):
        owners = wl["metadata"].get("ownerReferences") or ()
        if any(o["kind"] == owner_kind and o["name"] == owner for o in owners):
            result: dict[str, Any] = wl
            return result
    return None


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or ():
        if c["type"] == kind:
            found: dict[str, Any] = c
            return found
    return None


def workload_admitted(kube: Kube, namespace: str, owner: str, owner_kind: str = "Job") -> bool:
    c = condition(workload_of(kube, namespace, owner, owner_kind), "Admitted")
    return bool(c and c["status"] == "True")


def admitted(kube: Kube, namespace: str, job: str) -> bool:
    """Kueue admitted the Job's Workload and unsuspended the Job."""
    obj = kube.get_or_none("Job", job, namespace)
    if obj is None or obj["spec"].get("suspend", False):
        return False
    return workload_admitted(kube, namespace, job)


def job_finished(kube: Kube, namespace: str, job: str) -> bool:
    obj = kube.get_or_none("Job", job, namespace)
    status = (obj or {}).get("status") or {}
    return bool(status.get("succeeded")) or bool(status.get("failed"))


def delete_job(kube: Kube, namespace: str, job: str) -> None:
    """With its pods (the API's default for Jobs orphans them)."""
    try:
        kube.request(
            "DELETE", Kube.path("Job", namespace, job), {"propagationPolicy": "Background"}
        )
    except ApiError as e:
        if e.status != 404:
            raise
