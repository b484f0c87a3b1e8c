"""make bench-prepare: prepare/unprepare cycles through the real kubelet plugin socket,
gpudra beside the Go reference driver and the floor, in one run.

`gpudra node` runs as its own process (emulated 8x H100, checkpoint and CDI specs
on disk) against the real API server. Eight claims, each allocated one whole GPU by
the real scheduler, are prepared and unprepared over the DRA gRPC socket, one
claim per GPU in flight at a time, like eight pods starting and stopping at once.
Each prepare includes the plugin's GET of the claim. The CDI specs go on a tmpfs where
there is one (as /var/run/cdi is on a node); the checkpoint stays on disk (a whole GPU's
prepare and unprepare end in lines appended to its changes file, unsynced).
Writes bench/results/prepare.json.

`peer` is the kubelet plugin of sigs.k8s.io/dra-example-driver (bench/peers.py), the
reference implementation on the upstream plugin helper, driven the same way: the same
Go client, eight claims allocated by the scheduler on the devices it publishes itself,
its CDI specs on the same tmpfs, its checkpoint on the same disk. BENCH_PEER=0 skips it.

`floor_get_only` repeats the cycles against a plugin served from this process (on the
event loop `gpudra node` runs on) that only reads and checks each claim (the plugin's
own claim read, a GET) and answers: the gRPC calls and the API server read that every
prepare pays, so that the agent's own share can be told from what no agent can avoid.
`floor_with_files` does the same and also writes what any crash-safe driver writes,
at their least cost (`WithFiles`): a CDI spec on the same tmpfs and a durable record
of each claim on the same disk, its syncs shared by the claims in flight. It tells
the cost of those files from the rest of the agent's work when reading the floor
target; it is not a target. BENCH_FLOOR=0 skips both.

`device_metadata` is a second `gpudra node`, the same in all but `--device-metadata`
(a file of each claim's devices for its containers, and a CDI mount of it; off by
default), on a driver name and claims of its own: what the option costs a prepare,
beside gpudra without it (`ratio_to_gpudra`). Before it is measured, one prepare
through it must carry the mount and write the file, or the bench stops. The peer's
release enables no device metadata, so there is nothing of its to compare it with.
BENCH_DEVICE_METADATA=0 skips it.

All of them are measured in BENCH_ROUNDS interleaved rounds (default 3), each taking
its share of BENCH_CYCLES in turn, so that noise on a shared machine hits them alike.
`ratio_to_peer`, `ratio_to_floor` and `ratio_to_floor_with_files` divide gpudra's
numbers by theirs; `targets` says whether gpudra is no worse than the peer and within
1.3x of the GET-only floor.

BENCH_SAMPLE_INTERVAL=<seconds> sets the agent's device sampling interval (0: off;
default: the agent's own). BENCH_SAMPLE_INTERVAL=0,0.2 (several values) measures each
in turn, in one run, a fresh agent each, gpudra alone, and writes
bench/results/prepare-sampling.json: whether device sampling slows prepares.

The calls come from a small Go client (bench/kubeletclient, the kubelet's own DRA
stubs and grpc-go), built from the Go module proxy and cached under
~/.cache/gpudra, so that the two cores measure the plugin rather than a Python gRPC
client. Without Go the Python kubelet stand-in makes the calls (gpudra alone, no peer
or floor); `client` in the results says which. BENCH_CLIENT=python|go forces one.
"""

from __future__ import annotations

import contextlib
import json
import os
import pstats
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import gpudra
from gpudra.api import jsonbytes
from gpudra.common.eventloop import run_event_loop
from gpudra.common.files import atomic_write, write_all
from gpudra.common.kube import Kube as KubeAsync
from gpudra.driver import devicemetadata
from gpudra.driver.claimreader import ApiClaims
from gpudra.driver.claims import Claim, ClaimRef
from gpudra.driver.plugin import KubeletPlugin, PreparedDevice, PrepareResult
from gpudra.driver.prepare import METADATA_DIR

