"""Claim prepare/unprepare on a node, against the real API server and scheduler.

Claims are allocated by the real kube-scheduler from ResourceSlices each test
publishes for its own driver name on node worker-1; GPUs are the pynvml-level
emulator, and nvidia-smi / nvidia-cuda-mps-control are the stand-ins in
`fakebin/`, which record how they were called.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import platform
import secrets
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import pynvml
import pytest
from gpudra.api.names import POD_CLAIM_NAME_ANNOTATION
from gpudra.common.kube import Kube as AsyncKube
from gpudra.driver import publish
from gpudra.driver import sharing as sharing_module
from gpudra.driver.accounting import Accounting
from gpudra.driver.cdi import (
    DEFAULT_KIND,
    CdiSpecStore,
    DeviceNumbers,
    ToolkitSpec,
    find_toolkit_spec,
)
from gpudra.driver.checkpoint import ClaimRecord
from gpudra.driver.checkpoint import document as checkpoint_document
from gpudra.driver.checkpoint import load as load_checkpoint
from gpudra.driver.checkpoint_changes import ChangesFile
from gpudra.driver.claimreader import ApiClaims
from gpudra.driver.claims import Claim, ClaimRef, checked_claim
from gpudra.driver.claimstatus import ClaimStatusWriter
from gpudra.driver.devices import (
    Inventory,
    MigPlacement,
    MigStrategy,
    discover,
)
from gpudra.driver.driverroot import CUDA_LIBRARY, NVML_LIBRARY
from gpudra.driver.holders import ClaimInfos
from gpudra.driver.metrics import ClaimMetrics, DeviceMetrics
from gpudra.driver.mig import (
    create_compute_instance,
    create_gpu_instance,
    destroy_mig,
    mig_capability_minors,
)
from gpudra.driver.nvml import NvmlEmulator
from gpudra.driver.nvml.branches import EMULATED_BRANCHES
from gpudra.driver.nvml.emulator import gpu_instance_id_for_placement
from gpudra.driver.nvml.standin import (
    CAPS_MAJOR,
    FAKEBIN,
    NVIDIA_MAJOR,
    UVM_MAJOR,
    device_numbers,
    install_driver_root,
)
from gpudra.driver.plugin import ClaimDispatcher, PrepareResult
from gpudra.driver.prepare import CONFLICT_WAIT_S, MPS_THREADS, ClaimPreparer, RecoveryReport
from gpudra.driver.processes import ProcessIdentity
from gpudra.driver.records import CreatedMig
from gpudra.driver.sampling import Sampler
from gpudra.driver.sharing import (
    DaemonPod,
    MpsDaemon,
    NvidiaSharing,
    SharingError,
    may_mount,
    may_remove_anything,
)
from prometheus_client import CollectorRegistry, generate_latest

from e2e.claims import pod_with_claim, wait_allocated
from e2e.cluster.kube import Kube, wait_for
from e2e.node_process import create_driver_namespace
from e2e.shared_libraries import shared_library

NODE = "worker-1"
BOOT_A = "5f1c7a52-0c1d-4c57-9a5e-00000000000a"
BOOT_B = "5f1c7a52-0c1d-4c57-9a5e-00000000000b"
EXCLUSIVE_PROCESS = 3
DEFAULT_MODE = 0

# --- the API side: driver, class, slices, claims and pods ---------------------------------


@dataclass
class Env:
    """One test's driver name, DeviceClass, namespace and the objects it created."""

    kube: Kube
    driver: str
    namespace: str
    slices: list[str] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)

    def publish(
        self,
        inventory: Inventory,
        strategy: MigStrategy = MigStrategy.STATIC,
        *,
        shared: bool = False,
        shares: int = 0,
        only: tuple[str, ...] = (),
        on: str = NODE,
        counters: bool = True,
    ) -> None:
        """The inventory as ResourceSlices of node `on`'s pool (counters in their own slice)."""
        # The agent's own serializer; `shared` publishes for memory slices with its policy
        # (a request without an amount takes the whole GPU).
        devices = [
            publish.device(d, shared_by=self.driver if shared else None, shares=shares)
            for d in inventory.devices(strategy)
            if not only or d.name in only
        ]
        sets = (
            [publish.counter_set(c) for c in inventory.counter_sets(strategy)] if counters else []
        )
        if not sets:
            for device in devices:
                device.pop("consumesCounters", None)
        parts: list[dict[str, Any]] = [{"devices": devices}]
        if sets:
            parts.append({"sharedCounters": sets})
        for i, part in enumerate(parts):
            name = f"{on}-{self.driver}-{i}"
            self.kube.create(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceSlice",
                    "metadata": {"name": name},
                    "spec": {
                        "driver": self.driver,
                        "nodeName": on,
                        "pool": {"name": on, "generation": 1, "resourceSliceCount": len(parts)},
                        **part,
                    },
                }
            )
            self.slices.append(name)

    def device_class(self, suffix: str, config: list[dict[str, Any]]) -> str:
        """Another DeviceClass for this driver's devices, carrying `config`."""
        name = f"{self.driver}-{suffix}"
        self.kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": name},
                "spec": {
                    "selectors": [{"cel": {"expression": f'device.driver == "{self.driver}"'}}],
                    "config": config,
                },
            }
        )
        self.classes.append(name)
        return name

    def request(
        self, name: str = "gpu", *, cel: str = "", device_class: str = "", **extra: Any
    ) -> dict[str, Any]:
        exactly: dict[str, Any] = {"deviceClassName": device_class or self.driver, **extra}
        if cel:
            exactly["selectors"] = [{"cel": {"expression": cel}}]
        return {"name": name, "exactly": exactly}

    def config(self, parameters: dict[str, Any], *requests: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"opaque": {"driver": self.driver, "parameters": parameters}}
        if requests:
            entry["requests"] = list(requests)
        return entry

    def claim(
        self,
        name: str,
        requests: list[dict[str, Any]] | None = None,
        config: list[dict[str, Any]] | None = None,
        annotations: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        devices: dict[str, Any] = {"requests": requests or [self.request()]}
        if config:
            devices["config"] = config
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace}
        if annotations:
            meta["annotations"] = annotations
        created: dict[str, Any] = self.kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": meta,
                "spec": {"devices": devices},
            }
        )
        return created

    def pod_for(self, claim: str, pod: str | None = None, on: str = NODE) -> str:
        name = pod or f"pod-{claim}"
        self.kube.create(pod_with_claim(name, self.namespace, on, claim=claim))
        return name

    def allocated(
        self,
        name: str,
        *,
        requests: list[dict[str, Any]] | None = None,
        config: list[dict[str, Any]] | None = None,
        on: str = NODE,
        annotations: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """A claim the real scheduler allocated for a pod on node `on`."""
        self.claim(name, requests, config, annotations)
        self.pod_for(name, on=on)
        return wait_allocated(self.kube, name, self.namespace)

    def delete_claim(self, name: str) -> None:
        """Delete the claim's pod and the claim, and wait until the claim is gone."""
        self.kube.delete("Pod", f"pod-{name}", self.namespace, grace=0)
        self.kube.delete("ResourceClaim", name, self.namespace)
        wait_for(
            f"claim {name} to be deleted",
            lambda: self.kube.get_or_none("ResourceClaim", name, self.namespace) is None,
            timeout=60,
        )

    def wait_pod_gone(self, name: str) -> None:
        wait_for(
            f"pod {name} to be gone",
            lambda: self.kube.get_or_none("Pod", name, self.namespace) is None,
            timeout=60,
        )

    def cleanup(self) -> None:
        for pod in self.kube.list("Pod", self.namespace):
            self.kube.delete("Pod", pod["metadata"]["name"], self.namespace, grace=0)
        for name in self.slices:
            self.kube.delete("ResourceSlice", name)
        for name in (self.driver, *self.classes):
            self.kube.delete("DeviceClass", name)
        self.kube.delete("Namespace", self.namespace)


def time_sliced(interval: str) -> dict[str, Any]:
    """A GpuConfig that time-slices a whole GPU with `interval`."""
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}},
    }


def _ref(claim: dict[str, Any]) -> ClaimRef:
    meta = claim["metadata"]
    return ClaimRef(namespace=meta["namespace"], uid=meta["uid"], name=meta["name"])


def _device(claim: dict[str, Any], index: int = 0) -> str:
    name: str = claim["status"]["allocation"]["devices"]["results"][index]["device"]
    return name


@pytest.fixture
def env(kube: Kube) -> Iterator[Env]:
    driver = f"t{secrets.token_hex(4)}.gpudra.dev"
    namespace = f"prep-{secrets.token_hex(3)}"
    # Admin access is allowed only in namespaces labelled for it.
    create_driver_namespace(
        kube, driver, namespace, labels={"resource.kubernetes.io/admin-access": "true"}
    )
    e = Env(kube=kube, driver=driver, namespace=namespace)
    yield e
    e.cleanup()


# --- the node side: emulated GPUs, folders, tools --------------------------------------------


@dataclass
class Node:
    """Folders standing in for the node's /dev, /proc, CDI dir and plugin state."""

    root: Path
    tools_log: Path

    @property
    def dev_root(self) -> Path:
        return self.root / "host"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def checkpoint(self) -> Path:
        return self.root / "plugin" / "checkpoint.json"

    @property
    def boot_id(self) -> Path:
        return self.root / "boot_id"

    @property
    def proc(self) -> Path:
        return self.root / "proc"

    def tool_calls(self) -> list[str]:
        if not self.tools_log.exists():
            return []
        return self.tools_log.read_text().splitlines()

    def spec(self, uid: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(CdiSpecStore(self.cdi_dir).spec_path(uid).read_text())
        return data

    def has_spec(self, uid: str) -> bool:
        return CdiSpecStore(self.cdi_dir).spec_path(uid).exists()


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    n = Node(root=tmp_path, tools_log=tmp_path / "tools.log")
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        path = n.dev_root / "dev" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    n.boot_id.write_text(BOOT_A + "\n")
    n.proc.mkdir()
    monkeypatch.setenv("GPUDRA_FAKEBIN_LOG", str(n.tools_log))
    monkeypatch.delenv("GPUDRA_FAKE_MPS_FAIL", raising=False)
    monkeypatch.delenv("GPUDRA_FAKE_SMI_FAIL", raising=False)
    yield n
    # Daemons of claims a test left prepared run on, as real ones would: stop them
    # (and unmount their shm) the way recovery stops orphans.
    mps = n.checkpoint.parent / "mps"
    for base in sorted(mps.iterdir()) if mps.is_dir() else []:
        fake_sharing().stop_mps(_daemon_in(base))


def _daemon_in(base: Path, identity: ProcessIdentity | None = None) -> MpsDaemon:
    """The daemon whose folders are under `base`, as the preparer lays them out."""
    return MpsDaemon(
        base.name, base / "pipe", base / "log", (), shm_dir=base / "shm", identity=identity
    )


def _mps_control_tool(folder: Path, script: str) -> Path:
    """`script` as the `nvidia-cuda-mps-control` under `folder`/bin: NVIDIA's client
    (and daemon) acting as a test needs them to."""
    tool = folder / "bin" / "nvidia-cuda-mps-control"
    tool.parent.mkdir()
    tool.write_text(script)
    tool.chmod(0o755)
    return tool


def _ended(identity: ProcessIdentity) -> None:
    """Kill a daemon a test's stop left running, so that no failure leaks a process."""
    if identity.alive():
        identity.signal(signal.SIGKILL)
        identity.wait_gone(5.0)


@contextlib.contextmanager
def _running_daemon(
    backend: NvidiaSharing, daemon: MpsDaemon
) -> Iterator[tuple[MpsDaemon, ProcessIdentity]]:
    """`daemon` started by `backend`, as its record names it (with its identity),
    and that identity; killed on the way out if still running."""
    identity = backend.start_mps(daemon)
    assert isinstance(identity, ProcessIdentity)
    try:
        yield dataclasses.replace(daemon, identity=identity), identity
    finally:
        _ended(identity)


class StandInTools(NvidiaSharing):
    """The sharing backend running the stand-in nvidia-smi and MPS control tools."""

    def __init__(self) -> None:
        super().__init__(
            nvidia_smi=FAKEBIN / "nvidia-smi",
            mps_control=FAKEBIN / "nvidia-cuda-mps-control",
            ready_timeout_s=5.0,
        )


def fake_sharing() -> NvidiaSharing:
    return StandInTools()


@dataclass
class Plugin:
    """The preparer behind the plugin's claim handling, wired as `gpudra node` wires
    them but for the sockets: a prepare reads and checks each claim from the API
    server, then hands it to the preparer."""

    preparer: ClaimPreparer
    claims: ApiClaims
    calls: ClaimDispatcher

    async def prepare(self, refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        return await self.calls.prepare(refs)

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, str | None]:
        return await self.calls.unprepare(refs)

    async def recover(self) -> RecoveryReport:
        return await self.preparer.recover()

    async def cleanup_deleted_claims(self) -> list[str]:
        return await self.preparer.cleanup_deleted_claims(self.claims)


def make_preparer(
    env: Env,
    node: Node,
    akube: AsyncKube,
    nvml: Any,
    *,
    registry: CollectorRegistry | None = None,
    **options: Any,
) -> Plugin:
    """`node_preparer` (same options) behind the plugin's claim reads and metrics."""
    registry = registry if registry is not None else CollectorRegistry()
    preparer = node_preparer(node, nvml, registry=registry, **options)
    claims = ApiClaims(akube, driver=env.driver, pool=NODE)
    return Plugin(preparer, claims, ClaimDispatcher(preparer, claims, ClaimMetrics(registry)))


def node_preparer(
    node: Node,
    nvml: Any,
    *,
    strategy: MigStrategy = MigStrategy.STATIC,
    registry: CollectorRegistry | None = None,
    toolkit: ToolkitSpec | None = None,
    fault: Callable[[str], None] | None = None,
    device_numbers: DeviceNumbers | None = None,
    inventory: Callable[[], Inventory | None] | None = None,
    sharing: NvidiaSharing | None = None,
    shares: Mapping[str, int] | None = None,
    checkpoint: Path | None = None,
    conflict_wait: float = CONFLICT_WAIT_S,
    cdi_kind: str = DEFAULT_KIND,
    device_metadata: str | None = None,
    **attribute_options: bool,
) -> ClaimPreparer:
    """The device layer on this test's node: its folders, the emulated GPUs, fake tools;
    `shares`: the integer shares each GPU is published with; `checkpoint`: elsewhere
    than the node's (a small file system to fill), with the MPS folders beside it;
    `cdi_kind`: its claim specs' kind (its driver name's); `attribute_options`: the
    agent's `legacy_attributes` and `numa_node_list`."""
    return ClaimPreparer(
        node_name=NODE,
        nvml=nvml,
        inventory=inventory or (lambda: discover(nvml)),
        cdi=CdiSpecStore(node.cdi_dir, kind=cdi_kind),
        checkpoint_path=checkpoint or node.checkpoint,
        sharing=sharing or fake_sharing(),
        dev_root=node.dev_root,
        proc_root=node.proc,
        boot_id_path=node.boot_id,
        mig_strategy=strategy,
        registry=registry,
        toolkit=toolkit,
        fault=fault,
        device_numbers=device_numbers,
        shares=(lambda: shares) if shares is not None else None,
        conflict_wait=conflict_wait,
        device_metadata=device_metadata,
        **attribute_options,
    )


def h100() -> NvmlEmulator:
    return NvmlEmulator.from_builtin("h100-80gb-hbm3-x8")


def h100_mig() -> NvmlEmulator:
    """An H100 node whose first GPU has MIG mode on and no MIG devices yet."""
    emu = h100()
    emu.nvmlInit()
    emu.nvmlDeviceSetMigMode(emu.nvmlDeviceGetHandleByIndex(0), 1)
    emu.reset_gpu(0)
    emu.nvmlShutdown()
    return emu


def mig_devices(emu: NvmlEmulator) -> dict[str, str]:
    """Existing MIG devices of GPU 0 by name -> UUID, as discovery reads them from NVML."""
    return {d.name: str(d.uuid) for d in discover(emu).gpus[0].mig_devices}


def cdi_env(spec: dict[str, Any], index: int = 0) -> dict[str, str]:
    pairs = spec["devices"][index]["containerEdits"].get("env", [])
    return dict(p.split("=", 1) for p in pairs)


def node_paths(edits: dict[str, Any]) -> list[str]:
    return [n["path"] for n in edits.get("deviceNodes", [])]


# --- whole GPUs --------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.anyio
async def test_whole_gpu_prepare_writes_one_spec_and_unprepare_removes_it(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100()
    registry = CollectorRegistry()
    env.publish(discover(emu))
    claim = env.allocated("one-gpu")
    ref = _ref(claim)
    device = _device(claim)
    minor = int(device.removeprefix("gpu-"))
    preparer = make_preparer(env, node, akube, emu, registry=registry)

    result = (await preparer.prepare([ref]))[ref.uid]

    assert result.error is None
    [prepared] = result.devices
    assert prepared.device_name == device
    assert prepared.pool_name == NODE
    assert prepared.request_names == ["gpu"]
    assert prepared.cdi_device_ids == [f"k8s.gpu.nvidia.com/claim={ref.uid}-{device}"]
    assert prepared.share_id is None
    spec = node.spec(ref.uid)
    assert [d["name"] for d in spec["devices"]] == [f"{ref.uid}-{device}"]
    edits = spec["devices"][0]["containerEdits"]
    assert edits["deviceNodes"] == [
        {"path": f"/dev/nvidia{minor}", "hostPath": f"{node.dev_root}/dev/nvidia{minor}"}
    ]
    assert node_paths(spec["containerEdits"]) == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"]
    gpu_uuid = discover(emu).gpus[minor].uuid
    assert cdi_env(spec)[f"GPUDRA_DEVICE_GPU_{minor}_UUID"] == gpu_uuid
    labels = {
        "namespace": env.namespace,
        "pod": "pod-one-gpu",
        "claim": "one-gpu",
        "request": "gpu",
        "device": device,
        "uuid": gpu_uuid,
    }
    assert registry.get_sample_value("gpudra_prepared_device_info", labels) == 1.0
    assert registry.get_sample_value("gpudra_device_prepared_claims", {"device": device}) == 1.0
    assert node.tool_calls() == []  # nothing to share, no tool runs

    # Repeated prepare: the recorded answer, nothing written again.
    changes = ChangesFile(node.checkpoint)
    before = (node.checkpoint.stat().st_mtime_ns, node.checkpoint.read_bytes(), changes.read())
    again = (await preparer.prepare([ref]))[ref.uid]
    assert again == result
    assert (
        node.checkpoint.stat().st_mtime_ns,
        node.checkpoint.read_bytes(),
        changes.read(),
    ) == before

    assert (await preparer.unprepare([ref])) == {ref.uid: None}
    assert not node.has_spec(ref.uid)
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).claims() == []
    assert registry.get_sample_value("gpudra_prepared_device_info", labels) is None
    assert registry.get_sample_value("gpudra_device_prepared_claims", {"device": device}) is None
    # Unprepare again, and of a claim never seen: both succeed.
    unknown = ClaimRef(namespace=env.namespace, uid=str(uuidlib.uuid4()), name="never")
    assert (await preparer.unprepare([ref, unknown])) == {ref.uid: None, unknown.uid: None}
    assert (
        registry.get_sample_value("gpudra_claim_operations_total", {"operation": "prepare"}) == 2.0
    )
    assert (
        registry.get_sample_value("gpudra_claim_operation_errors_total", {"operation": "prepare"})
        == 0.0
    )


@pytest.mark.cluster
@pytest.mark.anyio
async def test_claim_uid_mismatch_names_both_uids(env: Env, node: Node, akube: AsyncKube) -> None:
    emu = h100()
    env.publish(discover(emu))
    claim = env.allocated("recreated")
    wrong = ClaimRef(namespace=env.namespace, uid=str(uuidlib.uuid4()), name="recreated")
    preparer = make_preparer(env, node, akube, emu)

    result = (await preparer.prepare([wrong]))[wrong.uid]

    assert result.error is not None
    assert claim["metadata"]["uid"] in result.error
    assert wrong.uid in result.error
    assert not node.has_spec(wrong.uid)


@pytest.mark.cluster
@pytest.mark.anyio
async def test_prepare_before_the_first_discovery_asks_for_a_retry(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100()
    env.publish(discover(emu))
    ref = _ref(env.allocated("early"))
    preparer = make_preparer(env, node, akube, emu, inventory=lambda: None)

    result = (await preparer.prepare([ref]))[ref.uid]

    assert result.error is not None
    assert "not been discovered yet" in result.error


@pytest.mark.cluster
@pytest.mark.anyio
async def test_unallocated_claim_is_refused(env: Env, node: Node, akube: AsyncKube) -> None:
    emu = h100()
    env.publish(discover(emu))
    claim = env.claim("no-pod")  # nothing uses it, so the scheduler never allocates it
    ref = _ref(claim)

    result = (await make_preparer(env, node, akube, emu).prepare([ref]))[ref.uid]

    assert result.error is not None
    assert "status.allocation" in result.error
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).claims() == []


@pytest.mark.cluster
@pytest.mark.anyio
async def test_invalid_opaque_config_names_the_field(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100()
    env.publish(discover(emu))
    bad = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "Sometimes"},
    }
    claim = env.allocated("bad-config", config=[env.config(bad)])
    ref = _ref(claim)

    result = (await make_preparer(env, node, akube, emu).prepare([ref]))[ref.uid]

    assert result.error is not None
    assert "status.allocation.devices.config[0].opaque.parameters.sharing.strategy" in result.error
    assert "TimeSlicing, MPS" in result.error
    assert not node.has_spec(ref.uid)
    assert node.tool_calls() == []


