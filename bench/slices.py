"""make bench-slices: many simulated nodes' slice controllers against the real API
server, beside the floor the API server itself sets. Writes bench/results/slices.json.

Each simulated node runs the real discovery on its own emulated 8x H100 (MIG enabled,
so every placement is published as a partitionable device) and the real
SliceController. NVML health watchers are left out: they are per node and do not
touch the API server, and hundreds of them would only measure the thread pool.

`BENCH_NODES` (default 200) nodes run in `BENCH_PROCESSES` worker processes (default:
one per 250 nodes), so that 1,000 nodes fit one machine's memory and more than one
core drives them. `BENCH_PROFILE` names the emulated GPUs (default every MIG placement
of 8 H100s; `h100-80gb-hbm3-x8`, whole GPUs), and `BENCH_OUT` the results file
(default bench/results/slices.json): `make bench-compare` also runs 1,000 whole-GPU
nodes into slices-1000-whole-gpus.json.

`converge_s` counts from the release of the workers to the last node's slices being
written. Each worker first starts, imports, connects (the kubeconfig is read; no
request is sent) and builds its nodes' agents on their emulated GPUs, then says
ready on stdout and waits; once every worker is ready, all are released at once
through stdin. On a real cluster each agent starts on its own node, on its own cores,
so process start and imports (about half a second of CPU per worker process, on the
cores the API server needs) are no part of slice convergence. Everything a node does
to converge stays inside the clock: discovery, building and checking the slices, the
TLS connections, list, watch and writes. `cpu_s_to_converge.node_workers` is the
workers' CPU inside the clock; `node_workers_setup`, what they spent before it.

The floor: the API server's and etcd's CPU time per slice write, measured during the
same convergence, times the writes the nodes need (one per slice), over the API
server's cores: how long convergence would take if the API server were the only work
on its cores. Target: `converge_s` within 1.2x of it.

The cores (`BENCH_CORES`): on a real cluster the agents run on their own nodes, not on
the API server's cores. `split` (the default, with two cores or more) gives that to the
simulated nodes: for the convergence, kube-apiserver and etcd are held to the lower
half of the cores and everything else of the bench (the node workers, the scheduler,
the controller-manager, the fake nodes' heartbeat and this process) to the upper half;
the floor is then over the API server's half. `shared` leaves every process on every
core, as the whole cluster on one small machine, and the floor over all of them: there
the workers' CPU comes on top of the API server's on the same cores, so the ratio is
about 1 + workers / control plane and says more about the simulation than about the
driver. `cores` in the results names the layout and the cores each side was seen on.

The threads (`BENCH_WORKER_THREADS`, default 1): a node's agent discovers its GPUs in a
worker thread, and on a real cluster each node does so on its own interpreter, whose
event loop has nothing else to serve meanwhile. A worker process holds hundreds of
nodes on one interpreter; with anyio's default of 40 threads, 40 emulated discoveries
(pure Python, where a real NVML call lets go of the interpreter lock) ran at once and
took the lock in turns of the 5 ms switch interval from the one event loop that serves
every node's requests, so the API server waited on the simulation. Each worker takes
its nodes' discoveries this many at a time instead; all of them still run inside the
clock, on the same cores. Measured on the 2-core machine, 1,000 whole-GPU nodes: 1.12
and 1.22x the floor with 40 threads, 1.03 with 1, 2 or 4; 200 MIG nodes: 1.09 with 40,
1.03 with 2. `worker_threads` in the results is the limit each worker ran with.

`agent_rss_mib` is one real `gpudra node` process on the same emulated GPUs, with its
NVML watcher and kubelet plugin: what one node's agent costs in memory (target: under
100 MiB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from gpudra.cli import logs
from gpudra.common.eventloop import run_event_loop
from gpudra.common.files import atomic_write
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import MigStrategy
from gpudra.driver.nvml import load_nvml

from bench.cores import Pinning, affinity, split_cores, usable_cores
from bench.prepare import control_plane_pids, cpu_seconds
from bench.runinfo import load_avg, run_context
from e2e.cluster.harness import REPO, Cluster, State, register_node
from e2e.cluster.kube import Kube as SyncKube
from e2e.cluster.kube import wait_for
from e2e.node_process import NodeDirs

DRIVER = "gpu.nvidia.com"
OUT = Path(__file__).resolve().parent / "results" / "slices.json"
NODES_PER_PROCESS = 250


def rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def node_names(count: int) -> list[str]:
    return [f"bench-{i:04d}" for i in range(count)]


def cpu_s() -> float:
    """This process's CPU seconds so far (all its threads: discovery runs in workers)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def worker(
    kubeconfig: str, names: list[str], profile: str, steady_s: float, threads: int
) -> None:
    """One process's share of the nodes: get ready, converge once released, report,
    hold still, report again. `threads` bounds the worker threads its nodes' discoveries
    share (the module docstring says why).

    Reports are JSON lines on stdout: {"ready": CPU seconds so far, "threads": the
    thread limit in force} once the agents are built; then, after a line on stdin asks
    for it, {"cores": the cores it may run on}; then, after a line on stdin releases
    the worker, {"converged": wall time, "writes": n, "rss_mb", "cpu_s": CPU seconds
    since the release}, then {"steady_writes": n} after `steady_s` at rest."""
    kube = await Kube.connect(kubeconfig, max_connections=None)
    limiter = anyio.to_thread.current_default_thread_limiter()
    limiter.total_tokens = threads
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
    setup_cpu = cpu_s()
    print(json.dumps({"ready": setup_cpu, "threads": limiter.total_tokens}), flush=True)
    if not await anyio.to_thread.run_sync(sys.stdin.readline):
        await kube.close()  # stdin closed: the parent is gone, nobody waits for us
        return
    # Seen from inside, once the parent has placed it: what the results report.
    print(json.dumps({"cores": sorted(os.sched_getaffinity(0))}), flush=True)
    if not await anyio.to_thread.run_sync(sys.stdin.readline):
        await kube.close()
        return
    start_cpu = cpu_s()
    async with anyio.create_task_group() as tg:
        for a in agents:
            tg.start_soon(a.run)
        for a in agents:
            await a.slices.converged.wait()
        converged = time.time()
        writes = sum(a.slices.writes for a in agents)
        report = {
            "converged": converged,
            "writes": writes,
            "rss_mb": rss_mb(),
            "cpu_s": cpu_s() - start_cpu,
        }
        print(json.dumps(report), flush=True)
        await anyio.sleep(steady_s)
        print(
            json.dumps({"steady_writes": sum(a.slices.writes for a in agents) - writes}), flush=True
        )
        tg.cancel_scope.cancel()
    await kube.close()