from bench import peers
from bench.runinfo import load_avg, run_context
from e2e.claims import pod_with_claim, wait_allocated
from e2e.cluster.harness import REPO, Cluster, State
from e2e.cluster.kube import Kube
from e2e.gobuild import GoBuildError, go_binary
from e2e.kubelet_standin import KubeletStandin
from e2e.node_process import NodeDirs, create_driver_namespace, delete_driver_namespace

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "prepare.json"
OUT_SAMPLING = HERE / "results" / "prepare-sampling.json"
GO_CLIENT = HERE / "kubeletclient"
NODE = "worker-1"
GPUS = 8


def _stat_times(stat: Path) -> tuple[str, float, float] | None:
    """(name, user s, system s) from a /proc stat file of a process or a thread; None
    once it is gone."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    name, _, rest = text[text.index("(") + 1 :].rpartition(")")
    fields = rest.split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based).
    tick = os.sysconf("SC_CLK_TCK")
    return name, int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of a process (all its threads), None once it is gone."""
    times = _stat_times(Path(f"/proc/{pid}/stat"))
    return times[1] + times[2] if times is not None else None


def control_plane_pids(cluster: Cluster) -> dict[str, int]:
    """The pids of kube-apiserver and etcd: the control plane a floor is measured on."""
    state = State.load(cluster.layout.state)
    return {
        name: pid
        for name, pid in (state.pids if state else {}).items()
        if name in ("kube-apiserver", "etcd")
    }


