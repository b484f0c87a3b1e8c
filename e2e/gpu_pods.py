"""GPU pods on the real node, shared by the test files that run them: the demo's
workloads in a namespace of the test's own, busybox pods that hold a claim, the claim
templates they use, and what a container sees of its devices.

One place, so the suites that start pods of every kind (the GPU-pod suite, the escape
tests, the upgrade tests) ask for and inspect them the same way.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpudra.driver.mpspods import CLAIM_LABEL

from e2e.claims import claim_name, claim_template, pod_with_claim
from e2e.cluster.harness import Cluster
from e2e.cluster.kube import Kube, wait_for
from e2e.demo import workloads
from e2e.node import images
from e2e.node.gpus import DRIVER, NodeGpus
from e2e.processes import commands

SHOW = "ls /dev /dev/nvidia-caps 2>/dev/null | grep nvidia; env | grep -E '^(GPUDRA|NVIDIA|LD_)'"


def demo_objects(namespace: str) -> list[dict[str, Any]]:
    """The demo's workloads, moved into `namespace` (its Namespace object left out)."""
    # The shared Deployment needs the demo's 8 GPUs with shares; the shares test of
    # test_realnode_gpus.py runs its pods (legacy `nvidia.com/gpu.shared: 1`) on this node.
    out = [o for o in workloads() if o["kind"] not in ("Namespace", "Deployment")]
    for obj in out:
        obj["metadata"]["namespace"] = namespace
    return out


def gpu_pod(
    stack: NodeGpus,
    name: str,
    namespace: str,
    claim: str = "",
    template: str = "",
    script: str = "sleep 86400",
) -> dict[str, Any]:
    """A busybox pod on the GPU node that holds the claim and runs `script` (sleeps)."""
    return busybox_pod(name, namespace, stack.node_name, claim, template, script)


def busybox_pod(
    name: str,
    namespace: str,
    node: str | None,
    claim: str = "",
    template: str = "",
    script: str = "sleep 86400",
) -> dict[str, Any]:
    """`gpu_pod` on `node`, or wherever the scheduler finds the claim's devices (None)."""
    pod = pod_with_claim(name, namespace, node, claim=claim, template=template)
    pod["spec"]["terminationGracePeriodSeconds"] = 1
    pod["spec"]["containers"][0].update(
        image=images.TEST_IMAGE, imagePullPolicy="Never", command=["sh", "-c", script]
    )
    return pod


def whole_gpu_template(namespace: str, name: str = "whole", count: int = 1) -> dict[str, Any]:
    """One (or `count`) exclusive whole GPUs; memory-slice GPUs are left out."""
    return claim_template(name, namespace, "!device.allowMultipleAllocations", count=count)


def mps_template(namespace: str, name: str, selector: str) -> dict[str, Any]:
    """One GPU with the MPS strategy, chosen by the CEL `selector`."""
    parameters = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS"},
    }
    template = claim_template(name, namespace, selector)
    template["spec"]["spec"]["devices"]["config"] = [
        {"opaque": {"driver": DRIVER, "parameters": parameters}}
    ]
    return template


def seen(cluster: Cluster, namespace: str, pod: str) -> tuple[set[str], dict[str, str]]:
    """The NVIDIA device nodes (under /dev and /dev/nvidia-caps) and the environment
    variables the container sees."""
    out = cluster.kubectl("exec", "-n", namespace, pod, "--", "sh", "-c", SHOW)
    assert out.returncode == 0, out.stderr
    nodes, env = set(), {}
    for line in out.stdout.splitlines():
        if "=" in line:
            key, _, value = line.partition("=")
            env[key] = value
        else:
            nodes.add(line.strip())
    return nodes, env


def gpu_minors(nodes: set[str]) -> set[int]:
    return {int(n.removeprefix("nvidia")) for n in nodes if n.removeprefix("nvidia").isdigit()}


def cap_nodes(nodes: set[str]) -> set[str]:
    """The MIG access nodes (/dev/nvidia-caps/nvidia-cap<N>) among those `seen` lists."""
    return {n for n in nodes if n.startswith("nvidia-cap") and n != "nvidia-caps"}


def claim_of(kube: Kube, namespace: str, pod: str) -> str:
    """The name of the pod's (single) claim."""
    obj = kube.get("Pod", pod, namespace)
    return claim_name(obj, obj["spec"]["resourceClaims"][0]["name"])


