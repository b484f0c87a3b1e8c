"""make bench-prepare: prepare/unprepare cycles through the real kubelet plugin socket.

`gpudra node` runs as its own process (emulated 8x H100, checkpoint and CDI specs
on disk) against the real API server. Eight claims, each allocated one whole GPU by
the real scheduler, are prepared and unprepared over the DRA gRPC socket, one
claim per GPU in flight at a time, like eight pods starting and stopping at once.
Each prepare includes the plugin's GET of the claim. The CDI specs go on a tmpfs where
there is one (as /var/run/cdi is on a node); the checkpoint stays on disk, fsynced.
Writes bench/results/prepare.json.

`floor_get_only` repeats the cycles against a plugin served from this process that only
reads and checks each claim (the plugin's own claim read, a GET) and answers: the gRPC
calls and the API server read that every prepare pays, so that the agent's own share
can be told from what no agent can avoid.
BENCH_FLOOR=0 skips it.

BENCH_SAMPLE_INTERVAL=<seconds> sets the agent's device sampling interval (0: off;
default: the agent's own). BENCH_SAMPLE_INTERVAL=0,0.2 (several values) measures each
in turn, in one run, a fresh agent each, and writes bench/results/prepare-sampling.json:
whether device sampling slows prepares.

The calls come from a small Go client (bench/kubeletclient, the kubelet's own DRA
stubs and grpc-go), built from the Go module proxy and cached under
~/.cache/gpudra, so that the two cores measure the plugin rather than a Python gRPC
client. Without Go the Python kubelet stand-in makes the calls; `client` in the
results says which. BENCH_CLIENT=python|go forces one.
"""

from __future__ import annotations

import hashlib
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from gpudra.common.files import atomic_write
from gpudra.common.kube import Kube as KubeAsync
from gpudra.driver.claimreader import ApiClaims
from gpudra.driver.claims import Claim, ClaimRef
from gpudra.driver.plugin import KubeletPlugin, PreparedDevice, PrepareResult

from e2e.cache import cache_root
from e2e.claims import pod_with_claim, wait_allocated
from e2e.cluster.harness import REPO, Cluster, State
from e2e.cluster.kube import Kube
from e2e.kubelet_standin import KubeletStandin
from e2e.node_process import NodeDirs, create_driver_namespace, delete_driver_namespace

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "prepare.json"
OUT_SAMPLING = HERE / "results" / "prepare-sampling.json"
GO_CLIENT = HERE / "kubeletclient"
NODE = "worker-1"
GPUS = 8


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of a process (all its threads), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    # After the command name: state is field 3, utime 14 and stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU time each process spends during the measurement, per cycle.

    Wall-clock latency on a small, shared machine mostly measures the neighbours;
    the CPU each process burns per cycle is what the code under test controls.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self._start = {n: c for n, p in pids.items() if (c := cpu_seconds(p)) is not None}

    def per_cycle_ms(self, cycles: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, started in self._start.items():
            now = cpu_seconds(self._pids[name])
            if now is not None:
                out[name] = round((now - started) * 1000 / cycles, 3)
        return out


def go_client() -> Path | None:
    """The Go kubelet client, built when missing; None without a Go toolchain.

    Cached by a hash of its sources, so an edit rebuilds it and nothing else does.
    """
    go = shutil.which("go")
    if go is None:
        return None
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((GO_CLIENT / name).read_bytes())
    binary = cache_root() / "bench-kubeletclient" / digest.hexdigest()[:16] / "kubeletclient"
    if binary.is_file():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "GOTOOLCHAIN": "local",
        "GOWORK": "off",
        "GOFLAGS": "-mod=mod",
        "CGO_ENABLED": "0",
        "GOSUMDB": os.environ.get("GOSUMDB", "off"),
    }
    temp = binary.with_name(f".{binary.name}.tmp")
    print(f"bench-prepare: building the Go kubelet client into {binary}", file=sys.stderr)
    build = subprocess.run(
        [go, "build", "-trimpath", "-o", str(temp), "."],
        cwd=GO_CLIENT,
        env=env,
        check=False,
    )
    if build.returncode != 0:
        print("bench-prepare: the Go client did not build; using Python", file=sys.stderr)
        return None
    temp.replace(binary)
    return binary


@dataclass
class Run:
    prepare_ms: list[float]
    unprepare_ms: list[float]
    wall_s: float
    errors: int
    client_cpu_s: float | None = None

    def cpu_per_cycle(self, meter: CpuMeter, cycles: int) -> dict[str, float]:
        """The metered processes' CPU per cycle, with the Go client's own report."""
        cpu_ms = meter.per_cycle_ms(cycles)
        if self.client_cpu_s is not None:
            cpu_ms["client"] = round(self.client_cpu_s * 1000 / cycles, 3)
        return cpu_ms


