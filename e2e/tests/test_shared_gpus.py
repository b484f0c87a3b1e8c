"""Memory slices end to end: `gpudra node --shared-gpus` publishes a GPU the real
scheduler hands to several claims, each with its own shareID and memory amount."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from gpudra.driver.claims import ClaimRef, checked_claim

from e2e import features
from e2e.claims import pod_with_claim, wait_allocated
from e2e.cluster.harness import REPO, Cluster
from e2e.cluster.kube import ApiError, Kube, wait_for

pytestmark = pytest.mark.cluster
DRIVER = "shared.gpudra.dev"
NODE = "worker-1"
PROFILE = "emulated:h100-80gb-hbm3-x8"
SHARED = "gpu-0"
MEMORY = f"{DRIVER}/memory"
# A slice claim asks for memory on a device that allows multiple allocations: without
# the selector the scheduler may give it an exclusive GPU whole.
SLICE_SELECTOR = "device.allowMultipleAllocations"


@pytest.fixture(scope="module")
def consumable_capacity(kube: Kube) -> None:
    """Skips unless the API server keeps allowMultipleAllocations (DRAConsumableCapacity)."""
    if reason := features.consumable_capacity(kube):
        pytest.skip(reason)


@pytest.fixture
def namespace(cluster: Cluster, kube: Kube, consumable_capacity: None) -> Iterator[str]:
    ns = f"shared-{secrets.token_hex(3)}"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    expr = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
    kube.apply(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": expr}}]},
        }
    )
    yield ns
    for pod in kube.list("Pod", ns):
        kube.delete("Pod", pod["metadata"]["name"], ns, grace=0)
    for claim in kube.list("ResourceClaim", ns):
        kube.delete("ResourceClaim", claim["metadata"]["name"], ns)
    kube.delete("Namespace", ns)
    kube.delete("DeviceClass", DRIVER)
    for o in kube.list("ResourceSlice", fieldSelector=f"spec.driver={DRIVER}"):
        kube.delete("ResourceSlice", o["metadata"]["name"])


def node_command(cluster: Cluster, *flags: str) -> subprocess.Popen[str]:
    env = {**os.environ, "KUBECONFIG": str(cluster.layout.admin_kubeconfig), "NODE_NAME": NODE}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpudra.cli",
            "node",
            "--nvml",
            PROFILE,
            "--driver-name",
            DRIVER,
            "--no-kubelet-plugin",
            "--metrics-address",
            "",
            *flags,
        ],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextmanager
def agent(cluster: Cluster, *flags: str) -> Iterator[subprocess.Popen[str]]:
    proc = node_command(cluster, *flags)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)


def published(kube: Kube) -> dict[str, dict[str, Any]] | None:
    """Our node's devices by name, once the whole pool of one generation is there."""
    items = kube.list("ResourceSlice", fieldSelector=f"spec.driver={DRIVER}")
    items = [o for o in items if o["spec"]["pool"]["name"] == NODE]
    if not items:
        return None
    pools = {
        (o["spec"]["pool"]["generation"], o["spec"]["pool"]["resourceSliceCount"]) for o in items
    }
    if len(pools) != 1 or next(iter(pools))[1] != len(items):
        return None
    return {d["name"]: d for o in items for d in o["spec"].get("devices", [])}


def wait_published(kube: Kube, what: str, shared: set[str]) -> dict[str, dict[str, Any]]:
    def ready() -> dict[str, dict[str, Any]] | None:
        devices = published(kube)
        if devices is None or len(devices) != 8:
            return None
        now = {n for n, d in devices.items() if d.get("allowMultipleAllocations")}
        return devices if now == shared else None

    result: dict[str, dict[str, Any]] = wait_for(what, ready, timeout=180)
    return result


def claim(kube: Kube, ns: str, name: str, memory: str | None, selector: str | None) -> None:
    exactly: dict[str, Any] = {"deviceClassName": DRIVER}
    if memory is not None:
        exactly["capacity"] = {"requests": {MEMORY: memory}}
    if selector is not None:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    claim_and_pod(kube, ns, name, exactly)


def claim_and_pod(kube: Kube, ns: str, name: str, exactly: dict[str, Any]) -> None:
    """A one-request claim and a pod on the node that holds it."""
    kube.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        }
    )
    kube.create(pod_with_claim(f"pod-{name}", ns, NODE, claim=name))