def thread_cpu(pid: int) -> dict[int, tuple[str, float, float]]:
    """Each live thread of a process: thread ID -> (name, user s, system s)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    return {
        int(task.name): times
        for task in tasks
        if (times := _stat_times(task / "stat")) is not None  # None: ended meanwhile
    }


class ProfileWindow:
    """The node process's CPU over the measured cycles only: the event-loop thread's
    profile (`bench.nodeprofile`, switched on and off by signal) and each thread's user
    and system time from /proc, grouped as the event-loop (main) thread, Python worker
    threads (the file and NVML calls anyio hands off) and the rest by name (gRPC's
    core threads)."""

    def __init__(self, proc: subprocess.Popen[bytes], path: Path) -> None:
        self._proc = proc
        self._path = path
        self._before: dict[int, tuple[str, float, float]] = {}
        self._name = ""

    def start(self) -> None:
        self._name = Path(f"/proc/{self._proc.pid}/comm").read_text().strip()
        self._before = thread_cpu(self._proc.pid)
        self._proc.send_signal(signal.SIGUSR1)

    async def stop(self, cycles: int) -> dict[str, dict[str, float]]:
        """Per thread group: user and system ms per cycle; the profile is on disk after."""
        groups = self._groups(thread_cpu(self._proc.pid), cycles)
        self._proc.send_signal(signal.SIGUSR2)
        with anyio.fail_after(30):
            while not self._path.exists():  # noqa: ASYNC110 - another process writes it
                await anyio.sleep(0.1)
        return groups

    def _groups(
        self, after: dict[int, tuple[str, float, float]], cycles: int
    ) -> dict[str, dict[str, float]]:
        groups: dict[str, list[float]] = {}
        for tid, (name, user, system) in after.items():
            _, user0, system0 = self._before.get(tid, (name, 0.0, 0.0))
            if tid == self._proc.pid:
                group = "event_loop_thread"
            elif name == self._name:
                group = "python_worker_threads"
            else:
                group = name
            total = groups.setdefault(group, [0.0, 0.0])
            total[0] += user - user0
            total[1] += system - system0
        return {
            group: {
                "user": round(user * 1000 / cycles, 3),
                "system": round(system * 1000 / cycles, 3),
            }
            for group, (user, system) in sorted(groups.items(), key=lambda kv: -sum(kv[1]))
        }


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


@contextlib.contextmanager
def node_process(
    dirs: NodeDirs,
    driver: str,
    env: dict[str, str],
    options: Sequence[str] = (),
    runner: Sequence[str] = (),
) -> Iterator[subprocess.Popen[bytes]]:
    """`gpudra node` for `driver` on `dirs`, without its metrics listener, stopped as
    the agent is on a node (SIGTERM) when the block ends."""
    proc = subprocess.Popen(
        dirs.command(driver, "--metrics-address", "", *options, runner=runner),
        cwd=REPO,
        env=env,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


async def check_metadata_written(
    kubelet: KubeletStandin, driver: str, ref: ClaimRef, dirs: NodeDirs
) -> None:
    """One prepare through the agent with `--device-metadata` must carry the metadata
    mount and write its file, and its unprepare remove it: otherwise the rows measured
    without what they are named for."""
    store = devicemetadata.DeviceMetadataStore(dirs.state / METADATA_DIR, driver=None)
    result = (await kubelet.prepare(driver, [ref]))[ref.uid]
    ids = [i for device in result.devices for i in device.cdi_device_ids]
    written = ref.uid in store.claim_uids()
    error = (await kubelet.unprepare(driver, [ref]))[ref.uid]
    if result.error or error or not devicemetadata.mounted(ids) or not written:
        raise SystemExit(
            f"bench-prepare: the agent with --device-metadata prepared {ref.name} with "
            f"CDI IDs {ids}, {'a' if written else 'no'} file in {store.root} (error: "
            f"{result.error or error}); expected a metadata mount and its file"
        )
    if ref.uid in store.claim_uids():
        raise SystemExit(f"bench-prepare: the unprepare of {ref.name} left files in {store.root}")


def go_client() -> Path | None:
    """The Go kubelet client, built when missing (`e2e.gobuild`); None without a Go
    toolchain or when it does not build."""
    try:
        return go_binary(GO_CLIENT, "bench-kubeletclient")
    except GoBuildError as exc:
        print(f"bench-prepare: {exc}; using the Python client", file=sys.stderr)
        return None


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


class Journal:
    """Records appended to one file and fdatasynced once for all that wait: the least a
    durable record costs. Appends that arrive while a sync runs go to disk together in
    the next one, and each caller returns once a sync holding its record has finished.
    A failed write or sync raises in its callers and in every later one: what reached
    the file after it is unknown."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._pending: list[bytes] = []
        self._waiting: list[anyio.Event] = []
        self._syncing = False
        self._failed: OSError | None = None

    def close(self) -> None:
        os.close(self._fd)

    def _write(self, data: bytes) -> None:
        write_all(self._fd, data)
        os.fdatasync(self._fd)

    async def append(self, line: bytes) -> None:
        done = anyio.Event()
        self._pending.append(line)
        self._waiting.append(done)
        if not self._syncing:
            self._syncing = True
            try:
                while self._pending:
                    batch, waiting = b"".join(self._pending), self._waiting
                    self._pending, self._waiting = [], []
                    try:
                        await anyio.to_thread.run_sync(self._write, batch)
                    except OSError as e:
                        self._failed = e
                    for event in waiting:
                        event.set()
            finally:
                self._syncing = False
        await done.wait()
        if self._failed is not None:
            raise self._failed


