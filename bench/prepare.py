"""make bench-prepare: prepare/unprepare cycles through the real kubelet plugin socket.

`gpudra node` runs as its own process (emulated 8x H100, checkpoint and CDI specs
on disk) against the real API server. Eight claims, each allocated one whole GPU by
the real scheduler, are prepared and unprepared over the DRA gRPC socket, one
claim per GPU in flight at a time, like eight pods starting and stopping at once.
Each prepare includes the plugin's GET of the claim. Writes bench/results/prepare.json.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from gpudra.common.files import atomic_write
from gpudra.driver.plugin import ClaimRef

from e2e.claims import pod_with_claim, wait_allocated
from e2e.cluster.harness import REPO, Cluster
from e2e.cluster.kube import Kube, wait_for
from e2e.kubelet_standin import KubeletStandin

OUT = Path(__file__).resolve().parent / "results" / "prepare.json"
NODE = "worker-1"
GPUS = 8


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))
    return ordered[index]


def allocated_claims(kube: Kube, driver: str, namespace: str) -> list[ClaimRef]:
    """One claim per GPU, each allocated by the scheduler for a pod on the node."""
    for i in range(GPUS):
        name = f"bench-{i}"
        kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": driver}}]
                    }
                },
            }
        )
        kube.create(pod_with_claim(name, namespace, NODE, claim=name))
    refs = []
    for i in range(GPUS):
        name = f"bench-{i}"
        claim = wait_allocated(kube, name, namespace, timeout=120)
        refs.append(ClaimRef(namespace, claim["metadata"]["uid"], name))
    return refs


async def drive(
    kubelet: KubeletStandin, driver: str, refs: list[ClaimRef], cycles: int
) -> tuple[list[float], list[float], float, int]:
    prepare_ms: list[float] = []
    unprepare_ms: list[float] = []
    errors = 0

    async def worker(ref: ClaimRef, count: int) -> None:
        nonlocal errors
        for _ in range(count):
            t0 = time.perf_counter()
            result = (await kubelet.prepare(driver, [ref]))[ref.uid]
            t1 = time.perf_counter()
            error = (await kubelet.unprepare(driver, [ref]))[ref.uid]
            t2 = time.perf_counter()
            if result.error or error:
                errors += 1
            prepare_ms.append((t1 - t0) * 1000)
            unprepare_ms.append((t2 - t1) * 1000)

    per_claim = [
        cycles // len(refs) + (1 if i < cycles % len(refs) else 0) for i in range(len(refs))
    ]
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for ref, count in zip(refs, per_claim, strict=True):
            tg.start_soon(worker, ref, count)
    return prepare_ms, unprepare_ms, time.perf_counter() - started, errors


async def main() -> dict[str, Any]:
    cycles = int(os.environ.get("BENCH_CYCLES", "1000"))
    warmup = int(os.environ.get("BENCH_WARMUP", "40"))
    cluster = Cluster()
    if not cluster.is_up():
        cluster.up()
    kube = cluster.kube()
    driver = f"bench{secrets.token_hex(3)}.gpudra.dev"
    namespace = f"bench-prepare-{secrets.token_hex(3)}"
    root = Path(tempfile.mkdtemp(prefix="gdb-", dir=os.environ.get("BENCH_DIR")))
    dev = root / "host" / "dev"
    dev.mkdir(parents=True)
    for name in (
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        *(f"nvidia{i}" for i in range(GPUS)),
    ):
        (dev / name).touch()
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    kube.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": driver},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
        }
    )
    wait_for(
        "the namespace's service account",
        lambda: kube.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default"),
        timeout=60,
    )
    env = {**os.environ, "KUBECONFIG": str(cluster.layout.admin_kubeconfig), "NODE_NAME": NODE}
    # Optional: BENCH_PROFILE=<file> writes a cProfile of the node process.
    profile = os.environ.get("BENCH_PROFILE")
    runner = ["-m", "cProfile", "-o", profile] if profile else []
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before the measurement
        [
            sys.executable,
            *runner,
            "-m",
            "gpudra.cli",
            "node",
            "--nvml",
            "emulated:h100-80gb-hbm3-x8",
            "--driver-name",
            driver,
            "--kubelet-root",
            str(root / "k"),
            "--cdi-root",
            str(root / "cdi"),
            "--state-dir",
            str(root / "state"),
            "--dev-root",
            str(root / "host"),
            "--no-toolkit-cdi",
            "--metrics-address",
            "",
        ],
        cwd=REPO,
        env=env,
    )
    try:
        async with KubeletStandin(root / "k") as kubelet:
            await kubelet.wait_for_driver(driver, timeout_s=120)
            refs = await anyio.to_thread.run_sync(allocated_claims, kube, driver, namespace)
            await drive(kubelet, driver, refs, warmup)
            prepare_ms, unprepare_ms, wall_s, errors = await drive(kubelet, driver, refs, cycles)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        for pod in kube.list("Pod", namespace):
            kube.delete("Pod", pod["metadata"]["name"], namespace, grace=0)
        for o in kube.list("ResourceSlice", fieldSelector=f"spec.driver={driver}"):
            kube.delete("ResourceSlice", o["metadata"]["name"])
        kube.delete("DeviceClass", driver)
        kube.delete("Namespace", namespace)
        shutil.rmtree(root, ignore_errors=True)
    return {
        "cycles": cycles,
        "in_flight": GPUS,
        "p50_ms": round(statistics.median(prepare_ms), 2),
        "p99_ms": round(percentile(prepare_ms, 99), 2),
        "max_ms": round(max(prepare_ms), 2),
        "unprepare_p50_ms": round(statistics.median(unprepare_ms), 2),
        "unprepare_p99_ms": round(percentile(unprepare_ms, 99), 2),
        "claims_per_s": round(cycles / wall_s, 1),
        "errors": errors,
        "target_p50_ms": 5,
        "target_p99_ms": 20,
        "cpus": os.cpu_count(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
    }


if __name__ == "__main__":
    result = anyio.run(main)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(OUT, (json.dumps(result, indent=2) + "\n").encode())
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["errors"] == 0 else 1)
