"""make bench-schedule: the real scheduler placing one-GPU pods on fake nodes, four ways
of asking for a GPU, in one run. Writes bench/results/schedule.json.

(a) `extended_resource`: `nvidia.com/gpu: 1` on node capacity, what the device plugin
    gave; the nodes advertise 8 each and publish no slices.
(b) `native_claims`: a ResourceClaimTemplate per namespace, one claim per pod made by
    the controller-manager, allocated by the scheduler from gpudra's slices.
(c) `converted_legacy`: the same `nvidia.com/gpu: 1` pods as (a), converted by gpudra's
    webhook (its own process, registered with the API server) into (b)'s shape.
(d) `class_extended_resource`: the unconverted pods of (a), served by the DeviceClass
    `extendedResourceName` mapping (the scheduler makes the claim); skipped with the
    reason where the API server drops the field (DRAExtendedResource off).

For (b) to (d), each fake node publishes 8 whole H100s through gpudra's real slice
controller (emulated NVML), in this process; the nodes of (a) are other fake nodes
with the capacity instead, so each way sees exactly `BENCH_SCHED_NODES` candidate nodes
(default 125: 1,000 GPUs for `BENCH_SCHED_PODS`, default 1,000 pods, so every pod can
bind). Pods select the bench's nodes by label, so the harness's own nodes take none.

Per way: pods per second from the first create to the last bind, and create-to-bound
p50/p99, the bind seen on a watch of the namespace. Pods are created by 8 concurrent
clients as fast as the API server takes them. Target: (c) at least 0.9x of (b); (b)/(a)
is the price of DRA itself, reported as measured.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from gpudra.api.deviceclasses import device_classes
from gpudra.common.files import atomic_write
from gpudra.common.kube import ApiError
from gpudra.common.kube import Kube as AsyncKube
from gpudra.webhook import registration
from gpudra.webhook.certs import ensure_pki, service_dns_names

from bench.prepare import percentile
from bench.runinfo import load_avg, run_context
from bench.webhook import start_server
from e2e.cluster.harness import NODE_CAPACITY, Cluster, heartbeat, register_node
from e2e.cluster.kube import Kube, wait_for
from e2e.node_process import delete_slices
from e2e.webhook_env import EmulatedNode, start_emulated_nodes

OUT = Path(__file__).resolve().parent / "results" / "schedule.json"
DRIVER = "gpu.nvidia.com"
GPU = "nvidia.com/gpu"
GPUS_PER_NODE = 8
LABEL = "gpudra.dev/bench-schedule"
CREATORS = 8
WAYS = ("extended_resource", "native_claims", "converted_legacy", "class_extended_resource")


def pod(name: str, namespace: str, native: bool) -> dict[str, Any]:
    """One pod asking for one GPU: by claim template (`native`) or `nvidia.com/gpu: 1`."""
    container: dict[str, Any] = {"name": "cuda", "image": "registry.k8s.io/pause:3.10"}
    spec: dict[str, Any] = {"containers": [container], "nodeSelector": {LABEL: "true"}}
    if native:
        container["resources"] = {"claims": [{"name": "gpu"}]}
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]
    else:
        container["resources"] = {"limits": {GPU: "1"}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def template(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": namespace},
        "spec": {
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}
            }
        },
    }


async def keep_alive(sync: Kube, nodes: list[str], capacity: Mapping[str, str]) -> None:
    """Heartbeats for the fake nodes (the node lifecycle controller taints silent ones)."""
    while True:
        for name in nodes:
            await anyio.to_thread.run_sync(heartbeat, sync, name, capacity)
        await anyio.sleep(10)


def register(sync: Kube, nodes: list[str], capacity: Mapping[str, str]) -> None:
    for name in nodes:
        register_node(sync, name, capacity, labels={LABEL: "true"})


def delete_nodes(sync: Kube, nodes: list[str]) -> None:
    for name in nodes:
        if sync.get_or_none("Node", name) is not None:
            sync.delete("Node", name)


async def measure(akube: AsyncKube, namespace: str, pods: list[dict[str, Any]]) -> dict[str, Any]:
    """Create `pods` as fast as the API server takes them; time each to its bind."""
    timeout_s = float(os.environ.get("BENCH_SCHED_TIMEOUT_S", "600"))
    created: dict[str, float] = {}
    bound: dict[str, float] = {}
    errors: dict[str, int] = {}
    all_bound = anyio.Event()
    path = f"/api/v1/namespaces/{namespace}/pods"

    async def watch() -> None:
        while not all_bound.is_set():
            async for event in akube.watch(path, {}):
                obj = event.get("object") or {}
                name = (obj.get("metadata") or {}).get("name", "")
                if (obj.get("spec") or {}).get("nodeName") and name not in bound:
                    bound[name] = time.monotonic()
                    if len(bound) == len(pods):
                        all_bound.set()
                        return

    async def create(queue: list[dict[str, Any]]) -> None:
        while queue:
            body = queue.pop()
            name = body["metadata"]["name"]
            created[name] = time.monotonic()
            try:
                await akube.request("POST", path, body)
            except ApiError as e:
                created.pop(name, None)
                errors[str(e.status)] = errors.get(str(e.status), 0) + 1

    queue = list(reversed(pods))
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        await anyio.sleep(0.5)  # the watch is open before the first create
        async with anyio.create_task_group() as creators:
            for _ in range(CREATORS):
                creators.start_soon(create, queue)
        with anyio.move_on_after(timeout_s):
            await all_bound.wait()
        tg.cancel_scope.cancel()
    latencies = [(bound[n] - t) * 1000 for n, t in created.items() if n in bound]
    span = max(bound.values(), default=0.0) - min(created.values(), default=0.0)
    return {
        "pods": len(pods),
        "bound": len(latencies),
        "create_errors": errors,
        "wall_s": round(span, 2),
        "pods_per_s": round(len(latencies) / span, 1) if span > 0 else None,
        "create_to_bound_p50_ms": round(statistics.median(latencies), 1) if latencies else None,
        "create_to_bound_p99_ms": round(percentile(latencies, 99), 1) if latencies else None,
    }


async def empty_namespace(akube: AsyncKube, sync: Kube, namespace: str) -> None:
    """Pods go at once (fake nodes have no kubelet to confirm), then their claims, so
    that the next way starts with every device free; then the namespace."""
    for item in sync.list("Pod", namespace):
        await akube.request(
            "DELETE",
            f"/api/v1/namespaces/{namespace}/pods/{item['metadata']['name']}",
            {"gracePeriodSeconds": 0},
        )
    await anyio.to_thread.run_sync(
        lambda: wait_for(
            f"the claims in {namespace} to go",
            lambda: not sync.list("ResourceClaim", namespace),
            timeout=300,
            interval=1,
        )
    )
    sync.delete("Namespace", namespace)


async def run_way(
    way: str, akube: AsyncKube, sync: Kube, count: int, setup: Any = None
) -> dict[str, Any]:
    namespace = f"sched-{way.replace('_', '-')}-{secrets.token_hex(3)}"
    sync.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    native = way == "native_claims"
    if native:
        sync.create(template(namespace))
    # Pods of a namespace without its service account are refused.
    account = f"/api/v1/namespaces/{namespace}/serviceaccounts/default"
    await anyio.to_thread.run_sync(
        lambda: wait_for(f"service account in {namespace}", lambda: sync.request("GET", account))
    )
    pods = [pod(f"p-{i:05d}", namespace, native) for i in range(count)]
    try:
        print(f"bench-schedule: {way}: {count} pods", file=sys.stderr, flush=True)
        result = await measure(akube, namespace, pods)
        print(f"bench-schedule: {way}: {json.dumps(result)}", file=sys.stderr, flush=True)
        return result
    finally:
        await empty_namespace(akube, sync, namespace)


async def with_webhook(cluster: Cluster, akube: AsyncKube, workdir: Path) -> Any:
    """gpudra's webhook in its own process, registered for pods; returns the process."""
    pki, _ = ensure_pki(workdir / "pki", service_dns_names("gpudra-webhook", "gpudra"))
    proc, port = start_server(workdir, cluster.layout.admin_kubeconfig, "api", None)
    await registration.apply(
        akube,
        registration.mutating_configuration(
            ca_bundle_b64=pki.ca_bundle_base64(),
            own_namespace="gpudra",
            url=f"https://{cluster.webhook_host()}:{port}",
        ),
    )
    return proc


