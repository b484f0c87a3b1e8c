"""Run gpudra's NVML code paths on a real GPU node, read-only, and keep what they saw.

CI has no GPU: every suite runs on the emulator, driven by product profiles. This
check runs the production code against the node's own libnvidia-ml, so that what the
emulator assumes can be compared with what a driver answers. Into OUTDIR it writes:

- `recording.json`: the node recorded (`gpudra.driver.nvml.record`), ready for
  `tests/nvml/fixtures/`;
- `report.json`: discovery and the devices of each MIG strategy, the ResourceSlices
  they make, the driver files and CDI edits a claim gets, a whole-GPU claim prepared
  and unprepared through the `ClaimPreparer` (CDI spec and checkpoint in a scratch
  folder), sampling idle and under load, the health watcher's events, what one
  sampling pass and one discovery cost with NVML held open by the health watcher (as
  in the agent) and without, and which NVML calls that time went to, NVML's raw answer
  to each call the emulator models (`nvml_answers`, kept in `tests/nvml/answers/`),
  what NVML's utilization sample buffers hold at the end (`sample_buffer`: how many
  samples, how far apart), every NVML call made, with counts and the mean time of each
  (`nvml_call_ms`), and the steps that failed (`errors`);
- `metrics.txt`: the agent's device and accounting series under the load.

Every NVML call goes through `ReadOnlyNvml`, which refuses those that change the
machine (MIG mode, instances, compute mode, clocks, any Set, Reset or Clear). The
only calls let through that are named like one are the health watcher's event set
and GPM's samples: they allocate in the library and change nothing on the GPU. A
whole-GPU claim with no config changes nothing either, so the guard refusing a call
is itself a finding, reported under `refused`.

`--load` names a command that keeps the GPU busy for a while (a matrix product loop);
the check samples before it starts and while it runs.

Usage on a GPU node, from the repository root:
`python -m e2e.gpu_node_check OUTDIR [--load CMD] [--health-seconds N]`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pynvml
from gpudra.api.deviceclasses import DEFAULT_DRIVER
from gpudra.driver.accounting import Accounting
from gpudra.driver.cdi import CdiSpecStore, driver_common_edits, find_driver_files
from gpudra.driver.claims import ClaimRef, checked_claim
from gpudra.driver.devices import Inventory, MigStrategy, discover
from gpudra.driver.health import HealthState, NvmlHealthWatcher
from gpudra.driver.metrics import DeviceMetrics
from gpudra.driver.nvml import load_nvml
from gpudra.driver.nvml.codes import constant_names
from gpudra.driver.nvml.record import record, write_recording
from gpudra.driver.nvml.topology import SysfsTopology
from gpudra.driver.nvml.unrepairable import read_status_words
from gpudra.driver.prepare import ClaimPreparer
from gpudra.driver.publish import pool_content
from gpudra.driver.sampling import Sample, Sampler
from gpudra.driver.sharing import NvidiaSharing
from gpudra.driver.slices import SliceLimits, plan_slices
from prometheus_client import CollectorRegistry, generate_latest

__all__ = ["ReadOnlyNvml", "RefusedCall", "main", "nvml_answers"]

NODE = "gpu-node-check"
# Named like a change but changing nothing on the GPU: event sets and GPM samples are
# the library's own allocations.
_HARMLESS = frozenset(
    {
        "nvmlEventSetCreate",
        "nvmlEventSetWait",
        "nvmlEventSetWait_v2",
        "nvmlEventSetFree",
        "nvmlDeviceRegisterEvents",
        "nvmlGpmSampleAlloc",
        "nvmlGpmSampleFree",
        "nvmlGpmSampleGet",
        "nvmlGpmMigSampleGet",
        "nvmlGpmMetricsGet",
    }
)
# `/`, GKE's driver folder, the GPU operator's containerised driver.
_DRIVER_ROOTS = (Path("/"), Path("/usr/local/nvidia"), Path("/run/nvidia/driver"))
_CHANGES = re.compile(r"Set|Create|Destroy|Reset|Clear|Register")


class RefusedCall(RuntimeError):
    """A call that would change the GPU, refused before it reached the library."""


class ReadOnlyNvml:
    """pynvml with every call counted and timed, and every call that changes the
    machine refused. The time per call is what says where a step's cost goes on a
    real driver, which the emulator cannot tell."""

    def __init__(self, nvml: Any) -> None:
        self.inner = nvml
        self.calls: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.refused: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if not name.startswith("nvml") or not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            if _CHANGES.search(name) and name not in _HARMLESS:
                self.refused[name] += 1
                raise RefusedCall(f"{name} changes the GPU; this check is read-only")
            self.calls[name] += 1
            started = time.perf_counter()
            try:
                return target(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return call


def _step(report: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    """Run one step and time it; its error goes under `errors`, and the check goes on."""
    started = time.monotonic()
    try:
        value = fn()
    except Exception as err:  # a finding to record, not a reason to stop the others
        report["errors"][name] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        return None
    report["timings_s"][name] = round(time.monotonic() - started, 3)
    return value


def _plain(value: Any) -> Any:
    """A ctypes structure (or a list of them) as JSON-ready values."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    fields = getattr(value, "_fields_", None)
    if fields is None:
        return value.decode(errors="replace") if isinstance(value, bytes) else value
    return {name: _plain(getattr(value, name)) for name, *_ in fields}