def spawn_workers(
    kubeconfig: Path, names: list[str], processes: int, profile: str, steady_s: float, threads: int
) -> list[subprocess.Popen[str]]:
    size = math.ceil(len(names) / processes)
    procs = []
    for i in range(processes):
        share = names[i * size : (i + 1) * size]
        if not share:
            continue
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.slices",
                    "worker",
                    "--kubeconfig",
                    str(kubeconfig),
                    "--first",
                    str(i * size),
                    "--count",
                    str(len(share)),
                    "--profile",
                    profile,
                    "--steady-s",
                    str(steady_s),
                    "--threads",
                    str(threads),
                ],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def worker_threads(value: str) -> int:
    """`BENCH_WORKER_THREADS`: a positive whole number."""
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise SystemExit(
            f"BENCH_WORKER_THREADS={value!r}: give the number of threads each worker's "
            "discoveries share, 1 or more (default 1)"
        )
    return threads


def wait_ready(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]] | None:
    """Each worker's ready report (its CPU seconds until then, its thread limit); None
    when one ended before."""
    ready = []
    for proc in procs:
        assert proc.stdout is not None
        line = json.loads(proc.stdout.readline() or "{}")
        if "ready" not in line:
            return None
        ready.append(line)
    return ready


def cores_seen(procs: list[subprocess.Popen[str]]) -> list[list[int]]:
    """The cores each ready worker sees itself on, asked before the clock starts."""
    seen = []
    for proc in procs:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("cores?\n")
        proc.stdin.flush()
        seen.append(json.loads(proc.stdout.readline() or '{"cores": []}')["cores"])
    return seen


def release(procs: list[subprocess.Popen[str]]) -> None:
    """Let every ready worker start its nodes, all at once."""
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()


def place(
    pinning: Pinning,
    cluster: Cluster,
    api_pids: dict[str, int],
    workers: list[subprocess.Popen[str]],
    halves: tuple[frozenset[int], frozenset[int]],
) -> None:
    """Hold kube-apiserver and etcd (`api_pids`) to the first half of the cores and the
    rest of the bench (workers, the cluster's other processes, this one) to the second;
    the module docstring says why."""
    api_side, node_side = halves
    api = set(api_pids.values())
    state = State.load(cluster.layout.state)
    others = [pid for pid in (state.pids if state else {}).values() if pid not in api]
    for pid in api:
        pinning.pin(pid, api_side)
    for pid in [*others, *(proc.pid for proc in workers), 0]:
        pinning.pin(pid, node_side)


def control_plane_cpu(api_pids: dict[str, int]) -> float:
    """kube-apiserver's and etcd's CPU seconds so far."""
    return sum(cpu_seconds(pid) or 0.0 for pid in api_pids.values())