@pytest.mark.cluster
@pytest.mark.anyio
async def test_device_held_by_another_claim_fails_only_that_claim(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100()
    env.publish(discover(emu), only=("gpu-0", "gpu-1"))
    first = env.allocated("first")
    held = _device(first)
    preparer = make_preparer(env, node, akube, emu)
    assert (await preparer.prepare([_ref(first)]))[_ref(first).uid].error is None
    # The claim goes away without an unprepare (a missed kubelet call), so the
    # scheduler hands its device out again while our record still holds it.
    env.delete_claim("first")
    second = env.allocated("second")
    third = env.allocated("third")
    refs = [_ref(second), _ref(third)]

    results = await preparer.prepare(refs)

    by_device = {_device(c): _ref(c).uid for c in (second, third)}
    loser, winner = by_device[held], next(u for d, u in by_device.items() if d != held)
    error = results[loser].error
    assert error is not None
    assert f"{NODE}/{held}" in error
    assert f"{env.namespace}/first" in error
    assert first["metadata"]["uid"] in error
    assert results[winner].error is None
    assert node.has_spec(winner)
    assert not node.has_spec(loser)


@pytest.mark.cluster
@pytest.mark.anyio
async def test_admin_access_is_prepared_beside_the_owner(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100()
    env.publish(discover(emu), only=("gpu-3",))
    owner = env.allocated("owner")
    monitor = env.allocated("monitor", requests=[env.request("watch", adminAccess=True)])
    assert _device(monitor) == _device(owner) == "gpu-3"
    assert monitor["status"]["allocation"]["devices"]["results"][0]["adminAccess"] is True
    preparer = make_preparer(env, node, akube, emu)

    results = await preparer.prepare([_ref(owner), _ref(monitor)])

    assert results[_ref(owner).uid].error is None
    assert results[_ref(monitor).uid].error is None
    assert results[_ref(monitor).uid].devices[0].request_names == ["watch"]
    # The owner keeps its device when the monitor goes, and the monitor never blocks it.
    assert await preparer.unprepare([_ref(monitor)]) == {_ref(monitor).uid: None}
    assert node.has_spec(_ref(owner).uid)
    cp = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id)
    assert [c.uid for c in cp.claims()] == [_ref(owner).uid]


@pytest.mark.cluster
@pytest.mark.anyio
@pytest.mark.parametrize("bound_to", ["gpu/any", "gpu"], ids=["subrequest", "parent"])
async def test_subrequest_result_reports_the_base_request_and_gets_its_config(
    env: Env, node: Node, akube: AsyncKube, bound_to: str
) -> None:
    """A config bound to the subrequest applies to its result, and so does one bound to
    the parent request (it covers every subrequest), as the API defines `requests`."""
    emu = h100()
    env.publish(discover(emu))
    long_slices = time_sliced("Long")
    claim = env.allocated(
        "first-available",
        requests=[
            {
                "name": "gpu",
                "firstAvailable": [{"name": "any", "deviceClassName": env.driver}],
            }
        ],
        config=[env.config(long_slices, bound_to)],
    )
    assert claim["status"]["allocation"]["devices"]["results"][0]["request"] == "gpu/any"
    ref = _ref(claim)

    result = (await make_preparer(env, node, akube, emu).prepare([ref]))[ref.uid]

    assert result.error is None
    assert result.devices[0].request_names == ["gpu"]
    gpu_uuid = discover(emu).gpus[int(_device(claim).removeprefix("gpu-"))].uuid
    assert f"nvidia-smi compute-policy -i {gpu_uuid} --set-timeslice 3" in node.tool_calls()


@pytest.mark.cluster
@pytest.mark.anyio
async def test_plain_claim_on_an_idle_shared_gpu_holds_it_alone(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """A claim without a capacity request consumes a shared GPU's whole memory (the
    request policy's default), so nothing else fits beside it: it is prepared like an
    exclusive GPU (its time-slicing config applies, no MPS daemon). A 10Gi slice of
    the same GPU cannot be time-sliced: other claims share the GPU."""
    emu = h100()
    env.publish(discover(emu), only=("gpu-5",), shared=True)
    sliced = time_sliced("Short")
    whole = env.allocated("whole", config=[env.config(sliced)])
    result = whole["status"]["allocation"]["devices"]["results"][0]
    assert result["device"] == "gpu-5" and result.get("shareID")
    preparer = make_preparer(env, node, akube, emu)
    gpu_uuid = discover(emu).gpus[5].uuid

    prepared = (await preparer.prepare([_ref(whole)]))[_ref(whole).uid]

    assert prepared.error is None
    assert f"nvidia-smi compute-policy -i {gpu_uuid} --set-timeslice 1" in node.tool_calls()
    assert not [c for c in node.tool_calls() if c.startswith("mps-control")]
    assert await preparer.unprepare([_ref(whole)]) == {_ref(whole).uid: None}
    env.delete_claim("whole")

    memory = f"{env.driver}/memory"
    part = env.allocated(
        "part",
        requests=[env.request("mem", capacity={"requests": {memory: "10Gi"}})],
        config=[env.config(sliced)],
    )
    refused = (await preparer.prepare([_ref(part)]))[_ref(part).uid]
    assert refused.error is not None
    assert "sharing.strategy: TimeSlicing cannot apply" in refused.error
    assert not node.has_spec(_ref(part).uid)


@pytest.mark.cluster
@pytest.mark.anyio
async def test_claim_allocated_on_another_node_is_refused(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100()
    env.publish(discover(emu), on="worker-2")
    claim = env.allocated("elsewhere", on="worker-2")
    ref = _ref(claim)

    result = (await make_preparer(env, node, akube, emu).prepare([ref]))[ref.uid]

    assert result.error is not None
    assert f"pool {NODE}" in result.error
    assert not node.has_spec(ref.uid)


@pytest.mark.cluster
@pytest.mark.anyio
async def test_claim_config_wins_over_class_config(env: Env, node: Node, akube: AsyncKube) -> None:
    emu = h100()
    env.publish(discover(emu), only=("gpu-1", "gpu-2"))

    sliced = env.device_class("short", [env.config(time_sliced("Short"))])
    overridden = env.allocated(
        "overridden",
        requests=[env.request(device_class=sliced)],
        config=[env.config(time_sliced("Long"))],
    )
    plain = env.allocated("from-class", requests=[env.request(device_class=sliced)])
    uuids = {g.device.name: g.uuid for g in discover(emu).gpus}
    preparer = make_preparer(env, node, akube, emu)

    results = await preparer.prepare([_ref(overridden), _ref(plain)])

    assert all(r.error is None for r in results.values())
    calls = node.tool_calls()
    long_gpu, short_gpu = uuids[_device(overridden)], uuids[_device(plain)]
    assert f"nvidia-smi compute-policy -i {long_gpu} --set-timeslice 3" in calls
    assert f"nvidia-smi compute-policy -i {short_gpu} --set-timeslice 1" in calls
    assert len([c for c in calls if "--set-timeslice" in c]) == 2


# --- device metadata ---------------------------------------------------------------------------


def metadata_files(node: Node, uid: str) -> list[str]:
    """The names of the claim's device metadata files, temp files included."""
    root = node.checkpoint.parent / "device-metadata"
    return sorted(p.name for p in root.glob(f"*{uid}.*")) if root.is_dir() else []


def metadata_file(node: Node, uid: str, request: str) -> Path:
    return node.checkpoint.parent / "device-metadata" / f"{uid}.{request}.json"


def metadata_objects(path: Path) -> list[dict[str, Any]]:
    """The objects of a metadata file's stream, one per line."""
    return [json.loads(line) for line in path.read_bytes().splitlines()]


@pytest.mark.cluster
@pytest.mark.anyio
@pytest.mark.parametrize("options", [False, True], ids=["scalar", "legacy-and-lists"])
async def test_device_metadata_is_mounted_once_per_request_and_goes_at_unprepare(
    env: Env, node: Node, akube: AsyncKube, options: bool
) -> None:
    """Each request's file lists its devices with the attributes their slice publishes
    (upstream's old ones and the NUMA node list too where the agent publishes them);
    the claim's own spec mounts it, read-only, through a CDI ID the request's first
    device carries (as upstream's helper hands it to the kubelet)."""
    emu = h100()
    inventory = discover(emu)
    env.publish(inventory)
    claim = env.allocated("metadata", requests=[env.request("gpu"), env.request("pair", count=2)])
    ref = _ref(claim)
    preparer = make_preparer(
        env,
        node,
        akube,
        emu,
        device_metadata=env.driver,
        legacy_attributes=options,
        numa_node_list=options,
    )

    result = (await preparer.prepare([ref]))[ref.uid]

    assert result.error is None
    kind = "k8s.gpu.nvidia.com/claim"
    by_request: dict[str, list[list[str]]] = {}
    for device in result.devices:
        by_request.setdefault(device.request_names[0], []).append(device.cdi_device_ids)
    for request, ids in by_request.items():
        mount_id = f"{kind}={ref.uid}-metadata_{request}"
        assert [mount_id in i for i in ids] == [True] + [False] * (len(ids) - 1)
    spec = node.spec(ref.uid)
    mounts = {
        d["name"]: d["containerEdits"]["mounts"]
        for d in spec["devices"]
        if "-metadata_" in d["name"]
    }
    assert metadata_files(node, ref.uid) == [f"{ref.uid}.gpu.json", f"{ref.uid}.pair.json"]
    published = {
        d.name: publish.device(d, legacy=options, lists=options)["attributes"]
        for d in inventory.devices()
    }
    assert all(("index" in a) is options for a in published.values())
    numa = [a["resource.kubernetes.io/numaNode"] for a in published.values()]
    assert all(("ints" in n) is options for n in numa)
    for request in ("gpu", "pair"):
        host = metadata_file(node, ref.uid, request)
        assert mounts[f"{ref.uid}-metadata_{request}"] == [
            {
                "hostPath": str(host),
                "containerPath": "/var/run/kubernetes.io/dra-device-attributes/"
                f"resourceclaims/metadata/{request}/{env.driver}-metadata.json",
                "options": ["ro", "bind"],
            }
        ]
        newest, oldest = metadata_objects(host)
        assert oldest["apiVersion"] == "metadata.resource.k8s.io/v1alpha1"
        assert newest["metadata"]["uid"] == ref.uid and "podClaimName" not in newest
        [listed] = newest["requests"]
        assert listed["name"] == request
        names = [
            r["device"]
            for r in claim["status"]["allocation"]["devices"]["results"]
            if r["request"] == request
        ]
        assert [d["name"] for d in listed["devices"]] == names
        for device in listed["devices"]:
            assert (device["driver"], device["pool"]) == (env.driver, NODE)
            assert device["attributes"] == published[device["name"]]
    # Asked again: the recorded answer, the same mounts.
    assert (await preparer.prepare([ref]))[ref.uid] == result

    assert await preparer.unprepare([ref]) == {ref.uid: None}
    assert not node.has_spec(ref.uid)
    assert metadata_files(node, ref.uid) == []


@pytest.mark.cluster
@pytest.mark.anyio
async def test_device_metadata_of_a_template_claim_goes_under_the_pods_name_for_it(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """A claim made from a pod's template is found under the pod's entry name (its
    `pod-claim-name` annotation); an annotation that is no DNS label, which a claim's
    writer may set where no admission policy stops it, fails the prepare naming it and
    leaves nothing: no file, no spec, no record."""
    emu = h100()
    env.publish(discover(emu))
    made = env.allocated("trainer-0-gpu-x7k2p", annotations={POD_CLAIM_NAME_ANNOTATION: "gpu"})
    hostile = env.allocated("hostile", annotations={POD_CLAIM_NAME_ANNOTATION: "../../../../etc"})
    preparer = make_preparer(env, node, akube, emu, device_metadata=env.driver)

    results = await preparer.prepare([_ref(made), _ref(hostile)])

    assert results[made["metadata"]["uid"]].error is None
    [mount] = [
        d["containerEdits"]["mounts"][0]
        for d in node.spec(made["metadata"]["uid"])["devices"]
        if "-metadata_" in d["name"]
    ]
    assert mount["containerPath"] == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/"
        f"{env.driver}-metadata.json"
    )
    newest, _ = metadata_objects(Path(mount["hostPath"]))
    assert newest["podClaimName"] == "gpu"
    assert newest["metadata"]["name"] == "trainer-0-gpu-x7k2p"
    error = results[hostile["metadata"]["uid"]].error
    assert error is not None
    assert f"annotation {POD_CLAIM_NAME_ANNOTATION} '../../../../etc'" in error
    assert "remove or fix the annotation on the claim" in error
    assert not node.has_spec(hostile["metadata"]["uid"])
    assert metadata_files(node, hostile["metadata"]["uid"]) == []
    left = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id)
    assert [c.uid for c in left.claims()] == [made["metadata"]["uid"]]


@pytest.mark.cluster
@pytest.mark.anyio
async def test_device_metadata_goes_with_its_claim_whatever_the_next_agent_writes(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """An agent restarted without device metadata still removes the files at unprepare
    (its record's CDI IDs name the mount), and a start sweeps the folders of claims
    the checkpoint does not name: here a prepare that died after its files and spec,
    before its record was written."""
    emu = h100()
    env.publish(discover(emu))
    kept = _ref(env.allocated("kept"))
    died = _ref(env.allocated("died"))
    writing = make_preparer(env, node, akube, emu, device_metadata=env.driver)
    assert (await writing.prepare([kept]))[kept.uid].error is None

    def crash(step: str) -> None:
        if step == "cdi-written":
            raise SimulatedCrash(step)

    with pytest.raises(SimulatedCrash):
        await make_preparer(env, node, akube, emu, device_metadata=env.driver, fault=crash).prepare(
            [died]
        )
    assert metadata_files(node, died.uid) == [f"{died.uid}.gpu.json"] and node.has_spec(died.uid)

    restarted = make_preparer(env, node, akube, emu)  # writes no metadata
    report = await restarted.recover()

    assert report.orphaned_metadata == (died.uid,) and report.orphaned_specs == (died.uid,)
    assert report.errors == ()
    assert metadata_files(node, died.uid) == []
    assert metadata_files(node, kept.uid) == [f"{kept.uid}.gpu.json"]  # still prepared
    assert await restarted.unprepare([kept]) == {kept.uid: None}
    assert metadata_files(node, kept.uid) == []
    # Without the option, a prepare writes and mounts nothing.
    result = (await restarted.prepare([died]))[died.uid]
    assert result.error is None
    assert not any("-metadata_" in i for d in result.devices for i in d.cdi_device_ids)
    assert metadata_files(node, died.uid) == []


@pytest.mark.cluster
@pytest.mark.anyio
async def test_devices_in_the_toolkit_spec_reference_it_instead_of_device_nodes(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100()
    inventory = discover(emu)
    env.publish(inventory, only=("gpu-6",))
    gpu_uuid = inventory.gpus[6].uuid
    toolkit_file = node.root / "etc-cdi" / "nvidia.json"
    toolkit_file.parent.mkdir()
    toolkit_file.write_text(
        json.dumps(
            {
                "cdiVersion": "0.5.0",
                "kind": "nvidia.com/gpu",
                "devices": [{"name": gpu_uuid, "containerEdits": {"deviceNodes": []}}],
            }
        )
    )
    toolkit = find_toolkit_spec([toolkit_file])
    claim = env.allocated("toolkit")
    ref = _ref(claim)

    result = (await make_preparer(env, node, akube, emu, toolkit=toolkit).prepare([ref]))[ref.uid]

    assert result.error is None
    assert result.devices[0].cdi_device_ids == [
        f"k8s.gpu.nvidia.com/claim={ref.uid}-gpu-6",
        f"nvidia.com/gpu={gpu_uuid}",
    ]
    spec = node.spec(ref.uid)
    assert "deviceNodes" not in spec["devices"][0]["containerEdits"]
    assert "deviceNodes" not in spec["containerEdits"]


# --- sharing ---------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.anyio
async def test_time_slicing_is_applied_and_reset(env: Env, node: Node, akube: AsyncKube) -> None:
    emu = h100()
    env.publish(discover(emu))
    medium = time_sliced("Medium")
    claim = env.allocated("sliced", config=[env.config(medium)])
    ref = _ref(claim)
    gpu_uuid = discover(emu).gpus[int(_device(claim).removeprefix("gpu-"))].uuid
    preparer = make_preparer(env, node, akube, emu)

    assert (await preparer.prepare([ref]))[ref.uid].error is None
    assert node.tool_calls() == [f"nvidia-smi compute-policy -i {gpu_uuid} --set-timeslice 2"]
    assert (await preparer.prepare([ref]))[ref.uid].error is None
    assert len(node.tool_calls()) == 1  # a repeated prepare runs nothing

    assert await preparer.unprepare([ref]) == {ref.uid: None}
    assert node.tool_calls()[1:] == [f"nvidia-smi compute-policy -i {gpu_uuid} --set-timeslice 0"]
    assert _compute_mode(emu, gpu_uuid) == DEFAULT_MODE  # as it was: nothing to restore


def _compute_mode(emu: Any, gpu_uuid: str) -> int:
    emu.nvmlInit()
    try:
        return int(emu.nvmlDeviceGetComputeMode(emu.nvmlDeviceGetHandleByUUID(gpu_uuid)))
    finally:
        emu.nvmlShutdown()


def _set_compute_mode(emu: Any, gpu_uuid: str, mode: int) -> None:
    emu.nvmlInit()
    try:
        emu.nvmlDeviceSetComputeMode(emu.nvmlDeviceGetHandleByUUID(gpu_uuid), mode)
    finally:
        emu.nvmlShutdown()


@pytest.mark.cluster
@pytest.mark.anyio
async def test_time_slicing_restores_the_compute_mode_it_replaced(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """A GPU the admin keeps in EXCLUSIVE_PROCESS is DEFAULT while a claim time-slices
    it (several processes), and EXCLUSIVE_PROCESS again after, also when the claim's
    undo comes from recovery after a crash."""
    emu = h100()
    env.publish(discover(emu))
    sliced = time_sliced("Short")
    claim = env.allocated("sliced", config=[env.config(sliced)])
    ref = _ref(claim)
    gpu_uuid = discover(emu).gpus[int(_device(claim).removeprefix("gpu-"))].uuid
    _set_compute_mode(emu, gpu_uuid, EXCLUSIVE_PROCESS)
    preparer = make_preparer(env, node, akube, emu)

    assert (await preparer.prepare([ref]))[ref.uid].error is None
    assert _compute_mode(emu, gpu_uuid) == DEFAULT_MODE
    device = checkpoint_document(node.checkpoint)["claims"][ref.uid]["devices"][0]
    assert device["details"]["timeSlice"]["previousComputeMode"] == EXCLUSIVE_PROCESS

    assert await preparer.unprepare([ref]) == {ref.uid: None}
    assert _compute_mode(emu, gpu_uuid) == EXCLUSIVE_PROCESS

    # A crash after the mode changed, before the prepare completed: recovery restores it.
    def crash(step: str) -> None:
        if step == "time-slice-applied":
            raise SimulatedCrash(step)

    crashing = make_preparer(env, node, akube, emu, fault=crash)
    with pytest.raises(SimulatedCrash):
        await crashing.prepare([ref])
    assert _compute_mode(emu, gpu_uuid) == DEFAULT_MODE
    report = await make_preparer(env, node, akube, emu).recover()
    assert report.rolled_back == (ref.uid,)
    assert _compute_mode(emu, gpu_uuid) == EXCLUSIVE_PROCESS


@pytest.mark.cluster
@pytest.mark.anyio
async def test_started_record_is_on_disk_only_for_prepares_with_side_effects(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """A prepare that only writes a CDI spec saves one checkpoint write: a crash
    before completion leaves an orphaned spec, which recover() removes. A prepare
    that changes the GPU records its start on disk before the change."""
    emu = h100()
    env.publish(discover(emu))
    sliced = time_sliced("Short")
    plain = _ref(env.allocated("plain"))
    shared = _ref(env.allocated("shared", config=[env.config(sliced)]))
    on_disk_at_start: dict[str, list[str]] = {}
    current: list[str] = []

    def fault(step: str) -> None:
        if step == "prepare-started":
            cp = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id)
            on_disk_at_start[current[0]] = [r.uid for r in cp.claims()]

    preparer = make_preparer(env, node, akube, emu, fault=fault)
    for ref in (plain, shared):
        current[:] = [ref.uid]
        assert (await preparer.prepare([ref]))[ref.uid].error is None

    assert on_disk_at_start == {plain.uid: [], shared.uid: [plain.uid, shared.uid]}
    cp = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id)
    assert sorted(r.uid for r in cp.claims() if r.completed) == sorted([plain.uid, shared.uid])


@pytest.mark.cluster
@pytest.mark.anyio
async def test_time_slicing_failure_names_the_gpu_and_leaves_nothing(
    env: Env, node: Node, akube: AsyncKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    emu = h100()
    env.publish(discover(emu))
    short = time_sliced("Short")
    claim = env.allocated("old-gpu", config=[env.config(short)])
    ref = _ref(claim)
    gpu_uuid = discover(emu).gpus[int(_device(claim).removeprefix("gpu-"))].uuid
    _set_compute_mode(emu, gpu_uuid, EXCLUSIVE_PROCESS)
    monkeypatch.setenv("GPUDRA_FAKE_SMI_FAIL", "1")

    result = (await make_preparer(env, node, akube, emu).prepare([ref]))[ref.uid]

    assert result.error is not None
    assert gpu_uuid in result.error
    assert "Ampere" in result.error
    assert not node.has_spec(ref.uid)
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).claims() == []
    assert _compute_mode(emu, gpu_uuid) == EXCLUSIVE_PROCESS  # put back by the rollback


@pytest.mark.cluster
@pytest.mark.anyio
async def test_mps_starts_one_daemon_per_claim_and_stops_it(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100()
    env.publish(discover(emu))
    mps = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultActiveThreadPercentage": 40,
                "defaultPinnedDeviceMemoryLimit": "10Gi",
            },
        },
    }
    claim = env.allocated("mps", config=[env.config(mps)])
    ref = _ref(claim)
    index = int(_device(claim).removeprefix("gpu-"))
    gpu_uuid = discover(emu).gpus[index].uuid
    preparer = make_preparer(env, node, akube, emu)

    result = (await preparer.prepare([ref]))[ref.uid]

    assert result.error is None
    pipe = node.checkpoint.parent / "mps" / ref.uid / "pipe"
    logs = node.checkpoint.parent / "mps" / ref.uid / "log"
    assert node.tool_calls() == [
        f"mps-control -d pipe={pipe} log={logs} devices={gpu_uuid} server=none",
        f"mps-control set_default_active_thread_percentage 40 pipe={pipe}",
        f"mps-control set_default_device_pinned_mem_limit {gpu_uuid} 10240M pipe={pipe}",
    ]
    spec = node.spec(ref.uid)
    edits = spec["devices"][0]["containerEdits"]
    assert cdi_env(spec)["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    # The claim's own /dev/shm: the host's, asserted here before, let tenants share
    # POSIX shared memory with each other and with the host.
    shm = node.checkpoint.parent / "mps" / ref.uid / "shm"
    assert mounts == {"/tmp/nvidia-mps": str(pipe), "/dev/shm": str(shm)}
    emu.nvmlInit()
    handle = emu.nvmlDeviceGetHandleByIndex(index)
    assert emu.nvmlDeviceGetComputeMode(handle) == EXCLUSIVE_PROCESS

    assert await preparer.unprepare([ref]) == {ref.uid: None}
    assert node.tool_calls()[3:] == [f"mps-control quit pipe={pipe}"]
    assert emu.nvmlDeviceGetComputeMode(handle) == DEFAULT_MODE
    assert not (node.checkpoint.parent / "mps" / ref.uid).exists()
    emu.nvmlShutdown()


@pytest.mark.cluster
@pytest.mark.anyio
async def test_mps_multi_user_starts_the_claims_daemon_with_dash_m(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """Upstream's `mpsConfig.multiUser` reaches NVIDIA's control daemon as `-M`, so the
    claim's containers may run CUDA as different users (an H100: Hopper, past Volta)."""
    emu = h100()
    env.publish(discover(emu))
    mps = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"multiUser": True}},
    }
    claim = env.allocated("mps-users", config=[env.config(mps)])
    ref = _ref(claim)
    gpu_uuid = discover(emu).gpus[int(_device(claim).removeprefix("gpu-"))].uuid
    preparer = make_preparer(env, node, akube, emu)

    assert (await preparer.prepare([ref]))[ref.uid].error is None
    pipe = node.checkpoint.parent / "mps" / ref.uid / "pipe"
    logs = node.checkpoint.parent / "mps" / ref.uid / "log"
    assert node.tool_calls() == [
        f"mps-control -d -M pipe={pipe} log={logs} devices={gpu_uuid} server=none"
    ]
    assert await preparer.unprepare([ref]) == {ref.uid: None}
    assert node.tool_calls()[1:] == [f"mps-control quit pipe={pipe}"]


@pytest.mark.cluster
@pytest.mark.anyio
async def test_memory_slices_return_share_ids_and_pin_the_memory(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100()
    env.publish(discover(emu), only=("gpu-5",), shared=True)
    memory = f"{env.driver}/memory"
    slices = [
        env.allocated(name, requests=[env.request("mem", capacity={"requests": {memory: "10Gi"}})])
        for name in ("slice-a", "slice-b")
    ]
    results = [c["status"]["allocation"]["devices"]["results"][0] for c in slices]
    assert {r["device"] for r in results} == {"gpu-5"}
    share_ids = {r["shareID"] for r in results}
    assert len(share_ids) == 2
    gpu_uuid = discover(emu).gpus[5].uuid
    preparer = make_preparer(env, node, akube, emu)
    refs = [_ref(c) for c in slices]

    prepared = await preparer.prepare(refs)

    for ref, result in zip(refs, results, strict=True):
        out = prepared[ref.uid]
        assert out.error is None
        assert out.devices[0].share_id == result["shareID"]
        assert out.devices[0].cdi_device_ids == [
            f"k8s.gpu.nvidia.com/claim={ref.uid}-gpu-5-{result['shareID']}"
        ]
        pipe = node.checkpoint.parent / "mps" / ref.uid / "pipe"
        assert (
            f"mps-control set_default_device_pinned_mem_limit {gpu_uuid} 10240M pipe={pipe}"
            in node.tool_calls()
        )
    # Both claims share the GPU, so neither changed its compute mode.
    emu.nvmlInit()
    assert emu.nvmlDeviceGetComputeMode(emu.nvmlDeviceGetHandleByIndex(5)) == DEFAULT_MODE
    emu.nvmlShutdown()
    assert await preparer.unprepare(refs) == {r.uid: None for r in refs}


@pytest.mark.cluster
@pytest.mark.anyio
async def test_integer_shares_set_the_time_slice_once_and_reset_it_with_the_last(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """Claims holding shares of one GPU share its one time-slice setting: the first
    sets it, the last resets it, and a claim asking another interval is refused."""
    emu = h100()
    env.publish(discover(emu), only=("gpu-4",), shares=3)

    def sliced(interval: str) -> list[dict[str, Any]]:
        return [env.config(time_sliced(interval))]

    one_share = [env.request(capacity={"requests": {"shares": "1"}})]
    claims = [
        env.allocated(name, requests=one_share, config=sliced(interval))
        for name, interval in (("a", "Long"), ("b", "Long"), ("short", "Short"))
    ]
    results = [c["status"]["allocation"]["devices"]["results"][0] for c in claims]
    assert {r["device"] for r in results} == {"gpu-4"}
    assert [r["consumedCapacity"]["shares"] for r in results] == ["1", "1", "1"]
    a, b, short = (_ref(c) for c in claims)
    gpu_uuid = discover(emu).gpus[4].uuid
    setting = f"nvidia-smi compute-policy -i {gpu_uuid} --set-timeslice"
    preparer = make_preparer(env, node, akube, emu)

    prepared = await preparer.prepare([a, b])
    assert [prepared[r.uid].error for r in (a, b)] == [None, None]
    assert [c for c in node.tool_calls() if c.startswith(setting)] == [f"{setting} 3"]
    refused = (await preparer.prepare([short]))[short.uid].error
    assert refused is not None
    assert f"time-sliced with interval Long for claim {env.namespace}/" in refused
    assert "claims sharing a GPU need the same interval" in refused

    assert await preparer.unprepare([a]) == {a.uid: None}
    assert [c for c in node.tool_calls() if c.startswith(setting)] == [f"{setting} 3"]
    assert await preparer.unprepare([b]) == {b.uid: None}
    assert [c for c in node.tool_calls() if c.startswith(setting)] == [
        f"{setting} 3",
        f"{setting} 0",
    ]


async def _shares_one_unreadable(
    env: Env,
    node: Node,
    akube: AsyncKube,
    emu: NvmlEmulator,
    names: tuple[str, str],
    prepared: int,
    spoil: Callable[[dict[str, Any]], None],
) -> tuple[list[ClaimRef], str]:
    """Two claims for a share each of time-sliced gpu-4; the first `prepared` of them
    prepared, then the first's record changed by `spoil` as a newer release might have
    written it. Returns the claims and the GPU's time-slice command."""
    env.publish(discover(emu), only=("gpu-4",), shares=2)
    one_share = [env.request(capacity={"requests": {"shares": "1"}})]
    config = [env.config(time_sliced("Long"))]
    refs = [_ref(env.allocated(name, requests=one_share, config=config)) for name in names]
    done = await make_preparer(env, node, akube, emu).prepare(refs[:prepared])
    assert [done[r.uid].error for r in refs[:prepared]] == [None] * prepared
    doc = checkpoint_document(node.checkpoint)
    spoil(doc["claims"][refs[0].uid])
    _rewrite_checkpoint(node.checkpoint, doc)
    gpu_uuid = discover(emu).gpus[4].uuid
    return refs, f"nvidia-smi compute-policy -i {gpu_uuid} --set-timeslice"


@pytest.mark.cluster
@pytest.mark.anyio
async def test_a_share_whose_record_cannot_be_read_keeps_the_time_slice_it_may_rely_on(
    env: Env, node: Node, akube: AsyncKube, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim sharing a time-sliced GPU whose record this release cannot read (a newer
    release's, say, after a downgrade) may still run there: the last readable share to
    leave does not reset the setting under it, and says why."""
    emu = h100()

    def unreadable(record: dict[str, Any]) -> None:
        record["devices"][0]["requestNames"] = "gpu"

    (a, b), setting = await _shares_one_unreadable(env, node, akube, emu, ("a", "b"), 2, unreadable)

    assert await make_preparer(env, node, akube, emu).unprepare([b]) == {b.uid: None}

    assert [call for call in node.tool_calls() if call.startswith(setting)] == [f"{setting} 3"]
    [kept] = [r for r in caplog.records if r.getMessage().startswith("time-slice kept")]
    assert "cannot be read" in kept.getMessage()
    assert getattr(kept, "fields", {})["unreadable"] == [a.uid]
    assert b.uid not in checkpoint_document(node.checkpoint)["claims"]


@pytest.mark.cluster
@pytest.mark.anyio
async def test_no_share_joins_a_gpu_whose_time_slice_a_record_cannot_tell(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """A share whose time-slice step this release cannot read (an interval a newer
    release wrote) holds the GPU at a setting nobody here knows: a new share would set
    its own interval under that pod, so it is refused with the by-hand remedy."""
    emu = h100()

    def unknown_interval(record: dict[str, Any]) -> None:
        record["devices"][0]["details"]["timeSlice"]["interval"] = "often"

    (a, c), setting = await _shares_one_unreadable(
        env, node, akube, emu, ("a", "c"), 1, unknown_interval
    )

    refused = (await make_preparer(env, node, akube, emu).prepare([c]))[c.uid].error

    assert refused is not None
    gpu = setting.split(" -i ")[1].split()[0]
    assert f"GPU {gpu} is named by checkpoint records this release cannot read" in refused
    assert str(node.checkpoint.parent / "undone" / a.uid) in refused
    assert [call for call in node.tool_calls() if call.startswith(setting)] == [f"{setting} 3"]
    assert c.uid not in checkpoint_document(node.checkpoint)["claims"]


@pytest.mark.cluster
@pytest.mark.anyio
async def test_the_last_time_sliced_share_restores_the_compute_mode_the_first_replaced(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """The first share records the GPU's EXCLUSIVE_PROCESS mode and leaves first; the
    mode stays DEFAULT while the second runs, and the second, which found the GPU
    DEFAULT already, puts EXCLUSIVE_PROCESS back when it goes."""
    emu = h100()
    env.publish(discover(emu), only=("gpu-4",), shares=2)
    sliced = time_sliced("Long")
    one_share = [env.request(capacity={"requests": {"shares": "1"}})]
    first, second = (
        _ref(env.allocated(name, requests=one_share, config=[env.config(sliced)]))
        for name in ("first", "second")
    )
    gpu_uuid = discover(emu).gpus[4].uuid
    _set_compute_mode(emu, gpu_uuid, EXCLUSIVE_PROCESS)
    preparer = make_preparer(env, node, akube, emu)

    assert (await preparer.prepare([first]))[first.uid].error is None
    assert (await preparer.prepare([second]))[second.uid].error is None
    assert _compute_mode(emu, gpu_uuid) == DEFAULT_MODE
    claims = checkpoint_document(node.checkpoint)["claims"]
    for ref in (first, second):
        step = claims[ref.uid]["devices"][0]["details"]["timeSlice"]
        assert step["previousComputeMode"] == EXCLUSIVE_PROCESS

    assert await preparer.unprepare([first]) == {first.uid: None}
    assert _compute_mode(emu, gpu_uuid) == DEFAULT_MODE  # the second still runs on it
    assert await preparer.unprepare([second]) == {second.uid: None}
    assert _compute_mode(emu, gpu_uuid) == EXCLUSIVE_PROCESS


# --- MIG -----------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.anyio
async def test_dynamic_mig_instance_is_created_at_prepare_and_destroyed_at_unprepare(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100_mig()
    inventory = discover(emu)
    env.publish(inventory, MigStrategy.DYNAMIC)
    profile = f'device.attributes["{env.driver}"].profile == "1g.10gb"'
    claim = env.allocated("mig", requests=[env.request("mig", cel=profile)])
    ref = _ref(claim)
    name = _device(claim)
    assert name.startswith("gpu-0-mig-1g10gb-19-")
    assert mig_devices(emu) == {}
    preparer = make_preparer(env, node, akube, emu, strategy=MigStrategy.DYNAMIC)

    result = (await preparer.prepare([ref]))[ref.uid]

    assert result.error is None
    created = mig_devices(emu)
    assert list(created) == [name]  # the instance sits exactly at the allocated placement
    spec = node.spec(ref.uid)
    assert cdi_env(spec)[f"GPUDRA_DEVICE_{name.upper().replace('-', '_')}_UUID"] == created[name]
    record = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).get(ref.uid)
    assert record is not None
    mig = record.devices[0].details.mig
    assert isinstance(mig, CreatedMig) and mig.gi is not None and mig.ci is not None
    gi, ci = mig_capability_minors(node.proc, 0, mig.gi, mig.ci)
    assert node_paths(spec["devices"][0]["containerEdits"]) == [
        "/dev/nvidia0",
        f"/dev/nvidia-caps/nvidia-cap{gi[0]}",
        f"/dev/nvidia-caps/nvidia-cap{ci[0]}",
    ]

    assert await preparer.unprepare([ref]) == {ref.uid: None}
    assert mig_devices(emu) == {}
    assert not node.has_spec(ref.uid)


@pytest.mark.cluster
@pytest.mark.anyio
async def test_emulated_gpus_get_numbered_nodes_the_host_lacks(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """With the emulator's device numbers every node of the spec carries its type and
    numbers (a MIG device's two capability nodes included), so a runtime starts the
    container on a host without /dev/nvidia*."""
    emu = h100_mig()
    env.publish(discover(emu), MigStrategy.DYNAMIC)
    profile = f'device.attributes["{env.driver}"].profile == "1g.10gb"'
    claim = env.allocated("mig", requests=[env.request("mig", cel=profile)])
    ref = _ref(claim)
    preparer = make_preparer(
        env, node, akube, emu, strategy=MigStrategy.DYNAMIC, device_numbers=device_numbers
    )

    assert (await preparer.prepare([ref]))[ref.uid].error is None

    spec = node.spec(ref.uid)
    nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert [(n["path"], n["type"], n["major"]) for n in nodes] == [
        ("/dev/nvidia0", "c", NVIDIA_MAJOR),
        (nodes[1]["path"], "c", CAPS_MAJOR),
        (nodes[2]["path"], "c", CAPS_MAJOR),
    ]
    assert all(n["minor"] == int(n["path"].rsplit("cap", 1)[-1]) for n in nodes[1:])
    control = {n["path"]: (n["major"], n["minor"]) for n in spec["containerEdits"]["deviceNodes"]}
    assert control["/dev/nvidiactl"] == (NVIDIA_MAJOR, 255)
    assert control["/dev/nvidia-uvm"] == (UVM_MAJOR, 0)
    assert await preparer.unprepare([ref]) == {ref.uid: None}


@pytest.mark.cluster
@pytest.mark.anyio
async def test_admin_access_to_a_dynamic_mig_device_sees_the_owners_instance(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100_mig()
    # Without counters: the scheduler (1.36) refuses admin access to a device whose
    # counters its owner has consumed.
    env.publish(discover(emu), MigStrategy.DYNAMIC, only=("gpu-0-mig-4g40gb-5-0",), counters=False)
    owner = env.allocated("mig-owner", requests=[env.request("mig")])
    monitor = env.allocated("mig-monitor", requests=[env.request("watch", adminAccess=True)])
    assert _device(owner) == _device(monitor) == "gpu-0-mig-4g40gb-5-0"
    preparer = make_preparer(env, node, akube, emu, strategy=MigStrategy.DYNAMIC)

    early = (await preparer.prepare([_ref(monitor)]))[_ref(monitor).uid]
    assert early.error is not None
    assert "does not exist yet" in early.error
    assert (await preparer.prepare([_ref(owner)]))[_ref(owner).uid].error is None
    assert (await preparer.prepare([_ref(monitor)]))[_ref(monitor).uid].error is None

    [mig_uuid] = mig_devices(emu).values()
    key = "GPUDRA_DEVICE_GPU_0_MIG_4G40GB_5_0_UUID"
    assert cdi_env(node.spec(_ref(owner).uid))[key] == mig_uuid
    assert cdi_env(node.spec(_ref(monitor).uid))[key] == mig_uuid
    # The monitor leaving destroys nothing: the instance is the owner's.
    assert await preparer.unprepare([_ref(monitor)]) == {_ref(monitor).uid: None}
    assert list(mig_devices(emu).values()) == [mig_uuid]


class SimulatedCrash(BaseException):
    """Stands for the process dying: no Python cleanup runs past it."""


class CrashAfterGpuInstance:
    """The real emulator, except that the process 'dies' right after a GPU instance
    is created (before the prepare can record its ID)."""

    def __init__(self, inner: NvmlEmulator) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, *args: Any) -> Any:
        self._inner.nvmlDeviceCreateGpuInstanceWithPlacement(*args)
        raise SimulatedCrash


@pytest.mark.cluster
@pytest.mark.anyio
async def test_crash_after_gpu_instance_creation_is_rolled_back_by_recover(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100_mig()
    env.publish(discover(emu), MigStrategy.DYNAMIC)
    profile = f'device.attributes["{env.driver}"].profile == "2g.20gb"'
    claim = env.allocated("crash", requests=[env.request("mig", cel=profile)])
    ref = _ref(claim)
    crashing = make_preparer(
        env, node, akube, CrashAfterGpuInstance(emu), strategy=MigStrategy.DYNAMIC
    )

    with pytest.raises(SimulatedCrash):
        await crashing.prepare([ref])

    assert list(mig_devices(emu)) == []  # a GI without CI is no MIG device yet...
    emu.nvmlInit()
    parent = emu.nvmlDeviceGetHandleByIndex(0)
    assert emu.nvmlDeviceGetGpuInstanceRemainingCapacity(parent, 14) < 3  # ...but it exists
    left = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id)
    assert [c.uid for c in left.incomplete()] == [ref.uid]

    # The restarted plugin.
    restarted = make_preparer(env, node, akube, emu, strategy=MigStrategy.DYNAMIC)
    report = await restarted.recover()

    assert report.rolled_back == (ref.uid,)
    assert report.errors == ()
    assert emu.nvmlDeviceGetGpuInstanceRemainingCapacity(parent, 14) == 3
    emu.nvmlShutdown()
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).claims() == []
    # And the claim can be prepared normally afterwards.
    assert (await restarted.prepare([ref]))[ref.uid].error is None
    assert list(mig_devices(emu)) == [_device(claim)]


@pytest.mark.cluster
@pytest.mark.anyio
async def test_failed_step_after_mig_creation_is_rolled_back_at_once(
    env: Env, node: Node, akube: AsyncKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    emu = h100_mig()
    env.publish(discover(emu), MigStrategy.DYNAMIC)
    profile = f'device.attributes["{env.driver}"].profile == "1g.20gb"'
    mps = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS"},
    }
    claim = env.allocated(
        "mig-mps", requests=[env.request("mig", cel=profile)], config=[env.config(mps)]
    )
    ref = _ref(claim)
    monkeypatch.setenv("GPUDRA_FAKE_MPS_FAIL", "1")

    result = (
        await make_preparer(env, node, akube, emu, strategy=MigStrategy.DYNAMIC).prepare([ref])
    )[ref.uid]

    assert result.error is not None
    assert "MPS control daemon" in result.error
    assert mig_devices(emu) == {}  # the instance made before the failure is gone again
    assert not node.has_spec(ref.uid)
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).claims() == []
    assert not (node.checkpoint.parent / "mps" / ref.uid).exists()


@pytest.mark.cluster
@pytest.mark.anyio
async def test_reboot_destroys_mig_instances_the_driver_kept(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100_mig()
    env.publish(discover(emu), MigStrategy.DYNAMIC)
    profile = f'device.attributes["{env.driver}"].profile == "3g.40gb"'
    claim = env.allocated("before-reboot", requests=[env.request("mig", cel=profile)])
    ref = _ref(claim)
    before = make_preparer(env, node, akube, emu, strategy=MigStrategy.DYNAMIC)
    assert (await before.prepare([ref]))[ref.uid].error is None
    assert list(mig_devices(emu)) == [_device(claim)]

    node.boot_id.write_text(BOOT_B + "\n")  # the node rebooted; the GPU kept its MIG setup
    after = make_preparer(env, node, akube, emu, strategy=MigStrategy.DYNAMIC)
    report = await after.recover()

    assert report.previous_boot == (ref.uid,)
    assert report.orphaned_specs == (ref.uid,)
    assert report.errors == ()
    assert mig_devices(emu) == {}
    cp = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id)
    assert cp.claims() == []
    assert cp.previous_boot() == []
    assert not node.has_spec(ref.uid)


@pytest.mark.cluster
@pytest.mark.anyio
async def test_static_mig_device_gets_capability_nodes_from_proc(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = NvmlEmulator.from_builtin("a100-40gb-mig-mixed")
    inventory = discover(emu)
    env.publish(inventory)
    profile = f'device.attributes["{env.driver}"].profile == "4g.20gb"'
    claim = env.allocated("static-mig", requests=[env.request("mig", cel=profile)])
    ref = _ref(claim)
    device = next(d for d in inventory.gpus[1].mig_devices if d.name == _device(claim))
    gi, ci = device.gpu_instance_id, device.compute_instance_id
    caps = node.proc / "driver/nvidia/capabilities/gpu1/mig" / f"gi{gi}"
    (caps / f"ci{ci}").mkdir(parents=True)
    (caps / "access").write_text("DeviceFileMinor: 201\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    (caps / f"ci{ci}" / "access").write_text("DeviceFileMinor: 202\nDeviceFileMode: 292\n")
    (node.proc / "devices").write_text("Character devices:\n195 nvidia\n237 nvidia-caps\n")

    result = (await make_preparer(env, node, akube, emu).prepare([ref]))[ref.uid]

    assert result.error is None
    nodes = node.spec(ref.uid)["devices"][0]["containerEdits"]["deviceNodes"]
    assert nodes[0]["path"] == "/dev/nvidia1"
    assert nodes[1:] == [
        {
            "path": f"/dev/nvidia-caps/nvidia-cap{minor}",
            "hostPath": f"{node.dev_root}/dev/nvidia-caps/nvidia-cap{minor}",
            "type": "c",
            "major": 237,
            "minor": minor,
            "fileMode": 292,
        }
        for minor in (201, 202)
    ]
    assert cdi_env(node.spec(ref.uid))["GPUDRA_DEVICE_GPU_1_MIG_4G20GB_5_0_UUID"] == device.uuid


def test_mig_capability_minors_fall_back_to_the_drivers_fixed_table(tmp_path: Path) -> None:
    # Values from a real /proc/driver/nvidia-caps/mig-minors.
    assert mig_capability_minors(tmp_path, 0, 0, 0) == ((3, None), (4, None))
    assert mig_capability_minors(tmp_path, 0, 1, 0) == ((12, None), (13, None))
    assert mig_capability_minors(tmp_path, 3, 3, 3)[1] == (439, None)
    assert mig_capability_minors(tmp_path, 6, 11, 7)[1] == (920, None)
    table = tmp_path / "driver/nvidia-caps/mig-minors"
    table.parent.mkdir(parents=True)
    table.write_text("config 1\nmonitor 2\ngpu2/gi5/access 77\ngpu2/gi5/ci0/access 78\n")
    assert mig_capability_minors(tmp_path, 2, 5, 0) == ((77, None), (78, None))


# --- cleanup of claims deleted behind the kubelet's back -----------------------------------


@pytest.mark.cluster
@pytest.mark.anyio
async def test_cleanup_unprepares_deleted_and_recreated_claims(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100()
    env.publish(discover(emu))
    gone = env.allocated("gone")
    replaced = env.allocated("replaced")
    kept = env.allocated("kept")
    preparer = make_preparer(env, node, akube, emu)
    refs = [_ref(c) for c in (gone, replaced, kept)]
    assert all(r.error is None for r in (await preparer.prepare(refs)).values())
    env.delete_claim("gone")
    env.delete_claim("replaced")
    env.claim("replaced")  # same name, new UID

    cleaned = await preparer.cleanup_deleted_claims()

    assert sorted(cleaned) == sorted([refs[0].uid, refs[1].uid])
    assert not node.has_spec(refs[0].uid)
    assert not node.has_spec(refs[1].uid)
    assert node.has_spec(refs[2].uid)
    assert await preparer.cleanup_deleted_claims() == []


@pytest.mark.cluster
@pytest.mark.anyio
async def test_a_claim_deleted_under_its_running_pod_stays_prepared_until_the_pod_ends(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """A claim force-deleted (its delete-protection finalizer taken off) while its pod
    still runs here: its containers may still have the GPU, and the scheduler no longer
    counts it, so the sweep leaves it prepared (another claim for that GPU is refused,
    not given it too) until that pod is gone, whatever pod takes its name."""
    emu = h100()
    env.publish(discover(emu))
    held = env.allocated("held")
    preparer = make_preparer(env, node, akube, emu)
    ref = _ref(held)
    assert (await preparer.prepare([ref]))[ref.uid].error is None
    path = f"/apis/resource.k8s.io/v1/namespaces/{env.namespace}/resourceclaims/held"
    unprotect = {"metadata": {"finalizers": []}}
    env.kube.request("PATCH", path, unprotect, content_type="application/merge-patch+json")
    env.kube.delete("ResourceClaim", "held", env.namespace)
    wait_for(
        "the claim gone",
        lambda: env.kube.get_or_none("ResourceClaim", "held", env.namespace) is None,
        timeout=60,
    )

    assert await preparer.cleanup_deleted_claims() == []
    assert node.has_spec(ref.uid)
    # Another pod of the same name on this node, naming a claim of the same name, is
    # not the one the claim was prepared for.
    env.kube.delete("Pod", "pod-held", env.namespace, grace=0)
    env.wait_pod_gone("pod-held")
    successor = pod_with_claim("pod-held", env.namespace, None, claim="held")
    successor["spec"]["nodeName"] = NODE
    env.kube.create(successor)
    assert await preparer.cleanup_deleted_claims() == [ref.uid]
    assert not node.has_spec(ref.uid)


@pytest.mark.cluster
@pytest.mark.anyio
async def test_the_sweep_tells_a_new_pod_from_the_one_an_older_release_recorded(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """A record of a release that kept no pod UID names its pod by name only. A pod and
    claim deleted behind the kubelet's back and created again under the same names is
    not the pod the record was made for: the new claim is reserved for it, so the sweep
    unprepares the old claim (else the new claim, given the same GPU, is refused for good)."""
    emu = h100()
    env.publish(discover(emu))
    ref = _ref(env.allocated("held"))
    assert (await make_preparer(env, node, akube, emu).prepare([ref]))[ref.uid].error is None
    doc = checkpoint_document(node.checkpoint)
    for device in doc["claims"][ref.uid]["devices"]:
        del device["details"]["podUid"]  # as the older release wrote it
    _rewrite_checkpoint(node.checkpoint, doc)
    upgraded = make_preparer(env, node, akube, emu)
    await upgraded.recover()
    env.delete_claim("held")
    env.wait_pod_gone("pod-held")
    again = env.allocated("held")
    assert again["metadata"]["uid"] != ref.uid

    assert await upgraded.cleanup_deleted_claims() == [ref.uid]
    assert not node.has_spec(ref.uid)


@pytest.mark.cluster
@pytest.mark.anyio
async def test_recover_removes_orphaned_specs_and_temp_files(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100()
    env.publish(discover(emu))
    claim = env.allocated("kept")
    ref = _ref(claim)
    preparer = make_preparer(env, node, akube, emu)
    assert (await preparer.prepare([ref]))[ref.uid].error is None
    store = CdiSpecStore(node.cdi_dir)
    orphan = str(uuidlib.uuid4())
    store.write(orphan, node.spec(ref.uid))  # a spec whose claim the checkpoint never saw
    temp = node.cdi_dir / f".k8s.gpu.nvidia.com-claim_{orphan}.json.123.tmp"
    temp.write_text("{")
    stray = node.checkpoint.parent / f".{node.checkpoint.name}.456.tmp"
    stray.write_text("{")

    report = await make_preparer(env, node, akube, emu).recover()

    assert report.orphaned_specs == (orphan,)
    assert report.temp_files == 2
    assert node.has_spec(ref.uid)
    assert not store.spec_path(orphan).exists()
    assert not temp.exists()
    assert not stray.exists()


@pytest.mark.anyio
async def test_a_claim_allocated_again_is_never_answered_from_its_old_preparation(
    node: Node,
) -> None:
    """A claim keeps its UID when it is deallocated (its last pod ended) and allocated
    again, to other devices. While its old preparation is still recorded (its unprepare
    never reached the agent), its prepare is refused, naming both allocations and what
    to do, never answered with the old devices' CDI IDs: the scheduler may have given
    those devices to another claim. A repeat prepare of the same allocation still gets
    the recorded answer."""
    emu = h100()
    gpus = discover(emu).gpus
    old, new = gpus[1].device.name, gpus[2].device.name
    uid = str(uuidlib.uuid4())
    first = offline_claim("tenant-a", [("gpu", {"device": old})], {}, uid=uid)
    allocated_again = offline_claim("tenant-a", [("gpu", {"device": new})], {}, uid=uid)
    preparer = node_preparer(node, emu)
    prepared = (await preparer.prepare([first]))[uid]
    assert prepared.error is None
    assert (await preparer.prepare([first]))[uid] == prepared

    refused = (await preparer.prepare([allocated_again]))[uid]

    assert refused.devices == []
    error = refused.error
    assert error is not None
    assert first.ref.describe() in error
    assert f"(devices {old}) and now allocated {new};" in error
    assert "unprepared first" in error
    assert (await preparer.prepare([first]))[uid] == prepared  # the old one stays recorded
    assert await preparer.unprepare([first.ref]) == {uid: None}
    result = (await preparer.prepare([allocated_again]))[uid]
    assert result.error is None
    assert [d.device_name for d in result.devices] == [new]
    assert await preparer.unprepare([first.ref]) == {uid: None}


# --- the sharing backend on its own ------------------------------------------------------------


def test_missing_nvidia_smi_names_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    backend = NvidiaSharing(driver_root=tmp_path)
    with pytest.raises(SharingError) as caught:
        backend.set_time_slice("GPU-1234", 1)
    assert "GPU-1234" in str(caught.value)
    assert "nvidia-smi not found" in str(caught.value)


def test_tools_are_found_under_the_driver_root_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "usr/bin"
    bin_dir.mkdir(parents=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text((FAKEBIN / "nvidia-smi").read_text())
    tool.chmod(0o755)
    log = tmp_path / "log"
    monkeypatch.setenv("GPUDRA_FAKEBIN_LOG", str(log))
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))

    NvidiaSharing(driver_root=tmp_path).reset_time_slice("GPU-1")

    assert log.read_text().splitlines() == ["nvidia-smi compute-policy -i GPU-1 --set-timeslice 0"]


def preload_recording_tool(path: Path, record: Path) -> None:
    """A tool at `path` that writes its LD_PRELOAD and arguments to `record`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nprintf "%s|%s\\n" "$LD_PRELOAD" "$*" >> {record}\n')
    path.chmod(0o755)


def test_tools_are_found_in_the_driver_root_as_this_process_sees_it_with_its_libraries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's container sees the host's driver root under /host: the tools are
    looked for there, and run with the root's NVML and CUDA preloaded, which their
    linker would not find by soname."""
    host = tmp_path / "host"
    seen = host / "run/nvidia/driver"
    nvml = shared_library(seen / "usr/lib/x86_64-linux-gnu" / NVML_LIBRARY, NVML_LIBRARY)
    cuda = shared_library(seen / "usr/lib64" / CUDA_LIBRARY, CUDA_LIBRARY)
    record = tmp_path / "record"
    preload_recording_tool(seen / "usr/bin/nvidia-smi", record)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.delenv("LD_PRELOAD", raising=False)

    backend = NvidiaSharing(driver_root=Path("/run/nvidia/driver"), host_view=host)
    backend.set_time_slice("GPU-1", 2)

    assert record.read_text().splitlines() == [
        f"{nvml}:{cuda}|compute-policy -i GPU-1 --set-timeslice 2"
    ]
    # A tool named explicitly still wins over the one in the driver root.
    explicit = tmp_path / "explicit" / "nvidia-smi"
    preload_recording_tool(explicit, tmp_path / "explicit-record")
    NvidiaSharing(
        driver_root=Path("/run/nvidia/driver"), host_view=host, nvidia_smi=explicit
    ).reset_time_slice("GPU-1")
    assert (tmp_path / "explicit-record").read_text() == (
        f"{nvml}:{cuda}|compute-policy -i GPU-1 --set-timeslice 0\n"
    )


@pytest.mark.parametrize("where", ["own root", "stand-in libraries"])
def test_tools_get_no_preload_where_the_linker_needs_none_or_could_not_load_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A driver at this process's / is on its linker's own search path; emulated GPUs'
    stand-in libraries are no ELF objects, which the linker would refuse with an error
    in every process. The tools' environment is left as it is."""
    record = tmp_path / "record"
    tool = tmp_path / "nvidia-smi"
    preload_recording_tool(tool, record)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    if where == "own root":
        backend = NvidiaSharing(nvidia_smi=tool)
    else:
        install_driver_root(tmp_path / "driver", "580.95.05")
        backend = NvidiaSharing(driver_root=tmp_path / "driver", nvidia_smi=tool)
    backend.reset_time_slice("GPU-1")
    assert record.read_text() == "|compute-policy -i GPU-1 --set-timeslice 0\n"


def test_stopping_an_mps_daemon_that_died_only_removes_its_files(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "control").touch()
    (pipe / "nvidia-cuda-mps-control.pid").write_text("999999999\n")  # no such process
    daemon = MpsDaemon("x", pipe, tmp_path / "log", ("GPU-1",))
    fake_sharing().stop_mps(daemon)
    assert not pipe.exists()


# --- upgrades and unreadable records ----------------------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures"
# The claims of fixtures/checkpoint-v1.json, in the order they were prepared: name,
# allocation results (device, request, extra fields), config. Those under a step
# were stopped right after it (the process "died"), so they are PrepareStarted.
_TS = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
_MPS = {
    "strategy": "MPS",
    "mpsConfig": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "20Gi"},
}
_SHARE_A = {
    "shareID": "8b3f6a52-1c55-4c0e-b0c7-1f0ad1a2b3c4",
    "consumedCapacity": {"memory": "10Gi"},
}
_SHARE_B = {
    "shareID": "a2d94c7e-6e1f-4b8e-9d1c-5a6b7c8d9e0f",
    "consumedCapacity": {"memory": "20Gi"},
}
FIXTURE_CLAIMS: list[tuple[str, str | None, list[tuple[str, str, dict[str, Any]]], Any]] = [
    ("whole", None, [("gpu-1", "gpu", {})], None),
    ("sliced", None, [("gpu-2", "gpu", {})], _TS),
    ("mps", None, [("gpu-3", "gpu", {})], _MPS),
    ("slice-a", None, [("gpu-5", "mem", _SHARE_A)], None),
    ("slice-b", None, [("gpu-5", "mem", _SHARE_B)], None),
    ("mig", None, [("gpu-0-mig-3g40gb-9-0", "mig", {})], None),
    ("mig-admin", None, [("gpu-0-mig-3g40gb-9-0", "watch", {"adminAccess": True})], None),
    ("gpu-and-mig", None, [("gpu-6", "gpu", {}), ("gpu-0-mig-1g10gb-19-6", "mig", {})], None),
    ("mig-crash-early", "mig-recorded", [("gpu-0-mig-1g10gb-me-20-6", "mig", {})], None),
    ("mig-crash-gi", "mig-gpu-instance-created", [("gpu-0-mig-2g20gb-14-4", "mig", {})], None),
    ("ts-crash", "time-slice-recorded", [("gpu-4", "gpu", {})], _TS),
    ("mps-crash", "compute-mode-recorded", [("gpu-7", "gpu", {})], _MPS),
]
FIXTURE_DRIVER = "gpu.nvidia.com"
FIXTURE_STATE = "/var/lib/gpudra"


def _fixture_claim(index: int, uid: str | None = None) -> Claim:
    """Claim `index` of FIXTURE_CLAIMS (under another UID when given), checked from
    its ResourceClaim as the plugin does."""
    name, _, results, sharing = FIXTURE_CLAIMS[index]
    ref = ClaimRef("team-a", uid or f"00000000-0000-4000-8000-{index + 1:012d}", name)
    config = []
    if sharing is not None:
        parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
        opaque = {"driver": FIXTURE_DRIVER, "parameters": {**parameters, "sharing": sharing}}
        config.append({"source": "FromClaim", "opaque": opaque})
    obj = {
        "metadata": {"name": name, "namespace": ref.namespace, "uid": ref.uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"driver": FIXTURE_DRIVER, "pool": NODE, "device": d, "request": r, **x}
                        for d, r, x in results
                    ],
                    "config": config,
                }
            },
            "reservedFor": [{"resource": "pods", "name": f"pod-{name}", "uid": "x"}],
        },
    }
    return checked_claim(ref, obj, driver=FIXTURE_DRIVER, pool=NODE)


def _rewrite_checkpoint(path: Path, doc: dict[str, Any]) -> None:
    """Replace the checkpoint with `doc` by hand, as an admin or an older release would:
    the changes file, whose lines extended the file replaced, goes too."""
    path.write_text(json.dumps(doc))
    ChangesFile(path).path.unlink(missing_ok=True)


def _fixture(node: Node) -> dict[str, Any]:
    """The fixture as it would be on this test's node."""
    text = (FIXTURES / "checkpoint-v1.json").read_text()
    doc: dict[str, Any] = json.loads(text.replace(FIXTURE_STATE, str(node.checkpoint.parent)))
    node.boot_id.write_text(doc["bootId"] + "\n")
    return doc


def _gpu_instance_as_recorded(
    emu: NvmlEmulator, gpu_uuid: str, placement: MigPlacement, gi: int
) -> None:
    """A GPU instance at `placement` under the ID a record names. Where NVML would give
    that ID, prepare's own call makes it; the fixture's other IDs come from the lowest
    free numbering of the emulator of its day, so the emulator is told them."""
    if gi == gpu_instance_id_for_placement(8, placement.start, placement.size):
        assert create_gpu_instance(emu, gpu_uuid, placement) == gi
        return
    index = next(i for i, g in enumerate(discover(emu).gpus) if g.uuid == gpu_uuid)
    emu.create_gpu_instance_numbered(index, placement.profile_id, placement.start, gi)


def _numbered_by_appearance(doc: Any, names: dict[object, str] | None = None) -> Any:
    """`doc` with the values NVML assigns (GPU-instance IDs, and the MIG UUIDs the
    emulator derives from them) replaced by their order of first appearance.

    The fixture's were assigned by the emulator of its day, which gave the lowest free
    ID; NVML numbers by placement, as the emulator now does. The records' shape, and
    which records name the same instance, must stay the same; the numbers may not.
    """
    names = {} if names is None else names

    def label(kind: str, value: object) -> str:
        return names.setdefault((kind, value), f"{kind}-{sum(k == kind for k, _ in names)}")

    if isinstance(doc, list):
        return [_numbered_by_appearance(v, names) for v in doc]
    if isinstance(doc, str) and doc.startswith("MIG-"):
        return label("MIG", doc)
    if not isinstance(doc, dict):
        return doc
    out = {}
    for key, value in sorted(doc.items()):
        if key == "mig" and isinstance(value, dict) and "gi" in value:
            out[key] = _numbered_by_appearance({**value, "gi": label("gi", value["gi"])}, names)
        else:
            out[key] = _numbered_by_appearance(value, names)
    return out


@pytest.mark.anyio
async def test_records_keep_the_shape_the_previous_release_wrote(node: Node) -> None:
    """fixtures/checkpoint-v1.json was written by the release before the device records
    were typed (f154488), preparing FIXTURE_CLAIMS like this test on the same emulated
    node, its state folder then renamed to a node's: this release writes the same file,
    so either release reads what the other wrote."""
    expected = _fixture(node)
    crash: list[str | None] = [None]

    def fault(step: str) -> None:
        if step == crash[0]:
            raise SimulatedCrash(step)

    preparer = node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC, fault=fault)
    for index, (_, step, _, _) in enumerate(FIXTURE_CLAIMS):
        claim = _fixture_claim(index)
        crash[0] = step
        if step is None:
            assert (await preparer.prepare([claim]))[claim.uid].error is None
        else:
            with pytest.raises(SimulatedCrash):
                await preparer.prepare([claim])
    # The agent stops: what it appended to the changes file goes into the file, the one
    # the previous release reads.
    await preparer.close()

    written = json.loads(node.checkpoint.read_text())
    # Added since: a random ID that names the file to its changes file (the previous
    # release keeps the key as it reads it).
    assert isinstance(written.pop("writeId"), str)
    # Added since: each MPS record names the claim's shm folder and the daemon (its
    # PID varies); the previous release keeps such keys as it reads them.
    for claim in written["claims"].values():
        for device in claim["devices"]:
            mps = device["details"].get("mps", {})
            shm = mps.pop("shmDir", None)
            if shm is not None:
                assert shm == str(node.checkpoint.parent / "mps" / claim["uid"] / "shm")
                assert isinstance(mps.pop("daemonPid"), int)
                assert isinstance(mps.pop("daemonStartTime"), int)
    # Added since: the UID of the pod the claim was prepared for, which the sweep of
    # deleted claims compares (the previous release keeps the key as it reads it).
    for claim in written["claims"].values():
        for device in claim["devices"]:
            assert device["details"].pop("podUid") == "x"  # FIXTURE_CLAIMS reserve pod "x"
    for claim in written["claims"].values():
        for device in claim["devices"]:
            mig = device["details"].get("mig", {})
            if "gi" in mig and "start" in mig:
                assert mig["gi"] == gpu_instance_id_for_placement(8, mig["start"], mig["size"])
    assert _numbered_by_appearance(written) == _numbered_by_appearance(expected)