def _answer(call: Callable[[], Any]) -> Any:
    """What one NVML call answered: its value, or the error's name."""
    try:
        return _plain(call())
    except pynvml.NVMLError as err:
        code = getattr(err, "value", None)
        name = constant_names("NVML_ERROR_").get(code) if isinstance(code, int) else None
        return {"nvmlError": name or str(err)}
    except AttributeError as err:  # an entry point the emulator does not have
        return {"missing": str(err)}


def nvml_answers(nvml: ReadOnlyNvml, *, index: int = 0) -> dict[str, Any]:
    """The answers the emulator must match, one call at a time, for GPU `index`:
    every GPU-instance profile index (offered or its error), engine counts of a whole
    GPU, GPM support, both memory structures, the MIG maximum, the processes, and
    whether the row remapper answers and says a remapping failed (the flag the health
    state reads; the row counts are the board's own history, which no recording holds),
    and the two words the unrepairable-memory flag's call leaves (R590 and later: which
    of the two structs NVIDIA publishes the driver writes, `gpudra.driver.nvml.unrepairable`),
    and the addressing mode (R580 and later; no product profile says what a real GPU of
    its kind answers)."""
    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        names = constant_names("NVML_GPU_INSTANCE_PROFILE_")

        def profile(index: int) -> Any:
            return _answer(lambda: nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index))

        return {
            "gpuInstanceProfiles": {
                names.get(i, str(i)): profile(i)
                for i in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
            },
            "attributes": _answer(lambda: nvml.nvmlDeviceGetAttributes(handle)),
            "gpmSupport": _answer(lambda: nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice),
            "memoryV1": _answer(lambda: nvml.nvmlDeviceGetMemoryInfo(handle)),
            "memoryV2": _answer(
                lambda: nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            ),
            "maxMigDeviceCount": _answer(lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(handle)),
            "computeProcesses": _answer(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle)),
            "rowRemapFailed": _answer(lambda: nvml.nvmlDeviceGetRemappedRows(handle)[3]),
            "unrepairableMemoryWords": _answer(lambda: list(read_status_words(nvml, handle))),
            "addressingMode": _answer(lambda: nvml.nvmlDeviceGetAddressingMode(handle)),
        }
    finally:
        nvml.nvmlShutdown()


def sample_buffer(nvml: ReadOnlyNvml, *, index: int = 0) -> dict[str, Any]:
    """What NVML's utilization sample buffers hold for GPU `index`, read whole
    (timestamp 0), per sampling type: the value type, how many samples, the gaps
    between them, and the newest one's age on the node's wall clock. nvml.h leaves the
    buffer's length and the sample period open, and the sampler's reads between passes
    (`gpudra.driver.utilization`) rest on the buffer outlasting `TOP_UP_EVERY_S`."""

    def shape(kind: int) -> dict[str, Any]:
        value_type, samples = nvml.nvmlDeviceGetSamples(handle, kind, 0)
        now_us = time.time() * 1e6
        stamps = [int(s.timeStamp) for s in samples]
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        return {
            "valueType": value_type,
            "count": len(stamps),
            "oldestFirst": stamps == sorted(stamps),
            "gapUs": {"min": min(gaps), "median": statistics.median(gaps), "max": max(gaps)}
            if gaps
            else None,
            "spanS": round((stamps[-1] - stamps[0]) / 1e6, 3) if stamps else None,
            "newestAgeMs": round((now_us - max(stamps)) / 1e3, 1) if stamps else None,
        }

    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        return {
            "gpu": _answer(lambda: shape(pynvml.NVML_GPU_UTILIZATION_SAMPLES)),
            "memory": _answer(lambda: shape(pynvml.NVML_MEMORY_UTILIZATION_SAMPLES)),
        }
    finally:
        nvml.nvmlShutdown()