def process_rss_mib(pid: int) -> float | None:
    """A live process's resident memory; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def agent_rss_mib(sync: SyncKube, kubeconfig: Path, profile: str) -> float | None:
    """One real `gpudra node` on the same emulated GPUs, once its slices are published."""
    driver = f"rss{secrets.token_hex(3)}.gpudra.dev"
    node = f"bench-rss-{secrets.token_hex(3)}"
    register_node(sync, node)
    root = Path(tempfile.mkdtemp(prefix="gdb-rss-"))
    dirs = NodeDirs(root)
    dirs.make_dev(8)
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "NODE_NAME": node}
    proc = subprocess.Popen(
        dirs.command(driver, "--metrics-address", "", nvml=("--nvml", f"emulated:{profile}")),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            "the RSS node's slices",
            lambda: sync.list("ResourceSlice", fieldSelector=f"spec.driver={driver}"),
            timeout=120,
        )
        time.sleep(2)  # settle: the first scan and the plugin's servers are up
        return process_rss_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        for o in sync.list("ResourceSlice", fieldSelector=f"spec.driver={driver}"):
            sync.delete("ResourceSlice", o["metadata"]["name"])
        sync.delete("Node", node)
        shutil.rmtree(root, ignore_errors=True)


def main() -> dict[str, Any]:
    n_nodes = int(os.environ.get("BENCH_NODES", "200"))
    steady_s = float(os.environ.get("BENCH_STEADY_S", "60"))
    profile = os.environ.get("BENCH_PROFILE", "h100-80gb-hbm3-x8-mig")
    processes = int(os.environ.get("BENCH_PROCESSES", "0")) or math.ceil(
        n_nodes / NODES_PER_PROCESS
    )
    threads = worker_threads(os.environ.get("BENCH_WORKER_THREADS", "1"))
    mode = os.environ.get("BENCH_CORES", "split")
    if mode not in ("split", "shared"):
        raise SystemExit(f"BENCH_CORES={mode!r}: use split (the default) or shared")
    # None: shared, or one core with nothing to split.
    halves = split_cores(usable_cores()) if mode == "split" else None
    cluster = Cluster()
    if not cluster.is_up():
        cluster.up()
    sync = cluster.kube()
    kubeconfig = cluster.layout.admin_kubeconfig
    load_start = load_avg()
    # The control plane's state moves its CPU per write, and so the floor: one that
    # earlier runs left large spent 20 to 22 CPU-s on the 200-node run, a fresh one 11 to 16.
    api_pids = control_plane_pids(cluster)  # the cluster outlives the bench: read once
    rss_start = {name: process_rss_mib(pid) for name, pid in api_pids.items()}
    names = node_names(n_nodes)
    for n in names:
        register_node(sync, n)
    for o in sync.list("ResourceSlice", fieldSelector=f"spec.driver={DRIVER}"):
        sync.delete("ResourceSlice", o["metadata"]["name"])

    procs = spawn_workers(kubeconfig, names, processes, profile, steady_s, threads)
    reports: list[dict[str, Any]] = []
    with Pinning() as pinning:
        ready = wait_ready(procs)
        setup = [float(r["ready"]) for r in ready] if ready is not None else None
        if halves is not None and setup is not None:
            place(pinning, cluster, api_pids, procs, halves)
        workers_on = cores_seen(procs) if setup is not None else []
        # The clock starts at the release, not at the spawn (the module docstring says why).
        cpu_start, t0 = control_plane_cpu(api_pids), time.time()
        if setup is not None:
            release(procs)
            for proc in procs:
                assert proc.stdout is not None
                reports.append(json.loads(proc.stdout.readline() or "{}"))
        cpu_converge = control_plane_cpu(api_pids) - cpu_start
        api_on = {name: affinity(pid) for name, pid in api_pids.items()}
    if setup is None or not all("converged" in r for r in reports):
        for proc in procs:
            proc.kill()
        raise SystemExit("bench-slices: a worker process failed before its nodes converged")
    converged_at = max(r["converged"] for r in reports)
    converge_s = converged_at - t0
    writes = sum(r["writes"] for r in reports)

    # Independent check through the API: every pool complete and consistent.
    items = sync.list("ResourceSlice", fieldSelector=f"spec.driver={DRIVER}")
    pools: dict[str, list[dict[str, Any]]] = {}
    for o in items:
        pools.setdefault(o["spec"]["pool"]["name"], []).append(o)
    devices = 0
    for n in names:
        sl = pools.get(n, [])
        assert sl and all(o["spec"]["pool"]["resourceSliceCount"] == len(sl) for o in sl), n
        assert len({o["spec"]["pool"]["generation"] for o in sl}) == 1, n
        devices += sum(len(o["spec"].get("devices", [])) for o in sl)
    versions = {o["metadata"]["name"]: o["metadata"]["resourceVersion"] for o in items}

    steady_writes = 0
    for proc in procs:
        assert proc.stdout is not None
        steady_writes += json.loads(proc.stdout.readline() or '{"steady_writes": -1}')[
            "steady_writes"
        ]
        proc.wait(timeout=60)
    after = sync.list("ResourceSlice", fieldSelector=f"spec.driver={DRIVER}")
    changed = sum(
        1 for o in after if versions.get(o["metadata"]["name"]) != o["metadata"]["resourceVersion"]
    )
    for o in after:
        sync.delete("ResourceSlice", o["metadata"]["name"])
    for n in names:
        sync.delete("Node", n)
    agent_rss = agent_rss_mib(sync, kubeconfig, profile)

    cores = len(halves[0]) if halves else len(usable_cores())
    per_write = cpu_converge / writes if writes else None
    floor_s = per_write * len(items) / cores if per_write is not None else None
    return {
        "nodes": n_nodes,
        "processes": len(procs),
        # Each worker's thread limit, as it reported it (the module docstring says why).
        "worker_threads": [r["threads"] for r in ready or ()],
        "devices": devices,
        "slices": len(items),
        # Three decimals: a few nodes converge in a fraction of a second.
        "converge_s": round(converge_s, 3),
        "writes_to_converge": writes,
        # Where the cores went until convergence: the simulated nodes' processes
        # (discovery, slice building, requests) and the control plane; and what the
        # workers spent getting ready, before the clock (start, imports, agents).
        "cpu_s_to_converge": {
            "node_workers": round(sum(r["cpu_s"] for r in reports), 2),
            "control_plane": round(cpu_converge, 2),
            "node_workers_setup": round(sum(setup), 2),
        },
        "steady_window_s": steady_s,
        "steady_writes": steady_writes,
        "steady_changed_slices": changed,
        # The largest worker process (simulated nodes share it).
        "rss_mb": max(r["rss_mb"] for r in reports),
        "rss_mb_per_simulated_node": round(sum(r["rss_mb"] for r in reports) / n_nodes, 2),
        "agent_rss_mib": agent_rss,
        "floor": {
            "control_plane_cpu_ms_per_write": round(per_write * 1000, 3) if per_write else None,
            "writes_needed": len(items),
            "converge_s": round(floor_s, 3) if floor_s is not None else None,
            "cores": cores,
            "how": "kube-apiserver + etcd CPU during convergence / slice writes, times one "
            "write per slice, over the API server's cores",
        },
        # Where each side ran during the convergence, as the processes saw it.
        "cores": {
            "layout": "split" if halves else "shared",
            "api_server": sorted(halves[0]) if halves else sorted(usable_cores()),
            "nodes": sorted(halves[1]) if halves else sorted(usable_cores()),
            "api_server_seen": {n: sorted(c) if c else None for n, c in api_on.items()},
            "workers_seen": workers_on,
        },
        "ratio_to_floor": round(converge_s / floor_s, 3) if floor_s else None,
        "control_plane_rss_mib_at_start": rss_start,
        "targets": {
            "converge_vs_floor": {
                "limit": 1.2,
                "met": bool(floor_s) and converge_s / floor_s <= 1.2,
            },
            "steady_writes": {"limit": 0, "met": steady_writes == 0 and changed == 0},
            "agent_rss_mib": {"limit": 100, "met": agent_rss is not None and agent_rss < 100},
        },
        "profile": profile,
        **run_context(sync, load_start),
    }


def cli() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slices")
    sub = parser.add_subparsers(dest="mode")
    w = sub.add_parser("worker")
    w.add_argument("--kubeconfig", required=True)
    w.add_argument("--first", type=int, required=True)
    w.add_argument("--count", type=int, required=True)
    w.add_argument("--profile", required=True)
    w.add_argument("--steady-s", type=float, required=True)
    w.add_argument("--threads", type=int, required=True)  # checked by the parent
    args = parser.parse_args()
    if args.mode == "worker":
        names = node_names(args.first + args.count)[args.first :]
        # As `gpudra node` logs: a warning's line carries its fields (the error).
        logs.setup("warning")
        # As `gpudra node` runs its agent.
        run_event_loop(worker, args.kubeconfig, names, args.profile, args.steady_s, args.threads)
        return 0
    out = Path(os.environ.get("BENCH_OUT") or OUT)
    result = main()
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, (json.dumps(result, indent=2) + "\n").encode(), mode=0o644)
    print(json.dumps(result, indent=2))
    return 0 if result["steady_writes"] == 0 and result["steady_changed_slices"] == 0 else 1


if __name__ == "__main__":
    sys.exit(cli())