class WithFiles(GetOnly):
    """The GET-only handler plus the files any crash-safe driver writes, at their least
    cost: a CDI spec naming the claim's device, replaced atomically on the same tmpfs
    (as gpudra's, not fsynced: it is rebuilt after a reboot), and a durable record of
    the claim, a line appended to a journal on the same disk as gpudra's checkpoint and
    fdatasynced once for all the claims waiting (`Journal`) before the answer. Unprepare
    removes the spec and appends the claim's removal the same way.

    What it leaves out is what a driver does beyond that: gpudra's specs hold the device
    nodes, mounts and hooks a real GPU container needs (this one's, one device node);
    its checkpoint is a whole file that any release can read and a crash never leaves
    torn, replaced with two fsyncs where a change must survive a power loss, with the
    changes a power loss may take (a whole GPU's prepare and unprepare, whose devices
    do not outlive a reboot) appended to a changes file beside it, unsynced, in lines a
    reader checks (this journal syncs every record, and is never compacted, read back
    or checked); and its device layer plans, records and checks the devices."""

    def __init__(self, driver: str, cdi_root: Path, journal: Journal) -> None:
        super().__init__(driver)
        self._cdi_root = cdi_root
        self._journal = journal

    def _spec_path(self, uid: str) -> Path:
        return self._cdi_root / f"{self._driver}-{uid}.json"

    async def prepare(self, claims: list[Claim]) -> dict[str, PrepareResult]:
        out = await super().prepare(claims)
        for claim in claims:
            device = out[claim.uid].devices[0]
            name = f"{claim.uid}-{device.device_name}"
            spec = {
                "cdiVersion": "0.5.0",
                "kind": f"{self._driver}/gpu",
                "devices": [
                    {"name": name, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}
                ],
            }
            atomic_write(self._spec_path(claim.uid), jsonbytes.dumps(spec), durable=False)
            record = {"uid": claim.uid, "device": device.device_name, "cdi": name}
            await self._journal.append(jsonbytes.dumps(record) + b"\n")
        return out

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        for ref in claims:
            self._spec_path(ref.uid).unlink(missing_ok=True)
            await self._journal.append(jsonbytes.dumps({"uid": ref.uid, "removed": True}) + b"\n")
        return await super().unprepare(claims)


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


@dataclass
class Subject:
    """One plugin measured in rounds: its DRA socket, its claims, the processes whose CPU
    counts as its own, and what each round measured."""

    name: str
    socket: Path
    refs: list[ClaimRef]
    pids: dict[str, int]
    runs: list[Run] = field(default_factory=list)
    cpu: list[dict[str, float]] = field(default_factory=list)

    async def measure(self, binary: Path, cycles: int, control_plane: dict[str, int]) -> None:
        meter = CpuMeter({**self.pids, **control_plane})
        run = await drive_go(binary, self.socket, self.refs, cycles)
        self.runs.append(run)
        self.cpu.append(run.cpu_per_cycle(meter, cycles))

    def summary(self) -> dict[str, Any]:
        """All rounds together: latencies pooled, CPU per cycle averaged over rounds."""
        prepare = [ms for run in self.runs for ms in run.prepare_ms]
        unprepare = [ms for run in self.runs for ms in run.unprepare_ms]
        names = {name for cpu in self.cpu for name in cpu}
        return {
            "p50_ms": round(statistics.median(prepare), 2),
            "p99_ms": round(percentile(prepare, 99), 2),
            "max_ms": round(max(prepare), 2),
            "unprepare_p50_ms": round(statistics.median(unprepare), 2),
            "unprepare_p99_ms": round(percentile(unprepare, 99), 2),
            "claims_per_s": round(len(prepare) / sum(run.wall_s for run in self.runs), 1),
            "errors": sum(run.errors for run in self.runs),
            "cpu_ms_per_cycle": {
                name: round(statistics.fmean(c[name] for c in self.cpu if name in c), 3)
                for name in sorted(names)
            },
            "by_round_p50_ms": [round(statistics.median(r.prepare_ms), 2) for r in self.runs],
        }


def ratios(ours: dict[str, Any], other: dict[str, Any], plugin: str, theirs: str) -> dict[str, Any]:
    """gpudra's numbers over another's: below 1 is better for latency and CPU, above 1
    for claims per second."""

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    return {
        "p50": ratio(ours["p50_ms"], other["p50_ms"]),
        "p99": ratio(ours["p99_ms"], other["p99_ms"]),
        "claims_per_s": ratio(ours["claims_per_s"], other["claims_per_s"]),
        "plugin_cpu": ratio(
            ours["cpu_ms_per_cycle"].get(plugin, 0.0),
            other["cpu_ms_per_cycle"].get(theirs, 0.0),
        ),
    }