async def main() -> dict[str, Any]:
    nodes_n = int(os.environ.get("BENCH_SCHED_NODES", "125"))
    count = int(os.environ.get("BENCH_SCHED_PODS", "1000"))
    if count > nodes_n * GPUS_PER_NODE:
        raise SystemExit(
            f"bench-schedule: BENCH_SCHED_PODS={count} is more than the "
            f"{nodes_n * GPUS_PER_NODE} GPUs of BENCH_SCHED_NODES={nodes_n}: raise the nodes "
            "or lower the pods, so that every pod can bind"
        )
    cluster = Cluster()
    if not cluster.is_up():
        cluster.up()
    sync = cluster.kube()
    akube = await AsyncKube.connect(str(cluster.layout.admin_kubeconfig), max_connections=None)
    load_start = load_avg()
    ways: dict[str, Any] = {}
    workdir = Path(tempfile.mkdtemp(prefix="bench-schedule-"))
    plugin_nodes = [f"sched-dp-{i:03d}" for i in range(nodes_n)]
    dra_nodes = [f"sched-{i:03d}" for i in range(nodes_n)]
    with_gpus = {**NODE_CAPACITY, GPU: str(GPUS_PER_NODE)}
    try:
        # (a): nodes that advertise nvidia.com/gpu, as the device plugin made them.
        register(sync, plugin_nodes, with_gpus)
        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_alive, sync, plugin_nodes, with_gpus)
            ways["extended_resource"] = await run_way("extended_resource", akube, sync, count)
            tg.cancel_scope.cancel()
        delete_nodes(sync, plugin_nodes)

        # (b) to (d): nodes that publish gpudra's slices instead.
        for dc in device_classes(DRIVER):
            sync.apply(dc)
        register(sync, dra_nodes, NODE_CAPACITY)
        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_alive, sync, dra_nodes, NODE_CAPACITY)
            await start_emulated_nodes(
                tg,
                akube,
                DRIVER,
                [EmulatedNode(n, "emulated:h100-80gb-hbm3-x8", uuid_salt=n) for n in dra_nodes],
            )
            ways["native_claims"] = await run_way("native_claims", akube, sync, count)
            proc = await with_webhook(cluster, akube, workdir)
            try:
                ways["converted_legacy"] = await run_way("converted_legacy", akube, sync, count)
            finally:
                await registration.delete(akube)
                proc.terminate()
                proc.wait(timeout=30)
            ways["class_extended_resource"] = await class_way(akube, sync, count)
            tg.cancel_scope.cancel()
    finally:
        delete_slices(sync, DRIVER)
        delete_nodes(sync, plugin_nodes + dra_nodes)
        for dc in device_classes(DRIVER):
            sync.apply(dc)
        await akube.close()
        shutil.rmtree(workdir, ignore_errors=True)

    def rate(way: str) -> float | None:
        value = ways.get(way, {}).get("pods_per_s")
        return float(value) if value else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    converted_to_native = ratio(rate("converted_legacy"), rate("native_claims"))
    return {
        "nodes": nodes_n,
        "gpus_per_node": GPUS_PER_NODE,
        "pods": count,
        "ways": ways,
        "ratios": {
            "converted_legacy_to_native_claims": converted_to_native,
            "native_claims_to_extended_resource": ratio(
                rate("native_claims"), rate("extended_resource")
            ),
            "class_extended_resource_to_native_claims": ratio(
                rate("class_extended_resource"), rate("native_claims")
            ),
        },
        "targets": {
            "converted_legacy_to_native_claims": {
                "limit": 0.9,
                "value": converted_to_native,
                "met": None if converted_to_native is None else converted_to_native >= 0.9,
            }
        },
        "notes": (
            "The control plane runs with its components' default client limits, as a "
            "cluster does unless tuned: kube-scheduler 50 QPS (burst 100), "
            "kube-controller-manager 20 QPS (burst 30). A DRA pod costs more API writes "
            "than an extended-resource pod (the claim made from the template, its "
            "allocation in status, then the bind), so those limits weigh on (b) to (d) "
            "more than on (a)."
        ),
        **run_context(sync, load_start),
    }


async def class_way(akube: AsyncKube, sync: Kube, count: int) -> dict[str, Any]:
    """(d): the gpu class maps `nvidia.com/gpu` itself, for unconverted pods."""
    (whole,) = [c for c in device_classes(DRIVER) if c["metadata"]["name"] == DRIVER]
    mapped = {**whole, "spec": {**whole["spec"], "extendedResourceName": GPU}}
    stored = sync.apply(mapped)
    try:
        if stored["spec"].get("extendedResourceName") != GPU:
            return {
                "skipped": "the API server drops extendedResourceName: DRAExtendedResource is off"
            }
        return await run_way("class_extended_resource", akube, sync, count)
    finally:
        sync.apply(whole)


if __name__ == "__main__":
    result = anyio.run(main)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(OUT, (json.dumps(result, indent=2) + "\n").encode(), mode=0o644)
    print(json.dumps(result, indent=2))
    complete = all(w.get("bound") == w.get("pods") for w in result["ways"].values() if "pods" in w)
    sys.exit(0 if complete else 1)