def allocation(kube: Kube, namespace: str, pod: str) -> list[dict[str, Any]]:
    """The allocation results of the pod's (single) claim."""
    claim = claim_of(kube, namespace, pod)
    results: list[dict[str, Any]] = kube.get("ResourceClaim", claim, namespace)["status"][
        "allocation"
    ]["devices"]["results"]
    return results


def claim_uid(kube: Kube, namespace: str, pod: str) -> str:
    claim = claim_of(kube, namespace, pod)
    uid: str = kube.get("ResourceClaim", claim, namespace)["metadata"]["uid"]
    return uid


def spec_of(uid: str) -> str:
    return f"k8s.{DRIVER}-claim_{uid}.json"


def scratch_namespace(kube: Kube, prefix: str, stack: NodeGpus | None = None) -> Iterator[str]:
    """A namespace of the test's own (`prefix-<random>`); its pods are deleted at once
    and awaited before the namespace goes, and with `stack`, so are the node's
    unprepares of their claims: the next test finds their devices free.

    Why the unprepares too: a pod deleted at once is gone from the API before the
    kubelet has asked the agent to unprepare its claims, and the scheduler may give
    their devices to the next test's claims meanwhile. The agent refuses a device still
    prepared for another claim, and the kubelet retries a refused prepare only at its
    next sync of the pod (a minute or more), so the next test would wait that long."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    claims = {c["metadata"]["uid"] for c in kube.list("ResourceClaim", name)}
    for pod in kube.list("Pod", name):
        kube.delete("Pod", pod["metadata"]["name"], name, grace=0)
    wait_for(f"pods of {name} gone", lambda: not kube.list("Pod", name), timeout=60)
    if stack is not None:
        wait_released(stack, claims, f"the claims of {name}")
    kube.delete("Namespace", name)


def wait_released(stack: NodeGpus, uids: set[str], what: str) -> None:
    """Waits until the agent holds none of these claims: no CDI spec, no checkpoint
    record."""
    specs = {spec_of(u) for u in uids}
    wait_for(f"{what}: CDI specs removed", lambda: not specs & stack.cdi_specs(), timeout=90)
    wait_for(f"{what}: out of the checkpoint", lambda: not uids & set(stack.checkpoint()))


def wait_unprepared(stack: NodeGpus, uids: set[str], what: str) -> None:
    """Waits until the agent has unprepared these claims: no CDI spec, no checkpoint
    record, no MPS folders; and asserts no MIG instance is left on any GPU."""
    wait_released(stack, uids, what)
    left = uids & set(stack.list_names(stack.state_dir / "mps"))
    assert not left, f"{what}: MPS folders left for {sorted(left)}"
    assert all(not g["gpuInstances"] for g in stack.nvml_state()["gpus"])


def containers(kube: Kube, ns: str, pod: str) -> list[tuple[str, int]]:
    """Each container's ID and restart count: the same after a change means the pod's
    containers were left alone."""
    statuses = kube.get("Pod", pod, ns)["status"]["containerStatuses"]
    return [(s["containerID"], s["restartCount"]) for s in statuses]


def mps_pipes(stack: NodeGpus) -> dict[str, str]:
    """The MPS pipe folder of each prepared claim that has one, by claim UID."""
    return {
        uid: d["details"]["mps"]["pipeDir"]
        for uid, record in stack.checkpoint().items()
        for d in record["devices"]
        if "mps" in d["details"]
    }


def daemon_process(pipe_dir: str) -> Path | None:
    """The /proc folder of the stand-in MPS daemon for this pipe folder, wherever it
    runs (the agent's container, a daemon pod's, or none); None when none runs."""
    for pid, argv in commands():
        if b"nvidia-cuda-mps-daemon" in argv and pipe_dir.encode() in argv:
            return Path("/proc", str(pid))
    return None


def daemon_alive(pipe_dir: str) -> bool:
    """A stand-in MPS daemon for this pipe folder runs on the machine."""
    return daemon_process(pipe_dir) is not None


def daemon_pods(kube: Kube, namespace: str = "gpudra") -> dict[str, str]:
    """The MPS daemon pods in the driver's namespace: claim UID to pod UID."""
    return {
        p["metadata"]["labels"][CLAIM_LABEL]: p["metadata"]["uid"]
        for p in kube.list("Pod", namespace, labelSelector=CLAIM_LABEL)
    }