def targets(to_peer: dict[str, Any] | None, to_floor: dict[str, Any] | None) -> dict[str, Any]:
    """The relative targets: no worse than the peer, within 1.3x of the floor."""

    def met(value: float | None, limit: float, higher_is_better: bool = False) -> bool | None:
        if value is None:
            return None
        return value >= limit if higher_is_better else value <= limit

    out: dict[str, Any] = {}
    if to_peer is not None:
        out["p50_vs_peer"] = {
            "limit": 1.0,
            "value": to_peer["p50"],
            "met": met(to_peer["p50"], 1.0),
        }
        out["p99_vs_peer"] = {
            "limit": 1.0,
            "value": to_peer["p99"],
            "met": met(to_peer["p99"], 1.0),
        }
        out["claims_per_s_vs_peer"] = {
            "limit": 1.0,
            "value": to_peer["claims_per_s"],
            "met": met(to_peer["claims_per_s"], 1.0, higher_is_better=True),
        }
    if to_floor is not None:
        out["p50_vs_floor"] = {
            "limit": 1.3,
            "value": to_floor["p50"],
            "met": met(to_floor["p50"], 1.3),
        }
    return out


async def main(
    sampling: str | None = None, compare: bool = True, profile: str | None = None
) -> dict[str, Any]:
    """gpudra's agent, the Go peer and the GET-only floor, measured in interleaved rounds
    (`BENCH_ROUNDS`, default 3) so that noise on this shared machine hits all three
    alike. `compare=False` measures gpudra alone (the sampling comparison, the profile
    pass); `profile` names a file for a cProfile of the node process."""
    cycles = int(os.environ.get("BENCH_CYCLES", "1000"))
    warmup = int(os.environ.get("BENCH_WARMUP", "40"))
    rounds = max(1, int(os.environ.get("BENCH_ROUNDS", "3")))
    client = os.environ.get("BENCH_CLIENT", "auto")
    if client not in ("auto", "go", "python"):
        raise SystemExit(f"BENCH_CLIENT={client!r}: use go, python or leave it unset")
    binary = await anyio.to_thread.run_sync(go_client) if client != "python" else None
    if client == "go" and binary is None:
        raise SystemExit("BENCH_CLIENT=go: the Go kubelet client is not available")
    with_floor = compare and binary is not None and os.environ.get("BENCH_FLOOR", "1") != "0"
    with_peer = compare and binary is not None and os.environ.get("BENCH_PEER", "1") != "0"
    with_metadata = (
        compare and binary is not None and os.environ.get("BENCH_DEVICE_METADATA", "1") != "0"
    )
    peer_bins = await anyio.to_thread.run_sync(peers.bin_dir) if with_peer else None
    cluster = Cluster()
    if not cluster.is_up():
        cluster.up()
    kube = cluster.kube()
    driver = f"bench{secrets.token_hex(3)}.gpudra.dev"
    namespace = f"bench-prepare-{secrets.token_hex(3)}"
    peer_namespace = f"bench-peer-{secrets.token_hex(3)}"
    metadata_driver = f"benchmd{secrets.token_hex(3)}.gpudra.dev"
    metadata_namespace = f"bench-metadata-{secrets.token_hex(3)}"
    root = Path(tempfile.mkdtemp(prefix="gdb-", dir=os.environ.get("BENCH_DIR")))
    # The checkpoint and state stay on disk; the specs go where a node keeps them.
    shm = tmpfs_folder()
    cdi_root = Path(tempfile.mkdtemp(prefix="gdb-cdi-", dir=shm)) if shm else None
    dirs = NodeDirs(root, cdi_root)
    dirs.make_dev(GPUS)
    create_driver_namespace(kube, driver, namespace)
    if peer_bins is not None:
        create_driver_namespace(kube, peers.PEER_DRIVER, peer_namespace)
    if with_metadata:
        create_driver_namespace(kube, metadata_driver, metadata_namespace)
    started_load = load_avg()
    control_plane = control_plane_pids(cluster)
    env = {**os.environ, "KUBECONFIG": str(cluster.layout.admin_kubeconfig), "NODE_NAME": NODE}
    # Optional: BENCH_PROFILE=<file> writes a profile of the node's event loop over the
    # measured cycles (ProfileWindow).
    profile = profile or os.environ.get("BENCH_PROFILE")
    runner = ["-m", "bench.nodeprofile", "--out", profile, "--"] if profile else []
    options = ("--sample-interval", sampling) if sampling else ()
    threads: dict[str, dict[str, float]] | None = None
    result: dict[str, Any] = {}
    try:
        async with contextlib.AsyncExitStack() as stack:
            proc = stack.enter_context(node_process(dirs, driver, env, options, runner))
            window = ProfileWindow(proc, Path(profile)) if profile else None
            kubelet = await stack.enter_async_context(KubeletStandin(dirs.kubelet))
            registration = await kubelet.wait_for_driver(driver, timeout_s=120)
            refs = await anyio.to_thread.run_sync(allocated_claims, kube, driver, namespace)
            if binary is None:
                warm = await drive(kubelet, driver, refs, warmup)
                meter = CpuMeter({"node": proc.pid, "client": os.getpid(), **control_plane})
                if window is not None:
                    window.start()
                run = await drive(kubelet, driver, refs, cycles)
                if window is not None:
                    threads = await window.stop(cycles)
                run.errors += warm.errors
                gpudra = Subject("gpudra", registration.endpoint, refs, {"node": proc.pid})
                gpudra.runs.append(run)
                gpudra.cpu.append(run.cpu_per_cycle(meter, cycles))
                subjects = [gpudra]
            else:
                subjects = [Subject("gpudra", registration.endpoint, refs, {"node": proc.pid})]
                if peer_bins is not None:
                    plugin = stack.enter_context(
                        peers.kubelet_plugin(
                            peer_bins,
                            root / "peer",
                            (cdi_root or root) / "peer",
                            cluster.layout.admin_kubeconfig,
                            NODE,
                            GPUS,
                        )
                    )
                    peer_refs = await anyio.to_thread.run_sync(
                        allocated_claims, kube, peers.PEER_DRIVER, peer_namespace
                    )
                    subjects.append(
                        Subject("peer", plugin.socket, peer_refs, {"plugin": plugin.pid})
                    )
                if with_metadata:
                    metadata_dirs = NodeDirs(root / "metadata", dirs.cdi / "metadata")
                    metadata_dirs.cdi.mkdir(parents=True)
                    metadata_dirs.make_dev(GPUS)
                    metadata_proc = stack.enter_context(
                        node_process(
                            metadata_dirs,
                            metadata_driver,
                            env,
                            ("--device-metadata", *options),
                        )
                    )
                    metadata_kubelet = await stack.enter_async_context(
                        KubeletStandin(metadata_dirs.kubelet)
                    )
                    metadata_registration = await metadata_kubelet.wait_for_driver(
                        metadata_driver, timeout_s=120
                    )
                    metadata_refs = await anyio.to_thread.run_sync(
                        allocated_claims, kube, metadata_driver, metadata_namespace
                    )
                    await check_metadata_written(
                        metadata_kubelet, metadata_driver, metadata_refs[0], metadata_dirs
                    )
                    subjects.append(
                        Subject(
                            "device_metadata",
                            metadata_registration.endpoint,
                            metadata_refs,
                            {"node": metadata_proc.pid},
                        )
                    )
                if with_floor:
                    floor_kube = await KubeAsync.connect(str(cluster.layout.admin_kubeconfig))
                    stack.push_async_callback(floor_kube.close)
                    floor_root = root / "floor"
                    floor_root.mkdir()
                    floor_plugin = await stack.enter_async_context(
                        KubeletPlugin(
                            driver,
                            GetOnly(driver),
                            claims=ApiClaims(floor_kube, driver=driver, pool=NODE),
                            kubelet_root=floor_root,
                        )
                    )
                    subjects.append(
                        Subject("floor", floor_plugin.dra_socket, refs, {"plugin": os.getpid()})
                    )
                    files_root = root / "floor-files"
                    files_root.mkdir()
                    files_cdi = (cdi_root or root) / "floor-files"
                    files_cdi.mkdir()
                    journal = Journal(files_root / "journal")
                    stack.callback(journal.close)
                    files_plugin = await stack.enter_async_context(
                        KubeletPlugin(
                            driver,
                            WithFiles(driver, files_cdi, journal),
                            claims=ApiClaims(floor_kube, driver=driver, pool=NODE),
                            kubelet_root=files_root,
                        )
                    )
                    subjects.append(
                        Subject(
                            "floor_files", files_plugin.dra_socket, refs, {"plugin": os.getpid()}
                        )
                    )
                for subject in subjects:
                    warm = await drive_go(binary, subject.socket, subject.refs, warmup)
                    if warm.errors:
                        print(
                            f"bench-prepare: {subject.name}: {warm.errors} warm-up errors",
                            file=sys.stderr,
                        )
                per_round = [
                    cycles // rounds + (1 if i < cycles % rounds else 0) for i in range(rounds)
                ]
                if window is not None:
                    window.start()
                for count in per_round:
                    for subject in subjects:
                        await subject.measure(binary, count, control_plane)
                if window is not None:
                    threads = await window.stop(cycles)
            summaries = {subject.name: subject.summary() for subject in subjects}
    finally:
        delete_driver_namespace(kube, driver, namespace)
        if peer_bins is not None:
            delete_driver_namespace(kube, peers.PEER_DRIVER, peer_namespace)
        if with_metadata:
            delete_driver_namespace(kube, metadata_driver, metadata_namespace)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(dirs.cdi, ignore_errors=True)
    ours = summaries["gpudra"]
    peer, floor = summaries.get("peer"), summaries.get("floor")
    floor_files = summaries.get("floor_files")
    metadata = summaries.get("device_metadata")
    to_peer = ratios(ours, peer, "node", "plugin") if peer else None
    to_floor = ratios(ours, floor, "node", "plugin") if floor else None
    to_floor_files = ratios(ours, floor_files, "node", "plugin") if floor_files else None
    result = {
        "cycles": cycles,
        "rounds": rounds if binary is not None else 1,
        "in_flight": GPUS,
        "client": "python" if binary is None else "go",
        **{k: v for k, v in ours.items() if k != "by_round_p50_ms"},
        "by_round_p50_ms": ours["by_round_p50_ms"],
        # The same client and claims against a plugin that only GETs each claim:
        # gRPC plus the API server read, which every prepare pays before any node work.
        "floor_get_only": floor,
        # The GET-only floor plus a CDI spec on the same tmpfs and a durable record per
        # claim on the same disk (`WithFiles`): what any crash-safe driver pays. For
        # reading the floor target, not a target of its own.
        "floor_with_files": (
            {**floor_files, "what": " ".join((WithFiles.__doc__ or "").split())}
            if floor_files
            else None
        ),
        "peer": (
            {
                "name": peers.PEER_NAME,
                "version": peers.version(),
                **peer,
                "differences": list(peers.PEER_DIFFERENCES),
            }
            if peer
            else None
        ),
        "ratio_to_peer": to_peer,
        "ratio_to_floor": to_floor,
        "ratio_to_floor_with_files": to_floor_files,
        # The same agent with `--device-metadata`, over gpudra without it. No target.
        "device_metadata": (
            {**metadata, "ratio_to_gpudra": ratios(metadata, ours, "node", "node")}
            if metadata
            else None
        ),
        "targets": targets(to_peer, to_floor),
        "sample_interval_s": float(sampling) if sampling else None,
        **({"node_threads_ms_per_cycle": threads} if threads is not None else {}),
        "cdi_root_on_tmpfs": shm is not None,
        **run_context(kube, started_load),
    }
    return result


