"""`make demo`: the local control plane (brought up by the Makefile), a real node with
emulated GPUs, gpudra's node agent and webhook, and the sample workloads of demo/;
then a table of pod, container, device and how it is shared, as the containers see it.

Where the machine cannot run a real node (not root, no cgroups), the demo says why and
shows the scheduler's side only: a claim allocated from the emulated GPUs of a
simulated node.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import yaml

from e2e import smoke
from e2e.claims import claim_name, node_devices, wait_running
from e2e.cluster.harness import REPO, Cluster, ClusterError
from e2e.cluster.kube import ApiError, Kube, wait_for
from e2e.node.gpus import GpuStack
from e2e.node.realnode import DEFAULT_NODE, NodeError, RealNode, unavailable_reason

DEMO = REPO / "demo"
NAMESPACE = "gpudra-demo"
# The device plugin's time-slicing `replicas: 2`, for the shared Deployment.
GPU_SHARES = "--gpu-shares=2"
# Three whole GPUs, a memory-sliced one and two shared ones, besides the MIG GPUs.
DEMO_GPUS = "8"


def workloads() -> list[dict[str, Any]]:
    """Every object of demo/*.yaml, in file order."""
    out = []
    for path in sorted(DEMO.glob("*.yaml")):
        out.extend(obj for obj in yaml.safe_load_all(path.read_text()) if obj)
    return out


def apply_all(kube: Kube, objects: list[dict[str, Any]]) -> list[str]:
    """Creates what is missing (pods are immutable: an existing one is kept)."""
    pods = []
    for obj in objects:
        meta = obj["metadata"]
        if obj["kind"] == "Pod":
            pods.append(meta["name"])
        if kube.get_or_none(obj["kind"], meta["name"], meta.get("namespace")) is None:
            kube.create(obj)
    return pods


def workload_pods(kube: Kube, objects: list[dict[str, Any]]) -> list[str]:
    """The demo's pods: its Pods, then those of its Deployments (once all exist)."""
    pods = [o["metadata"]["name"] for o in objects if o["kind"] == "Pod"]
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        labels = deployment["spec"]["selector"]["matchLabels"]
        selector = ",".join(f"{k}={v}" for k, v in labels.items())

        def made(want: int = deployment["spec"]["replicas"], sel: str = selector) -> list[str]:
            names = [p["metadata"]["name"] for p in kube.list("Pod", NAMESPACE, labelSelector=sel)]
            return sorted(names) if len(names) == want else []

        pods += wait_for(f"the pods of Deployment {deployment['metadata']['name']}", made)
    return pods


def _sharing(claim: dict[str, Any], result: dict[str, Any], device: dict[str, Any]) -> str:
    attrs = device.get("attributes", {})
    kind = next(iter(attrs.get("type", {}).values()), "gpu")
    if kind == "mig":
        return f"MIG {next(iter(attrs['profile'].values()))}, dynamic"
    shares = (result.get("consumedCapacity") or {}).get("shares")
    published = device.get("capacity", {}).get("shares", {}).get("value")
    if shares is not None and shares != published:  # all of them: the GPU whole
        return f"{shares} of {published} shares, time-sliced"
    if result.get("shareID") and shares is None:
        memory = next(
            (v for k, v in (result.get("consumedCapacity") or {}).items() if "memory" in k), "?"
        )
        return f"memory slice {memory} (MPS)"
    users = len(claim["status"].get("reservedFor") or ())
    for config in claim["spec"]["devices"].get("config") or ():
        sharing = (config.get("opaque") or {}).get("parameters", {}).get("sharing") or {}
        if sharing.get("strategy") == "TimeSlicing":
            interval = (sharing.get("timeSlicingConfig") or {}).get("interval", "Default")
            return f"time-sliced ({interval}), {users} pods"
        if sharing.get("strategy") == "MPS":
            return f"MPS, {users} pods"
    return "exclusive"


def rows(cluster: Cluster, kube: Kube, pods: list[str]) -> list[tuple[str, ...]]:
    devices = node_devices(kube, DEFAULT_NODE)
    out = []
    for name in pods:
        pod = kube.get("Pod", name, NAMESPACE)
        for container in pod["spec"]["containers"]:
            refs = [c["name"] for c in (container.get("resources") or {}).get("claims") or ()]
            seen = cluster.kubectl(
                "exec",
                "-n",
                NAMESPACE,
                name,
                "-c",
                container["name"],
                "--",
                "sh",
                "-c",
                "cd /dev && ls -d nvidia[0-9]* nvidia-caps/* 2>/dev/null",
            ).stdout.split()
            for ref in refs:
                claim = kube.get("ResourceClaim", claim_name(pod, ref), NAMESPACE)
                for result in claim["status"]["allocation"]["devices"]["results"]:
                    device = devices.get(result["device"], {})
                    out.append(
                        (
                            name,
                            container["name"],
                            result["device"],
                            _sharing(claim, result, device),
                            " ".join(f"/dev/{n}" for n in seen),
                        )
                    )
    return out


TABLE_HEADER = ("POD", "CONTAINER", "DEVICE", "SHARING", "CONTAINER SEES")


def print_table(table: list[tuple[str, ...]], header: tuple[str, ...] = TABLE_HEADER) -> None:
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    for r in [header, *table]:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def start_gpu_node(cluster: Cluster, flags: tuple[str, ...] = ()) -> GpuStack:
    """The real node with emulated GPUs and gpudra's agent and webhook (kept where they
    run already)."""
    node = RealNode(cluster)
    print("== a real node: kubelet, containerd and runc, with emulated GPUs")
    os.environ.setdefault("GPUDRA_REAL_NODE_GPUS", DEMO_GPUS)
    node.up(log=lambda m: print(f"  {m}"))
    stack = GpuStack(node, flags=flags)
    stack.up(log=lambda m: print(f"  {m}"))
    return stack


def real_node_demo(cluster: Cluster, kube: Kube) -> None:
    start = time.monotonic()
    start_gpu_node(cluster, flags=(GPU_SHARES,))
    print(f"== the sample workloads ({DEMO.relative_to(REPO)}/)")
    objects = workloads()
    apply_all(kube, objects)
    pods = workload_pods(kube, objects)
    wait_running(kube, NAMESPACE, *pods)
    print(f"  {len(pods)} pods Running in {time.monotonic() - start:.1f}s\n")
    print_table(rows(cluster, kube, pods))
    print(
        "\nLook around: `make cluster-env` prints how to reach the cluster, "
        f"`kubectl -n {NAMESPACE} logs legacy-gpu` shows what a container saw, "
        "`make demo-down` removes everything."
    )


def scheduler_only_demo(kube: Kube) -> None:
    print("== smoke: the real scheduler allocates a ResourceClaim from a template")
    res = smoke.run(kube, node="worker-1", log=lambda m: print(f"  {m}"))
    print_table(
        [(f"{res.namespace}/{res.pod}", "main", f"{res.pool}/{res.device}", "exclusive", "-")]
    )
    smoke.teardown(kube, res)
    print("  deleted the pod: the controller-manager deleted its claim")


def main() -> int:
    cluster = Cluster()
    try:
        kube = cluster.kube()
        reason = unavailable_reason()
        if reason:
            print(f"demo: no real node on this machine ({reason}); showing allocation only")
            scheduler_only_demo(kube)
        else:
            real_node_demo(cluster, kube)
    except (ClusterError, NodeError, ApiError, TimeoutError) as e:
        print(f"demo: {e}", file=sys.stderr)
        return 1
    return 0


def down() -> int:
    """`make demo-down`: the workloads, the real node and the control plane."""
    cluster = Cluster()
    if cluster.is_up():
        kube = cluster.kube()
        kube.delete("Namespace", NAMESPACE)
    cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(down() if sys.argv[1:] == ["down"] else main())