@pytest.mark.anyio
async def test_the_agents_stop_leaves_every_change_in_the_checkpoint_file(node: Node) -> None:
    """A whole GPU's prepare ends in the changes file, beside the checkpoint file; when
    the agent stops (`close`), the file alone holds it, as a release from before the
    changes file reads it, and a restarted agent reads the same."""
    claim = _fixture_claim(0)
    preparer = node_preparer(node, h100())
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    changes = ChangesFile(node.checkpoint)
    # The agent's load wrote the file (empty), saying that a changes file extends it,
    # which a release that reads the file alone refuses; the prepare's end is a line
    # beside it.
    assert json.loads(node.checkpoint.read_text())["claims"] == {}
    assert json.loads(node.checkpoint.read_text())["majorVersion"] == 2
    assert list(checkpoint_document(node.checkpoint)["claims"]) == [claim.uid]

    await preparer.close()
    assert "majorVersion" not in json.loads(node.checkpoint.read_text())
    file_alone = json.loads(node.checkpoint.read_text())["claims"]
    assert list(file_alone) == [claim.uid]
    assert file_alone[claim.uid]["state"] == "PrepareCompleted"
    assert changes.read() == b""
    assert checkpoint_document(node.checkpoint)["claims"] == file_alone
    restarted = node_preparer(node, h100())
    assert (await restarted.unprepare([claim.ref])) == {claim.uid: None}
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).claims() == []