def missed(result: dict[str, Any]) -> list[str]:
    """The targets gpudra missed in this run."""
    return [name for name, target in result["targets"].items() if target["met"] is False]


CALLS_NOTE = (
    "calls_per_cycle counts each time the profiler saw a function entered, and a "
    "coroutine is entered again each time it resumes after an await: one that awaits "
    "once per call shows two, so aiohttp's _request at 2 per cycle is one GET"
)
"""What a coroutine's call count means, said beside the numbers: read as calls, the
profile seems to show two API requests per prepare where there is one."""

_WAITING = "<method 'poll' of 'select.epoll' objects>"
"""Where the event loop waits for its next event: wall-clock time, but no CPU."""


def profile_summary(path: Path, cycles: int, top: int = 15) -> dict[str, Any]:
    """The event-loop thread's functions per measured cycle: those that took the most
    time of their own, and gpudra's functions by all the time under them, which say
    what each step of a prepare or an unprepare costs. The loop's waiting for events
    is reported apart (`waiting_ms_per_cycle`), not as a function."""
    package = [f"{folder}{os.sep}" for folder in gpudra.__path__]
    stats = pstats.Stats(str(path))
    rows = []
    ours = []
    waiting = 0.0
    for (file, line, name), (_, calls, own, total, _) in stats.stats.items():  # type: ignore[attr-defined]
        if name == _WAITING:
            waiting += own
            continue
        root = next((folder for folder in package if file.startswith(folder)), None)
        where = file[len(root) :] if root else Path(file).name
        row = {
            "function": f"{where}:{line}({name})",
            "calls_per_cycle": round(calls / cycles, 2),
            "own_ms_per_cycle": round(own * 1000 / cycles, 4),
            "cumulative_ms_per_cycle": round(total * 1000 / cycles, 4),
        }
        rows.append(row)
        if root:
            ours.append(row)
    rows.sort(key=lambda row: row["own_ms_per_cycle"], reverse=True)
    ours.sort(key=lambda row: row["cumulative_ms_per_cycle"], reverse=True)
    return {
        "waiting_ms_per_cycle": round(waiting * 1000 / cycles, 4),
        "top_own_time": rows[:top],
        "top_cumulative_gpudra": ours[:top],
    }


