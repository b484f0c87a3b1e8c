"""`make demo-kueue`: Kueue queueing GPU Jobs for gpudra on the real node.

The control plane (brought up by the Makefile), the real node with emulated GPUs and
gpudra, Kueue, and the queues of demo/kueue/; then legacy and native Jobs from the
same files the tests apply, more than the quota holds. A table of Job, queue, state,
pods and devices is printed each time a Job changes state: the queue filling, Jobs
waiting, admitted, running on GPUs, and the next admitted as one completes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from e2e.cluster.harness import Cluster, ClusterError
from e2e.cluster.kube import ApiError, Kube, wait_for
from e2e.demo import print_table, start_gpu_node
from e2e.kueue import jobs
from e2e.kueue.manager import KueueError, KueueManager
from e2e.kueue.watch import HEADER, JobRow, Timeline
from e2e.node import images
from e2e.node.gpus import NodeGpus
from e2e.node.realnode import NodeError, unavailable_reason

WORK = ["sh", "-c", "ls /dev | grep -q '^nvidia[0-9]' && sleep 8"]
"""Succeeds only where the container sees a GPU device node."""
DEMO_JOBS: list[tuple[Path, str, str]] = [
    (jobs.LEGACY_JOB, "team-a", "legacy-0"),
    (jobs.NATIVE_JOB, "team-b", "native-0"),
    (jobs.LEGACY_JOB, "team-a", "legacy-1"),
    (jobs.NATIVE_JOB, "team-b", "native-1"),
    (jobs.LEGACY_JOB, "team-b", "legacy-2"),
]


def queues_on_gpus(cluster: Cluster) -> tuple[Kube, NodeGpus]:
    """The real node with gpudra, Kueue, and the queues and priority classes of
    demo/kueue/ (all kept where they run already)."""
    stack = start_gpu_node(cluster)
    KueueManager(cluster).up(log=lambda m: print(f"  {m}"))
    kube = cluster.kube()
    for obj in [*jobs.load(jobs.QUEUES), *jobs.classes()]:
        kube.apply(obj)
    return kube, stack


def submit_all(
    kube: Kube, stack: NodeGpus, specs: Sequence[tuple[Path, str, str]], command: list[str]
) -> list[tuple[str, str]]:
    """The Jobs (file, namespace, name), those of an earlier run deleted first."""
    names = [(ns, name) for _path, ns, name in specs]
    for ns, name in names:
        jobs.delete_job(kube, ns, name)
    wait_for(
        "the Jobs of an earlier run gone",
        lambda: not any(kube.get_or_none("Job", n, ns) for ns, n in names),
        timeout=90,
    )
    for path, ns, name in specs:
        jobs.submit(
            kube, path, name, ns, image=images.TEST_IMAGE, command=command, node=stack.node_name
        )
    return names


def follow(
    timeline: Timeline, on_change: Callable[[list[JobRow]], None], timeout: float = 300
) -> list[JobRow]:
    """Polls until every Job finished, calling `on_change` whenever a state changed."""
    deadline = time.monotonic() + timeout
    last: list[str] = []
    while time.monotonic() < deadline:
        rows = timeline.poll()
        if [r.state for r in rows] != last:
            on_change(rows)
            last = [r.state for r in rows]
        if timeline.finished(rows):
            return rows
        time.sleep(0.1)
    raise TimeoutError(f"the Jobs did not all finish within {timeout:.0f}s")


def main() -> int:
    cluster = Cluster()
    reason = unavailable_reason()
    if reason:
        print(f"demo-kueue: no real node on this machine ({reason})", file=sys.stderr)
        return 1
    try:
        kube, stack = queues_on_gpus(cluster)
        print(f"== {len(DEMO_JOBS)} one-GPU Jobs, legacy and native, under a quota of 2 GPUs")
        names = submit_all(kube, stack, DEMO_JOBS, WORK)
        start = time.monotonic()

        def show(rows: list[JobRow]) -> None:
            print(f"\n  +{time.monotonic() - start:.1f}s")
            print_table([r.cells() for r in rows], HEADER)

        follow(Timeline(kube, names), show)
    except (ClusterError, NodeError, KueueError, ApiError, TimeoutError) as e:
        print(f"demo-kueue: {e}", file=sys.stderr)
        return 1
    print(
        "\nEach Job succeeded, which its command does only where the container sees a GPU. "
        "`make kueue-down` stops Kueue, `make demo-down` removes everything."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