@pytest.mark.anyio
async def test_an_upgrade_undoes_what_the_previous_release_recorded(node: Node) -> None:
    """The previous release's checkpoint (see the test above) with the GPUs as it left
    them: recover() rolls back its interrupted prepares and unprepare undoes the rest."""
    doc = _fixture(node)
    node.checkpoint.parent.mkdir(parents=True)
    _rewrite_checkpoint(node.checkpoint, doc)
    emu = h100_mig()
    partitions = {d.name: d for d in discover(emu).gpus[0].partitions}
    gpu0, gpu3 = discover(emu).gpus[0].uuid, discover(emu).gpus[3].uuid
    for name, gi, with_ci in (
        ("gpu-0-mig-3g40gb-9-0", 1, True),
        ("gpu-0-mig-1g10gb-19-6", 2, True),
        ("gpu-0-mig-2g20gb-14-4", 3, False),  # the crash came before its compute instance
    ):
        placement = partitions[name].placement
        assert placement is not None
        _gpu_instance_as_recorded(emu, gpu0, placement, gi)
        if with_ci:
            create_compute_instance(emu, gpu0, gi)
    emu.nvmlInit()
    emu.nvmlDeviceSetComputeMode(emu.nvmlDeviceGetHandleByUUID(gpu3), EXCLUSIVE_PROCESS)
    emu.nvmlShutdown()
    preparer = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC)

    report = await preparer.recover()

    started = [uid for uid, c in doc["claims"].items() if c["state"] == "PrepareStarted"]
    assert sorted(report.rolled_back) == sorted(started)
    assert report.errors == ()
    assert sorted(mig_devices(emu)) == ["gpu-0-mig-1g10gb-19-6", "gpu-0-mig-3g40gb-9-0"]
    refs = [ClaimRef(c["namespace"], c["uid"], c["name"]) for c in doc["claims"].values()]
    done = [r for r in refs if r.uid not in started]
    assert await preparer.unprepare(done) == {r.uid: None for r in done}
    assert mig_devices(emu) == {}
    emu.nvmlInit()
    parent = emu.nvmlDeviceGetHandleByIndex(0)
    assert emu.nvmlDeviceGetGpuInstanceRemainingCapacity(parent, 14) == 3  # no instance left
    assert emu.nvmlDeviceGetComputeMode(emu.nvmlDeviceGetHandleByUUID(gpu3)) == DEFAULT_MODE
    emu.nvmlShutdown()
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).claims() == []
    assert not (node.checkpoint.parent / "mps").exists() or not any(
        (node.checkpoint.parent / "mps").iterdir()
    )


@pytest.mark.anyio
@pytest.mark.parametrize("branch", EMULATED_BRANCHES)
async def test_dynamic_mig_works_on_every_driver_branch(node: Node, branch: int) -> None:
    """R535 to R570 have no nvmlDeviceGetGpuInstanceProfileInfoById: prepare, unprepare,
    and the roll-back of a crash before the GPU instance's ID was recorded (found by
    profile and placement) work without it."""
    emu = NvmlEmulator.from_builtin(f"h100-80gb-mig-r{branch}")
    claim = _fixture_claim(5)  # gpu-0-mig-3g40gb-9-0
    crashing = node_preparer(node, CrashAfterGpuInstance(emu), strategy=MigStrategy.DYNAMIC)
    with pytest.raises(SimulatedCrash):
        await crashing.prepare([claim])
    preparer = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC)

    report = await preparer.recover()

    assert (report.rolled_back, report.errors) == ((claim.uid,), ())
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    assert list(mig_devices(emu)) == ["gpu-0-mig-3g40gb-9-0"]
    assert await preparer.unprepare([claim.ref]) == {claim.uid: None}
    assert mig_devices(emu) == {}
    emu.nvmlInit()
    parent = emu.nvmlDeviceGetHandleByIndex(0)
    assert emu.nvmlDeviceGetGpuInstanceRemainingCapacity(parent, 9) == 2
    emu.nvmlShutdown()


@pytest.mark.anyio
@pytest.mark.parametrize("when", ["before the prepare", "while it creates"])
async def test_a_mig_instance_the_claim_did_not_make_is_never_destroyed(
    node: Node, when: str
) -> None:
    """Dynamic MIG publishes every placement, whatever instances exist. An instance
    already at the allocated placement (an administrator's, a static layout's, or one
    made by someone else between the check and the creation) fails the prepare, and the
    roll-back, which finds an instance by profile and placement until its ID is
    recorded, leaves it alone."""
    emu = h100_mig()
    gpu = discover(emu).gpus[0]
    placement = {p.name: p for p in gpu.partitions}["gpu-0-mig-3g40gb-9-0"].placement
    assert placement is not None

    def theirs() -> None:
        create_compute_instance(emu, gpu.uuid, create_gpu_instance(emu, gpu.uuid, placement))

    def fault(step: str) -> None:
        if step == "mig-recorded" and when == "while it creates":
            theirs()

    if when == "before the prepare":
        theirs()
    preparer = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC, fault=fault)
    claim = _fixture_claim(5)  # allocated gpu-0-mig-3g40gb-9-0

    result = (await preparer.prepare([claim]))[claim.uid]

    assert result.error is not None
    if when == "before the prepare":
        assert "is taken by an instance gpudra did not create" in result.error
    instances = mig_devices(emu)
    assert list(instances) == ["gpu-0-mig-3g40gb-9-0"]
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).claims() == []
    assert (await preparer.recover()).errors == ()
    assert mig_devices(emu) == instances


@pytest.mark.anyio
async def test_unprepare_destroys_only_the_mig_instance_the_claim_made(node: Node) -> None:
    """The claim's instance went (its undo destroyed it, then a later step failed, so
    the record stayed), and another instance now sits at the same placement under the
    same ID, made after the ownership check: the retried unprepare, which before
    matched by profile and placement only, leaves it alone by its MIG UUID."""
    emu = h100_mig()
    gpu = discover(emu).gpus[0]
    placement = {p.name: p for p in gpu.partitions}["gpu-0-mig-3g40gb-9-0"].placement
    assert placement is not None
    preparer = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC)
    claim = _fixture_claim(5)  # allocated gpu-0-mig-3g40gb-9-0
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    record = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).get(claim.uid)
    assert record is not None
    mig = record.devices[0].details.mig
    assert isinstance(mig, CreatedMig) and mig.gi is not None
    ours = mig_devices(emu)
    assert destroy_mig(emu, gpu.uuid, mig)
    create_compute_instance(emu, gpu.uuid, create_gpu_instance(emu, gpu.uuid, placement))
    theirs = mig_devices(emu)
    assert list(theirs) == list(ours) and theirs != ours  # same place, another instance

    assert await preparer.unprepare([claim.ref]) == {claim.uid: None}

    assert mig_devices(emu) == theirs


def share_claim(index: int, device: str, shares: int, config: Any = None) -> Claim:
    """A claim of tenant `index` holding `shares` integer shares of `device`, as the
    scheduler allocates them (a shareID, the shares consumed), with a claim config."""
    uid = f"00000000-0000-4000-8000-{index + 100:012d}"
    name = f"shares-{index}"
    configs = (
        [
            {
                "source": "FromClaim",
                "opaque": {
                    "driver": FIXTURE_DRIVER,
                    "parameters": {
                        "apiVersion": "resource.nvidia.com/v1beta1",
                        "kind": "GpuConfig",
                        **config,
                    },
                },
            }
        ]
        if config
        else []
    )
    result = {
        "driver": FIXTURE_DRIVER,
        "pool": NODE,
        "device": device,
        "request": "gpu",
        "shareID": f"share-{index}",
        "consumedCapacity": {"shares": str(shares), "memory": "0"},
    }
    obj = {
        "metadata": {"name": name, "namespace": f"tenant-{index}", "uid": uid},
        "status": {"allocation": {"devices": {"results": [result], "config": configs}}},
    }
    return checked_claim(
        ClaimRef(f"tenant-{index}", uid, name), obj, driver=FIXTURE_DRIVER, pool=NODE
    )


