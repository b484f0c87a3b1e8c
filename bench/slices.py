"""make bench-slices: many simulated nodes' slice controllers in one process against
the real API server. Writes bench/results/slices.json.

Each simulated node runs the real discovery on its own emulated 8x H100 (MIG enabled,
so every placement is published as a partitionable device) and the real
SliceController. NVML health watchers are left out: they are per node and do not
touch the API server, and 200 of them would only measure the thread pool.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import anyio
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import MigStrategy
from gpudra.driver.nvml import load_nvml

from bench.runinfo import load_avg, run_context
from e2e.cluster.harness import Cluster, register_node

DRIVER = "gpu.nvidia.com"
OUT = Path(__file__).resolve().parent / "results" / "slices.json"


def rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


async def main() -> dict[str, Any]:
    n_nodes = int(os.environ.get("BENCH_NODES", "200"))
    steady_s = float(os.environ.get("BENCH_STEADY_S", "60"))
    profile = os.environ.get("BENCH_PROFILE", "h100-80gb-hbm3-x8-mig")
    cluster = Cluster()
    if not cluster.is_up():
        cluster.up()
    sync = cluster.kube()
    load_start = load_avg()
    names = [f"bench-{i:04d}" for i in range(n_nodes)]
    for n in names:
        register_node(sync, n)
    for o in sync.list("ResourceSlice"):
        if o["spec"]["driver"] == DRIVER:
            sync.delete("ResourceSlice", o["metadata"]["name"])
    kube = await Kube.connect(str(cluster.layout.admin_kubeconfig), max_connections=None)
    agents = []
    for n in names:
        nvml = load_nvml(f"emulated:{profile}", uuid_salt=n)
        cfg = AgentConfig(
            node_name=n,
            driver_name=DRIVER,
            mig_strategy=MigStrategy.DYNAMIC,
            health_events=False,
            rescan_s=3600,
        )
        agents.append(NodeAgent(cfg, kube, nvml))
    devices = 0
    async with anyio.create_task_group() as tg:
        t0 = time.monotonic()
        for a in agents:
            tg.start_soon(a.run)
        for a in agents:
            await a.slices.converged.wait()
        converge_s = time.monotonic() - t0
        # Independent check through the API: every pool complete and consistent.
        items = sync.list("ResourceSlice", fieldSelector=f"spec.driver={DRIVER}")
        pools: dict[str, list[dict[str, Any]]] = {}
        for o in items:
            pools.setdefault(o["spec"]["pool"]["name"], []).append(o)
        for n in names:
            sl = pools.get(n, [])
            assert sl and all(o["spec"]["pool"]["resourceSliceCount"] == len(sl) for o in sl), n
            assert len({o["spec"]["pool"]["generation"] for o in sl}) == 1, n
            devices += sum(len(o["spec"].get("devices", [])) for o in sl)
        versions = {o["metadata"]["name"]: o["metadata"]["resourceVersion"] for o in items}
        writes_before = sum(a.slices.writes for a in agents)
        await anyio.sleep(steady_s)
        steady_writes = sum(a.slices.writes for a in agents) - writes_before
        after = sync.list("ResourceSlice", fieldSelector=f"spec.driver={DRIVER}")
        changed = sum(
            1
            for o in after
            if versions.get(o["metadata"]["name"]) != o["metadata"]["resourceVersion"]
        )
        tg.cancel_scope.cancel()
    await kube.close()
    for o in sync.list("ResourceSlice", fieldSelector=f"spec.driver={DRIVER}"):
        sync.delete("ResourceSlice", o["metadata"]["name"])
    for n in names:
        sync.delete("Node", n)
    return {
        "nodes": n_nodes,
        "devices": devices,
        "slices": len(items),
        "converge_s": round(converge_s, 2),
        "steady_window_s": steady_s,
        "steady_writes": steady_writes,
        "steady_changed_slices": changed,
        "rss_mb": rss_mb(),
        "target_converge_s": 30,
        "profile": profile,
        **run_context(sync),
        "load_avg_1m_at_start": load_start,
        "load_avg_1m_at_end": load_avg(),
    }


if __name__ == "__main__":
    result = anyio.run(main)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["steady_writes"] == 0 and result["steady_changed_slices"] == 0 else 1)
