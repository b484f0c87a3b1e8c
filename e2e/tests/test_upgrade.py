"""Upgrading and downgrading gpudra with GPU pods running, on the real node.

The previous release (pinned in e2e/tools/versions.env, exported from git and built by
its own image script) and the working tree are each installed from their own chart and
image; with pods of every kind running (an exclusive GPU through the webhook, a
time-sliced GPU shared by two pods, an MPS GPU, two memory slices of one GPU, a
dynamic MIG device), `helm upgrade` goes to the other one. Then:
- every running pod keeps its container (same ID, no restart) and sees the same devices;
- nothing is prepared twice: the new agent answers no prepare for them, its checkpoint
  records are the old agent's, byte for byte, and no tool ran again for them;
- new pods start under the new agent (a memory slice and a MIG device, which start an
  MPS daemon and create a MIG instance);
- pods deleted afterwards are unprepared completely: CDI spec, checkpoint record, MPS
  folders, MIG instance, time-slice.
The MPS control daemons of the running claims: the working tree runs each in a pod of
its own, which an upgrade or downgrade leaves running; the previous release ran them in
its agent's container, where they stop with it, which is why docs/install.md asks to
drain MPS and memory-slice pods before upgrading from it. The test holds both to what
happens, and after a downgrade the older agent still ends the newer daemons (their pods
end once their claim's folders are removed).

The downgrade reads a checkpoint the newer agent really wrote; after the older agent has
rewritten it (prepares of its own), the newer agent's records of the running claims are
still there as they were written, unknown fields included, and nothing in the older
agent's log calls them unreadable.

From 0.1.0, whose agent neither takes the checkpoint's lock nor reads its changes file,
the working tree's chart refuses an upgrade with a surge pod beside the old agent
(node.updateStrategy.rollingUpdate.maxSurge), naming the value and the fix, and changes
nothing; the upgrade without one then goes on.

Skips with the reason where the machine cannot run a real node or build the release.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpudra.driver.mpspods import CLAIM_LABEL
from prometheus_client.parser import text_string_to_metric_families

from e2e.claims import wait_running
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import Kube, wait_for
from e2e.gpu_pods import (
    claim_uid,
    containers,
    daemon_alive,
    daemon_pods,
    demo_objects,
    gpu_pod,
    mps_pipes,
    mps_template,
    scratch_namespace,
    seen,
    spec_of,
    wait_unprepared,
)
from e2e.node.chart import (
    IMAGE_REPOSITORY,
    NAMESPACE,
    RELEASE,
    WORKING_TREE,
    ChartBuild,
    ChartStack,
    chart_node_unavailable_reason,
    previous_release,
)
from e2e.node.realnode import NodeError, RealNode
from e2e.pins import TOOL_VERSIONS, pinned
from e2e.processes import commands
from e2e.provider import local_only
from e2e.tools import helm as h

# Four minutes on a warm machine, plus the previous release's image build on a cold one:
# run by `make test-upgrade`, kept out of `make test` so that CI stays well under an hour.
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.upgrade,
    local_only("upgrades and downgrades releases on the local real node (make test-upgrade)"),
]
# The demo's workloads but the CEL-selected pod, so that a whole GPU is left for MPS.
LEFT_OUT = {"cel-selected", "h100-40g"}
SLICED = ("sliced-a", "sliced-b")


@pytest.fixture(scope="module")
def node(cluster: Cluster) -> Iterator[RealNode]:
    if reason := chart_node_unavailable_reason():
        pytest.skip(reason)
    real = RealNode(cluster)
    real.up(log=lambda _m: None)
    try:
        yield real
    finally:
        real.down(log=lambda _m: None)


@pytest.fixture(scope="module")
def release() -> ChartBuild:
    try:
        return previous_release()
    except NodeError as e:
        if "not in this clone" in str(e):
            pytest.skip(str(e))
        raise


@pytest.fixture
def ns(node: RealNode, kube: Kube) -> Iterator[str]:
    yield from scratch_namespace(kube, "upgrade")


# --- what the tests compare before and after ------------------------------------------


def start_every_kind(stack: ChartStack, kube: Kube, ns: str) -> list[str]:
    """Pods of every kind, running; returns their names."""
    objects = [o for o in demo_objects(ns) if o["metadata"]["name"] not in LEFT_OUT]
    objects.append(mps_template(ns, "mps", "!device.allowMultipleAllocations"))
    objects.append(gpu_pod(stack, "mps", ns, template="mps"))
    for obj in objects:
        kube.create(obj)
    pods = [o["metadata"]["name"] for o in objects if o["kind"] == "Pod"]
    wait_running(kube, ns, *pods)
    return pods


def mps_daemons(stack: ChartStack) -> int:
    """Daemons started: as the agent's child (-d, before daemon pods) or in a pod (-f)."""
    return sum(("mps-control -d " in c or "mps-control -f " in c) for c in stack.tool_calls())