@pytest.mark.anyio
async def test_some_integer_shares_are_never_exclusive_and_all_of_them_are_the_whole_gpu(
    node: Node,
) -> None:
    """Claims holding some of a GPU's integer shares use it together: a share with no
    sharing config (Exclusive for a whole GPU) is time-sliced with the others, as the
    device plugin's replicas were, and as admission judges it; one holding all of the
    shares has the GPU alone, and no other claim is prepared beside it."""
    emu = h100()
    preparer = node_preparer(node, emu, shares={"gpu-4": 4, "gpu-5": 4}, conflict_wait=0.1)
    one, sliced = (
        share_claim(1, "gpu-4", 1),
        share_claim(
            2,
            "gpu-4",
            1,
            {"sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}}},
        ),
    )

    results = await preparer.prepare([one, sliced])

    assert all(r.error is None for r in results.values()), results
    checkpoint = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id)
    for claim in (one, sliced):
        (device,) = checkpoint.get(claim.uid).devices  # type: ignore[union-attr]
        assert not device.exclusive
        assert device.details.time_slice is not None  # time-sliced, one setting for both

    whole = share_claim(3, "gpu-5", 4)
    assert (await preparer.prepare([whole]))[whole.uid].error is None
    beside = share_claim(4, "gpu-5", 1)
    error = (await preparer.prepare([beside]))[beside.uid].error
    assert error is not None and "already prepared exclusively" in error
    assert "must be unprepared first" in error and "undone" not in error
    (device,) = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).get(whole.uid).devices  # type: ignore[union-attr]
    assert device.exclusive and device.details.time_slice is None


async def _gpu_held(
    node: Node, index: int, conflict_wait: float, *namespaces: str
) -> tuple[ClaimPreparer, str, Claim, list[Claim]]:
    """A preparer (`conflict_wait`) with H100 GPU `index` prepared for a claim of
    tenant-a, and a claim of each of `namespaces` allocated the same GPU."""
    emu = h100()
    preparer = node_preparer(node, emu, conflict_wait=conflict_wait)
    gpu = discover(emu).gpus[index].device.name
    old, *others = (
        offline_claim(ns, [("gpu", {"device": gpu})], {}) for ns in ("tenant-a", *namespaces)
    )
    assert (await preparer.prepare([old]))[old.uid].error is None
    return preparer, gpu, old, others


async def _prepare_into(
    results: dict[str, PrepareResult], preparer: ClaimPreparer, claim: Claim
) -> None:
    results.update(await preparer.prepare([claim]))


@pytest.mark.anyio
async def test_a_prepare_waits_for_the_unprepare_of_the_claim_holding_its_gpu(node: Node) -> None:
    """A pod deleted with no grace leaves the API before its node has unprepared its
    claim, and the scheduler may give its GPU to a new claim at once. The new claim's
    prepare waits for that unprepare and succeeds once it comes, rather than failing
    into the kubelet's next sync of its pod, a minute or more later. While it waits,
    nothing of it is recorded."""
    # Only the unprepare ends the wait.
    preparer, gpu, old, [new] = await _gpu_held(node, 2, 3600, "tenant-b")
    results: dict[str, PrepareResult] = {}

    with anyio.fail_after(60):  # the unprepare never ended the wait
        async with anyio.create_task_group() as group:
            group.start_soon(_prepare_into, results, preparer, new)
            await anyio.wait_all_tasks_blocked()
            assert results == {}  # waiting, not refused
            assert new.uid not in checkpoint_document(node.checkpoint)["claims"]
            assert await preparer.unprepare([old.ref]) == {old.uid: None}

    result = results[new.uid]
    assert result.error is None
    assert [d.device_name for d in result.devices] == [gpu]
    record = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).get(new.uid)
    assert record is not None and record.completed
    assert list(node.cdi_dir.iterdir()) and old.uid not in str(list(node.cdi_dir.iterdir()))


@dataclass
class GoneFromTheApi:
    """The sweep's view of the API server: the claims named are deleted, with no pod."""

    deleted: set[str]

    async def current_uid(self, ref: ClaimRef) -> str | None:
        return None if ref.uid in self.deleted else ref.uid

    async def still_used(self, ref: ClaimRef, pod: str, pod_uid: str) -> bool:
        return False


@pytest.mark.anyio
async def test_the_sweeps_unprepare_of_the_holder_lets_a_waiting_prepare_go_on_only_at_its_end(
    node: Node,
) -> None:
    """The sweep of deleted claims unprepares a claim whose pod is gone from the API; a
    pod deleted with no grace may still have containers on the node then (the kubelet
    gives them 2 s or more). Only the kubelet's unprepare, which comes once they are
    gone, lets a waiting prepare go on at once; after the sweep's it plans again at the
    end of its wait, as a kubelet's retry would, and gets the GPU then."""
    preparer, gpu, old, [new] = await _gpu_held(node, 4, 1.0, "tenant-b")
    results: dict[str, PrepareResult] = {}

    async with anyio.create_task_group() as group:
        group.start_soon(_prepare_into, results, preparer, new)
        await anyio.wait_all_tasks_blocked()
        assert await preparer.cleanup_deleted_claims(GoneFromTheApi({old.uid})) == [old.uid]
        await anyio.wait_all_tasks_blocked()
        assert results == {}  # still waiting: the sweep's unprepare does not end it
        assert old.uid not in checkpoint_document(node.checkpoint)["claims"]

    result = results[new.uid]
    assert result.error is None
    assert [d.device_name for d in result.devices] == [gpu]


@pytest.mark.anyio
async def test_of_two_prepares_waiting_for_one_gpu_one_gets_it_and_the_other_is_refused(
    node: Node,
) -> None:
    """The unprepare frees the GPU for one claim; the other plans again, finds the GPU
    held by the first, waits out what is left of its time and is refused, its error
    naming the holder, the wait and what frees the GPU."""
    preparer, gpu, old, [first, second] = await _gpu_held(node, 3, 0.5, "team-b", "team-c")
    results: dict[str, PrepareResult] = {}

    async with anyio.create_task_group() as group:
        group.start_soon(_prepare_into, results, preparer, first)
        group.start_soon(_prepare_into, results, preparer, second)
        await anyio.wait_all_tasks_blocked()
        assert results == {}
        assert await preparer.unprepare([old.ref]) == {old.uid: None}

    got, refused = sorted((first, second), key=lambda c: results[c.uid].error is not None)
    assert results[got.uid].error is None
    error = results[refused.uid].error
    assert error is not None
    assert f"device {NODE}/{gpu} is already prepared exclusively for claim ({got.uid})" in error
    assert "must be unprepared first (waited 0.5 s for it;" in error
    assert refused.uid not in checkpoint_document(node.checkpoint)["claims"]
    assert await preparer.unprepare([got.ref]) == {got.uid: None}
    assert (await preparer.prepare([refused]))[refused.uid].error is None


class FailAfterGpuInstance:
    """The real emulator, except that reading a GPU instance fails once, right after
    one is created (the instance exists; its ID was never read)."""

    def __init__(self, inner: NvmlEmulator) -> None:
        self._inner = inner
        self._created = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, *args: Any) -> Any:
        self._created = True
        return self._inner.nvmlDeviceCreateGpuInstanceWithPlacement(*args)

    def nvmlGpuInstanceGetInfo(self, gi: Any) -> Any:
        if self._created:
            self._created = False
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return self._inner.nvmlGpuInstanceGetInfo(gi)


@pytest.mark.anyio
async def test_an_instance_made_before_a_failure_is_destroyed_not_leaked(node: Node) -> None:
    """Only NVML refusing the creation means nothing was made: a failure after it (here
    reading the new instance) keeps the record, so the undo destroys the instance and
    the placement serves the next prepare."""
    emu = h100_mig()
    claim = _fixture_claim(5)  # allocated gpu-0-mig-3g40gb-9-0
    failing = node_preparer(node, FailAfterGpuInstance(emu), strategy=MigStrategy.DYNAMIC)

    result = (await failing.prepare([claim]))[claim.uid]

    assert result.error is not None and "creating MIG GPU instance" in result.error
    assert mig_devices(emu) == {}
    preparer = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC)
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    assert list(mig_devices(emu)) == ["gpu-0-mig-3g40gb-9-0"]


@pytest.mark.anyio
@pytest.mark.parametrize(("previous", "shown"), [(None, "null"), ("abc", "'abc'")])
async def test_unreadable_record_is_its_claims_error_and_never_stops_recovery(
    node: Node, previous: Any, shown: str
) -> None:
    """A compute mode record whose previous mode is not a number cannot be restored:
    recover() undoes the rest of that claim, reports it and keeps its record for a
    retry, and goes on with the other claims."""
    emu = h100()
    gpus = discover(emu).gpus
    broken = ClaimRef("team-a", str(uuidlib.uuid4()), "broken")
    fine = ClaimRef("team-a", str(uuidlib.uuid4()), "fine")

    def record(ref: ClaimRef, gpu: int, details: dict[str, Any]) -> dict[str, Any]:
        uuid = gpus[gpu].uuid
        details = {"type": "gpu", "request": "gpu", "parentUuid": uuid, "uuid": uuid, **details}
        device = {"pool": NODE, "device": f"gpu-{gpu}", "requestNames": ["gpu"], "details": details}
        return {
            "uid": ref.uid,
            "namespace": ref.namespace,
            "name": ref.name,
            "state": "PrepareStarted",
            "devices": [device],
        }

    mode = {"uuid": gpus[2].uuid, "previous": previous, "applied": True}
    slices = {"uuid": gpus[2].uuid, "interval": 3, "applied": True}
    claims = {
        broken.uid: record(broken, 2, {"timeSlice": slices, "computeMode": mode}),
        fine.uid: record(fine, 3, {"timeSlice": {**slices, "uuid": gpus[3].uuid}}),
    }
    node.checkpoint.parent.mkdir(parents=True)
    node.checkpoint.write_text(json.dumps({"version": 1, "bootId": BOOT_A, "claims": claims}))
    preparer = node_preparer(node, emu)

    report = await preparer.recover()

    assert report.rolled_back == (fine.uid,)
    [error] = report.errors
    assert broken.describe() in error
    assert f"details.computeMode: previous must be an integer, not {shown}" in error
    assert str(node.checkpoint.parent / "undone" / broken.uid) in error
    # The rest of the broken claim was undone all the same.
    resets = [f"nvidia-smi compute-policy -i {gpus[i].uuid} --set-timeslice 0" for i in (2, 3)]
    assert sorted(c for c in node.tool_calls() if "--set-timeslice 0" in c) == sorted(resets)
    # Its record stays, as written, and unprepare reports the same until it is fixed.
    cp = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id)
    assert [c.uid for c in cp.claims()] == [broken.uid]
    written = checkpoint_document(node.checkpoint)["claims"][broken.uid]
    assert written["devices"][0]["details"]["computeMode"] == mode
    again = (await preparer.unprepare([broken]))[broken.uid]
    assert again is not None and "details.computeMode" in again
    # Undone by hand, as the error says: the file it names lets the rest go.
    marker = node.checkpoint.parent / "undone" / broken.uid
    assert str(marker) in again
    marker.parent.mkdir()
    marker.touch()
    assert (await preparer.unprepare([broken]))[broken.uid] is None
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).claims() == []
    assert not marker.exists()


@pytest.mark.anyio
async def test_a_newer_releases_side_effect_keeps_its_claim_until_undone_by_hand(
    node: Node,
) -> None:
    """After a downgrade, a record naming a side effect this release does not know (a
    newer release's) is not unprepared as if it were not there: unprepare fails naming
    it, the record stays, and the `undone` file lets it go once undone by hand."""
    emu = h100()
    claim = _fixture_claim(0)
    preparer = node_preparer(node, emu)
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    doc = checkpoint_document(node.checkpoint)
    effect = {"uuid": "GPU-x", "previous": 300, "applied": True}
    doc["claims"][claim.uid]["devices"][0]["details"]["powerLimit"] = effect
    _rewrite_checkpoint(node.checkpoint, doc)
    older = node_preparer(node, emu)

    error = (await older.unprepare([claim]))[claim.uid]

    assert error is not None and "details.powerLimit" in error
    cp = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id)
    assert [c.uid for c in cp.claims()] == [claim.uid]
    marker = node.checkpoint.parent / "undone" / claim.uid
    assert str(marker) in error
    marker.parent.mkdir()
    marker.touch()
    assert (await older.unprepare([claim]))[claim.uid] is None
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).claims() == []


@pytest.mark.anyio
async def test_a_mark_left_for_a_claim_of_this_boot_goes_with_its_unprepare(node: Node) -> None:
    """The previous boot's clean-up keeps an admin's mark while this boot has a record
    of the same claim; that claim's unprepare then removes it, even when its own record
    reads whole, so that no mark outlives every record it could be for (a stale one
    would forget a later record of the claim that cannot be read)."""
    emu = h100()
    claim = _fixture_claim(0)
    preparer = node_preparer(node, emu)
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    doc = checkpoint_document(node.checkpoint)
    gpu = discover(emu).gpus[0].uuid
    doc["previousBoot"] = [
        _previous_boot_record(claim.uid, "gpu-1", {"type": "gpu", "parentUuid": gpu, "mig": "?"})
    ]
    node.checkpoint.write_text(json.dumps(doc))
    marker = node.checkpoint.parent / "undone" / claim.uid
    marker.parent.mkdir()
    marker.touch()
    again = node_preparer(node, emu)
    report = await again.recover()
    assert not report.errors, report.errors
    assert "previousBoot" not in checkpoint_document(node.checkpoint)
    assert marker.exists()  # kept: this boot's claim of that UID is there
    assert (await again.unprepare([claim.ref]))[claim.uid] is None
    assert not marker.exists()


@pytest.mark.anyio
async def test_a_claim_whose_record_cannot_be_read_is_never_called_unprepared(node: Node) -> None:
    """A record unreadable as a whole (a field of its own or a device's of the wrong
    type) may describe a compute mode or instance still set up: unprepare and prepare of
    that claim fail naming the field until it is fixed by hand, recovery reports it, and
    the device it names is given to no other claim."""
    emu = h100()
    gpu = discover(emu).gpus[1].uuid
    uid = "00000000-0000-4000-8000-0000000000aa"
    record = {
        "uid": uid,
        "namespace": "team-a",
        "name": "whole",
        "state": "PrepareCompleted",
        "devices": [
            {
                "pool": NODE,
                "device": "gpu-1",
                "requestNames": "gpu",  # not a list: the whole record is unreadable
                "details": {
                    "type": "gpu",
                    "parentUuid": gpu,
                    "uuid": gpu,
                    "computeMode": {"uuid": gpu, "previous": 0, "applied": True},
                },
            }
        ],
    }
    node.checkpoint.parent.mkdir(parents=True)
    node.checkpoint.write_text(
        json.dumps({"version": 1, "bootId": BOOT_A, "claims": {uid: record}})
    )
    _set_compute_mode(emu, gpu, EXCLUSIVE_PROCESS)
    # No unprepare frees what an unreadable record names: a prepare refused for it
    # never waits for one (`fail_after` below).
    preparer = node_preparer(node, emu, conflict_wait=3600)

    [error] = (await preparer.recover()).errors
    assert uid in error and "requestNames must be a list of strings" in error
    ref = ClaimRef("team-a", uid, "whole")
    for answer in (
        (await preparer.unprepare([ref]))[uid],
        (await preparer.prepare([_fixture_claim(0, uid=uid)]))[uid].error,
    ):
        assert answer is not None
        assert "requestNames must be a list of strings" in answer
        assert str(node.checkpoint.parent / "undone" / uid) in answer
    other = _fixture_claim(0)  # gpu-1, another claim
    with anyio.fail_after(60):
        refused = (await preparer.prepare([other]))[other.uid].error
    assert refused is not None and f"checkpoint record of claim {uid}" in refused
    # The remedy is the by-hand one: no unprepare frees a device an unreadable record names.
    assert str(node.checkpoint.parent / "undone" / uid) in refused
    assert "unprepared first" not in refused
    assert _compute_mode(emu, gpu) == EXCLUSIVE_PROCESS
    assert checkpoint_document(node.checkpoint)["claims"][uid] == record

    # Undone by hand, as the error says: the file it names makes the agent forget it.
    marker = node.checkpoint.parent / "undone" / uid
    assert str(marker) in error
    marker.parent.mkdir()
    marker.touch()
    assert (await preparer.unprepare([ref]))[uid] is None
    assert uid not in checkpoint_document(node.checkpoint)["claims"]
    assert not marker.exists()
    assert (await preparer.prepare([other]))[other.uid].error is None


@pytest.mark.anyio
async def test_previous_boot_cleanup_keeps_what_a_claim_with_an_unreadable_record_holds(
    node: Node,
) -> None:
    """This boot's claim whose record cannot be read may still hold its MIG instance and
    MPS folders: the previous boot's records naming them leave them, as the orphan sweep
    and the other claims do."""
    emu = h100_mig()
    gpu = discover(emu).gpus[0]
    placement = next(p.placement for p in gpu.partitions if p.name == "gpu-0-mig-3g40gb-9-0")
    mig_claim, mps_claim = _fixture_claim(5), _fixture_claim(_MPS_CLAIM)
    first = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC)
    for claim in (mig_claim, mps_claim):
        assert (await first.prepare([claim]))[claim.uid].error is None
    daemon = _recorded_daemon(node, mps_claim.uid)
    base = _mps_base(node, mps_claim.uid)
    try:
        doc = checkpoint_document(node.checkpoint)
        for claim in (mig_claim, mps_claim):
            doc["claims"][claim.uid]["devices"][0]["requestNames"] = "gpu"  # unreadable
        mig = {
            "created": True,
            "profileId": placement.profile_id,
            "profile": placement.profile,
            "start": placement.start,
            "size": placement.size,
        }
        folders = {"pipeDir": str(base / "pipe"), "logDir": str(base / "log")}
        doc["previousBoot"] = [
            _previous_boot_record(
                "11111111-1111-4111-8111-111111111111",
                "gpu-0-mig-3g40gb-9-0",
                {"type": "mig", "parentUuid": gpu.uuid, "mig": mig},
            ),
            _previous_boot_record(mps_claim.uid, "gpu-3", {"type": "gpu", "mps": folders}),
        ]
        _rewrite_checkpoint(node.checkpoint, doc)

        report = await node_preparer(node, emu, strategy=MigStrategy.DYNAMIC).recover()

        assert sum(c.uid in e for c in (mig_claim, mps_claim) for e in report.errors) == 2
        assert list(mig_devices(emu)) == ["gpu-0-mig-3g40gb-9-0"]
        assert (base / "pipe" / "control").exists()
    finally:
        daemon.signal(signal.SIGKILL)


# --- MPS and hostile tenants ------------------------------------------------------------------
# A tenant controls its containers, and so everything they can write: the MPS pipe
# folder and the claim's /dev/shm. Nothing there may decide what unprepare does.

_MPS_CLAIM = 2  # FIXTURE_CLAIMS' MPS claim on gpu-3
_NEXT_TENANT = "00000000-0000-4000-8000-0000000000ff"


def _mps_base(node: Node, uid: str) -> Path:
    return node.checkpoint.parent / "mps" / uid


def _recorded_daemon(node: Node, uid: str, checkpoint: Path | None = None) -> ProcessIdentity:
    record = load_checkpoint(checkpoint or node.checkpoint, boot_id_path=node.boot_id).get(uid)
    assert record is not None
    mps = record.devices[0].details.mps
    assert mps is not None and mps.daemon is not None
    return mps.daemon


def _as_an_older_release_recorded(node: Node, uid: str) -> None:
    """The claim's record as a release from before the daemon's identity was kept
    wrote it, and the daemon's PID file (which the claim's containers may remove)
    gone: only the pipe folder is left to find the daemon by."""
    doc = checkpoint_document(node.checkpoint)
    for device in doc["claims"][uid]["devices"]:
        for key in ("daemonPid", "daemonStartTime"):
            device["details"]["mps"].pop(key, None)
    _rewrite_checkpoint(node.checkpoint, doc)
    (_mps_base(node, uid) / "pipe" / "nvidia-cuda-mps-control.pid").unlink()


async def _unmount_claim_folders(base: Path) -> None:
    """Unmount the tmpfs of a claim's MPS folders under `base`, where there are any."""
    for folder in ("shm", "pipe", "log"):
        if (base / folder).is_mount():
            await anyio.run_process(["umount", "--lazy", str(base / folder)])


async def _reboot(node: Node, daemon: ProcessIdentity, base: Path) -> None:
    """The node reboots: the MPS daemon and the claim's tmpfs under `base` are gone, and
    the boot ID is new; what is on the disk stays."""
    os.kill(daemon.pid, signal.SIGKILL)
    assert daemon.wait_gone(10.0)
    await _unmount_claim_folders(base)
    node.boot_id.write_text(BOOT_B + "\n")


@pytest.fixture
def signals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every signal the code under test sends, sent on after being noted."""
    sent: list[tuple[int, int]] = []
    real_kill = os.kill

    def kill(pid: int, signum: int) -> None:
        sent.append((pid, signum))
        real_kill(pid, signum)

    monkeypatch.setattr(os, "kill", kill)
    return sent


@pytest.mark.anyio
async def test_an_mps_claim_gets_its_own_shm_shared_with_its_daemon_only(node: Node) -> None:
    """The claim's containers and its daemon share a /dev/shm of their own (a tmpfs
    where the agent may mount, as upstream's), never the host's; unprepare removes it."""
    preparer = node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC)
    claim = _fixture_claim(_MPS_CLAIM)

    assert (await preparer.prepare([claim]))[claim.uid].error is None

    shm = _mps_base(node, claim.uid) / "shm"
    mounts = {
        m["containerPath"]: m["hostPath"]
        for m in node.spec(claim.uid)["devices"][0]["containerEdits"]["mounts"]
    }
    assert mounts["/dev/shm"] == str(shm)
    daemon = _recorded_daemon(node, claim.uid)
    assert daemon.alive()
    if may_mount():
        assert shm.is_mount()
        # The stand-in daemon marks the /dev/shm it sees: the claim's.
        assert (shm / f"gpudra-standin-mps.{daemon.pid}").exists()
    record = checkpoint_document(node.checkpoint)["claims"][claim.uid]
    assert record["devices"][0]["details"]["mps"]["shmDir"] == str(shm)

    assert await preparer.unprepare([claim.ref]) == {claim.uid: None}

    assert not daemon.alive()
    assert not shm.is_mount()
    assert not _mps_base(node, claim.uid).exists()


@pytest.mark.parametrize(
    ("cap_eff", "mounts", "removes"),
    [
        ("0000000000000000", False, False),  # every capability dropped
        ("000000000000000a", False, True),  # DAC_OVERRIDE and FOWNER: the chart's, emulated
        ("0000000000000002", False, False),  # DAC_OVERRIDE alone: no sticky folders
        ("000001ffffffffff", True, True),  # privileged
    ],
)
def test_the_agent_reads_what_its_capabilities_let_it_do_with_a_claims_folders(
    tmp_path: Path, cap_eff: str, mounts: bool, removes: bool
) -> None:
    """A tmpfs of the claim's own needs CAP_SYS_ADMIN; without it the folders are plain
    ones, whose contents unprepare must remove whoever made them (a folder left without
    write permission, another user's files in the sticky /dev/shm folder)."""
    status = tmp_path / "status"
    status.write_text(f"Name:\tgpudra\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff}\n")
    assert may_mount(status) is mounts
    assert may_remove_anything(status) is removes
    assert not may_mount(tmp_path / "gone") and not may_remove_anything(tmp_path / "gone")


@pytest.mark.anyio
@pytest.mark.skipif(not may_mount(), reason="a tmpfs of the claim's own needs CAP_SYS_ADMIN")
async def test_what_a_container_writes_in_its_pipe_folder_never_fills_the_nodes_disk(
    node: Node,
) -> None:
    """The pipe folder is mounted writable into the claim's containers: it is a small
    tmpfs of its own, so a tenant that fills it fills that, never the file system the
    checkpoint is on, and the next tenant's prepare still records its claim."""
    preparer = node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC)
    claim = _fixture_claim(_MPS_CLAIM)
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    pipe = _mps_base(node, claim.uid) / "pipe"
    assert pipe.is_mount()
    assert os.statvfs(pipe).f_blocks * os.statvfs(pipe).f_frsize <= 4 << 20

    # What the tenant's container does through its mount of the pipe folder.
    with pytest.raises(OSError) as full, (pipe / "filler").open("wb") as filler:
        for _ in range(64):
            filler.write(b"\0" * (1 << 20))
            filler.flush()
    assert full.value.errno == errno.ENOSPC
    other = _fixture_claim(0)
    assert (await preparer.prepare([other]))[other.uid].error is None
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).get(other.uid) is not None

    assert await preparer.unprepare([claim.ref]) == {claim.uid: None}
    assert not pipe.is_mount()
    assert not _mps_base(node, claim.uid).exists()