def _devices(inventory: Inventory) -> dict[str, Any]:
    out: dict[str, Any] = {
        "driverVersion": inventory.driver_version,
        "cudaDriverVersion": inventory.cuda_driver_version,
        "gpus": [
            {
                "uuid": g.uuid,
                "name": g.device.name,
                "product": g.product_name,
                "migDevices": [m.name for m in g.mig_devices],
            }
            for g in inventory.gpus
        ],
    }
    limits = SliceLimits()
    for strategy in MigStrategy:
        content = pool_content(inventory, strategy, driver=DEFAULT_DRIVER)
        out[strategy.value] = {
            "devices": content.devices,
            "counterSets": content.counter_sets,
            "slices": plan_slices(content, limits),
        }
    return out


def _exists(path: str) -> bool:
    return Path(path).exists()


def _spec_paths(spec: dict[str, Any]) -> dict[str, bool]:
    """Every host path a CDI spec names, and whether the node has it."""
    paths: dict[str, bool] = {}
    edits = [spec.get("containerEdits", {})] + [
        d.get("containerEdits", {}) for d in spec.get("devices", [])
    ]
    for edit in edits:
        for node in edit.get("deviceNodes", []):
            host = node.get("hostPath", node["path"])
            paths[host] = _exists(host)
        for mount in edit.get("mounts", []):
            paths[mount["hostPath"]] = _exists(mount["hostPath"])
        for hook in edit.get("hooks", []):
            paths[hook["path"]] = _exists(hook["path"])
    return paths


def _sample_json(sample: Sample) -> list[dict[str, Any]]:
    return [
        {
            "device": d.name,
            "mig": d.mig,
            "values": dict(r.values),
            "missing": dict(r.missing),
            "held_by": [h.claim for h in sample.held[d.name].holders]
            if d.name in sample.held
            else [],
        }
        for d, r in sample.devices
    ]


def _processes(nvml: ReadOnlyNvml) -> Any:
    nvml.nvmlInit()
    try:
        return nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        nvml.nvmlShutdown()


async def _cost(
    nvml: ReadOnlyNvml, step: Callable[[], Awaitable[object]], repeat: int
) -> dict[str, Any]:
    """Wall and CPU (all threads) milliseconds of one `step`, the median of `repeat`,
    and the NVML calls it made: the mean milliseconds per step that each call took,
    largest first. The health watcher's wait, which runs beside the step in its own
    thread, is left out of them."""
    walls: list[float] = []
    cpus: list[float] = []
    before = dict(nvml.seconds)
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        await step()
        walls.append((time.perf_counter() - wall) * 1e3)
        cpus.append((time.process_time() - cpu) * 1e3)
    # A copy first: the health watcher's thread may add a call while this reads.
    spent = {name: s - before.get(name, 0.0) for name, s in dict(nvml.seconds).items()}
    per_step = {
        name: round(seconds * 1e3 / repeat, 3)
        for name, seconds in sorted(spent.items(), key=lambda item: -item[1])
        if seconds > 0 and not name.startswith("nvmlEventSetWait")
    }
    return {
        "wall_ms": round(statistics.median(walls), 3),
        "cpu_ms": round(statistics.median(cpus), 3),
        "nvml_ms": per_step,
        "repeat": repeat,
    }


def _driver_root(found: dict[Path, tuple[str, ...]]) -> Path:
    """Where the driver's files are: the first root in `found` (each root's driver
    files) that holds libnvidia-ml; `/` where none does."""
    for root, files in found.items():
        if any("libnvidia-ml.so" in f for f in files):
            return root
    return Path("/")