def mig_instances(stack: ChartStack) -> int:
    return sum(len(g["gpuInstances"]) for g in stack.nvml_state()["gpus"])


def prepares(stack: ChartStack) -> float:
    """Claims the running agent was asked to prepare since it started."""
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpudra_claim_operations_total" and s.labels.get("operation") == "prepare"
    )


def checkpoint_warnings(log: str) -> list[dict[str, Any]]:
    """What the agent's checkpoint and record readers warned about (a record unreadable,
    an unknown state, a value of an unexpected type)."""
    entries = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [
        e
        for e in entries
        if e.get("level") in ("warning", "error")
        and e.get("logger") in ("gpudra.driver.checkpoint", "gpudra.driver.records")
    ]


def roll_with_pods_running(
    cluster: Cluster, kube: Kube, node: RealNode, ns: str, start: ChartBuild, to: ChartBuild
) -> dict[str, dict[str, str]]:
    """Installs `start`, runs pods of every kind, upgrades to `to` and checks that the
    running pods were left alone, new pods start and every pod is cleaned up after.
    Returns the checkpoint records of the running claims as `start` wrote them and as
    they are once `to` has rewritten the file."""
    stack = ChartStack(node, start)
    stack.up(log=lambda _m: None)
    try:
        pods = start_every_kind(stack, kube, ns)
        uids = {p: claim_uid(kube, ns, p) for p in pods}
        before = {p: (containers(kube, ns, p), seen(cluster, ns, p)) for p in pods}
        written = {u: json.dumps(r, sort_keys=True) for u, r in stack.checkpoint().items()}
        assert set(uids.values()) <= written.keys()
        daemons, instances = mps_daemons(stack), mig_instances(stack)
        pipes = mps_pipes(stack)
        assert len(pipes) == 3 and all(daemon_alive(p) for p in pipes.values())
        # The working tree runs each daemon in a pod of its own; the previous release
        # ran them in its agent's container.
        in_pods = start is WORKING_TREE
        pods_before = daemon_pods(kube)
        assert set(pods_before) == (set(pipes) if in_pods else set())

        stack.upgrade_to(to)

        for pod in pods:
            assert (containers(kube, ns, pod), seen(cluster, ns, pod)) == before[pod], pod
        assert prepares(stack) == 0  # the kubelet asked the new agent for none of them
        read = {u: json.dumps(r, sort_keys=True) for u, r in stack.checkpoint().items()}
        assert read == written
        assert (mps_daemons(stack), mig_instances(stack)) == (daemons, instances)
        if in_pods:
            # Their pods are not the agent's: the daemons run on, untouched.
            assert all(daemon_alive(p) for p in pipes.values())
            assert daemon_pods(kube) == pods_before
        else:
            # The previous release's daemons (the MPS pod's, the memory slices') ran
            # in its agent's container and stopped with it: docs/install.md says to
            # drain such pods before upgrading from it.
            assert not any(daemon_alive(p) for p in pipes.values())

        # New pods under the new agent: a memory slice (its own MPS daemon) and a MIG
        # device (a new instance); both rewrite the checkpoint.
        kube.create(gpu_pod(stack, "slice-c", ns, template="memory-10g"))
        kube.create(gpu_pod(stack, "mig-2", ns, template="mig-1g10gb"))
        wait_running(kube, ns, "slice-c", "mig-2")
        assert mps_daemons(stack) == daemons + 1
        assert mig_instances(stack) == instances + 1
        assert prepares(stack) == 2
        rewritten = {u: json.dumps(r, sort_keys=True) for u, r in stack.checkpoint().items()}
        for pod in (*pods, "slice-c", "mig-2"):
            uids[pod] = claim_uid(kube, ns, pod)
        assert not checkpoint_warnings(stack.agent_log())

        for pod in uids:
            kube.delete("Pod", pod, ns)
        wait_unprepared(stack, set(uids.values()), "every pod's claim")
        # An older agent knows nothing of daemon pods, but removes the claim's folders,
        # and a daemon pod ends with its folder.
        wait_for("every MPS daemon ended", lambda: not any(map(daemon_alive, pipes.values())))
        if in_pods and to is not WORKING_TREE:
            # The older agent deletes no daemon pods: they ended with their claims'
            # folders and stay Completed, and docs/install.md's command removes them.
            left = kube.list("Pod", NAMESPACE, labelSelector=CLAIM_LABEL)
            assert {p["metadata"]["uid"] for p in left} == set(pods_before.values())
            wait_for(
                "the daemon pods Completed",
                lambda: all(
                    kube.get("Pod", p["metadata"]["name"], NAMESPACE)["status"]["phase"]
                    == "Succeeded"
                    for p in left
                ),
            )
            out = cluster.kubectl(
                "-n",
                NAMESPACE,
                "delete",
                "pods",
                "-l",
                CLAIM_LABEL,
                "--field-selector=status.phase=Succeeded",
            )
            assert out.returncode == 0, out.stderr
            wait_for("the daemon pods deleted", lambda: not daemon_pods(kube))
        else:
            assert not daemon_pods(kube)
        sliced = {c for c in stack.tool_calls() if "--set-timeslice" in c}
        assert any(c.endswith("--set-timeslice 0") for c in sliced), sliced
        return {"written": written, "rewritten": rewritten}
    finally:
        stack.down(log=lambda _m: None)