@pytest.mark.anyio
@pytest.mark.skipif(not may_mount(), reason="a tmpfs of the claim's own needs CAP_SYS_ADMIN")
async def test_what_a_tenant_makes_its_daemon_log_never_fills_the_state_disk(
    node: Node, small_fs: Path, fill_folder: Callable[[Path], None]
) -> None:
    """The daemon appends to control.log every command a client sends it, and the
    claim's containers hold a client (CDI mounts nvidia-cuda-mps-control into them): a
    tenant looping commands grows the log at will. The log folder is a small tmpfs of
    its own, so that fills, never the file system the checkpoint is on, and another
    tenant's prepare still records its claim."""
    emu = h100()
    gpus = discover(emu).gpus
    checkpoint = small_fs / "plugin" / "checkpoint.json"
    preparer = node_preparer(node, emu, checkpoint=checkpoint)
    mps = offline_claim(
        "tenant-a", [("mps", {"device": gpus[3].device.name})], {"mps": {"strategy": "MPS"}}
    )
    other = offline_claim("tenant-b", [("ts", {"device": gpus[4].device.name})], {"ts": TS_LONG})
    base = checkpoint.parent / "mps" / mps.uid
    try:
        assert (await preparer.prepare([mps]))[mps.uid].error is None
        log_dir = base / "log"

        fill_folder(log_dir)  # what the daemon writes there for the tenant's commands

        assert (await preparer.prepare([other]))[other.uid].error is None
        assert load_checkpoint(checkpoint, boot_id_path=node.boot_id).get(other.uid) is not None
        assert log_dir.is_mount()
        assert os.statvfs(log_dir).f_blocks * os.statvfs(log_dir).f_frsize <= 16 << 20
        assert await preparer.unprepare([mps.ref, other.ref]) == {mps.uid: None, other.uid: None}
        assert not log_dir.is_mount()
        assert not base.exists()
    finally:
        fake_sharing().stop_mps(_daemon_in(base))


@pytest.mark.anyio
@pytest.mark.skipif(not may_mount(), reason="a tmpfs of the claim's own needs CAP_SYS_ADMIN")
async def test_recovery_unmounts_every_folder_of_an_mps_claim_it_has_no_record_of(
    node: Node,
) -> None:
    """Folders under the MPS root that no record names (a record removed by hand) are
    an orphan's: recovery stops its daemon and unmounts each of its tmpfs, the log
    folder's as the pipe folder's, before removing them."""
    preparer = node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC)
    claim = _fixture_claim(_MPS_CLAIM)
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    await preparer.close()
    daemon = _recorded_daemon(node, claim.uid)
    base = _mps_base(node, claim.uid)
    assert all((base / folder).is_mount() for folder in ("pipe", "log", "shm"))
    doc = checkpoint_document(node.checkpoint)
    del doc["claims"][claim.uid]
    _rewrite_checkpoint(node.checkpoint, doc)

    report = await node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC).recover()

    assert report.orphaned_mps_dirs == (claim.uid,) and report.errors == ()
    assert not daemon.alive()
    assert not base.exists()


@pytest.mark.anyio
async def test_recovery_unmounts_the_shm_of_a_prepare_a_crash_interrupted(node: Node) -> None:
    def crash(step: str) -> None:
        if step == "mps-started":
            raise SimulatedCrash(step)

    claim = _fixture_claim(_MPS_CLAIM)
    with pytest.raises(SimulatedCrash):
        await node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC, fault=crash).prepare(
            [claim]
        )
    daemon = _recorded_daemon(node, claim.uid)

    report = await node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC).recover()

    assert report.rolled_back == (claim.uid,)
    assert not daemon.alive()
    assert not (_mps_base(node, claim.uid) / "shm").is_mount()
    assert not _mps_base(node, claim.uid).exists()


@pytest.mark.anyio
async def test_a_tenant_that_fakes_its_daemons_files_cannot_keep_its_claim_prepared(
    node: Node, signals: list[tuple[int, int]]
) -> None:
    """The attack: a root container quits the daemon, replaces the control FIFO with
    a plain file and writes 1 into the PID file. Unprepare still completes, signals
    nothing, and frees the GPU for the next claim."""
    preparer = node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC)
    claim = _fixture_claim(_MPS_CLAIM)
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    daemon = _recorded_daemon(node, claim.uid)
    pipe = _mps_base(node, claim.uid) / "pipe"

    # What the tenant's container does through its mount of the pipe folder.
    with (pipe / "control").open("w") as control:
        control.write("quit\n")
    assert daemon.wait_gone(10.0)
    (pipe / "control").unlink(missing_ok=True)
    (pipe / "control").write_text("not a pipe\n")
    (pipe / "nvidia-cuda-mps-control.pid").write_text("1\n")

    assert await preparer.unprepare([claim.ref]) == {claim.uid: None}

    assert signals == []
    assert not node.has_spec(claim.uid)
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).get(claim.uid) is None
    assert not _mps_base(node, claim.uid).exists()
    following = _fixture_claim(_MPS_CLAIM, uid=_NEXT_TENANT)
    assert (await preparer.prepare([following]))[following.uid].error is None
    assert await preparer.unprepare([following.ref]) == {following.uid: None}


def test_a_recycled_pid_is_never_signalled(tmp_path: Path, signals: list[tuple[int, int]]) -> None:
    """The recorded daemon is gone and its PID now belongs to another process (same
    PID, other start time); nor does a PID file naming that process, in a record
    without the daemon's identity, make it the daemon."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        now = ProcessIdentity.of(other.pid)
        assert now is not None
        for recorded in (ProcessIdentity(other.pid, now.start_time - 1), None):
            base = tmp_path / ("recorded" if recorded else "legacy")
            daemon = _daemon_in(base, recorded)
            daemon.pipe_dir.mkdir(parents=True)
            os.mkfifo(daemon.pipe_dir / "control")  # nothing reads it
            (daemon.pipe_dir / "nvidia-cuda-mps-control.pid").write_text(f"{other.pid}\n")

            fake_sharing().stop_mps(daemon)

            assert not base.exists() or not any(base.iterdir())
        assert signals == []
        assert now.alive()
    finally:
        other.kill()
        other.wait()


@pytest.mark.anyio
async def test_a_control_fifo_nobody_reads_does_not_hang_unprepare(node: Node) -> None:
    """The tenant swaps the daemon's control FIFO for one nobody reads: the daemon is
    not asked to quit through it (that would wait out the tool's timeout, and a tenant
    with many claims would hold the agent's threads), and the recorded daemon is
    signalled instead."""
    preparer = node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC)
    claim = _fixture_claim(_MPS_CLAIM)
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    daemon = _recorded_daemon(node, claim.uid)
    control = _mps_base(node, claim.uid) / "pipe" / "control"
    control.unlink()
    os.mkfifo(control)
    sent: list[str] = []

    class Sending(NvidiaSharing):
        def _control(self, daemon: MpsDaemon, command: str, purpose: str) -> str:
            sent.append(command)
            return super()._control(daemon, command, purpose)

    sharing = Sending(
        nvidia_smi=FAKEBIN / "nvidia-smi",
        mps_control=FAKEBIN / "nvidia-cuda-mps-control",
        timeout_s=1.0,
        ready_timeout_s=1.0,
    )
    base = _mps_base(node, claim.uid)

    sharing.stop_mps(_daemon_in(base, daemon))

    assert sent == []
    assert not daemon.alive()
    assert not base.exists() or not any(base.iterdir())


@pytest.mark.anyio
async def test_mps_daemons_start_and_stop_beside_the_threads_other_claims_need(
    node: Node,
) -> None:
    """A daemon's stop may wait on what the claim's containers left: it holds a thread of
    its own, never one of the pool that checkpoint writes and other claims' NVML calls
    use, so a tenant's slow stops cannot make another tenant's prepare wait."""
    emu = h100()
    gpus = discover(emu).gpus
    stopping, go = threading.Event(), threading.Event()

    class SlowStop(StandInTools):
        def stop_mps(self, daemon: MpsDaemon) -> None:
            stopping.set()
            go.wait(10)
            super().stop_mps(daemon)

    preparer = node_preparer(node, emu, sharing=SlowStop())
    mps = offline_claim(
        "tenant-a", [("gpu", {"device": gpus[3].device.name})], {"gpu": {"strategy": "MPS"}}
    )
    other = offline_claim("tenant-b", [("gpu", {"device": gpus[4].device.name})], {})
    assert (await preparer.prepare([mps]))[mps.uid].error is None
    default = anyio.to_thread.current_default_thread_limiter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(preparer.unprepare, [mps.ref])
        while not stopping.is_set():
            await anyio.sleep(0.01)
        assert default.borrowed_tokens == 0  # the stop holds a thread of its own pool
        assert (await preparer.prepare([other]))[other.uid].error is None
        go.set()
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).get(mps.uid) is None


@pytest.mark.anyio
async def test_a_tenants_stuck_mps_stops_never_hold_back_another_tenants_mps_start(
    node: Node,
) -> None:
    """A tenant that leaves a `control` FIFO nobody reads in its pipe folders makes each
    of its stops wait (about a second); unpreparing more such claims than stops may run
    at once fills the stops' slots only: another tenant's MPS prepare starts its daemon
    while every stop slot is held and more stops wait for one."""
    emu = h100()
    gpus = discover(emu).gpus
    calls: list[str] = []
    go = threading.Event()

    class StuckStops(StandInTools):
        def start_mps(self, daemon: MpsDaemon) -> ProcessIdentity | DaemonPod:
            calls.append(f"start {daemon.name}")
            return super().start_mps(daemon)

        def stop_mps(self, daemon: MpsDaemon) -> None:
            calls.append("stop")
            go.wait(30)  # a stop stuck on what the tenant's containers left
            super().stop_mps(daemon)

    preparer = node_preparer(node, emu, sharing=StuckStops())
    slice_of = {"device": gpus[5].device.name, "consumedCapacity": {"memory": "1Gi"}}
    tampered = [
        offline_claim("tenant-a", [("mem", {**slice_of, "shareID": str(uuidlib.uuid4())})], {})
        for _ in range(MPS_THREADS + 2)
    ]
    results = await preparer.prepare(tampered)
    assert [r.error for r in results.values()] == [None] * len(tampered)
    victim = offline_claim(
        "tenant-b", [("gpu", {"device": gpus[3].device.name})], {"gpu": {"strategy": "MPS"}}
    )
    calls.clear()
    async with anyio.create_task_group() as tg:
        tg.start_soon(preparer.unprepare, [c.ref for c in tampered])
        while len(calls) < MPS_THREADS:
            await anyio.sleep(0.01)
        try:
            # Only a guard: one limiter for both would wait here until `go`.
            with anyio.fail_after(20):
                result = await preparer.prepare([victim])
            seen = list(calls)
        finally:
            go.set()
    assert result[victim.uid].error is None
    # Every stop slot was held, two stops waited for one, and the start went ahead.
    assert seen == ["stop"] * MPS_THREADS + [f"start {victim.uid}"]
    assert calls.count("stop") == len(tampered)
    assert await preparer.unprepare([victim.ref]) == {victim.uid: None}


def _share_claim(namespace: str, interval: str, device: str) -> Claim:
    """One share of `device`, time-sliced at `interval`, as the scheduler allocates it."""
    uid = str(uuidlib.uuid4())
    parameters = time_sliced(interval)
    result = {
        "request": "gpu",
        "driver": FIXTURE_DRIVER,
        "pool": NODE,
        "device": device,
        "shareID": str(uuidlib.uuid4()),
        "consumedCapacity": {"shares": "1"},
    }
    opaque = {"driver": FIXTURE_DRIVER, "parameters": parameters}
    obj = {
        "metadata": {"name": "c", "namespace": namespace, "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [result],
                    "config": [{"source": "FromClaim", "opaque": opaque}],
                }
            }
        },
    }
    return checked_claim(ClaimRef(namespace, uid, "c"), obj, driver=FIXTURE_DRIVER, pool=NODE)


@pytest.mark.anyio
async def test_a_refusal_for_another_interval_names_no_other_tenants_claim(node: Node) -> None:
    """The refusal reaches the refused claim's pod events: a claim of another namespace on
    the same GPU is not named there; one of the same namespace is."""
    emu = h100()
    preparer = node_preparer(node, emu)
    device = discover(emu).gpus[4].device.name
    first = _share_claim("tenant-a", "Long", device)
    assert (await preparer.prepare([first]))[first.uid].error is None

    other = _share_claim("tenant-b", "Short", device)
    refused = (await preparer.prepare([other]))[other.uid].error
    assert refused is not None and "for a claim of another namespace" in refused
    assert "tenant-a" not in refused
    same = _share_claim("tenant-a", "Short", device)
    refused = (await preparer.prepare([same]))[same.uid].error
    assert refused is not None and "for claim tenant-a/c" in refused


def _deep_tree(folder: Path, depth: int = 1500) -> None:
    """What `mkdir -p d/d/.../d` (`depth` levels) makes, as a container could."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
    finally:
        os.close(fd)


@pytest.mark.anyio
async def test_a_deep_tree_in_the_pipe_folder_neither_keeps_the_claim_nor_stops_the_agent(
    node: Node,
) -> None:
    """A tree deeper than Python's recursion limit in the claim's pipe folder: unprepare
    removes it all; left over a reboot, recovery removes it and the agent starts."""
    claim = _fixture_claim(_MPS_CLAIM)
    try:
        preparer = node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC)
        assert (await preparer.prepare([claim]))[claim.uid].error is None
        _deep_tree(_mps_base(node, claim.uid) / "pipe")

        assert await preparer.unprepare([claim.ref]) == {claim.uid: None}
        assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).get(claim.uid) is None
        assert not _mps_base(node, claim.uid).exists()

        assert (await preparer.prepare([claim]))[claim.uid].error is None
        # After a reboot the tree is left on the disk (by an agent that could not mount
        # a tmpfs).
        await _reboot(node, _recorded_daemon(node, claim.uid), _mps_base(node, claim.uid))
        _deep_tree(_mps_base(node, claim.uid) / "pipe")

        report = await node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC).recover()

        assert report.previous_boot == (claim.uid,)
        assert report.errors == ()
        assert not _mps_base(node, claim.uid).exists()
    finally:  # a tree this deep would stop pytest's own clean-up of its temp folders
        base = _mps_base(node, claim.uid)
        await _unmount_claim_folders(base)
        await anyio.run_process(["rm", "-rf", str(base)])


@pytest.mark.parametrize("planted", ["fifo", "link to /dev/zero", "folder", "huge file"])
def test_a_pid_file_the_container_replaced_is_read_without_waiting(
    tmp_path: Path, planted: str
) -> None:
    """A record without the daemon's identity (from the release before it was recorded)
    is stopped on the word of the PID file, which the container can replace: a FIFO
    would block a plain open until written, /dev/zero would be read without end."""
    daemon = _daemon_in(tmp_path / "legacy")
    daemon.pipe_dir.mkdir(parents=True)
    pid_file = daemon.pipe_dir / "nvidia-cuda-mps-control.pid"
    if planted == "fifo":
        os.mkfifo(pid_file)
    elif planted == "link to /dev/zero":
        pid_file.symlink_to("/dev/zero")
    elif planted == "folder":
        pid_file.mkdir()
    else:
        pid_file.write_bytes(b"7" * (1 << 20))
    stopped: list[bool] = []
    stopper = threading.Thread(
        target=lambda: stopped.append(fake_sharing().stop_mps(daemon) is None), daemon=True
    )

    stopper.start()
    stopper.join(timeout=30)

    if stopper.is_alive():  # let a blocked open return, so that the test can end
        os.close(os.open(pid_file, os.O_WRONLY | os.O_NONBLOCK))
    assert stopped == [True]
    assert not daemon.pipe_dir.exists()


def test_a_pid_file_that_is_not_a_regular_file_is_never_opened(tmp_path: Path) -> None:
    """Opening is an act of its own: on a FIFO it releases the process waiting at its
    other end, on a device node the containers made (a plain folder is not `nodev`) it
    may act on the device. What is not a regular file is looked at, never opened; here
    the container's writer, waiting for a reader, is still waiting after the stop."""
    daemon = _daemon_in(tmp_path / "legacy")
    daemon.pipe_dir.mkdir(parents=True)
    pid_file = daemon.pipe_dir / "nvidia-cuda-mps-control.pid"
    os.mkfifo(pid_file)
    handle = os.open(pid_file, os.O_PATH)  # to release the writer at the end
    released = threading.Event()

    def container() -> None:
        # A signal with a handler that this thread takes for the process interrupts
        # the wait, and Python then opens the path again, which the stop may have
        # removed by then (seen when run after the module's other tests).
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        os.close(os.open(pid_file, os.O_WRONLY))  # waits for a reader
        released.set()

    writer = threading.Thread(target=container, daemon=True)
    writer.start()
    _wait_in_open(writer)  # else the stop may remove the folder before the writer opens
    try:
        fake_sharing().stop_mps(daemon)
        assert not released.wait(0.5)
    finally:
        os.close(os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK))
        os.close(handle)
    assert released.wait(5)
    assert not daemon.pipe_dir.exists()


_OPENAT: Final = {"x86_64": 257, "aarch64": 56}
"""openat's system call number, as /proc/<pid>/task/<tid>/syscall shows it."""


def _wait_in_open(thread: threading.Thread) -> None:
    """Until `thread` waits in openat (a FIFO's writer waiting for a reader): under load
    it may not have got there before the test goes on. Where the architecture's number
    is not known, a pause stands in."""
    number = _OPENAT.get(platform.machine())
    if number is None:
        time.sleep(0.5)
        return
    path = Path(f"/proc/self/task/{thread.native_id}/syscall")
    deadline = time.monotonic() + 10
    while not path.read_text().startswith(f"{number} "):
        assert time.monotonic() < deadline, "the writer never reached its open"
        time.sleep(0.01)


_WRITER = """
import os, sys
pipe, stop = sys.argv[1], sys.argv[2]
count = 0
while not os.path.exists(stop):
    try:
        os.close(os.open(f"{pipe}/f{count % 5000}", os.O_CREAT | os.O_WRONLY, 0o600))
    except FileNotFoundError:
        pass
    count += 1
"""
"""Makes files in a pipe folder until a stop file appears, as a container could."""


@pytest.mark.anyio
async def test_a_container_writing_while_its_claim_is_unprepared_only_delays_it(
    node: Node, tmp_path: Path
) -> None:
    """The agent's sweep unprepares a claim whose ResourceClaim is gone whatever still
    runs. Files made in the pipe folder while it is removed keep the claim prepared
    (an error, retried), never forgotten with its folder left behind; once the writes
    stop, unprepare completes, and a restarted agent finds nothing to wait on."""
    preparer = node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC)
    claim = _fixture_claim(_MPS_CLAIM)
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    pipe = _mps_base(node, claim.uid) / "pipe"
    stop = tmp_path / "stop-writing"
    # The claim's container, in a process of its own as it would be.
    writer = await anyio.open_process([sys.executable, "-c", _WRITER, str(pipe), str(stop)])
    try:
        while not any(pipe.glob("f*")):  # the container is busy writing
            await anyio.sleep(0.05)
        errors = [(await preparer.unprepare([claim.ref]))[claim.uid] for _ in range(3)]
    finally:
        stop.touch()
        with anyio.fail_after(30):
            await writer.wait()
        await writer.aclose()
    record = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).get(claim.uid)
    if record is not None:  # else the removal always won the race: nothing was left
        assert any(e and "Directory not empty" in e for e in errors), errors
        assert pipe.is_dir()
        # What the container leaves for the next try: a FIFO for the daemon's PID file.
        with contextlib.suppress(FileNotFoundError):
            (pipe / "nvidia-cuda-mps-control.pid").unlink()
        os.mkfifo(pipe / "nvidia-cuda-mps-control.pid")
        assert await preparer.unprepare([claim.ref]) == {claim.uid: None}
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).get(claim.uid) is None
    assert not _mps_base(node, claim.uid).exists()
    with anyio.fail_after(30):
        report = await node_preparer(node, h100_mig(), strategy=MigStrategy.DYNAMIC).recover()
    assert report.errors == () and report.orphaned_mps_dirs == ()


def test_a_control_fifo_without_a_daemon_is_not_written(node: Node) -> None:
    """No live daemon behind the FIFO: nothing is asked of it (a write would block)."""
    base = node.root / "mps" / "gone"
    gone = ProcessIdentity.of(os.getpid())
    assert gone is not None
    daemon = _daemon_in(base, ProcessIdentity(gone.pid, gone.start_time + 1))
    daemon.pipe_dir.mkdir(parents=True)
    os.mkfifo(daemon.pipe_dir / "control")

    fake_sharing().stop_mps(daemon)

    assert node.tool_calls() == []
    assert not daemon.pipe_dir.exists()


_RACING_CLIENT = """#!/bin/sh
# NVIDIA's client as a container racing the agent makes it act: between the agent's
# look at the control pipe and the client's open of it by path, the container swaps it
# for a link to a file of the node's. Other calls go to the stand-in tool.
case "$1" in -d|-f) exec "$STANDIN" "$@" ;; esac
read -r line
if [ "$line" = quit ]; then
    rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
    ln -s "$VICTIM" "$CUDA_MPS_PIPE_DIRECTORY/control"
    printf 'quit\\n' > "$CUDA_MPS_PIPE_DIRECTORY/control" || exit 1
    exit 0
fi
printf '%s\\n' "$line" | exec "$STANDIN"
"""


@pytest.mark.parametrize("folder", ["tmpfs", "plain folder"])
def test_a_link_a_container_swaps_in_for_the_control_pipe_never_takes_the_quit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    """The claim's containers may run on while it is unprepared (a pod force-deleted,
    its claim swept) and swap the control pipe for a link after the agent looked at it:
    the client would write `quit` through it, as root, to the checkpoint or any file
    the agent sees. Through a tmpfs mounted nosymfollow the link is not followed; in a
    plain folder the client is not run, and the daemon is ended by signal."""
    if folder == "tmpfs" and not may_mount():
        pytest.skip("a tmpfs of the claim's own needs CAP_SYS_ADMIN")
    if folder == "plain folder":
        monkeypatch.setattr(sharing_module, "may_mount", lambda: False)
    victim = tmp_path / "checkpoint.json"
    victim.write_text("{}\n")
    backend = NvidiaSharing(
        mps_control=_mps_control_tool(tmp_path, _RACING_CLIENT),
        env={"STANDIN": str(FAKEBIN / "nvidia-cuda-mps-control"), "VICTIM": str(victim)},
        ready_timeout_s=5.0,
    )
    with _running_daemon(backend, _daemon_in(tmp_path / "claim")) as (daemon, identity):
        backend.stop_mps(daemon)
    assert victim.read_text() == "{}\n"
    assert not identity.alive()
    assert not daemon.pipe_dir.exists()