async def _check(
    args: argparse.Namespace, nvml: ReadOnlyNvml, scratch: Path, report: dict[str, Any]
) -> None:
    """Every step, in order; the CDI specs and the checkpoint go under `scratch`."""
    out: Path = args.outdir
    # A real node's PCIe roots come from sysfs; the emulator knows its own.
    topology = SysfsTopology() if args.nvml == "real" else getattr(nvml.inner, "pci_topology", None)
    document = _step(
        report,
        "recording",
        lambda: record(nvml, topology=topology, description="recorded node"),
    )
    if document is not None:
        write_recording(out / "recording.json", document)
    inventory: Inventory | None = _step(report, "discovery", lambda: discover(nvml))
    if inventory is None:
        return
    report["discovery"] = _step(report, "slices", lambda: _devices(inventory))
    report["raw_answers"] = _step(report, "raw_answers", lambda: nvml_answers(nvml))
    found = {root: find_driver_files(root) for root in _DRIVER_ROOTS}
    root = _driver_root(found)
    files = found.get(root, ())
    report["driver_files"] = {
        "driver_root": str(root),
        "files": list(files),
        "found_under": {str(r): len(f) for r, f in found.items()},
    }
    edits = driver_common_edits(driver_root=root, libraries=files)
    report["common_edits"] = {
        "device_nodes": [n.path for n in edits.device_nodes],
        "mounts": [m.host_path for m in edits.mounts],
        "env": dict(edits.env),
    }

    (scratch / "boot_id").write_text(f"{uuid.uuid4()}\n", encoding="ascii")
    cdi = CdiSpecStore(scratch / "cdi")
    preparer = ClaimPreparer(
        node_name=NODE,
        nvml=nvml,
        inventory=inventory,
        cdi=cdi,
        checkpoint_path=scratch / "checkpoint.json",
        sharing=NvidiaSharing(driver_root=root),
        driver_root=root,
        state_dir=scratch / "state",
        boot_id_path=scratch / "boot_id",
        driver_libraries=files,
    )
    report["recover"] = str(await preparer.recover())
    whole = [g.device.name for g in inventory.gpus if not g.mig_enabled]
    if not whole:
        report["prepare"] = {"skipped": "every GPU has MIG enabled; a whole GPU is needed"}
        return
    gpu = whole[0]
    uid = str(uuid.uuid4())
    ref = ClaimRef(namespace="check", uid=uid, name="whole-gpu")
    obj = {
        "metadata": {"uid": uid, "namespace": "check", "name": "whole-gpu"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": DEFAULT_DRIVER, "pool": NODE, "device": gpu}
                    ]
                }
            }
        },
    }
    claim = checked_claim(ref, obj, driver=DEFAULT_DRIVER, pool=NODE)
    started = time.perf_counter()
    result = (await preparer.prepare([claim]))[uid]
    prepare_ms = (time.perf_counter() - started) * 1e3
    spec_path = cdi.spec_path(uid)
    spec = json.loads(spec_path.read_text()) if spec_path.exists() else None
    if result.error:
        report["errors"]["prepare"] = result.error
    report["prepare"] = {
        "error": result.error,
        "ms": round(prepare_ms, 2),
        "devices": [str(d) for d in result.devices],
        "spec": spec,
        "spec_paths_present": _spec_paths(spec) if spec else {},
    }

    def prepared() -> list[Any]:
        cp = preparer.checkpoint_now()
        return cp.claims() if cp is not None else []

    health = HealthState(inventory)
    accounting = Accounting()
    sampler = Sampler(
        nvml,
        pool=NODE,
        inventory=lambda: inventory,
        prepared=prepared,
        health=lambda: health,
        interval_s=5.0,
        on_sample=(accounting.observe,),
    )
    registry = CollectorRegistry()
    registry.register(DeviceMetrics(sampler, accounting))
    samples: dict[str, Any] = {}

    def discovery() -> Awaitable[Inventory]:
        return anyio.to_thread.run_sync(discover, nvml)

    # With nothing else holding NVML each pass pays NVML's whole start and stop, which
    # the agent never does: its health watcher keeps NVML open, so there a pass's
    # nvmlInit only counts one more user (measured below, as "held"). The difference
    # is what that open NVML saves.
    report["costs"] = {
        "sampling_pass": await _cost(nvml, sampler.sample_once, args.repeat),
        "discovery": await _cost(nvml, discovery, args.repeat),
    }
    watcher = NvmlHealthWatcher(nvml, health)
    async with anyio.create_task_group() as group:
        await group.start(watcher.run)
        report["costs"]["sampling_pass_held"] = await _cost(nvml, sampler.sample_once, args.repeat)
        report["costs"]["discovery_held"] = await _cost(nvml, discovery, args.repeat)
        samples["idle_first"] = _sample_json(await sampler.sample_once())
        await anyio.sleep(args.sample_gap)
        samples["idle"] = _sample_json(await sampler.sample_once())
        load = (
            subprocess.Popen(shlex.split(args.load))  # noqa: ASYNC220 - runs beside us
            if args.load
            else None
        )
        await anyio.sleep(args.load_warmup)
        samples["loaded"] = _sample_json(await sampler.sample_once())
        samples["loaded_processes"] = _answer(lambda: _processes(nvml))
        await anyio.sleep(args.sample_gap)
        samples["loaded_again"] = _sample_json(await sampler.sample_once())
        # Now, while that sample is fresh: the device series are left out once the
        # latest sample is older than the sampler's stale limit.
        (out / "metrics.txt").write_bytes(generate_latest(registry))
        if load is not None:
            await anyio.to_thread.run_sync(load.wait)
            samples["load_exit"] = load.returncode
        remaining = args.health_seconds - (time.monotonic() - report["t0"])
        await anyio.sleep(max(remaining, 0))
        group.cancel_scope.cancel()
    report["samples"] = samples
    # Last: by now the GPU has been sampled for longer than any buffer seen holds.
    report["sample_buffer"] = _step(report, "sample_buffer", lambda: sample_buffer(nvml))
    report["health"] = {
        name: {"healthy": d.healthy, "message": d.message, "taints": [t.key for t in d.taints]}
        for name, d in health.report().devices.items()
    }
    report["xids"] = {f"{u}/{x}": n for (u, x), n in health.xid_counts().items()}

    unprepared = (await preparer.unprepare([ref]))[uid]
    if unprepared or spec_path.exists() or prepared():
        report["errors"]["unprepare"] = unprepared or "the claim's spec or record was left"
    report["unprepare"] = {
        "error": unprepared,
        "spec_left": spec_path.exists(),
        "claims_left": len(prepared()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; exit 1 when a step failed or a call was refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--nvml", default="real", help="'real', or 'emulated:<profile>'")
    parser.add_argument("--load", default="", help="a command that keeps the GPU busy")
    parser.add_argument("--load-warmup", type=float, default=12.0, help="seconds before sampling")
    parser.add_argument("--sample-gap", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs of each step")
    parser.add_argument("--health-seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "t0": time.monotonic(),
        "python": sys.version,
        "errors": {},
        "timings_s": {},
    }
    nvml = ReadOnlyNvml(load_nvml(args.nvml))
    try:
        with tempfile.TemporaryDirectory(prefix="gpudra-check-") as scratch:
            anyio.run(_check, args, nvml, Path(scratch), report)
    except Exception as err:
        report["fatal"] = f"{type(err).__name__}: {err}"
        report["trace"] = traceback.format_exc()
    report["nvml_calls"] = dict(sorted(nvml.calls.items()))
    report["nvml_call_ms"] = {
        name: round(nvml.seconds[name] * 1e3 / count, 4)
        for name, count in report["nvml_calls"].items()
    }
    report["refused"] = dict(nvml.refused)
    if args.nvml == "real":
        smi = ["nvidia-smi", "--query-gpu=name,driver_version,mig.mode.current", "--format=csv"]
        try:
            report["smi"] = subprocess.run(smi, capture_output=True, text=True, check=False).stdout
        except OSError as err:
            report["smi"] = str(err)
    report["env"] = {k: v for k, v in os.environ.items() if k.startswith(("NVIDIA", "CUDA"))}
    (args.outdir / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    failed = sorted(report["errors"])
    print(json.dumps({"failed_steps": failed, "refused": report.get("refused")}))
    return 1 if failed or report.get("refused") or "fatal" in report else 0


if __name__ == "__main__":
    sys.exit(main())