def test_upgrade_from_the_previous_release_leaves_running_gpu_pods_alone(
    cluster: Cluster, kube: Kube, node: RealNode, ns: str, release: ChartBuild
) -> None:
    roll_with_pods_running(cluster, kube, node, ns, release, WORKING_TREE)


def test_downgrade_to_the_previous_release_keeps_the_newer_checkpoint(
    cluster: Cluster, kube: Kube, node: RealNode, ns: str, release: ChartBuild
) -> None:
    records = roll_with_pods_running(cluster, kube, node, ns, WORKING_TREE, release)
    # The older agent rewrote the file with prepares of its own; the records the newer
    # agent wrote for the claims that kept running are there as written, every field
    # the older release does not know included.
    written, rewritten = records["written"], records["rewritten"]
    assert {u: rewritten.get(u) for u in written} == written


# --- a surge pod beside the previous release's agents ---------------------------------------

SURGE = {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def workloads(kube: Kube) -> dict[str, Any]:
    """What an upgrade changes: the release's revisions as Helm stores them, and its
    DaemonSet's and Deployment's generation, labels and images."""
    state: dict[str, Any] = {
        "revisions": sorted(
            (s["metadata"]["name"], s["metadata"]["labels"].get("status"))
            for s in kube.list("Secret", NAMESPACE, labelSelector=f"owner=helm,name={RELEASE}")
        )
    }
    for kind in ("DaemonSet", "Deployment"):
        for obj in kube.list(kind, NAMESPACE):
            meta = obj["metadata"]
            if meta.get("labels", {}).get("app.kubernetes.io/instance") != RELEASE:
                continue
            images = [c["image"] for c in obj["spec"]["template"]["spec"]["containers"]]
            state[f"{kind}/{meta['name']}"] = (meta["generation"], meta["labels"], images)
    return state


def test_an_upgrade_from_0_1_0_with_a_surge_pod_is_refused_and_changes_nothing(
    cluster: Cluster, kube: Kube, node: RealNode, release: ChartBuild, tmp_path: Path
) -> None:
    """0.1.0's agent neither takes the checkpoint's lock nor reads its changes file, so a
    surge pod of the working tree beside it and it would overwrite each other's records.
    The working tree's chart reads the version of the release's running agents from its
    DaemonSet (`lookup`, which only a real upgrade answers) and refuses the upgrade
    before anything is changed; the upgrade the refusal asks for (maxSurge=0) goes on."""
    tag = pinned("GPUDRA_PREVIOUS_RELEASE", TOOL_VERSIONS)
    if tag != "v0.1.0":
        pytest.skip(f"the check is for upgrades from 0.1.0; the previous release is {tag}")
    stack = ChartStack(node, release)
    stack.up(log=lambda _m: None)
    try:
        before = workloads(kube)
        daemonset = kube.get("DaemonSet", f"{RELEASE}-node", NAMESPACE)
        assert daemonset["metadata"]["labels"]["app.kubernetes.io/version"] == "0.1.0"
        assert before[f"DaemonSet/{RELEASE}-node"][2] == [f"{IMAGE_REPOSITORY}:{release.tag}"]

        values = stack.values()
        values["node"]["updateStrategy"] = SURGE
        with pytest.raises(h.HelmFailed) as failure:
            h.run(
                h.helm_binary(),
                "upgrade", RELEASE, str(WORKING_TREE.chart),
                "--namespace", NAMESPACE,
                *h.values_args([values], tmp_path),
                "--force-conflicts",  # what docs/install.md adds from 0.1.0 with Helm 4
                env={"KUBECONFIG": str(cluster.layout.admin_kubeconfig)},
            )  # fmt: skip
        (line,) = [x for x in str(failure.value).splitlines() if "maxSurge" in x]
        assert (
            "node.updateStrategy.rollingUpdate.maxSurge=1 cannot be used to upgrade from 0.1.0 "
            f"(DaemonSet {NAMESPACE}/{RELEASE}-node runs 0.1.0's agents)" in line
        ), line
        assert (
            "Roll this upgrade with node.updateStrategy.rollingUpdate.maxSurge=0 "
            "(and maxUnavailable=1)" in line
        ), line
        assert workloads(kube) == before

        stack.upgrade_to(WORKING_TREE)  # without a surge pod, as the refusal says
        after = kube.get("DaemonSet", f"{RELEASE}-node", NAMESPACE)
        chart = yaml.safe_load((WORKING_TREE.chart / "Chart.yaml").read_text())
        assert after["metadata"]["labels"]["app.kubernetes.io/version"] == chart["appVersion"]
    finally:
        stack.down(log=lambda _m: None)


# --- a rollback after an agent that never stopped ---------------------------------------


def agent_pid() -> int:
    """The host PID of the chart's agent, `gpudra node` (under tini in its container)."""
    found = [
        pid
        for pid, argv in commands()
        if any(
            a.rsplit(b"/", 1)[-1] == b"gpudra" and argv[i + 1 : i + 2] == [b"node"]
            for i, a in enumerate(argv)
        )
        and not argv[0].endswith(b"tini")
    ]
    assert len(found) == 1, f"expected one agent process, found {found}"
    return found[0]


@contextlib.contextmanager
def agent_frozen() -> Iterator[None]:
    """The agent stopped where it is (SIGSTOP): the rollout's SIGTERM finds it unable to
    stop cleanly, and the kubelet kills it at the end of its grace period, as one whose
    stop outlasts that period (calls still running) or that is OOM-killed."""
    pid = agent_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_rollback_after_an_agent_killed_mid_run_leaves_running_devices_alone(
    cluster: Cluster, kube: Kube, node: RealNode, ns: str, release: ChartBuild
) -> None:
    """The agent appends prepares' ends beside its checkpoint and folds them in when it
    stops. Killed instead, its file alone lacks them; the previous release reads the
    file alone, and would roll back a prepare that ended: destroy the running pod's MIG
    instance and delete its CDI spec. The file says so (majorVersion 2), so the previous
    release refuses to start and touches nothing; going forward and back again, with a
    clean stop between, rolls back, and it then unprepares the pods as usual."""
    stack = ChartStack(node, WORKING_TREE)
    stack.up(log=lambda _m: None)
    try:
        for obj in demo_objects(ns):
            if obj["kind"] != "Pod":
                kube.create(obj)
        pods = ("mig-2", "whole")
        kube.create(gpu_pod(stack, "mig-2", ns, template="mig-1g10gb"))
        kube.create(gpu_pod(stack, "whole", ns, template="h100-40g"))
        wait_running(kube, ns, *pods)
        uids = {p: claim_uid(kube, ns, p) for p in pods}
        before = {p: (containers(kube, ns, p), seen(cluster, ns, p)) for p in pods}
        instances, specs = mig_instances(stack), stack.cdi_specs()
        assert instances == 1 and {spec_of(u) for u in uids.values()} <= specs
        path = stack.state_dir / "checkpoint.json"
        assert json.loads(path.read_text()).get("majorVersion") == 2  # extended, running

        with agent_frozen():
            stack.roll_unwaited(release)
            old_image = f"{IMAGE_REPOSITORY}:{release.tag}"
            wait_for(
                "the previous release's agent to exit",
                lambda: (
                    (got := stack.agent_image_restarts()) is not None
                    and got[0] == old_image
                    and got[1] >= 1
                ),
                timeout=180,
            )
        refusal = stack.agent_log(previous=True)
        assert "has majorVersion 2, written by a newer gpudra release" in refusal, refusal
        written = path.read_bytes()
        assert (mig_instances(stack), stack.cdi_specs()) == (instances, specs)
        for pod in pods:
            assert (containers(kube, ns, pod), seen(cluster, ns, pod)) == before[pod], pod

        # Forward again, then back with the newer agent stopping as a rollout stops it.
        stack.upgrade_to(WORKING_TREE)
        assert path.read_bytes() != written  # taken over
        stack.upgrade_to(release)
        assert (mig_instances(stack), stack.cdi_specs()) == (instances, specs)
        for pod in pods:
            assert (containers(kube, ns, pod), seen(cluster, ns, pod)) == before[pod], pod
        for pod in pods:
            kube.delete("Pod", pod, ns)
        wait_unprepared(stack, set(uids.values()), "every pod's claim")
    finally:
        stack.down(log=lambda _m: None)