def profile_on_miss(result: dict[str, Any], sampling: str | None) -> None:
    """Where gpudra misses a target, a second pass of gpudra alone says where the node
    process's CPU goes over the measured cycles (`profile_node` in the results): each
    thread group's user and system time, and a profile of the event-loop thread."""
    if not missed(result) or os.environ.get("BENCH_PROFILE_ON_MISS", "1") == "0":
        return
    with tempfile.TemporaryDirectory(prefix="gdb-profile-") as folder:
        path = Path(folder) / "node.prof"
        profiled = run_event_loop(main, sampling, False, str(path))
        cycles = profiled["cycles"]
        result["profile_node"] = {
            "missed": missed(result),
            "cycles": cycles,
            "note": "a separate pass of gpudra alone (the profiler slows it), measured "
            "cycles only (no start-up or warm-up); per cycle. threads_ms_per_cycle: CPU of "
            "the node's threads from /proc; the function lists: a cProfile of the "
            "event-loop thread (wall clock; the loop's waits are waiting_ms_per_cycle). "
            f"{CALLS_NOTE}",
            "cpu_ms_per_cycle": profiled["cpu_ms_per_cycle"],
            "threads_ms_per_cycle": profiled.get("node_threads_ms_per_cycle"),
            **profile_summary(path, cycles),
        }


def compare_sampling(intervals: list[str]) -> dict[str, Any]:
    """The same bench with each device sampling interval, one after the other."""
    runs = {interval: run_event_loop(main, interval, False) for interval in intervals}
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
    result = run_event_loop(main, sampling)
    profile_on_miss(result, sampling)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(OUT, (json.dumps(result, indent=2) + "\n").encode())
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["errors"] == 0 else 1)