def result_of(claim: dict[str, Any]) -> dict[str, Any]:
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert isinstance(result, dict)
    return result


def unschedulable(kube: Kube, ns: str, pod: str) -> bool:
    conditions = kube.get("Pod", pod, ns).get("status", {}).get("conditions") or []
    return any(
        c["type"] == "PodScheduled"
        and c["status"] == "False"
        and c.get("reason") == "Unschedulable"
        for c in conditions
    )


def test_memory_slices_share_one_gpu_until_the_option_is_removed(
    cluster: Cluster, kube: Kube, namespace: str
) -> None:
    ns = namespace
    with agent(cluster, "--shared-gpus", "0"):
        devices = wait_published(kube, f"{SHARED} published shared", {SHARED})
        # Qualified, as claims ask for it: up to 1.37 the scheduler matches names literally.
        memory = devices[SHARED]["capacity"][MEMORY]
        total = int(memory["value"])
        assert all(set(d["capacity"]) == {"memory"} for n, d in devices.items() if n != SHARED)
        assert memory["requestPolicy"] == {
            "default": str(total),
            "validRange": {"min": "1Gi", "max": str(total)},
        }

        # Two 10Gi slices: the same GPU, each its own share of it.
        for name in ("slice-a", "slice-b"):
            claim(kube, ns, name, "10Gi", SLICE_SELECTOR)
        results = [
            result_of(wait_allocated(kube, n, ns, timeout=180)) for n in ("slice-a", "slice-b")
        ]
        assert {r["device"] for r in results} == {SHARED}
        assert all(r["pool"] == NODE and r["driver"] == DRIVER for r in results)
        assert len({r["shareID"] for r in results}) == 2
        assert [r["consumedCapacity"] for r in results] == [{MEMORY: "10Gi"}] * 2

        # More memory than the GPU has: no device can take it.
        claim(kube, ns, "too-big", f"{total // 1024**3 + 1}Gi", SLICE_SELECTOR)
        wait_for("pod-too-big to be unschedulable", lambda: unschedulable(kube, ns, "pod-too-big"))
        assert "allocation" not in (kube.get("ResourceClaim", "too-big", ns).get("status") or {})

        # An ordinary claim names no memory, so it would consume all of it: it never
        # lands on the GPU the slices hold, and gets an exclusive GPU whole.
        claim(kube, ns, "whole", None, None)
        whole = result_of(wait_allocated(kube, "whole", ns, timeout=180))
        assert whole["device"] != SHARED
        assert "shareID" not in whole

    # Restarted without the option: the same GPU is exclusive again.
    with agent(cluster):
        devices = wait_published(kube, f"{SHARED} republished exclusive", set())
        assert devices[SHARED]["capacity"] == {"memory": {"value": str(total)}}


def refusal(cluster: Cluster, *flags: str) -> str:
    """The last line `gpudra node` prints when it refuses to start with these flags."""
    proc = node_command(cluster, *flags)
    try:
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    return stderr.strip().splitlines()[-1]


def test_a_gpu_the_node_lacks_stops_the_agent(
    cluster: Cluster, kube: Kube, consumable_capacity: None
) -> None:
    assert refusal(cluster, "--shared-gpus", "1,9") == (
        "gpudra node: --shared-gpus '1,9': GPU index 9 does not exist on this node "
        "(it has 8 GPUs: indices 0-7)"
    )
    try:
        items = kube.list("ResourceSlice", fieldSelector=f"spec.driver={DRIVER}")
    except ApiError:
        items = []
    assert items == []  # nothing was published from a configuration it could not honour


def share_claim(kube: Kube, ns: str, name: str, shares: int | None) -> None:
    """A claim for `shares` integer shares (None: ask for none, a whole GPU)."""
    exactly: dict[str, Any] = {"deviceClassName": DRIVER}
    if shares is not None:
        exactly["capacity"] = {"requests": {"shares": str(shares)}}
    claim_and_pod(kube, ns, name, exactly)