async def drive_go(binary: Path, socket: Path, refs: list[ClaimRef], cycles: int) -> Run:
    claims = [{"namespace": r.namespace, "uid": r.uid, "name": r.name} for r in refs]
    done = await anyio.run_process(
        [str(binary), "-socket", str(socket), "-cycles", str(cycles), "-warmup", "0"],
        input=json.dumps(claims).encode(),
        stderr=None,
    )
    out = json.loads(done.stdout)
    if out.get("first_error"):
        print(f"bench-prepare: first error: {out['first_error']}", file=sys.stderr)
    return Run(out["prepare_ms"], out["unprepare_ms"], out["wall_s"], out["errors"], out["cpu_s"])


def tmpfs_folder() -> Path | None:
    """A tmpfs to hold the CDI specs, as /var/run/cdi is on a node (None: there is none)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and fields[1] == "/dev/shm" and fields[2] == "tmpfs":
            return Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    return None


class GetOnly:
    """A claim handler that answers one device for each claim the plugin read.

    Served from this process behind the plugin's own claim read (`ApiClaims`) with
    the same Go client, it measures the part of a cycle that any plugin pays: the
    kubelet's gRPC calls and the API server read.
    """

    def __init__(self, driver: str) -> None:
        self._driver = driver

    async def prepare(self, claims: list[Claim]) -> dict[str, PrepareResult]:
        out = {}
        for claim in claims:
            result = claim.devices[0]
            out[claim.uid] = PrepareResult(
                devices=[
                    PreparedDevice(
                        request_names=[result.request],
                        pool_name=NODE,
                        device_name=result.device,
                        cdi_device_ids=[f"{self._driver}/gpu={claim.uid}-{result.device}"],
                    )
                ]
            )
        return out

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        return {ref.uid: None for ref in claims}


async def floor_run(
    binary: Path,
    kubeconfig: Path,
    driver: str,
    refs: list[ClaimRef],
    cycles: int,
    warmup: int,
    control_plane: dict[str, int],
) -> dict[str, Any]:
    """The same cycles against `GetOnly`: what is left with no node work at all."""
    kube = await KubeAsync.connect(str(kubeconfig))
    root = Path(tempfile.mkdtemp(prefix="gdb-floor-", dir=os.environ.get("BENCH_DIR")))
    claims = ApiClaims(kube, driver=driver, pool=NODE)
    try:
        async with KubeletPlugin(
            driver, GetOnly(driver), claims=claims, kubelet_root=root
        ) as plugin:
            await drive_go(binary, plugin.dra_socket, refs, warmup)
            meter = CpuMeter({"plugin": os.getpid(), **control_plane})
            run = await drive_go(binary, plugin.dra_socket, refs, cycles)
            cpu_ms = run.cpu_per_cycle(meter, cycles)
    finally:
        await kube.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "p50_ms": round(statistics.median(run.prepare_ms), 2),
        "p99_ms": round(percentile(run.prepare_ms, 99), 2),
        "claims_per_s": round(cycles / run.wall_s, 1),
        "errors": run.errors,
        "cpu_ms_per_cycle": cpu_ms,
    }


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


async def drive(kubelet: KubeletStandin, driver: str, refs: list[ClaimRef], cycles: int) -> Run:
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
    return Run(prepare_ms, unprepare_ms, time.perf_counter() - started, errors)


async def main(sampling: str | None = None) -> dict[str, Any]:
    cycles = int(os.environ.get("BENCH_CYCLES", "1000"))
    warmup = int(os.environ.get("BENCH_WARMUP", "40"))
    client = os.environ.get("BENCH_CLIENT", "auto")
    if client not in ("auto", "go", "python"):
        raise SystemExit(f"BENCH_CLIENT={client!r}: use go, python or leave it unset")
    binary = await anyio.to_thread.run_sync(go_client) if client != "python" else None
    if client == "go" and binary is None:
        raise SystemExit("BENCH_CLIENT=go: the Go kubelet client is not available")
    cluster = Cluster()
    if not cluster.is_up():
        cluster.up()
    kube = cluster.kube()
    driver = f"bench{secrets.token_hex(3)}.gpudra.dev"
    namespace = f"bench-prepare-{secrets.token_hex(3)}"
    root = Path(tempfile.mkdtemp(prefix="gdb-", dir=os.environ.get("BENCH_DIR")))
    # The checkpoint and state stay on disk; the specs go where a node keeps them.
    shm = tmpfs_folder()
    cdi_root = Path(tempfile.mkdtemp(prefix="gdb-cdi-", dir=shm)) if shm else None
    dirs = NodeDirs(root, cdi_root)
    dirs.make_dev(GPUS)
    create_driver_namespace(kube, driver, namespace)
    state = State.load(cluster.layout.state)
    control_plane = {
        name: pid
        for name, pid in (state.pids if state else {}).items()
        if name in ("kube-apiserver", "etcd")
    }
    env = {**os.environ, "KUBECONFIG": str(cluster.layout.admin_kubeconfig), "NODE_NAME": NODE}
    # Optional: BENCH_PROFILE=<file> writes a cProfile of the node process.
    profile = os.environ.get("BENCH_PROFILE")
    runner = ["-m", "cProfile", "-o", profile] if profile else []
    options = ("--sample-interval", sampling) if sampling else ()
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before the measurement
        dirs.command(driver, "--metrics-address", "", *options, runner=runner),
        cwd=REPO,
        env=env,
    )
    floor: dict[str, Any] | None = None
    try:
        async with KubeletStandin(dirs.kubelet) as kubelet:
            registration = await kubelet.wait_for_driver(driver, timeout_s=120)
            refs = await anyio.to_thread.run_sync(allocated_claims, kube, driver, namespace)
            if binary is not None:
                socket = registration.endpoint
                warm = await drive_go(binary, socket, refs, warmup)
                meter = CpuMeter({"node": proc.pid, **control_plane})
                run = await drive_go(binary, socket, refs, cycles)
                run.errors += warm.errors
            else:
                warm = await drive(kubelet, driver, refs, warmup)
                meter = CpuMeter({"node": proc.pid, "client": os.getpid(), **control_plane})
                run = await drive(kubelet, driver, refs, cycles)
                run.errors += warm.errors
            cpu_ms = run.cpu_per_cycle(meter, cycles)
        # The agent is stopped first, so that it does not compete with the floor run.
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        if binary is not None and os.environ.get("BENCH_FLOOR", "1") != "0":
            floor = await floor_run(
                binary,
                cluster.layout.admin_kubeconfig,
                driver,
                refs,
                cycles,
                warmup,
                control_plane,
            )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        delete_driver_namespace(kube, driver, namespace)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(dirs.cdi, ignore_errors=True)
    return {
        "cycles": cycles,
        "in_flight": GPUS,
        "client": "python" if binary is None else "go",
        "p50_ms": round(statistics.median(run.prepare_ms), 2),
        "p99_ms": round(percentile(run.prepare_ms, 99), 2),
        "max_ms": round(max(run.prepare_ms), 2),
        "unprepare_p50_ms": round(statistics.median(run.unprepare_ms), 2),
        "unprepare_p99_ms": round(percentile(run.unprepare_ms, 99), 2),
        "claims_per_s": round(cycles / run.wall_s, 1),
        "errors": run.errors,
        # CPU time per prepare+unprepare cycle, by process.
        "cpu_ms_per_cycle": cpu_ms,
        "target_p50_ms": 5,
        "target_p99_ms": 20,
        # The same client and claims against a plugin that only GETs each claim:
        # gRPC plus the API server read, which every prepare pays before any node work.
        "floor_get_only": floor,
        "sample_interval_s": float(sampling) if sampling else None,
        "cdi_root_on_tmpfs": shm is not None,
        "cpus": os.cpu_count(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
    }


def compare_sampling(intervals: list[str]) -> dict[str, Any]:
    """The same bench with each device sampling interval, one after the other."""
    runs = {interval: anyio.run(main, interval) for interval in intervals}
    return {"by_sample_interval_s": runs}


if __name__ == "__main__":
    sampling = os.environ.get("BENCH_SAMPLE_INTERVAL") or None
    if sampling is not None and "," in sampling:
        compared = compare_sampling([s.strip() for s in sampling.split(",")])
        OUT_SAMPLING.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(OUT_SAMPLING, (json.dumps(compared, indent=2) + "\n").encode())
        print(json.dumps(compared, indent=2))
        runs = compared["by_sample_interval_s"].values()
        sys.exit(0 if all(r["errors"] == 0 for r in runs) else 1)
    result = anyio.run(main, sampling)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(OUT, (json.dumps(result, indent=2) + "\n").encode())
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["errors"] == 0 else 1)