@pytest.mark.cluster
@pytest.mark.anyio
async def test_a_dynamic_mig_device_is_sampled_with_its_holder_while_a_prepare_holds_the_lock(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """The sampler finds a MIG device a prepare created (before any rediscovery) and
    labels it with the claim; it reads the checkpoint without the preparer's lock."""
    emu = h100_mig()
    inventory = discover(emu)
    env.publish(inventory, MigStrategy.DYNAMIC)
    profile = f'device.attributes["{env.driver}"].profile == "1g.10gb"'
    claim = env.allocated("mig", requests=[env.request("mig", cel=profile)])
    ref = _ref(claim)
    registry = CollectorRegistry()
    preparer = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC, registry=registry)
    infos = ClaimInfos()
    claims = ApiClaims(akube, driver=env.driver, pool=NODE, infos=infos)
    calls = ClaimDispatcher(preparer, claims, ClaimMetrics(registry))
    assert (await calls.prepare([ref]))[ref.uid].error is None
    [mig_uuid] = mig_devices(emu).values()

    now = [0.0]
    accounting = Accounting(zero_window_s=0)  # a new counter at zero to one scrape only
    sampler = Sampler(
        emu,
        pool=NODE,
        inventory=lambda: inventory,  # discovered before the MIG device existed
        prepared=lambda: cp.claims() if (cp := preparer.checkpoint_now()) else (),
        claim_info=infos.snapshot,
        on_sample=(accounting.observe,),
        clock=lambda: now[0],
        interval_s=60,  # sampled a minute apart: no stall between the two
    )
    registry.register(DeviceMetrics(sampler, accounting))
    async with preparer._lock:  # a prepare in progress
        with anyio.fail_after(30):
            await sampler.sample_once()
            now[0] += 60
            await sampler.sample_once()

    generate_latest(registry)  # a new counter's first scrape serves it at zero
    text = generate_latest(registry).decode()
    [memory] = [
        ln
        for ln in text.splitlines()
        if ln.startswith("gpudra_gpu_memory_total_bytes{") and f'uuid="{mig_uuid}"' in ln
    ]
    assert f'claim="{ref.name}"' in memory
    assert f'namespace="{env.namespace}"' in memory
    assert 'utilization_scope="mig_instance"' in memory  # an H100: GPM measures it
    [billed] = [
        ln for ln in text.splitlines() if ln.startswith("gpudra_allocated_device_seconds_total{")
    ]
    assert f'device_class="{env.driver}"' in billed
    # A minute of a 1g instance of an H100: a seventh of a GPU-minute.
    assert float(billed.rsplit(" ", 1)[1]) == pytest.approx(60 / 7)
    assert await calls.unprepare([ref]) == {ref.uid: None}


@pytest.mark.cluster
@pytest.mark.anyio
async def test_claim_status_shows_the_created_mig_device_until_unprepare(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    emu = h100_mig()
    env.publish(discover(emu), MigStrategy.DYNAMIC)
    profile = f'device.attributes["{env.driver}"].profile == "1g.10gb"'
    claim = env.allocated("mig", requests=[env.request("mig", cel=profile)])
    ref = _ref(claim)
    plugin = make_preparer(env, node, akube, emu, strategy=MigStrategy.DYNAMIC)
    writer = ClaimStatusWriter(
        akube,
        driver=env.driver,
        pool=NODE,
        prepared=lambda: cp.claims() if (cp := plugin.preparer.checkpoint_now()) else (),
    )
    assert (await plugin.prepare([ref]))[ref.uid].error is None
    [(name, mig_uuid)] = mig_devices(emu).items()

    await writer.sync_once()
    status = env.kube.get("ResourceClaim", ref.name, env.namespace)["status"]
    [entry] = status["devices"]
    assert (entry["driver"], entry["pool"], entry["device"]) == (env.driver, NODE, name)
    assert entry["data"]["migUUID"] == mig_uuid
    assert entry["data"]["gpuUUID"] == discover(emu).gpus[0].uuid
    assert entry["data"]["sharing"] == "Exclusive"
    assert status["allocation"]  # the scheduler's part is left alone

    assert await plugin.unprepare([ref]) == {ref.uid: None}
    await writer.sync_once()
    status = env.kube.get("ResourceClaim", ref.name, env.namespace)["status"]
    assert not status.get("devices")
    assert status["allocation"]


@pytest.mark.cluster
@pytest.mark.anyio
async def test_memory_slices_are_billed_by_the_memory_the_scheduler_gave_them(
    env: Env, node: Node, akube: AsyncKube
) -> None:
    """The claim reader remembers each slice's memory; accounting and claim status use it."""
    emu = h100()
    env.publish(discover(emu), only=("gpu-5",), shared=True)
    memory = f"{env.driver}/memory"
    sizes = {"slice-a": "10Gi", "slice-b": "30Gi"}
    slices = [
        env.allocated(name, requests=[env.request("mem", capacity={"requests": {memory: size}})])
        for name, size in sizes.items()
    ]
    refs = [_ref(c) for c in slices]
    registry = CollectorRegistry()
    preparer = node_preparer(node, emu, registry=registry)
    infos = ClaimInfos()
    claims = ApiClaims(akube, driver=env.driver, pool=NODE, infos=infos)
    calls = ClaimDispatcher(preparer, claims, ClaimMetrics(registry))
    assert all(r.error is None for r in (await calls.prepare(refs)).values())

    def prepared() -> list[ClaimRecord]:
        cp = preparer.checkpoint_now()
        return cp.claims() if cp is not None else []

    now = [0.0]
    accounting = Accounting()
    sampler = Sampler(
        emu,
        pool=NODE,
        inventory=lambda: discover(emu),
        prepared=prepared,
        claim_info=infos.snapshot,
        on_sample=(accounting.observe,),
        clock=lambda: now[0],
        interval_s=100,  # sampled 100 s apart: no stall between the two
    )
    await sampler.sample_once()
    now[0] += 100
    sample = await sampler.sample_once()
    [total] = [r.values["memory_total"] for d, r in sample.devices if d.name == "gpu-5"]
    billed = {k.sharing: v for k, v in accounting.allocated().items()}
    assert list(billed) == ["MemorySlice"]
    assert billed["MemorySlice"] == pytest.approx(100 * 40 * 1024**3 / total)

    writer = ClaimStatusWriter(
        akube, driver=env.driver, pool=NODE, prepared=prepared, claim_info=infos.snapshot
    )
    await writer.sync_once()
    for ref, size in zip(refs, (10, 30), strict=True):
        [entry] = env.kube.get("ResourceClaim", ref.name, env.namespace)["status"]["devices"]
        assert entry["data"]["memoryLimit"] == size * 1024**3
        assert entry["data"]["sharing"] == "MemorySlice"
    assert await calls.unprepare(refs) == {r.uid: None for r in refs}


# --- time-slices shared by claims, without the API server -----------------------------------
# Found by an outside review acting as hostile tenants: the setting of a GPU that claims of
# several tenants share must follow whichever claim is really last, whatever fails.

TS_LONG = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}


def offline_claim(
    namespace: str,
    results: list[tuple[str, dict[str, Any]]],
    sharing: dict[str, Any],
    uid: str | None = None,
    kind: str = "GpuConfig",
) -> Claim:
    """A claim checked as the plugin checks it: `results` are (request, result fields),
    `sharing` the sharing of a config of `kind` bound to each request; a new UID unless
    given."""
    uid = uid or str(uuidlib.uuid4())
    config = [
        {
            "source": "FromClaim",
            "requests": [request],
            "opaque": {
                "driver": FIXTURE_DRIVER,
                "parameters": {
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": kind,
                    "sharing": value,
                },
            },
        }
        for request, value in sharing.items()
    ]
    obj = {
        "metadata": {"name": "c", "namespace": namespace, "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": r, "driver": FIXTURE_DRIVER, "pool": NODE, **x}
                        for r, x in results
                    ],
                    "config": config,
                }
            },
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "x"}],
        },
    }
    return checked_claim(ClaimRef(namespace, uid, "c"), obj, driver=FIXTURE_DRIVER, pool=NODE)


def one_share(device: str) -> dict[str, Any]:
    return {
        "device": device,
        "shareID": str(uuidlib.uuid4()),
        "consumedCapacity": {"shares": "1"},
    }


def time_slice_of(node: Node, gpu_uuid: str) -> int:
    """The GPU's time-slice as the last compute-policy call on it left it (0: default)."""
    prefix = f"nvidia-smi compute-policy -i {gpu_uuid} --set-timeslice "
    calls = [c for c in node.tool_calls() if c.startswith(prefix)]
    return int(calls[-1].removeprefix(prefix)) if calls else 0


class RemovalRacedOnce(StandInTools):
    """The stand-in tools; the first removal of a pipe folder fails as GNU rm does when
    the claim's container made a file in it meanwhile (the documented, retried case)."""

    def __init__(self) -> None:
        super().__init__()
        self.raced = False

    def stop_mps(self, daemon: MpsDaemon) -> None:
        super().stop_mps(daemon)
        if not self.raced:
            self.raced = True
            daemon.pipe_dir.mkdir(parents=True)
            (daemon.pipe_dir / "f1").touch()
            raise OSError(f"removing {daemon.pipe_dir}: Directory not empty")


class TimeSliceFailsOnce(StandInTools):
    """The stand-in tools; the first time-slice setting fails (a tool timing out)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def set_time_slice(self, gpu_uuid: str, interval: int) -> None:
        if not self.failed:
            self.failed = True
            raise SharingError(f"setting time-slice {interval} on GPU {gpu_uuid}: timed out")
        super().set_time_slice(gpu_uuid, interval)


class SlowDefaultMode:
    """The emulated GPUs, but setting GPU `gpu_uuid` to DEFAULT (an MPS claim's mode put
    back) waits: `waiting` is set while it does, and it goes on once `go` is set."""

    def __init__(self, inner: NvmlEmulator, gpu_uuid: str) -> None:
        self._inner, self._uuid = inner, gpu_uuid
        self.waiting, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> Any:
        uuid = self._inner.nvmlDeviceGetUUID(handle)
        if (uuid.decode() if isinstance(uuid, bytes) else uuid) == self._uuid and mode == 0:
            self.waiting.set()
            self.go.wait(10)
        return self._inner.nvmlDeviceSetComputeMode(handle, mode)


def _sliced_and_mps(gpu_share: str, whole: str) -> Claim:
    """One share of a GPU time-sliced, and a whole GPU with MPS."""
    return offline_claim(
        "tenant-a",
        [("ts", one_share(gpu_share)), ("mps", {"device": whole})],
        {"ts": TS_LONG, "mps": {"strategy": "MPS"}},
    )


@pytest.mark.anyio
async def test_a_failed_unprepare_does_not_keep_counting_as_a_time_slice_user(node: Node) -> None:
    """The last share resets the GPU, then the rest of its unprepare fails (a tenant can
    cause that: files written into its pipe folder while it is removed). Another
    tenant's share joining the GPU meanwhile must still get its time-slice."""
    emu = h100()
    gpus = discover(emu).gpus
    sliced, whole = gpus[4], gpus[3]
    _set_compute_mode(emu, sliced.uuid, EXCLUSIVE_PROCESS)
    preparer = node_preparer(node, emu, sharing=RemovalRacedOnce())
    a = _sliced_and_mps(sliced.device.name, whole.device.name)
    assert (await preparer.prepare([a]))[a.uid].error is None
    assert (_compute_mode(emu, sliced.uuid), time_slice_of(node, sliced.uuid)) == (DEFAULT_MODE, 3)

    error = (await preparer.unprepare([a.ref]))[a.uid]
    assert error is not None and "Directory not empty" in error  # retried later

    b = offline_claim("tenant-b", [("gpu", one_share(sliced.device.name))], {"gpu": TS_LONG})
    assert (await preparer.prepare([b]))[b.uid].error is None
    assert (_compute_mode(emu, sliced.uuid), time_slice_of(node, sliced.uuid)) == (DEFAULT_MODE, 3)
    assert await preparer.unprepare([a.ref, b.ref]) == {a.uid: None, b.uid: None}
    assert _compute_mode(emu, sliced.uuid) == EXCLUSIVE_PROCESS


@pytest.mark.anyio
async def test_a_share_prepared_while_the_last_one_unprepares_gets_its_time_slice(
    node: Node,
) -> None:
    """Tenant A's unprepare has reset the GPU and waits on a later step (its MPS GPU's
    mode put back) when tenant B's share of the GPU is prepared."""
    emu = h100()
    gpus = discover(emu).gpus
    sliced, whole = gpus[4], gpus[3]
    _set_compute_mode(emu, sliced.uuid, EXCLUSIVE_PROCESS)
    nvml = SlowDefaultMode(emu, whole.uuid)
    preparer = node_preparer(node, nvml, inventory=lambda: discover(emu))
    a = _sliced_and_mps(sliced.device.name, whole.device.name)
    assert (await preparer.prepare([a]))[a.uid].error is None
    b = offline_claim("tenant-b", [("gpu", one_share(sliced.device.name))], {"gpu": TS_LONG})

    results: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:

        async def unprepare_a() -> None:
            results["a"] = (await preparer.unprepare([a.ref]))[a.uid]

        tg.start_soon(unprepare_a)
        while not nvml.waiting.is_set():
            await anyio.sleep(0.01)
        results["b"] = (await preparer.prepare([b]))[b.uid].error
        nvml.go.set()

    assert results == {"a": None, "b": None}
    assert (_compute_mode(emu, sliced.uuid), time_slice_of(node, sliced.uuid)) == (DEFAULT_MODE, 3)


@pytest.mark.anyio
async def test_the_last_two_shares_leaving_together_reset_the_gpu(node: Node) -> None:
    """Two claims sharing a GPU are unprepared at once (one pod with both, or two pods
    deleted together), one with a MIG instance to destroy after its time-slice step:
    neither may leave the setting to the other."""
    emu = h100_mig()
    gpus = discover(emu).gpus
    sliced = gpus[4]
    partition = next(p.name for p in gpus[0].partitions if "-3g40gb-" in p.name)
    _set_compute_mode(emu, sliced.uuid, EXCLUSIVE_PROCESS)
    preparer = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC)
    a = offline_claim(
        "team-a",
        [("ts", one_share(sliced.device.name)), ("mig", {"device": partition})],
        {"ts": TS_LONG},
    )
    b = offline_claim("team-a", [("ts", one_share(sliced.device.name))], {"ts": TS_LONG})
    prepared = await preparer.prepare([a, b])
    assert [prepared[c.uid].error for c in (a, b)] == [None, None]

    assert await preparer.unprepare([a.ref, b.ref]) == {a.uid: None, b.uid: None}
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).claims() == []
    assert (time_slice_of(node, sliced.uuid), _compute_mode(emu, sliced.uuid)) == (
        0,
        EXCLUSIVE_PROCESS,
    )


@pytest.mark.anyio
async def test_a_failed_first_time_slice_does_not_lose_the_admins_compute_mode(
    node: Node,
) -> None:
    """The first share sets DEFAULT, then its time-slice fails; a second share waiting
    for the GPU must not take that DEFAULT for the admin's mode."""
    emu = h100()
    sliced = discover(emu).gpus[4]
    _set_compute_mode(emu, sliced.uuid, EXCLUSIVE_PROCESS)
    preparer = node_preparer(node, emu, sharing=TimeSliceFailsOnce())
    a = offline_claim("tenant-a", [("gpu", one_share(sliced.device.name))], {"gpu": TS_LONG})
    b = offline_claim("tenant-b", [("gpu", one_share(sliced.device.name))], {"gpu": TS_LONG})
    results = await preparer.prepare([a, b])
    assert results[a.uid].error is not None and "timed out" in results[a.uid].error
    assert results[b.uid].error is None
    assert time_slice_of(node, sliced.uuid) == 3

    assert await preparer.unprepare([b.ref]) == {b.uid: None}
    assert time_slice_of(node, sliced.uuid) == 0
    assert _compute_mode(emu, sliced.uuid) == EXCLUSIVE_PROCESS


@pytest.mark.anyio
async def test_a_full_state_disk_does_not_stop_the_agents_recovery(
    node: Node, small_fs: Path, fill_small_fs: Callable[[], None]
) -> None:
    """A tenant's MPS pipe folder is on the state disk and mounted writable into its
    containers: filled while the agent is down, every checkpoint write fails. The
    restarted agent reports the rollback it could not record as that claim's error,
    for the next start, and starts."""
    emu = h100()
    gpus = discover(emu).gpus
    checkpoint = small_fs / "plugin" / "checkpoint.json"
    mps = offline_claim(
        "tenant-a", [("mps", {"device": gpus[3].device.name})], {"mps": {"strategy": "MPS"}}
    )
    sliced = offline_claim("tenant-b", [("ts", {"device": gpus[2].device.name})], {"ts": TS_LONG})

    def crash(step: str) -> None:
        if step == "time-slice-applied":
            raise SimulatedCrash(step)

    crashing = node_preparer(node, emu, fault=crash, checkpoint=checkpoint)
    assert (await crashing.prepare([mps]))[mps.uid].error is None
    with pytest.raises(SimulatedCrash):
        await crashing.prepare([sliced])
    pipe = checkpoint.parent / "mps" / mps.uid / "pipe"
    assert pipe.is_dir()
    fill_small_fs()  # as the tenant's container could through its pipe folder, agent down
    try:
        report = await node_preparer(node, emu, checkpoint=checkpoint).recover()
        assert [e for e in report.errors if "tenant-b" in e and "rolling back" in e]
    finally:
        (small_fs / "filler").unlink()
        fake_sharing().stop_mps(_daemon_in(pipe.parent))


@pytest.mark.anyio
async def test_a_state_disk_filled_before_a_reboot_does_not_stop_the_agents_start(
    small_fs: Path, node: Node, fill_folder: Callable[[Path], None]
) -> None:
    """An agent that may not mount (the chart's for emulated GPUs) keeps an MPS claim's
    pipe folder on the state disk, where its container's files outlive a reboot. Filled
    that way, the load's first write, which moves the old boot's claims aside, fails:
    the agent still starts, and its recovery removes the folder, which frees the disk
    for the record of it and for this boot's claims."""
    emu = h100()
    gpus = discover(emu).gpus
    checkpoint = small_fs / "plugin" / "checkpoint.json"
    mps = offline_claim(
        "tenant-a", [("mps", {"device": gpus[3].device.name})], {"mps": {"strategy": "MPS"}}
    )

    first = node_preparer(node, emu, checkpoint=checkpoint)
    assert (await first.prepare([mps]))[mps.uid].error is None
    await first.close()
    base = checkpoint.parent / "mps" / mps.uid
    await _reboot(node, _recorded_daemon(node, mps.uid, checkpoint), base)
    fill_folder(base / "pipe")  # what the container left in its plain pipe folder

    again = node_preparer(node, emu, checkpoint=checkpoint)
    report = await again.recover()

    assert report.previous_boot == (mps.uid,)
    assert report.errors == ()
    assert not base.exists()
    doc = checkpoint_document(checkpoint)
    assert doc["bootId"] == BOOT_B and not doc["claims"] and "previousBoot" not in doc
    whole = offline_claim("tenant-b", [("gpu", {"device": gpus[2].device.name})], {})
    assert (await again.prepare([whole]))[whole.uid].error is None
    assert (await again.unprepare([whole.ref]))[whole.uid] is None


@pytest.mark.anyio
async def test_a_full_state_disk_does_not_stop_an_agent_told_a_record_was_undone(
    node: Node, small_fs: Path, fill_small_fs: Callable[[], None]
) -> None:
    """Forgetting a record an admin marked undone by hand is a write; on a full state
    disk it is that claim's error in the recovery's report, and the agent starts. The
    record and its mark stay, and the next start with room forgets it."""
    checkpoint = small_fs / "plugin" / "checkpoint.json"
    checkpoint.parent.mkdir()
    unreadable = {**_UNCLEANABLE, "state": "SomeNewerState"}
    uid = unreadable["uid"]
    checkpoint.write_text(json.dumps({"version": 1, "bootId": BOOT_A, "claims": {uid: unreadable}}))
    marker = checkpoint.parent / "undone" / uid
    marker.parent.mkdir()
    marker.touch()

    fill_small_fs()
    try:
        report = await node_preparer(node, h100(), checkpoint=checkpoint).recover()
        assert [e for e in report.errors if uid in e and "marked undone" in e], report.errors
        assert marker.exists()
    finally:
        (small_fs / "filler").unlink()
    assert uid in checkpoint_document(checkpoint)["claims"]

    report = await node_preparer(node, h100(), checkpoint=checkpoint).recover()

    assert report.errors == ()
    assert uid not in checkpoint_document(checkpoint)["claims"]
    assert not marker.exists()


TS_SHORT = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}


@pytest.mark.anyio
async def test_shares_asking_for_other_intervals_are_refused_also_when_prepared_at_once(
    node: Node,
) -> None:
    """Planning compares the interval with the shares already recorded; two tenants'
    shares prepared at the same moment (two kubelet calls in flight), or one claim's two
    shares of a GPU, are compared again under the time-slice lock: one is refused, and
    the GPU keeps the interval the other asked for."""
    emu = h100()
    gpu = discover(emu).gpus[4]
    preparer = node_preparer(node, emu)
    a = offline_claim("tenant-a", [("gpu", one_share(gpu.device.name))], {"gpu": TS_LONG})
    b = offline_claim("tenant-b", [("gpu", one_share(gpu.device.name))], {"gpu": TS_SHORT})
    errors: dict[str, str | None] = {}

    async def prepare(claim: Claim) -> None:
        errors[claim.uid] = (await preparer.prepare([claim]))[claim.uid].error

    async with anyio.create_task_group() as tg:
        tg.start_soon(prepare, a)
        tg.start_soon(prepare, b)
    refused = [e for e in errors.values() if e is not None]
    assert len(refused) == 1
    # One wording whichever check refused (planning's, or prepare's under the lock): the
    # GPU by its device name, the other claim as another namespace's.
    assert f"GPU {gpu.device.name} is time-sliced with interval" in refused[0]
    assert "for a claim of another namespace" in refused[0]
    assert "claims sharing a GPU need the same interval" in refused[0]
    kept = 3 if errors[a.uid] is None else 1
    assert time_slice_of(node, gpu.uuid) == kept

    other = discover(emu).gpus[5]
    both = offline_claim(
        "tenant-c",
        [("x", one_share(other.device.name)), ("y", one_share(other.device.name))],
        {"x": TS_LONG, "y": TS_SHORT},
    )
    error = (await preparer.prepare([both]))[both.uid].error
    assert error is not None and "need the same interval" in error
    assert time_slice_of(node, other.uuid) == 0  # rolled back


MPS_SHARE = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}


def memory_slice(device: str) -> dict[str, Any]:
    """Part of a shared GPU's memory, as the scheduler allocates it: runs under MPS."""
    return {
        "device": device,
        "shareID": str(uuidlib.uuid4()),
        "consumedCapacity": {"memory": "1Gi"},
    }