def test_integer_shares_pack_pods_onto_as_few_gpus_as_the_shares_allow(
    cluster: Cluster, kube: Kube, namespace: str
) -> None:
    """`--gpu-shares 2`, the device plugin's `replicas: 2`: two one-share claims on one
    GPU, the third on the next, and a whole-GPU claim on none that has a share taken."""
    ns = namespace
    every = {f"gpu-{i}" for i in range(8)}
    with agent(cluster, "--gpu-shares", "2"):
        devices = wait_published(kube, "every GPU published with 2 shares", every)
        assert devices["gpu-0"]["capacity"]["shares"] == {
            "value": "2",
            "requestPolicy": {"default": "2", "validRange": {"min": "1", "max": "2", "step": "1"}},
        }
        names = ("share-a", "share-b", "share-c")
        for name in names:
            share_claim(kube, ns, name, 1)
            wait_allocated(kube, name, ns, timeout=180)  # one at a time: a stable order
        results = [result_of(wait_allocated(kube, n, ns, timeout=180)) for n in names]
        by_gpu: dict[str, int] = {}
        for r in results:
            assert r["consumedCapacity"]["shares"] == "1"
            by_gpu[r["device"]] = by_gpu.get(r["device"], 0) + 1
        assert sorted(by_gpu.values()) == [1, 2]  # as few GPUs as two shares each allow
        assert len({r["shareID"] for r in results}) == 3

        # A claim that asks for no shares takes all of them: never a GPU with one taken.
        share_claim(kube, ns, "whole", None)
        whole = result_of(wait_allocated(kube, "whole", ns, timeout=180))
        assert whole["device"] not in by_gpu
        assert whole["consumedCapacity"]["shares"] == "2"

        # A third share fits beside the lone one, not beside the whole GPU.
        share_claim(kube, ns, "share-d", 1)
        lone = next(gpu for gpu, n in by_gpu.items() if n == 1)
        assert result_of(wait_allocated(kube, "share-d", ns, timeout=180))["device"] == lone


def test_a_share_asked_for_under_the_drivers_domain_is_a_share_or_nothing(
    cluster: Cluster, kube: Kube, namespace: str
) -> None:
    """A claim may name a capacity with its driver's domain. The scheduler of Kubernetes
    1.38 gives `<driver>/shares` one of the shares a GPU publishes as `shares`
    (kubernetes#142202) and records it under the slice's name; earlier ones match names
    literally and give the claim nothing. Either way the node reads what the scheduler
    wrote as a share, never a memory slice: the answer the webhook gives such a claim
    (tests/webhook/test_validate.py, and the escape suite under a tenant)."""
    ns = namespace
    with agent(cluster, "--gpu-shares", "2"):
        wait_published(kube, "every GPU published with 2 shares", {f"gpu-{i}" for i in range(8)})
        asks = {"deviceClassName": DRIVER, "capacity": {"requests": {f"{DRIVER}/shares": "1"}}}
        claim_and_pod(kube, ns, "qualified", asks)

        def answered() -> tuple[bool, dict[str, Any]] | None:
            got: dict[str, Any] = kube.get("ResourceClaim", "qualified", ns)
            if (got.get("status") or {}).get("allocation"):
                return True, got
            return (False, got) if unschedulable(kube, ns, "pod-qualified") else None

        allocated, got = wait_for(
            "the scheduler's answer to a qualified shares request", answered, 180
        )
        if not allocated:  # a scheduler that matches names literally
            assert "allocation" not in (got.get("status") or {})
            return
        assert result_of(got)["consumedCapacity"]["shares"] == "1"
        ref = ClaimRef(ns, got["metadata"]["uid"], "qualified")
        (device,) = checked_claim(ref, got, driver=DRIVER, pool=NODE).devices
        assert (device.consumed_shares, device.consumed_memory) == (1, None)


def test_shares_on_a_gpu_shared_by_memory_stop_the_agent(
    cluster: Cluster, kube: Kube, consumable_capacity: None
) -> None:
    line = refusal(cluster, "--gpu-shares", "4", "--gpu-shares-gpus", "1,2", "--shared-gpus", "2")
    assert line.startswith("gpudra node: GPU index 2 (GPU-")
    assert "is in --shared-gpus (memory slices) and cannot also have integer shares" in line
    assert line.endswith("; --gpu-shares-gpus 1,2 with --gpu-shares 4")