@pytest.mark.anyio
async def test_a_claim_running_mps_on_a_shared_gpu_keeps_its_default_time_slice(
    node: Node,
) -> None:
    """The time-slice is a setting of the whole GPU, and an MPS server (an MPS share,
    a memory slice) on it runs under it too, relying on Default: another tenant's share
    may not set Long under it, nor may one join a GPU set to Long. The interval is
    still reset by whichever time-sliced share leaves last."""
    emu = h100()
    gpus = discover(emu).gpus
    preparer = node_preparer(node, emu, shares={"gpu-4": 4, "gpu-5": 4})
    mps_first, long_first = gpus[4], gpus[5]
    a = offline_claim("tenant-a", [("gpu", one_share(mps_first.device.name))], {"gpu": MPS_SHARE})
    assert (await preparer.prepare([a]))[a.uid].error is None
    b = offline_claim("tenant-b", [("gpu", one_share(mps_first.device.name))], {"gpu": TS_LONG})
    refused = (await preparer.prepare([b]))[b.uid].error
    assert refused is not None
    assert "is shared with a claim of another namespace, which runs under the Default" in refused
    assert "tenant-a" not in refused
    config = "status.allocation.devices.config[0].opaque.parameters.sharing.timeSlicingConfig"
    assert f"this claim's config ({config}.interval) asks for Long" in refused
    assert "asks for Long; claims sharing a GPU need the same interval" in refused
    assert time_slice_of(node, mps_first.uuid) == 0  # never set under A's MPS server
    same = offline_claim("tenant-a", [("gpu", one_share(mps_first.device.name))], {"gpu": TS_LONG})
    refused = (await preparer.prepare([same]))[same.uid].error
    assert refused is not None and "is shared with claim tenant-a/c, which" in refused
    # A share time-sliced with the Default interval (no config) runs beside it.
    plain = offline_claim("tenant-c", [("gpu", one_share(mps_first.device.name))], {})
    assert (await preparer.prepare([plain]))[plain.uid].error is None

    long = offline_claim("tenant-b", [("gpu", one_share(long_first.device.name))], {"gpu": TS_LONG})
    assert (await preparer.prepare([long]))[long.uid].error is None
    assert time_slice_of(node, long_first.uuid) == 3
    for name, results, sharing in (
        ("MPS share", [("gpu", one_share(long_first.device.name))], {"gpu": MPS_SHARE}),
        ("memory slice", [("gpu", memory_slice(long_first.device.name))], {}),
        ("Default share", [("gpu", one_share(long_first.device.name))], {}),
    ):
        joining = offline_claim("tenant-a", results, sharing)
        refused = (await preparer.prepare([joining]))[joining.uid].error
        assert refused is not None, name
        assert "is time-sliced with interval Long for a claim of another namespace" in refused
        assert "claims sharing a GPU need the same interval" in refused
    assert time_slice_of(node, long_first.uuid) == 3
    # One claim's own devices on one GPU: an MPS share and a Long share.
    both = offline_claim(
        "tenant-d",
        [("x", one_share(gpus[6].device.name)), ("y", one_share(gpus[6].device.name))],
        {"x": MPS_SHARE, "y": TS_LONG},
    )
    refused = (await preparer.prepare([both]))[both.uid].error
    assert refused is not None and "for them" in refused and "this claim's status." in refused

    # The last time-sliced share leaving resets the GPU; then an MPS share may join.
    assert await preparer.unprepare([long.ref]) == {long.uid: None}
    assert time_slice_of(node, long_first.uuid) == 0
    later = offline_claim(
        "tenant-a", [("gpu", one_share(long_first.device.name))], {"gpu": MPS_SHARE}
    )
    assert (await preparer.prepare([later]))[later.uid].error is None
    refs = [a.ref, plain.ref, later.ref]
    assert await preparer.unprepare(refs) == {r.uid: None for r in refs}


@pytest.mark.anyio
async def test_an_mps_share_and_a_long_share_prepared_at_once_do_not_both_get_the_gpu(
    node: Node,
) -> None:
    """Two kubelet calls in flight: the plan of each records what it relies on before
    the other plans, so one of the two is refused, and the GPU's time-slice is the one
    the other relies on."""
    emu = h100()
    gpu = discover(emu).gpus[4]
    preparer = node_preparer(node, emu, shares={"gpu-4": 4})
    errors: dict[str, str | None] = {}

    async def prepare(claim: Claim) -> None:
        errors[claim.uid] = (await preparer.prepare([claim]))[claim.uid].error

    for first in ("mps", "long"):
        mps = offline_claim("tenant-a", [("gpu", one_share(gpu.device.name))], {"gpu": MPS_SHARE})
        long = offline_claim("tenant-b", [("gpu", one_share(gpu.device.name))], {"gpu": TS_LONG})
        errors.clear()

        async with anyio.create_task_group() as tg:
            for claim in (mps, long) if first == "mps" else (long, mps):
                tg.start_soon(prepare, claim)
        refused = [e for e in errors.values() if e is not None]
        assert len(refused) == 1, errors
        assert "claims sharing a GPU need the same interval" in refused[0]
        assert time_slice_of(node, gpu.uuid) == (3 if errors[long.uid] is None else 0)
        kept = mps if errors[mps.uid] is None else long
        assert await preparer.unprepare([kept.ref]) == {kept.uid: None}
        assert time_slice_of(node, gpu.uuid) == 0


@pytest.mark.anyio
async def test_a_pinned_memory_limit_above_the_devices_memory_is_refused(node: Node) -> None:
    """MPS takes a pinned memory limit as it is given: one above the device's memory
    (a typo, or `1e100`, a hundred-digit number on the daemon's command line) is refused
    before anything changes, naming the field; one within it reaches the daemon."""
    emu = h100()
    gpu = discover(emu).gpus[7]
    preparer = node_preparer(node, emu)
    mib = gpu.device.capacity["memory"] // 2**20
    for limits, path in (
        ({"defaultPinnedDeviceMemoryLimit": "100Gi"}, "defaultPinnedDeviceMemoryLimit"),
        (
            {"defaultPerDevicePinnedMemoryLimit": {"0": "1Ti"}},
            "defaultPerDevicePinnedMemoryLimit[0]",
        ),
        (
            {"defaultPerDevicePinnedMemoryLimit": {gpu.uuid: "1Pi"}},
            f"defaultPerDevicePinnedMemoryLimit[{gpu.uuid}]",
        ),
    ):
        mps = {"strategy": "MPS", "mpsConfig": limits}
        claim = offline_claim("tenant-a", [("gpu", {"device": gpu.device.name})], {"gpu": mps})
        error = (await preparer.prepare([claim]))[claim.uid].error
        assert error is not None
        assert f"sharing.mpsConfig.{path}: asks for " in error
        assert f"more than the {mib} MiB of memory of device gpu-7; use at most" in error
    assert node.tool_calls() == []  # no daemon started

    within = {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "60Gi"}}
    claim = offline_claim("tenant-a", [("gpu", {"device": gpu.device.name})], {"gpu": within})
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    assert any(
        c.startswith(f"mps-control set_default_device_pinned_mem_limit {gpu.uuid} 61440M ")
        for c in node.tool_calls()
    )
    assert await preparer.unprepare([claim.ref]) == {claim.uid: None}


@pytest.mark.anyio
async def test_a_pinned_memory_index_names_the_gpu_upstream_names(node: Node) -> None:
    """Upstream's MPS daemon counts an index into its devices' UUIDs sorted, whatever
    order the scheduler allocated them in: a claim written for it limits the same GPU
    here, not the one listed at that position."""
    emu = h100()
    gpus = sorted(discover(emu).gpus, key=lambda g: g.uuid)
    first, last = gpus[0], gpus[-1]
    preparer = node_preparer(node, emu)
    mps = {
        "strategy": "MPS",
        "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "10Gi", "1": "20Gi"}},
    }
    listed = [("gpu", {"device": g.device.name}) for g in (last, first)]
    claim = offline_claim("tenant-a", listed, {"gpu": mps})
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    limits = {
        c.split()[2]: c.split()[3]
        for c in node.tool_calls()
        if c.startswith("mps-control set_default_device_pinned_mem_limit ")
    }
    assert limits == {first.uuid: "10240M", last.uuid: "20480M"}
    assert await preparer.unprepare([claim.ref]) == {claim.uid: None}


@pytest.mark.anyio
async def test_an_index_limit_over_mig_devices_made_at_prepare_must_fit_each(node: Node) -> None:
    """MIG devices made at prepare get their UUIDs then, so while the claim is planned
    the device an index names is not known: a limit the smaller device cannot hold is
    refused before any instance is made, naming the key; one that fits both reaches the
    daemon for the device that index names once they are made."""
    emu = h100_mig()
    small, big = "gpu-0-mig-1g10gb-19-6", "gpu-0-mig-3g40gb-9-0"
    preparer = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC)
    listed = [("mig", {"device": small}), ("mig", {"device": big})]

    def claim_limiting(limit: str) -> Claim:
        mps = {"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"1": limit}}}
        return offline_claim("tenant-a", listed, {"mig": mps}, kind="MigDeviceConfig")

    refused = claim_limiting("20Gi")
    error = (await preparer.prepare([refused]))[refused.uid].error
    assert error is not None
    assert (
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[1]: asks for 20480 MiB, more " in error
    )
    assert f"memory of device {small}, which this index may name" in error
    assert mig_devices(emu) == {}
    assert node.tool_calls() == []

    taken = claim_limiting("8Gi")
    assert (await preparer.prepare([taken]))[taken.uid].error is None
    made = mig_devices(emu)
    assert set(made) == {small, big}
    limits = [
        c.split()[2:4]
        for c in node.tool_calls()
        if c.startswith("mps-control set_default_device_pinned_mem_limit ")
    ]
    assert limits == [[sorted(made.values())[1], "8192M"]]
    assert await preparer.unprepare([taken.ref]) == {taken.uid: None}
    assert mig_devices(emu) == {}


@pytest.mark.anyio
async def test_a_cancelled_first_share_puts_the_admins_compute_mode_back(node: Node) -> None:
    """The kubelet gives up on a prepare (its deadline cancels the call) while the first
    share sets DEFAULT: the mode is put back before another share can take the GPU, so
    the last one to leave restores EXCLUSIVE_PROCESS."""
    emu = h100()
    gpu = discover(emu).gpus[4]
    _set_compute_mode(emu, gpu.uuid, EXCLUSIVE_PROCESS)
    nvml = SlowDefaultMode(emu, gpu.uuid)
    preparer = node_preparer(node, nvml, inventory=lambda: discover(emu))
    a = offline_claim("tenant-a", [("gpu", one_share(gpu.device.name))], {"gpu": TS_LONG})
    b = offline_claim("tenant-b", [("gpu", one_share(gpu.device.name))], {"gpu": TS_LONG})

    async with anyio.create_task_group() as tg:
        tg.start_soon(preparer.prepare, [a])
        while not nvml.waiting.is_set():
            await anyio.sleep(0.01)
        tg.cancel_scope.cancel()  # the kubelet's deadline
        nvml.go.set()
    assert _compute_mode(emu, gpu.uuid) == EXCLUSIVE_PROCESS

    assert (await preparer.prepare([b]))[b.uid].error is None
    assert (await preparer.prepare([a]))[a.uid].error is None  # the kubelet retries
    assert await preparer.unprepare([a.ref, b.ref]) == {a.uid: None, b.uid: None}
    assert (time_slice_of(node, gpu.uuid), _compute_mode(emu, gpu.uuid)) == (0, EXCLUSIVE_PROCESS)


def _previous_boot_record(uid: str, device: str, details: dict[str, Any]) -> dict[str, Any]:
    return {
        "uid": uid,
        "namespace": "team-old",
        "name": "old",
        "state": "PrepareStarted",
        "devices": [{"pool": NODE, "device": device, "requestNames": ["gpu"], "details": details}],
    }


# A previous-boot record that can never be cleaned on its own: its MIG record names no GPU.
_UNCLEANABLE = _previous_boot_record(
    "22222222-2222-4222-8222-222222222222",
    "gpu-0",
    {"type": "mig", "mig": {"created": True, "profileId": 19, "start": 6, "size": 1}},
)


@pytest.mark.anyio
async def test_an_admins_mark_on_a_previous_boot_record_goes_once_its_removal_is_synced(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record marked undone by hand is forgotten, then its mark deleted: were the
    mark gone first, a crash or a power loss could bring the record back without it,
    to be undone by hand again."""
    node.checkpoint.parent.mkdir(parents=True)
    node.checkpoint.write_text(
        json.dumps({"version": 1, "bootId": BOOT_A, "claims": {}, "previousBoot": [_UNCLEANABLE]})
    )
    marker = node.checkpoint.parent / "undone" / _UNCLEANABLE["uid"]
    marker.parent.mkdir()
    marker.touch()
    mark_at_folder_sync: list[bool] = []
    real = os.fsync

    def spying(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            mark_at_folder_sync.append(marker.exists())
        real(fd)

    monkeypatch.setattr(os, "fsync", spying)

    report = await node_preparer(node, h100()).recover()

    assert not report.errors
    assert "previousBoot" not in checkpoint_document(node.checkpoint)
    assert not marker.exists()
    # The write that forgot the record (after the agent's take-over of the file at its
    # load) synced its rename while the mark was still there.
    assert mark_at_folder_sync == [True, True]


@pytest.mark.anyio
async def test_previous_boot_cleanup_never_destroys_this_boots_mig_instance(node: Node) -> None:
    """A previous boot's record of an instance without its ID yet (a crash before NVML
    gave one) names only a placement, which the scheduler may hand out again in this
    boot. A record that cannot be cleaned keeps only itself for the next start."""
    emu = h100_mig()
    gpu = discover(emu).gpus[0]
    placement = next(p.placement for p in gpu.partitions if p.name == "gpu-0-mig-3g40gb-9-0")
    crashed = _previous_boot_record(
        "11111111-1111-4111-8111-111111111111",
        "gpu-0-mig-3g40gb-9-0",
        {
            "type": "mig",
            "parentUuid": gpu.uuid,
            "mig": {
                "created": True,
                "profileId": placement.profile_id,
                "profile": placement.profile,
                "start": placement.start,
                "size": placement.size,
            },
        },
    )
    node.checkpoint.parent.mkdir(parents=True)
    node.checkpoint.write_text(
        json.dumps(
            {"version": 1, "bootId": BOOT_A, "claims": {}, "previousBoot": [crashed, _UNCLEANABLE]}
        )
    )
    first = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC)
    report = await first.recover()
    assert len(report.errors) == 1 and "parentUuid" in report.errors[0]
    cp = load_checkpoint(node.checkpoint, boot_id_path=node.boot_id)
    assert [r.uid for r in cp.previous_boot()] == [_UNCLEANABLE["uid"]]

    claim = _fixture_claim(5)  # a tenant's claim of this boot on that placement
    assert (await first.prepare([claim]))[claim.uid].error is None
    assert list(mig_devices(emu)) == ["gpu-0-mig-3g40gb-9-0"]
    # The same record again, as after a crash between its destroy and its forget.
    doc = checkpoint_document(node.checkpoint)
    doc["previousBoot"].append(crashed)
    _rewrite_checkpoint(node.checkpoint, doc)

    await node_preparer(node, emu, strategy=MigStrategy.DYNAMIC).recover()  # a restart

    assert list(mig_devices(emu)) == ["gpu-0-mig-3g40gb-9-0"]


@pytest.mark.anyio
async def test_a_reboot_leaves_the_mig_instance_made_since_at_a_recorded_placement(
    node: Node,
) -> None:
    """NVIDIA's MIG instances do not outlive a reboot; a layout tool (nvidia-mig-parted)
    or an admin may make one at the same placement, with the same GPU instance ID, before
    the agent starts. It is not gpudra's: the previous boot's record is forgotten and the
    instance left. One the GPU kept (its MIG UUID the recorded one) is destroyed."""
    emu = h100_mig()
    claim = _fixture_claim(5)
    first = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC)
    assert (await first.prepare([claim]))[claim.uid].error is None
    ours = mig_devices(emu)
    (name,) = ours

    emu.power_cycle()
    gpu = discover(emu).gpus[0]
    placement = next(p.placement for p in gpu.partitions if p.name == name)
    gi = create_gpu_instance(emu, gpu.uuid, placement)
    create_compute_instance(emu, gpu.uuid, gi)
    theirs = mig_devices(emu)
    assert list(theirs) == [name] and theirs[name] != ours[name]
    node.boot_id.write_text(BOOT_B + "\n")

    report = await node_preparer(node, emu, strategy=MigStrategy.DYNAMIC).recover()

    assert report.previous_boot == (claim.uid,)
    assert report.errors == ()
    assert mig_devices(emu) == theirs
    assert load_checkpoint(node.checkpoint, boot_id_path=node.boot_id).previous_boot() == []


@pytest.mark.anyio
async def test_previous_boot_cleanup_leaves_the_folders_of_a_claim_prepared_again(
    node: Node,
) -> None:
    """After a reboot the kubelet prepares the same claim UIDs again: the previous boot's
    MPS record then names the folders of this boot's live daemon."""
    claim = _fixture_claim(_MPS_CLAIM)
    base = _mps_base(node, claim.uid)
    old = _previous_boot_record(
        claim.uid,
        "gpu-3",
        {
            "type": "gpu",
            "mps": {
                "pipeDir": str(base / "pipe"),
                "logDir": str(base / "log"),
                "shmDir": str(base / "shm"),
            },
        },
    )
    node.checkpoint.parent.mkdir(parents=True)
    node.checkpoint.write_text(
        json.dumps(
            {"version": 1, "bootId": BOOT_A, "claims": {}, "previousBoot": [old, _UNCLEANABLE]}
        )
    )
    first = node_preparer(node, h100())
    assert (await first.recover()).errors
    assert (await first.prepare([claim]))[claim.uid].error is None
    daemon = _recorded_daemon(node, claim.uid)
    try:
        doc = checkpoint_document(node.checkpoint)
        doc["previousBoot"].append(old)  # as if its cleanup had not been recorded
        _rewrite_checkpoint(node.checkpoint, doc)
        await node_preparer(node, h100()).recover()  # a restart
        assert (base / "pipe" / "control").exists()
        assert daemon.alive()
    finally:
        assert await node_preparer(node, h100()).unprepare([claim.ref]) == {claim.uid: None}


@pytest.mark.anyio
async def test_an_mps_daemon_an_older_release_recorded_stops_without_its_pid_file(
    node: Node,
) -> None:
    """Records from before the daemon's identity was kept find it by the PID file in
    the pipe folder, which the claim's containers may remove: the daemon still reading
    its control pipe is asked to quit all the same, and unprepare waits for it."""
    claim = _fixture_claim(_MPS_CLAIM)
    assert (await node_preparer(node, h100()).prepare([claim]))[claim.uid].error is None
    daemon = _recorded_daemon(node, claim.uid)
    try:
        _as_an_older_release_recorded(node, claim.uid)
        upgraded = node_preparer(node, h100())
        assert (await upgraded.recover()).errors == ()
        assert await upgraded.unprepare([claim.ref]) == {claim.uid: None}
        assert daemon.wait_gone(5.0)
        assert not _mps_base(node, claim.uid).exists()
    finally:
        daemon.signal(signal.SIGKILL)


# --- what a prepare builds once ----------------------------------------------------------------


@pytest.mark.anyio
async def test_a_whole_gpus_spec_entry_is_converted_once_and_a_shares_for_each_claim(
    node: Node, conversions: list[Any]
) -> None:
    """A whole GPU's spec entry is the same on every prepare of it, so its edits are
    checked and converted for the first claim only; a share's entry names the share and
    is made for its claim. Every spec still holds what its claim needs."""
    converted = conversions
    emu = h100()
    gpus = discover(emu).gpus
    preparer = node_preparer(node, emu, shares={g.device.name: 4 for g in gpus})
    specs = []
    for _ in range(3):
        claim = offline_claim("tenant-a", [("gpu", {"device": gpus[2].device.name})], {})
        assert (await preparer.prepare([claim]))[claim.uid].error is None
        specs.append((claim.uid, node.spec(claim.uid)))
        assert await preparer.unprepare([claim.ref]) == {claim.uid: None}
    assert len(converted) == 2  # the node's common edits and the GPU's, once each
    for uid, spec in specs:
        assert spec["devices"][0]["name"] == f"{uid}-gpu-2"
        assert spec["devices"][0]["containerEdits"] == specs[0][1]["devices"][0]["containerEdits"]
        assert any(
            n["path"] == "/dev/nvidia2" for n in spec["devices"][0]["containerEdits"]["deviceNodes"]
        )

    for _ in range(2):
        share = offline_claim("tenant-a", [("gpu", one_share(gpus[5].device.name))], {})
        assert (await preparer.prepare([share]))[share.uid].error is None
        share_id = share.devices[0].share_id
        device = node.spec(share.uid)["devices"][0]
        assert device["name"] == f"{share.uid}-gpu-5-{share_id}"
        assert await preparer.unprepare([share.ref]) == {share.uid: None}
    assert len(converted) == 4  # each share's entry afresh


@pytest.mark.anyio
async def test_a_claims_guard_orders_its_calls_and_is_given_up_when_a_waiter_is_cancelled(
    node: Node,
) -> None:
    """Two prepares of one claim at once prepare it once; a call cancelled while it
    waits for the claim's guard leaves nothing behind, and the claim's next calls run."""
    emu = h100()
    gpus = discover(emu).gpus
    preparer = node_preparer(node, emu)
    claim = offline_claim("tenant-a", [("gpu", {"device": gpus[1].device.name})], {})
    first, second = await asyncio.gather(preparer.prepare([claim]), preparer.prepare([claim]))
    assert first == second and first[claim.uid].error is None
    assert preparer._guards == {}

    # Another call holds the claim.
    async with preparer._guard(claim.uid), anyio.create_task_group() as tg:
        tg.start_soon(preparer.unprepare, [claim.ref])
        await anyio.sleep(0.05)
        assert preparer._guards[claim.uid].users == 2
        tg.cancel_scope.cancel()
    assert preparer._guards == {}
    assert node.has_spec(claim.uid)  # the cancelled unprepare did nothing
    assert await preparer.unprepare([claim.ref]) == {claim.uid: None}
    assert not node.has_spec(claim.uid) and preparer._guards == {}


@pytest.mark.anyio
async def test_a_kept_whole_gpu_entry_refers_to_the_toolkit_only_where_every_device_can(
    node: Node,
) -> None:
    """The toolkit's spec knows GPU 6, not GPU 7: a claim of GPU 6 alone refers to it;
    a claim of both gives both their own nodes, and GPU 6 alone refers to it again."""
    emu = h100()
    gpus = discover(emu).gpus
    toolkit = ToolkitSpec(
        path=node.root / "nvidia.json",
        kind="nvidia.com/gpu",
        device_names=frozenset({gpus[6].uuid}),
    )
    preparer = node_preparer(node, emu, toolkit=toolkit)
    alone = [("gpu", {"device": gpus[6].device.name})]
    both = [*alone, ("other", {"device": gpus[7].device.name})]
    for results in (alone, both, alone):
        claim = offline_claim("tenant-a", results, {})
        result = (await preparer.prepare([claim]))[claim.uid]
        assert result.error is None
        spec = node.spec(claim.uid)
        ids = result.devices[0].cdi_device_ids
        if results is alone:
            assert ids == [
                f"k8s.gpu.nvidia.com/claim={claim.uid}-gpu-6",
                f"nvidia.com/gpu={gpus[6].uuid}",
            ]
            assert "deviceNodes" not in spec["devices"][0]["containerEdits"]
            assert spec["containerEdits"] == {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}
        else:
            assert ids == [f"k8s.gpu.nvidia.com/claim={claim.uid}-gpu-6"]
            assert [
                n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]
            ] == [
                "/dev/nvidia6",
                "/dev/nvidia7",
            ]
            assert "/dev/nvidiactl" in node_paths(spec["containerEdits"])
        assert await preparer.unprepare([claim.ref]) == {claim.uid: None}
