"""Preparing and unpreparing claims on this node: the device layer of the kubelet plugin.

A prepare gets a claim the plugin has already read and checked (`Claim`), plans
its devices (`gpudra.driver.planning`: where each one is, its config, what it
needs) and then sets them up: dynamic MIG instances (`gpudra.driver.mig`),
time-slicing, an MPS daemon, and one CDI spec file per claim
(`gpudra.driver.claimspec`) whose device IDs go back to the kubelet.

Crash safety comes from the checkpoint: a prepare starts by recording the planned
devices (which is also where a device held by another claim is refused), records
each side effect before or right after making it (`gpudra.driver.records`), and
only then marks the claim prepared. Whatever a crash or a failed step leaves
behind is undone from that record: at once on failure, at the next prepare of the
claim, or by `recover()` at start. Undo steps are idempotent, so undoing twice is
harmless.

Concurrency: checkpoint changes go through one `GroupCommit`, so claims prepared at
the same time share checkpoint writes instead of queueing for one fsync each; a
per-claim lock keeps two calls for the same claim (a kubelet retry, a cleanup) from
interleaving while different claims proceed in parallel. NVML calls, tools and file
I/O run in worker threads so the event loop keeps answering the kubelet.

Nothing here knows gRPC, HTTP or the API server: the protocol layer calls
`prepare`/`unprepare` (see `gpudra.driver.plugin.ClaimHandler`), and the sweep of
deleted claims asks a `ClaimLookup`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import anyio
import anyio.to_thread
import pynvml
from gpudra.api.config import ConfigError
from gpudra.common.errors import exception_text
from gpudra.common.files import remove_tree
from gpudra.driver.cdi import (
    CdiDevice,
    CdiError,
    CdiSpecStore,
    DeviceNumbers,
    ToolkitSpec,
    validate_claim_uid,
)
from gpudra.driver.checkpoint import (
    DEFAULT_BOOT_ID_PATH,
    Checkpoint,
    CheckpointError,
    CheckpointTakenOverError,
    ClaimRecord,
    DeviceConflictError,
    GroupCommit,
)
from gpudra.driver.checkpoint import load as load_checkpoint
from gpudra.driver.claims import Claim, ClaimError, ClaimRef, config_error
from gpudra.driver.claimspec import ClaimSpecs
from gpudra.driver.devicemetadata import (
    DeviceMetadataStore,
    MetadataDevice,
    MetadataError,
    MetadataRequest,
    mounted,
)
from gpudra.driver.devices import DeviceType, Inventory, MigStrategy
from gpudra.driver.metrics import PreparedDevices
from gpudra.driver.mig import (
    MigError,
    MigNotCreated,
    compute_mode,
    create_compute_instance,
    create_gpu_instance,
    destroy_mig,
    placement_taken,
    set_compute_mode,
)
from gpudra.driver.nvml import NvmlLibrary
from gpudra.driver.planning import (
    Entry,
    mps_limits,
    mps_settings,
    other_claim,
    plan,
    time_slice_conflict,
)
from gpudra.driver.plugin import PreparedDevice, PrepareResult
from gpudra.driver.publish import device_attributes
from gpudra.driver.records import (
    ComputeModeSet,
    CreatedMig,
    MpsStarted,
    TimeSliceSet,
)
from gpudra.driver.sharing import MpsDaemon, SharingBackend
from prometheus_client import CollectorRegistry

__all__ = [
    "PREPARE_STEPS",
    "ClaimLookup",
    "ClaimPreparer",
    "HoldingEvents",
    "RecoveryReport",
]

log = logging.getLogger(__name__)

_UNDONE_DIR = "undone"
"""Beside the checkpoint: files named by claim UID, each saying that what the claim's
unreadable record describes was undone by hand, so the agent forgets the record."""
METADATA_DIR: Final = "device-metadata"
"""Under the state folder: the device metadata files of prepared claims."""
_SPARE_GUARDS: Final = 64
"""Free claim guards kept for reuse: about the claims a kubelet has in flight at once."""

T = TypeVar("T")

# The points of a prepare, in order, at which a fault hook runs: each follows a
# durable step (a checkpoint write or a side effect), so a crash there is one the
# recovery code must handle. Steps a claim does not need are skipped. (A failed MIG
# creation also runs it, at "mig-not-created", once its record is cleared: nothing is
# left there to recover.)
PREPARE_STEPS: Final = (
    "prepare-started",
    "mig-recorded",
    "mig-gpu-instance-created",
    "mig-created",
    "time-slice-recorded",
    "time-slice-applied",
    "compute-mode-recorded",
    "compute-mode-applied",
    "mps-recorded",
    "mps-started",
    "cdi-written",
    "prepare-completed",
)


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What `recover()` found and did; `errors` lists what is left for a later try."""

    rolled_back: tuple[str, ...] = ()
    previous_boot: tuple[str, ...] = ()
    orphaned_specs: tuple[str, ...] = ()
    orphaned_mps_dirs: tuple[str, ...] = ()
    orphaned_metadata: tuple[str, ...] = ()
    temp_files: int = 0
    errors: tuple[str, ...] = ()


class HoldingEvents(Protocol):
    """Told when a claim starts holding its devices (its prepare completed) and stops
    (a completed claim unprepared), within the checkpoint change itself: accounting
    bills the time between (`gpudra.driver.holders.HoldingLog`). On the prepare path:
    each call must cost a dict or list insert, no I/O and no lock."""

    def held(self, uid: str) -> None: ...

    def released(self, record: ClaimRecord) -> None: ...


class ClaimLookup(Protocol):
    """Where the sweep of deleted claims learns which claims still exist."""

    async def current_uid(self, ref: ClaimRef) -> str | None:
        """The UID of the claim now at `ref`'s namespace and name, None when there is
        none; raises when that cannot be told."""
        ...

    async def still_used(self, ref: ClaimRef, pod: str, pod_uid: str) -> bool:
        """Whether `pod` (of UID `pod_uid`, "" when not known), the pod the claim was
        prepared for, still runs on this node naming the claim; raises when that cannot
        be told."""
        ...


def _result_from_record(record: ClaimRecord) -> PrepareResult:
    return PrepareResult(
        devices=[
            PreparedDevice(
                request_names=list(d.request_names),
                pool_name=d.pool,
                device_name=d.device,
                cdi_device_ids=list(d.cdi_device_ids),
                share_id=d.share_id,
            )
            for d in record.devices
        ]
    )


def _allocated_devices(devices: Sequence[tuple[str, str | None]]) -> str:
    """Devices as a message names them: by name, and share ID for a share."""
    return ", ".join(
        name if share is None else f"{name} (shareID {share})"
        for name, share in sorted(set(devices), key=lambda d: (d[0], d[1] or ""))
    )


def _check_same_allocation(claim: Claim, record: ClaimRecord) -> None:
    """Refuse a prepare answered from a completed record of another allocation.

    A repeat prepare (the kubelet restarted, or retried after a lost answer) gets the
    record's CDI IDs. But a claim keeps its UID when it is deallocated (its last pod
    ended) and allocated again, possibly to other devices: if its unprepare never
    reached this agent, the record is of the old allocation, and answering from it
    would hand the pod the old devices, which the scheduler may have given to
    another claim since.
    """
    recorded = {(d.device, d.share_id) for d in record.devices}
    allocated = {(d.device, d.share_id) for d in claim.devices}
    if recorded == allocated:
        return
    raise ClaimError(
        f"{claim.ref.describe()}: still prepared on this node for an earlier allocation "
        f"(devices {_allocated_devices(list(recorded))}) and now allocated "
        f"{_allocated_devices(list(allocated))}; the old preparation must be unprepared "
        "first: delete the claim's pods on this node (the kubelet then unprepares the "
        "claim) and create them again"
    )


MPS_THREADS: Final = 8
"""Threads MPS daemon starts may hold at once, and stops as many again, beside anyio's
default 40."""

CONFLICT_WAIT_S: Final = 10.0
"""How long a prepare refused because another claim holds its device waits for that
claim's unprepare before it fails, by default (`gpudra node --conflict-wait`, up to
`MAX_CONFLICT_WAIT_S`; 0 refuses at once). A pod deleted with no grace leaves the API
before its node has stopped it: the scheduler may give its devices to a new claim at once,
while the kubelet stops the old containers (2 s of grace at least) and only then
unprepares. A refusal there costs the new pod the kubelet's next sync of it (a minute
or more with its default syncFrequency); a short wait ends it within seconds of the
unprepare. Well inside the kubelet's 45 s deadline for the call; where the holder
stays (its pod runs), the new pod's retry comes this much later. Only the kubelet's
unprepare ends the wait early: it comes once the old pod has no container left on the
node (`ClaimPreparer._forgotten`)."""

MAX_CONFLICT_WAIT_S: Final = 30.0
"""The longest conflict wait a node may set: the kubelet gives a prepare call 45 s in
all (`KUBELET_CALL_TIMEOUT_S`), and the prepare's own work (a MIG instance made, an MPS
daemon started) comes after the wait. The chart's schema holds the same bound."""


def _time_slice_users(cp: Checkpoint, gpu_uuid: str, *, excluding: str) -> dict[str, TimeSliceSet]:
    """Claims other than `excluding` that rely on the time-slice they set on the GPU,
    each with its record of the setting."""
    users: dict[str, TimeSliceSet] = {}
    for record in cp.claims():
        if record.uid == excluding:
            continue
        for device in record.devices:
            step = device.details.time_slice
            if step is not None and step.applied and step.uuid == gpu_uuid:
                users[record.uid] = step
                break
    return users


def _mode_before_time_slicing(steps: Sequence[TimeSliceSet]) -> int | None:
    """The compute mode the GPU had before its time-slicing claims, as they recorded it."""
    return next(
        (s.previous_compute_mode for s in steps if s.previous_compute_mode is not None), None
    )


@dataclass(eq=False, slots=True)
class _Guard:
    """Orders the calls for one claim: `async with` it for one prepare or unprepare
    (`ClaimPreparer._guard`). It is almost never contended, so a free lock is taken
    without the turn of the event loop anyio gives by default: that turn bought no
    fairness here and cost every call a loop iteration (measured: 0.29 to 0.30 ms of
    device-layer CPU per cycle against 0.31 to 0.33 in one process; see
    docs/performance.md). A checkpoint write that other claims' changes may join
    takes a turn of its own for them (a lone line takes none: `GroupCommit`). A guard
    no claim uses is kept for the next claim (up to `_SPARE_GUARDS`): making an anyio
    lock costs more than taking it. Its own context manager, not a generator's: one
    is entered twice per claim."""

    guards: dict[str, _Guard]  # the preparer's, by claim UID
    spare: list[_Guard]
    uid: str = ""
    lock: anyio.Lock = field(default_factory=lambda: anyio.Lock(fast_acquire=True))
    users: int = 0  # holding or waiting for the lock; counted by `ClaimPreparer._guard`

    async def __aenter__(self) -> None:
        try:
            try:
                # A free lock is taken without an await: no check for cancellation
                # either, which anyio's acquire makes even with `fast_acquire`.
                self.lock.acquire_nowait()
            except anyio.WouldBlock:
                await self.lock.acquire()
        except BaseException:  # cancelled while waiting
            self._leave()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self.lock.release()
        self._leave()

    def _leave(self) -> None:
        self.users -= 1
        if self.users == 0:  # free: nobody holds or waits for its lock
            del self.guards[self.uid]
            if len(self.spare) < _SPARE_GUARDS:
                self.spare.append(self)


class ClaimPreparer:
    """Prepares and unprepares claims of one driver on one node (a `ClaimHandler`).

    `inventory` is the node's discovered devices, or a callable returning the
    current one (None until the first discovery). `mig_strategy` must be the view
    the slices are published with, so that a device name means here what it meant
    to the scheduler. `state_dir` (default: the checkpoint's folder) holds the
    per-claim MPS pipe and log folders and device metadata files; it must be a host
    path that this process sees at the same path, because the container runtime
    mounts the pipe folder and the metadata files from there. `dev_root`,
    `driver_root` and `proc_root` are where the host's /dev, driver files and /proc
    are; `host_view` is where this process sees the
    host's `/`. `device_numbers` (emulated GPUs) numbers the device nodes in the
    specs, for hosts that lack them. `registry` gets the prepared-device metrics.
    `holdings` is told when each claim starts and stops holding its devices.
    `device_metadata`, the driver's name, writes each prepared request's device
    metadata file for its containers (`gpudra.driver.devicemetadata`); None writes
    none. `legacy_attributes` and `numa_node_list` must be the agent's, so that the
    metadata lists a device's attributes as its slice does. Call `recover()` once
    before serving.
    """

    def __init__(
        self,
        *,
        node_name: str,
        nvml: NvmlLibrary,
        inventory: Inventory | Callable[[], Inventory | None],
        cdi: CdiSpecStore,
        checkpoint_path: Path,
        sharing: SharingBackend,
        driver_root: Path = Path("/"),
        dev_root: Path = Path("/"),
        proc_root: Path = Path("/proc"),
        state_dir: Path | None = None,
        boot_id_path: Path = DEFAULT_BOOT_ID_PATH,
        driver_libraries: Sequence[str] = (),
        host_view: Path | None = Path("/"),
        toolkit: ToolkitSpec | None = None,
        mig_strategy: MigStrategy = MigStrategy.STATIC,
        registry: CollectorRegistry | None = None,
        device_numbers: DeviceNumbers | None = None,
        fault: Callable[[str], None] | None = None,
        shares: Callable[[], Mapping[str, int]] | None = None,
        holdings: HoldingEvents | None = None,
        conflict_wait: float = CONFLICT_WAIT_S,
        device_metadata: str | None = None,
        legacy_attributes: bool = False,
        numa_node_list: bool = False,
    ) -> None:
        self._fault = fault
        # The attributes the slices publish, which the device metadata lists too.
        self._attributes = functools.partial(
            device_attributes, legacy=legacy_attributes, lists=numa_node_list
        )
        self._conflict_wait = conflict_wait
        # Claims the kubelet unprepared so far, and the event that a prepare waiting for
        # a device's holder to go waits on (`_wait_for_holder`): made only when one waits.
        self._releases = 0
        self._released: anyio.Event | None = None
        self._holdings = holdings
        self._shares: Callable[[], Mapping[str, int]] = shares or dict
        self._left_to_kubelet: set[str] = set()  # deleted claims whose pod runs (logged)
        self._node = node_name
        self._nvml = nvml
        self._inventory: Callable[[], Inventory | None] = (
            inventory if callable(inventory) else (lambda: inventory)
        )
        self._cdi = cdi
        self._checkpoint_path = checkpoint_path
        self._undone_dir = str(checkpoint_path.parent / _UNDONE_DIR)
        self._boot_id_path = boot_id_path
        self._sharing = sharing
        self._specs = ClaimSpecs(
            driver_root=driver_root,
            dev_root=dev_root,
            proc_root=proc_root,
            driver_libraries=driver_libraries,
            host_view=host_view,
            toolkit=toolkit,
            device_numbers=device_numbers,
        )
        self._mps_root = (state_dir or checkpoint_path.parent) / "mps"
        # Kept when off too: the files an earlier run wrote still go at unprepare.
        self._metadata = DeviceMetadataStore(
            (state_dir or checkpoint_path.parent) / METADATA_DIR, driver=device_metadata
        )
        self._mig_strategy = mig_strategy
        (registry if registry is not None else CollectorRegistry()).register(
            PreparedDevices(self.checkpoint_now, node_name)
        )
        # Held while the checkpoint loads or is written, and while its temp files are swept.
        # Taken without a turn of the loop when free: a checkpoint write that gathers
        # changes takes its own turn for that, a lone line none (GroupCommit).
        self._lock = anyio.Lock(fast_acquire=True)
        self._guards: dict[str, _Guard] = {}
        self._spare_guards: list[_Guard] = []
        # Orders setting and resetting time-slices, which claims sharing a GPU share.
        self._time_slice_lock = anyio.Lock()
        # MPS daemons start and stop in threads of their own: a stop waits on what a
        # claim's containers left (up to the tools' timeouts), and many at once must not
        # take the threads every other claim's checkpoint writes and NVML calls need.
        # Starts and stops have a limiter each: a tenant's tampered pipe folders (a
        # `control` file that is not the daemon's, read or not, gets no `quit` and costs
        # each stop about a second of looking for the daemon) then fill only
        # the stops' slots, and never make another claim's prepare wait for a start
        # slot. A rollback's stops (`_undo` of a record not completed) take start
        # slots: no container has seen those folders, and they are part of a prepare.
        # Stops still queue behind each other, first come first served: one tenant
        # unpreparing many tampered claims delays another's unprepare by about a
        # second per MPS_THREADS claims queued ahead of it; bounded by the claims
        # queued, never starved, and it only keeps the unprepared claim's own devices
        # a little longer (a claim given them meanwhile is refused until then, and
        # the kubelet retries it). Fair shares per tenant would not be worth their keep.
        self._mps_starts = anyio.CapacityLimiter(MPS_THREADS)
        self._mps_stops = anyio.CapacityLimiter(MPS_THREADS)
        self._commit: GroupCommit | None = None

    def checkpoint_now(self) -> Checkpoint | None:
        """The in-memory checkpoint as it is now, without the lock (None before it is
        loaded): for readers such as metrics, which must never wait for a prepare. Its
        claims are replaced on change, never changed in place."""
        return self._commit.checkpoint if self._commit is not None else None

    # --- plumbing ---

    def taken_over(self) -> str | None:
        """Why this agent no longer changes anything on the node: another agent took its
        checkpoint over (`Checkpoint.check_owner`), and publishes the node's slices too;
        None while none has, and before the checkpoint is loaded. One stat, without
        waiting: while a write of this process runs (in a worker thread) the checkpoint
        counts as this process's until the next call."""
        cp = self.checkpoint_now()
        if cp is None:
            return None
        try:
            cp.check_owner(wait=False)
        except CheckpointTakenOverError as exc:
            return str(exc)
        except CheckpointError:
            return None  # unreadable, not taken over: the next write says why
        return None

    async def owner_gone(self) -> str | None:
        """Why this agent should stop: its checkpoint was taken over, and the agents that
        took it over are gone (`Checkpoint.owner_gone`); its restart takes it over again.
        None otherwise, after one stat while the checkpoint is this agent's; once taken
        over, the owner files are read in a worker thread."""
        cp = self.checkpoint_now()
        if cp is None or self.taken_over() is None:
            return None
        return await anyio.to_thread.run_sync(cp.owner_gone)

    async def _check_owner(self, cp: Checkpoint) -> None:
        """Raise CheckpointTakenOverError where another agent took the checkpoint over:
        called before a device change, which that agent may hold under its own records.
        One stat here; while a write of this process runs, in a worker thread that
        waits for it (`Checkpoint.check_owner`)."""
        if not cp.check_owner(wait=False):
            await anyio.to_thread.run_sync(cp.check_owner)

    async def _checkpoint(self) -> Checkpoint:
        """Loaded once; afterwards the in-memory copy is authoritative (it is written
        through on every change), so no prepare re-reads the file."""
        return (await self._committer()).checkpoint

    async def _committer(self) -> GroupCommit:
        if self._commit is None:
            async with self._lock:
                if self._commit is None:
                    # Taken over: an agent a rolling update is replacing can no longer
                    # write it (see `Checkpoint.load`).
                    cp = await anyio.to_thread.run_sync(
                        functools.partial(
                            load_checkpoint,
                            self._checkpoint_path,
                            boot_id_path=self._boot_id_path,
                            take_over=True,
                        )
                    )
                    self._commit = GroupCommit(cp, lock=self._lock)
        return self._commit

    async def close(self) -> None:
        """Fold the checkpoint's appended changes into its file (`GroupCommit.compact`);
        call when the agent stops, after the last prepare and unprepare."""
        if self._commit is not None:
            with anyio.CancelScope(shield=True):
                await self._commit.compact()

    async def _persist(self, change: Callable[[Checkpoint], T]) -> T:
        """Apply a checkpoint change; returns once it is written, and durable where the
        change asks (`Checkpoint._save`)."""
        return await (await self._committer()).apply(change)

    def _guard(self, uid: str) -> _Guard:
        """The claim's guard, counted as used until its `async with` ends."""
        guard = self._guards.get(uid)
        if guard is None:
            spare = self._spare_guards
            guard = spare.pop() if spare else _Guard(self._guards, spare)
            guard.uid = uid
            self._guards[uid] = guard
        guard.users += 1
        return guard

    def _mps_daemon(self, uid: str) -> MpsDaemon:
        """The claim's daemon folders: pipe, log and its own /dev/shm."""
        base = self._mps_root / validate_claim_uid(uid)
        return MpsDaemon(
            name=uid,
            pipe_dir=base / "pipe",
            log_dir=base / "log",
            device_uuids=(),
            shm_dir=base / "shm",
        )

    async def _cdi_io(self, fn: Callable[[], T]) -> T:
        """Run a CDI spec write or removal.

        Specs that are not fsynced (the default: the CDI root is a tmpfs) cost a few
        small syscalls, less than the hand-off to a worker thread and back, so they
        run right here; fsynced ones wait for the disk in a worker thread.
        """
        if self._cdi.durable:
            return await anyio.to_thread.run_sync(fn)
        return fn()

    def _at(self, step: str) -> None:
        """A named point of a prepare, where tests inject crashes (see `PREPARE_STEPS`)."""
        if self._fault is not None:
            self._fault(step)

    # --- the ClaimHandler interface ---

    async def prepare(self, claims: list[Claim]) -> dict[str, PrepareResult]:
        """Prepare each claim on its own: one claim's failure is only its error."""
        if len(claims) == 1:
            return {claims[0].uid: await self._prepare_one(claims[0])}
        results: dict[str, PrepareResult] = {}

        async def one(claim: Claim) -> None:
            results[claim.uid] = await self._prepare_one(claim)

        async with anyio.create_task_group() as group:
            for claim in claims:
                group.start_soon(one, claim)
        return results

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        """Undo each claim's devices; an unknown claim is already unprepared. The
        kubelet's call (the sweep of deleted claims has its own way in)."""
        if len(claims) == 1:
            return {claims[0].uid: await self._unprepare_one(claims[0], by_kubelet=True)}
        results: dict[str, str | None] = {}

        async def one(ref: ClaimRef) -> None:
            results[ref.uid] = await self._unprepare_one(ref, by_kubelet=True)

        async with anyio.create_task_group() as group:
            for ref in claims:
                group.start_soon(one, ref)
        return results

    async def _prepare_one(self, claim: Claim) -> PrepareResult:
        try:
            result = await self._prepare_claim(claim)
        except ClaimError as exc:
            result = PrepareResult(error=str(exc))
        except CheckpointTakenOverError as exc:
            # No fault to trace: the newer agent beside this one serves the node now.
            result = PrepareResult(error=f"{claim.ref.describe()}: {exc}")
        except Exception as exc:
            log.exception("prepare failed", extra={"fields": {"claim": claim.uid}})
            result = PrepareResult(
                error=f"{claim.ref.describe()}: prepare failed: {exception_text(exc)}"
            )
        if result.error:
            log.warning(
                "claim not prepared",
                extra={"fields": {"claim": claim.uid, "error": result.error}},
            )
        return result

    async def _unprepare_one(self, ref: ClaimRef, *, by_kubelet: bool = False) -> str | None:
        """`by_kubelet`: the kubelet's call, which comes only once the claim's pods have
        no container left on the node; only that one lets a prepare waiting for the
        claim's devices go on at once (`_wait_for_holder`)."""
        error: str | None
        try:
            error = await self._unprepare_claim(ref)
            if error is None and by_kubelet:
                self._forgotten()
        except ClaimError as exc:
            error = str(exc)
        except CheckpointTakenOverError as exc:
            error = f"{ref.describe()}: {exc}"  # as in `_prepare_one`
        except Exception as exc:
            log.exception("unprepare failed", extra={"fields": {"claim": ref.uid}})
            error = f"{ref.describe()}: unprepare failed: {exception_text(exc)}"
        if error:
            log.warning(
                "claim not unprepared", extra={"fields": {"claim": ref.uid, "error": error}}
            )
        return error

    # --- prepare ---

    async def _prepare_claim(self, claim: Claim) -> PrepareResult:
        ref = claim.ref
        async with self._guard(ref.uid):
            cp = await self._checkpoint()
            # Before any device change (and after a wait for a device's holder, below): a
            # whole GPU's prepare writes the checkpoint only at its end, after its CDI
            # spec, too late to be refused.
            await self._check_owner(cp)
            await self._check_readable(cp, ref)
            record = cp.get(ref.uid)
            if record is not None:
                if record.completed:
                    _check_same_allocation(claim, record)
                    return _result_from_record(record)
                await self._undo(record, "rolling back an interrupted earlier prepare")
            if self._metadata.writes:
                try:  # before any device changes: nothing to roll back
                    requests = (d.request for d in claim.devices)
                    self._metadata.check(claim.name, claim.pod_claim_name, requests)
                except MetadataError as exc:
                    raise ClaimError(f"{ref.describe()}: {exc}") from None
            entries = await self._begin(claim, cp)
            self._at("prepare-started")
            try:
                devices = await self._setup(claim, entries)
            except Exception as exc:
                message = f"{ref.describe()}: {exc}"
                if isinstance(exc, ConfigError):
                    message = str(config_error(ref, exc))
                current = cp.get(ref.uid)
                if current is not None:
                    try:
                        await self._undo(current, "rolling back the failed prepare")
                    except ClaimError as undo_exc:
                        message += (
                            f"; rolling back failed too (retried at the next prepare or "
                            f"restart): {undo_exc}"
                        )
                raise ClaimError(message) from exc
            return PrepareResult(devices=devices)

    async def _begin(self, claim: Claim, cp: Checkpoint) -> list[Entry]:
        """Plan the claim and record that its prepare starts; where another claim holds
        a device of it, wait for that claim's unprepare and plan again
        (`_wait_for_holder`)."""
        ref = claim.ref
        deadline: float | None = None
        while True:
            releases = self._releases
            entries = plan(
                claim,
                inventory=self._inventory(),
                checkpoint=cp,
                pool=self._node,
                mig_strategy=self._mig_strategy,
                shares=self._shares(),
            )
            planned = [e.record(self._node) for e in entries]
            # Only prepares that change the node beyond the CDI spec need the started
            # record on disk before they begin; see Checkpoint.begin_prepare.
            persist = any(e.create_mig or e.time_slice is not None or e.mps for e in entries)
            try:
                if persist:
                    await self._persist(
                        functools.partial(Checkpoint.begin_prepare, claim=ref, devices=planned)
                    )
                else:
                    cp.begin_prepare(ref, planned, persist=False)  # memory only: no I/O
                return entries
            except DeviceConflictError as exc:
                deadline = await self._wait_for_holder(ref, exc, releases, deadline)
                # Another agent may have taken the checkpoint over meanwhile.
                await self._check_owner(cp)

    # --- side effects ---

    async def _setup(self, claim: Claim, entries: Sequence[Entry]) -> list[PreparedDevice]:
        ref = claim.ref

        async def progress(step: str) -> None:
            records = [e.record(self._node) for e in entries]
            await self._persist(lambda c: c.record_progress(ref.uid, records))
            self._at(step)

        for entry in entries:
            if entry.create_mig:
                await self._create_mig(entry, progress)
        for entry in entries:
            if entry.time_slice is not None and entry.uuid is not None:
                await self._set_time_slice(ref, entry, progress)
        members = [e for e in entries if e.mps]
        daemon: MpsDaemon | None = None
        if members:
            daemon = await self._start_mps(ref, members, progress)
        cdi_devices, common = await self._specs.claim(entries, daemon)
        mounts = self._write_metadata(claim, entries) if self._metadata.writes else {}
        await self._cdi_io(
            functools.partial(
                self._cdi.write_claim,
                ref.uid,
                [*cdi_devices, *mounts.values()] if mounts else cdi_devices,
                common_edits=common,
            )
        )
        self._at("cdi-written")
        for entry, cdi_device in zip(entries, cdi_devices, strict=True):
            entry.cdi_ids = tuple(self._cdi.device_ids(ref.uid, cdi_device))
            # The request's first device carries its metadata mount, as the helper's do.
            mount = mounts.pop(entry.base_request, None) if mounts else None
            if mount is not None:
                entry.cdi_ids += tuple(self._cdi.device_ids(ref.uid, mount))
        records = [e.record(self._node) for e in entries]

        def complete(cp: Checkpoint) -> ClaimRecord:
            done = cp.complete_prepare(ref.uid, records)
            if self._holdings is not None:  # with the change: a reader sees both or neither
                self._holdings.held(ref.uid)
            return done

        final = await self._persist(complete)
        self._at("prepare-completed")
        log.info(
            "claim prepared",
            extra={
                "fields": {
                    "claim": ref.uid,
                    "namespace": ref.namespace,
                    "name": ref.name,
                    "devices": [e.cdi_name for e in entries],
                }
            },
        )
        return _result_from_record(final).devices

    def _write_metadata(self, claim: Claim, entries: Sequence[Entry]) -> dict[str, CdiDevice]:
        """Write the claim's device metadata files, one per request, and return the CDI
        devices that mount them, by base request name (`gpudra.driver.devicemetadata`).
        A few small writes, not synced, so they run right here as the CDI spec's do."""
        requests: dict[str, list[Entry]] = {}
        for entry in entries:
            requests.setdefault(entry.allocated.request, []).append(entry)
        return self._metadata.write(
            namespace=claim.namespace,
            claim_name=claim.name,
            claim_uid=claim.uid,
            pod_claim_name=claim.pod_claim_name,
            requests=[
                MetadataRequest(
                    name=request,
                    devices=tuple(
                        MetadataDevice(
                            pool=self._node,
                            name=e.allocated.device,
                            attributes=self._attributes(e.device),
                        )
                        for e in members
                    ),
                )
                for request, members in requests.items()
            ],
        )

    async def _set_time_slice(
        self, ref: ClaimRef, entry: Entry, progress: Callable[[str], Any]
    ) -> None:
        """Set the GPU's time-slice once for all the claims sharing it.

        Every time-sliced claim records the setting it relies on, so the checkpoint
        counts the setting's users (an MPS share or memory slice relies on Default and
        sets nothing): the first sets it, later shares find it applied, and undo resets it
        only when the last one goes (`_undo`). One lock orders these, so two shares
        never both skip a reset nor count each other's change as the admin's setting.
        Planning compared the interval with every claim on the GPU, time-sliced or
        relying on Default (MPS, memory slices), its step recorded with the plan, so
        those being prepared at the same moment are seen too; the interval is compared
        again here, under the lock, with the settings applied, before anything changes.

        Time-slicing needs the GPU's compute mode at DEFAULT (several processes). The
        first claim records the mode it replaces; each later one copies that from the
        claims already there, so the last to leave, whichever it is, puts back the mode
        the admin chose (an EXCLUSIVE_PROCESS GPU stays one after a time-sliced claim).
        Each share makes sure of DEFAULT (one NVML call), so a share joining a GPU whose
        restore half failed still runs on a GPU that takes several processes.
        """
        uuid, interval = entry.uuid, entry.time_slice
        assert uuid is not None and interval is not None
        default = pynvml.NVML_COMPUTEMODE_DEFAULT
        async with self._time_slice_lock:
            cp = await self._checkpoint()
            unknown = cp.unreadable_naming(uuid, excluding=ref.uid)
            if unknown:
                # Their interval and the mode they replaced are unknown: setting either
                # could change a running pod's GPU under it.
                remedies = "; ".join(self._by_hand_each(unknown))
                raise ClaimError(
                    f"{ref.describe()}: GPU {uuid} is named by checkpoint records this "
                    f"release cannot read, which may rely on its time-slice; {remedies}"
                )
            users = _time_slice_users(cp, uuid, excluding=ref.uid)
            own = cp.get(ref.uid)
            held = [*users.values()] + [
                d.details.time_slice
                for d in (own.devices if own is not None else ())
                if d.details.time_slice is not None
                and d.details.time_slice.applied
                and d.details.time_slice.uuid == uuid
            ]
            other = next((step for step in held if step.interval != interval), None)
            if other is not None:
                holder = next((cp.get(u) for u, step in users.items() if step is other), own)
                name = holder.name_seen_from(ref.namespace) if holder is not None else None
                raise time_slice_conflict(
                    ref, entry, other.interval, asked=True, who=other_claim(name)
                )
            current = await anyio.to_thread.run_sync(compute_mode, self._nvml, uuid)
            first = not held
            if first:
                previous = None if current == default else current
            else:
                previous = _mode_before_time_slicing(held)
            # Recorded as not applied first: a setting the GPU refused needs no
            # reset, and a failing reset must not pin the claim.
            step = TimeSliceSet(
                uuid=uuid, interval=interval, applied=False, previous_compute_mode=previous
            )
            entry.details = replace(entry.details, time_slice=step)
            await progress("time-slice-recorded")
            try:
                if current != default:
                    await anyio.to_thread.run_sync(set_compute_mode, self._nvml, uuid, default)
                if first:
                    await anyio.to_thread.run_sync(self._sharing.set_time_slice, uuid, interval)
                entry.details = replace(entry.details, time_slice=replace(step, applied=True))
                await progress("time-slice-applied")
            except (Exception, anyio.get_cancelled_exc_class()):
                if first:
                    # Put back before the lock goes, also when cancelled (the kubelet's
                    # deadline): a share waiting for it would otherwise take this
                    # change for the admin's setting.
                    with anyio.CancelScope(shield=True):
                        await self._restore_before_time_slicing(ref.uid, uuid, previous)
                raise
            if not first:
                log.debug(
                    "time-slice already set for the GPU's other shares",
                    extra={"fields": {"claim": ref.uid, "gpu": uuid, "users": list(users)}},
                )

    async def _restore_before_time_slicing(
        self, uid: str, gpu_uuid: str, previous: int | None
    ) -> list[str]:
        """Reset GPU `gpu_uuid`'s time-slice and put back the compute mode `previous`
        (None: leave it); the failures, each named. Call under the time-slice lock."""
        steps: list[tuple[str, Callable[[], object]]] = [
            (
                f"resetting the time-slice of {gpu_uuid}",
                functools.partial(self._sharing.reset_time_slice, gpu_uuid),
            )
        ]
        if previous is not None:
            steps.append(
                (
                    f"restoring compute mode {previous} of {gpu_uuid}",
                    functools.partial(set_compute_mode, self._nvml, gpu_uuid, previous),
                )
            )
        errors: list[str] = []
        for what, fn in steps:
            try:
                await anyio.to_thread.run_sync(fn)
            except Exception as exc:
                log.warning(
                    "undoing a time-slice step failed",
                    extra={"fields": {"claim": uid, "step": what, "error": str(exc)}},
                )
                errors.append(f"{what}: {exc}")
        return errors

    async def _create_mig(self, entry: Entry, progress: Callable[[str], Any]) -> None:
        placement = entry.device.placement
        assert placement is not None
        mig = CreatedMig(
            profile_id=placement.profile_id,
            profile=placement.profile,
            start=placement.start,
            size=placement.size,
        )
        # Until the record has its ID, an undo finds the instance by profile and
        # placement: one there before this claim must never be taken for its own.
        if await anyio.to_thread.run_sync(placement_taken, self._nvml, entry.gpu.uuid, mig):
            raise MigError(
                f"MIG placement {placement.profile} at memory slice {placement.start} of GPU "
                f"{entry.gpu.uuid} is taken by an instance gpudra did not create (an "
                "administrator's or a static layout's); remove it, or publish that GPU "
                "with the static MIG strategy"
            )
        # Recorded before creating, so a crash right after creation is still undone.
        entry.details = replace(entry.details, mig=mig)
        await progress("mig-recorded")
        try:
            gi = await anyio.to_thread.run_sync(
                create_gpu_instance, self._nvml, entry.gpu.uuid, placement
            )
        except MigNotCreated:
            # NVML made nothing (another instance may have taken the placement since):
            # forget the record, so that no undo looks for one there.
            entry.details = replace(entry.details, mig=None)
            await progress("mig-not-created")
            raise
        mig = replace(mig, gi=gi)
        entry.details = replace(entry.details, mig=mig)
        await progress("mig-gpu-instance-created")
        ci, uuid = await anyio.to_thread.run_sync(
            create_compute_instance, self._nvml, entry.gpu.uuid, gi
        )
        entry.details = replace(entry.details, uuid=uuid, mig=replace(mig, ci=ci))
        await progress("mig-created")

    async def _start_mps(
        self, ref: ClaimRef, members: Sequence[Entry], progress: Callable[[str], Any]
    ) -> MpsDaemon:
        # A whole GPU given to one claim runs MPS clients only, as upstream does; a
        # shared GPU keeps its mode, since other claims' daemons use it too.
        exclusive = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
        for entry in members:
            uuid = entry.uuid
            if entry.device.type is not DeviceType.GPU or entry.share_id is not None or not uuid:
                continue
            previous = await anyio.to_thread.run_sync(compute_mode, self._nvml, uuid)
            if previous == exclusive:
                continue
            step = ComputeModeSet(uuid=uuid, previous=previous, applied=False)
            entry.details = replace(entry.details, compute_mode=step)
            await progress("compute-mode-recorded")
            await anyio.to_thread.run_sync(set_compute_mode, self._nvml, uuid, exclusive)
            entry.details = replace(entry.details, compute_mode=replace(step, applied=True))
            await progress("compute-mode-applied")
        uuids = tuple(dict.fromkeys(e.uuid for e in members if e.uuid))
        settings = mps_settings(members)
        percentage = settings.get("defaultActiveThreadPercentage")
        daemon = replace(
            self._mps_daemon(ref.uid),
            device_uuids=uuids,
            active_thread_percentage=None if percentage is None else int(percentage),
            pinned_memory_limits=mps_limits(members),
            multi_user=bool(settings.get("multiUser")),
        )
        started = MpsStarted(
            pipe_dir=daemon.pipe_dir, log_dir=daemon.log_dir, uuids=uuids, shm_dir=daemon.shm_dir
        )
        for entry in members:
            entry.details = replace(entry.details, mps=started)
        await progress("mps-recorded")
        identity = await anyio.to_thread.run_sync(
            self._sharing.start_mps, daemon, limiter=self._mps_starts
        )
        # The daemon is named in the checkpoint, which only this process writes,
        # before any container can reach its pipe folder.
        started = replace(started, daemon=identity)
        for entry in members:
            entry.details = replace(entry.details, mps=started)
        await progress("mps-started")
        return replace(daemon, identity=identity)

    # --- undo ---

    async def _unprepare_claim(self, ref: ClaimRef) -> str | None:
        try:
            validate_claim_uid(ref.uid)
        except CdiError as exc:
            raise ClaimError(f"claim {ref.namespace}/{ref.name}: {exc}") from None
        async with self._guard(ref.uid):
            cp = await self._checkpoint()
            await self._check_readable(cp, ref)
            record = cp.get(ref.uid)
            if record is None:
                return None
            await self._undo(record, "unprepare")
        return None

    async def _check_readable(self, cp: Checkpoint, ref: ClaimRef) -> None:
        """A claim whose record cannot be read is neither prepared again (that would
        drop the record) nor called unprepared (its devices may still be set up), until
        an admin says it was undone by hand."""
        if await self._forgot_unreadable(cp, ref.uid):
            return
        problem = cp.unreadable_problem(ref.uid)
        if problem is not None:
            raise ClaimError(f"{ref.describe()}: {self._unreadable_claim(ref.uid, problem)}")

    async def _forgot_unreadable(self, cp: Checkpoint, uid: str) -> bool:
        """Drop the unreadable record of `uid` where an admin marked it undone."""
        if cp.unreadable_problem(uid) is None or not self._marked_undone(uid):
            return False
        await self._persist(lambda c: c.remove(uid, durable=True))  # before the mark goes
        self._unmark(uid)
        log.warning(
            "unreadable checkpoint record forgotten: marked undone by hand",
            extra={"fields": {"claim": uid}},
        )
        return True

    async def _wait_for_holder(
        self, ref: ClaimRef, exc: DeviceConflictError, releases: int, deadline: float | None
    ) -> float:
        """Wait for another claim's unprepare to free the devices `exc` names, up to
        the conflict wait (`CONFLICT_WAIT_S` by default) from the first refusal
        (`deadline`: None until then); returns the deadline, for the caller to plan
        again. Raises the refusal where no unprepare frees them (a record that cannot be
        read waits for an admin), the time is up or the wait is 0.
        `releases`: `_releases` as the refused plan saw it; a claim the kubelet
        unprepared since then may have freed them already."""
        now = anyio.current_time()
        waits = exc.prepared and not exc.unreadable and self._conflict_wait > 0
        if not waits or (deadline is not None and now >= deadline):
            waited = self._conflict_wait if waits else None
            raise ClaimError(
                f"{ref.describe()}: {exc}; {self._conflict_remedy(exc, waited)}"
            ) from None
        if deadline is None:  # the first refusal: said once
            deadline = now + self._conflict_wait
            log.info(
                "claim waits for a device's holder to be unprepared",
                extra={"fields": {"claim": ref.uid, "conflict": str(exc)}},
            )
        if releases == self._releases:
            if self._released is None:
                self._released = anyio.Event()
            with anyio.move_on_after(deadline - now):
                await self._released.wait()
        return deadline

    def _forgotten(self) -> None:
        """The kubelet unprepared a claim: its devices may be free for a prepare that
        waits. Not the sweep of deleted claims: it unprepares a claim whose pod is gone
        from the API, and a pod deleted with no grace may still have containers on the
        node, which the kubelet gives 2 s or more to stop; a prepare waiting for that
        claim's devices plans again only at the end of its wait."""
        self._releases += 1
        if self._released is not None:
            self._released.set()
            self._released = None

    def _conflict_remedy(self, exc: DeviceConflictError, waited: float | None = None) -> str:
        """What frees the device: a prepared claim goes with its unprepare, an
        unreadable record only once an admin has undone it by hand. `waited`: how long
        the prepare waited for that unprepare."""
        remedies = self._by_hand_each(exc.unreadable)
        if exc.prepared:
            after = f"waited {waited:g} s for it; " if waited is not None else ""
            remedies.insert(
                0,
                f"a claim prepared on it must be unprepared first ({after}it is cleaned up "
                "once its ResourceClaim is deleted)",
            )
        return "; ".join(remedies)

    def _unreadable_claim(self, uid: str, problem: str) -> str:
        return f"its checkpoint record cannot be read: {problem}; " + self._by_hand(uid)

    @staticmethod
    def _owned_elsewhere(
        cp: Checkpoint, uid: str, gpu_uuid: str, mig: CreatedMig, *, any_id: bool = False
    ) -> str | None:
        """Another current claim that records the same MIG instance (after a crash
        between destroy and forget, the ID may have been handed out again).

        A placement holds one instance at a time, so an ID recorded on one side only
        (a crash before NVML gave it) does not tell them apart: the instance there is
        the other claim's. With `any_id` (a previous boot's record, whose IDs the GPU
        hands out afresh after a reboot) the placement alone decides."""
        for other in cp.claims():
            if other.uid == uid:
                continue
            for device in other.devices:
                theirs = device.details.mig
                if (
                    isinstance(theirs, CreatedMig)
                    and device.details.gpu_uuid == gpu_uuid
                    and (any_id or None in (theirs.gi, mig.gi) or theirs.gi == mig.gi)
                    and theirs.start == mig.start
                    and theirs.profile_id == mig.profile_id
                ):
                    return other.uid
        return None

    def _unreadable(self, uid: str, device: str, problem: str) -> str:
        return (
            f"the checkpoint record of device {device} cannot be read: {problem}; "
            + self._by_hand(uid)
        )

    def _undone_marker(self, uid: str) -> Path | None:
        """The file an admin creates to say that what claim `uid`'s unreadable record
        describes was undone by hand; None for a UID no file can be named by."""
        marker = self._undone_file(uid)
        return None if marker is None else Path(marker)

    def _undone_file(self, uid: str) -> str | None:
        """`_undone_marker` as a string: looked up on every unprepare, where Path
        arithmetic costs more than the lookup."""
        try:
            return f"{self._undone_dir}/{validate_claim_uid(uid)}"
        except CdiError:
            return None

    def _by_hand_each(self, uids: Sequence[str]) -> list[str]:
        """The by-hand remedy for each claim whose record cannot be read."""
        return [f"for claim {uid}: {self._by_hand(uid)}" for uid in uids]

    def _by_hand(self, uid: str) -> str:
        marker = self._undone_marker(uid)
        where = (
            f"then create the file {marker} on the node, and the agent forgets the record"
            if marker is not None
            else (
                f"then, with the agent stopped (stopped, not killed: its stop folds "
                f"{self._checkpoint_path.name}.changes into the file, whose pending lines "
                f"an edit would void), remove it from {self._checkpoint_path}"
            )
        )
        return (
            "undo what it describes by hand (MIG instances, MPS daemon, compute mode), "
            f"{where} (an edit while the agent runs does not stick: the agent then stops "
            "writing the file until it is restarted)"
        )

    def _marked_undone(self, uid: str) -> bool:
        marker = self._undone_file(uid)
        return marker is not None and os.path.lexists(marker)

    def _unmark(self, uid: str) -> None:
        marker = self._undone_marker(uid)
        if marker is not None:
            with contextlib.suppress(OSError):
                marker.unlink()

    async def _undo(self, record: ClaimRecord, why: str) -> None:
        """Undo every recorded side effect, newest kind first, then forget the claim.

        Every step is tried even when one fails, so one stuck piece does not keep
        the rest in place; the record stays until all of them succeed. Nothing is undone
        once another agent took the checkpoint over: what the record names may be that
        agent's by now (the claim deleted and created again, a time-slice its claims
        rely on), and it undoes what is its own.
        """
        cp = await self._checkpoint()
        await self._check_owner(cp)
        errors: list[str] = []

        async def attempt(
            what: str,
            fn: Callable[[], object],
            *,
            required: bool = True,
            cdi: bool = False,
            limiter: anyio.CapacityLimiter | None = None,
        ) -> None:
            try:
                if cdi:
                    await self._cdi_io(fn)
                else:
                    await anyio.to_thread.run_sync(fn, limiter=limiter)
            except Exception as exc:
                if required:
                    errors.append(f"{what}: {exc}")
                else:
                    # The step may never have taken effect (it failed, or the process
                    # died right after it): undoing it is best effort.
                    log.warning(
                        "undo of a step not known to be applied failed",
                        extra={"fields": {"claim": record.uid, "step": what, "error": str(exc)}},
                    )

        device_ids = [i for d in record.devices for i in d.cdi_device_ids]
        await attempt(
            "removing the CDI spec",
            functools.partial(self._cdi.remove, record.uid, device_ids=device_ids),
            cdi=True,
        )
        # After the spec: no container made from here on mounts the files.
        if self._metadata.writes or mounted(device_ids):
            await attempt(
                "removing the device metadata",
                functools.partial(
                    self._metadata.remove,
                    record.uid,
                    [r for d in record.devices for r in d.request_names],
                ),
                cdi=True,
            )
        daemons: dict[Path, MpsStarted] = {}
        time_slices: dict[str, bool] = {}
        modes_before_slicing: dict[str, int] = {}
        modes: dict[str, ComputeModeSet] = {}
        migs: list[tuple[str, CreatedMig, str | None]] = []
        # Looked up on every undo, not only for a record with problems: a mark the
        # previous boot's clean-up left for this claim goes with its unprepare.
        undone_by_hand = self._marked_undone(record.uid)
        for device in record.devices:
            details = device.details
            if not undone_by_hand:
                errors.extend(
                    self._unreadable(record.uid, device.device, p)
                    for p in details.problems.values()
                )
            if details.mps is not None:
                daemons.setdefault(details.mps.pipe_dir, details.mps)
            if details.time_slice is not None:
                key = details.time_slice.uuid
                time_slices[key] = time_slices.get(key, False) or details.time_slice.applied
                if details.time_slice.previous_compute_mode is not None:
                    modes_before_slicing[key] = details.time_slice.previous_compute_mode
            if details.compute_mode is not None:
                modes.setdefault(details.compute_mode.uuid, details.compute_mode)
            if isinstance(details.mig, CreatedMig) and details.gpu_uuid:
                migs.append((details.gpu_uuid, details.mig, details.uuid))
        for started in daemons.values():
            daemon = MpsDaemon(
                name=record.uid,
                pipe_dir=started.pipe_dir,
                log_dir=started.log_dir,
                device_uuids=started.uuids,
                shm_dir=started.shm_dir,
                identity=started.daemon,
            )
            await attempt(
                f"stopping MPS daemon {daemon.pipe_dir}",
                functools.partial(self._stop_mps, daemon),
                # A prepare's rollback: folders no container has seen (see __init__).
                limiter=self._mps_stops if record.completed else self._mps_starts,
            )
        # Taken only for a claim with time-slices: the lock yields a turn of the loop,
        # and every other unprepare would pay it for nothing.
        async with self._time_slice_lock if time_slices else contextlib.nullcontext():
            for uuid, applied in time_slices.items():
                users = _time_slice_users(cp, uuid, excluding=record.uid)
                keys = [
                    d.key
                    for d in record.devices
                    if d.details.time_slice is not None and d.details.time_slice.uuid == uuid
                ]
                unknown = cp.unreadable_naming(uuid, excluding=record.uid, devices=keys)
                if unknown:
                    # Their undo is by hand (they fail unprepare naming the record); a
                    # reset here could change a running pod's GPU under it.
                    log.warning(
                        "time-slice kept: claims whose checkpoint records cannot be read "
                        "name the GPU and may rely on it; once they are undone, reset the "
                        "time-slice and put back the compute mode given here by hand",
                        extra={
                            "fields": {
                                "claim": record.uid,
                                "gpu": uuid,
                                "unreadable": unknown,
                                "compute_mode_before": modes_before_slicing.get(uuid),
                            }
                        },
                    )
                elif users:
                    log.info(
                        "time-slice kept for the GPU's other shares",
                        extra={"fields": {"claim": record.uid, "gpu": uuid, "users": list(users)}},
                    )
                else:
                    failed = await self._restore_before_time_slicing(
                        record.uid, uuid, modes_before_slicing.get(uuid)
                    )
                    if failed and applied:
                        # Kept, and tried again with the claim's next undo; a share
                        # joining meanwhile applies the setting again anyway.
                        errors.extend(failed)
                        continue
                # From here this claim no longer relies on the setting: a share deciding
                # after it (its next undo step may wait, or fail) must not count it.
                await self._persist(
                    functools.partial(Checkpoint.release_time_slice, uid=record.uid, gpu_uuid=uuid)
                )
        for uuid, mode in modes.items():
            await attempt(
                f"restoring compute mode {mode.previous} of {uuid}",
                functools.partial(set_compute_mode, self._nvml, uuid, mode.previous),
                required=mode.applied,
            )
        for gpu_uuid, mig, mig_uuid in migs:
            owner = self._owned_elsewhere(cp, record.uid, gpu_uuid, mig)
            if owner is not None:
                log.warning(
                    "MIG instance now belongs to another claim; not destroying it",
                    extra={"fields": {"claim": record.uid, "owner": owner, "gi": mig.gi}},
                )
                continue
            # With the MIG device's UUID (recorded once NVML made it) only that very
            # instance goes: between the check above and NVML's answer another claim
            # may have made one at the same placement, under the same ID.
            await attempt(
                f"destroying MIG instance {'?' if mig.gi is None else mig.gi} on {gpu_uuid}",
                functools.partial(destroy_mig, self._nvml, gpu_uuid, mig, mig_uuid=mig_uuid),
            )
        if errors:
            raise ClaimError(f"{record.ref.describe()}: {why}: " + "; ".join(errors))

        def remove(cp: Checkpoint) -> None:
            removed = cp.remove(record.uid, durable=undone_by_hand)
            if removed and record.completed and self._holdings is not None:  # as above
                self._holdings.released(record)

        # The admin's mark goes only once the removal would survive a power loss.
        await self._persist(remove)
        if undone_by_hand:
            self._unmark(record.uid)
        log.info(
            "claim unprepared",
            extra={"fields": {"claim": record.uid, "reason": why}},
        )

    def _stop_mps(self, daemon: MpsDaemon) -> None:
        self._sharing.stop_mps(daemon)
        parent = daemon.pipe_dir.parent
        if parent.parent == self._mps_root:
            remove_tree(parent)

    # --- start-up and housekeeping ---

    async def recover(self) -> RecoveryReport:
        """Put the node back in line with the checkpoint; call once at start.

        Rolls back prepares a crash interrupted, cleans up after a reboot (MIG
        instances we created that the driver kept), and removes CDI specs, MPS
        folders and temp files that belong to no recorded claim. Safe to call while
        serving: each claim is handled under its own lock. A record that cannot be
        undone is that claim's error in the report, never the agent's.
        """
        cp = await self._checkpoint()
        errors: list[str] = []
        rolled_back: list[str] = []
        for record in cp.incomplete():
            async with self._guard(record.uid):
                current = cp.get(record.uid)
                if current is None or current.completed:
                    continue
                try:
                    await self._undo(current, "rolling back a prepare interrupted by a restart")
                except ClaimError as exc:
                    errors.append(str(exc))
                except CheckpointError as exc:
                    # The state disk full or failing: the claim keeps its record and is
                    # rolled back at the next start; the agent still starts.
                    errors.append(f"{current.ref.describe()}: rolling back: {exc}")
                else:
                    rolled_back.append(record.uid)
        for uid in sorted(cp.unreadable()):
            async with self._guard(uid):
                try:
                    if await self._forgot_unreadable(cp, uid):
                        continue
                except CheckpointError as exc:
                    # The state disk full: the record and its mark stay, for the next
                    # start or the claim's next call; the agent still starts.
                    errors.append(f"claim {uid}: forgetting its record marked undone: {exc}")
                    continue
                problem = cp.unreadable_problem(uid)
                if problem is not None:
                    errors.append(f"claim {uid}: {self._unreadable_claim(uid, problem)}")
        previous = [r.uid for r in cp.previous_boot()]
        errors.extend(await self._clean_previous_boot(cp))
        orphan_specs, orphan_dirs, temp_files = await self._remove_orphans(cp, errors)
        orphan_metadata = await self._remove_orphaned_metadata(cp, errors)
        report = RecoveryReport(
            rolled_back=tuple(rolled_back),
            previous_boot=tuple(previous),
            orphaned_specs=tuple(orphan_specs),
            orphaned_mps_dirs=tuple(orphan_dirs),
            orphaned_metadata=tuple(orphan_metadata),
            temp_files=temp_files,
            errors=tuple(errors),
        )
        log.info("recovery done", extra={"fields": dataclasses.asdict(report)})
        return report

    async def _clean_previous_boot(self, cp: Checkpoint) -> list[str]:
        """Daemons and time-slices do not outlive a reboot, and NVIDIA's MIG instances
        do not either (only MIG mode does), though a GPU that is not reset with its host
        (passed through to a virtual machine) may keep them. An instance at a recorded
        placement is destroyed only where it is provably the one gpudra made, its MIG
        device UUID the recorded one: after a reboot the placement and GPU instance ID
        may belong to an instance made since (nvidia-mig-parted re-creating a layout at
        boot, an admin), and a record from before NVML gave the UUID proves nothing. Each
        record goes once everything it names is cleaned, so one that cannot be
        (unreadable, or NVML refusing) is retried alone at later starts.

        This boot's claims may meanwhile hold what a previous-boot record names: a MIG
        placement the scheduler handed out again, or the MPS folders of the same claim
        UID, which the kubelet prepares again after a reboot. Those are theirs and stay.
        """
        errors: list[str] = []
        cleaned: list[ClaimRecord] = []
        unmark: list[str] = []
        for record in cp.previous_boot():
            where = f"previous boot claim {record.namespace}/{record.name}"
            failed = len(errors)
            undone_by_hand = self._marked_undone(record.uid)
            # This boot's claims of the same UID, readable or not, hold what is theirs.
            current = cp.get(record.uid) is not None or record.uid in cp.unreadable()
            for device in record.devices:
                details = device.details
                for key in ("mig", "parentUuid"):
                    if key in details.problems and not undone_by_hand:
                        problem = details.problems[key]
                        errors.append(
                            f"{where}: {self._unreadable(record.uid, device.device, problem)}"
                        )
                mig, gpu_uuid = details.mig, details.gpu_uuid
                if isinstance(mig, CreatedMig) and gpu_uuid:
                    if self._owned_elsewhere(
                        cp, "", gpu_uuid, mig, any_id=True
                    ) is not None or cp.unreadable_holders(device.key):
                        continue
                    if details.uuid is None:
                        log.info(
                            "previous boot MIG instance left: nothing proves an instance "
                            "at its placement is the one gpudra made",
                            extra={"fields": {"claim": record.uid, "gpu": gpu_uuid}},
                        )
                        continue
                    destroy = functools.partial(
                        destroy_mig, self._nvml, gpu_uuid, mig, mig_uuid=details.uuid
                    )
                    try:
                        await anyio.to_thread.run_sync(destroy)
                    except Exception as exc:
                        gi = "?" if mig.gi is None else mig.gi
                        errors.append(f"{where}: destroying MIG instance {gi} on {gpu_uuid}: {exc}")
                if details.mps is not None and not current:
                    pipe = details.mps.pipe_dir
                    if pipe.parent.parent == self._mps_root:
                        try:
                            await anyio.to_thread.run_sync(remove_tree, pipe.parent)
                        except OSError as exc:
                            errors.append(f"{where}: {exc}")
            if len(errors) == failed:
                cleaned.append(record)
                if undone_by_hand and not current:
                    unmark.append(record.uid)
        if cleaned:
            # An admin's mark goes only once the record is gone for good (synced): a
            # record back without its mark would have to be undone by hand again.
            forget = functools.partial(
                Checkpoint.forget_previous_boot, records=cleaned, durable=bool(unmark)
            )
            try:
                await self._persist(forget)
            except CheckpointError as exc:
                errors.append(f"forgetting the previous boot's claims: {exc}")
            else:
                for uid in unmark:
                    self._unmark(uid)
        return errors

    async def _remove_orphaned_metadata(self, cp: Checkpoint, errors: list[str]) -> list[str]:
        """Remove the device metadata files of claims the checkpoint does not name
        (a prepare that died before its record, a claim of a previous boot that was
        not prepared again), whether or not this agent writes them."""
        removed: list[str] = []
        for uid in await anyio.to_thread.run_sync(self._metadata.claim_uids):
            async with self._guard(uid):
                if cp.get(uid) is not None or uid in cp.unreadable():
                    continue
                try:
                    await anyio.to_thread.run_sync(self._metadata.remove_claim, uid)
                except OSError as exc:
                    errors.append(f"removing orphaned device metadata of claim {uid}: {exc}")
                else:
                    removed.append(uid)
        return removed

    async def _remove_orphans(
        self, cp: Checkpoint, errors: list[str]
    ) -> tuple[list[str], list[str], int]:
        def listing() -> tuple[list[str], list[str]]:
            specs = self._cdi.list_claim_uids()
            dirs = (
                sorted(p.name for p in self._mps_root.iterdir() if p.is_dir())
                if self._mps_root.is_dir()
                else []
            )
            return specs, dirs

        async with self._lock:
            specs, dirs = await anyio.to_thread.run_sync(listing)
        removed_specs: list[str] = []
        removed_dirs: list[str] = []
        for uid in specs:
            async with self._guard(uid):
                if cp.get(uid) is not None or uid in cp.unreadable():
                    continue
                try:
                    await anyio.to_thread.run_sync(self._cdi.remove, uid)
                except OSError as exc:
                    errors.append(f"removing orphaned CDI spec of claim {uid}: {exc}")
                else:
                    removed_specs.append(uid)
        for name in dirs:
            async with self._guard(name):
                if cp.get(name) is not None or name in cp.unreadable():
                    continue
                try:
                    daemon = self._mps_daemon(name)
                except CdiError:
                    continue  # not a folder of ours
                try:
                    await anyio.to_thread.run_sync(self._stop_mps, daemon, limiter=self._mps_stops)
                except Exception as exc:
                    errors.append(f"stopping orphaned MPS daemon {daemon.pipe_dir}: {exc}")
                else:
                    removed_dirs.append(name)

        def temp_files() -> int:
            count = self._cdi.remove_temp_files()
            folder = self._checkpoint_path.parent
            if folder.is_dir():
                for path in folder.glob(f".{self._checkpoint_path.name}.*.tmp"):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                        count += 1
            return count

        async with self._lock:
            removed_temp = await anyio.to_thread.run_sync(temp_files)
        return removed_specs, removed_dirs, removed_temp

    async def cleanup_deleted_claims(self, claims: ClaimLookup) -> list[str]:
        """Unprepare recorded claims whose ResourceClaim is gone or was re-created
        (other UID), as `claims` tells: the kubelet never unprepares those when it
        missed the deletion. A claim whose pod still runs here is left to the kubelet,
        which unprepares it when the pod ends: its containers may still have the
        devices, and the scheduler, which no longer counts them, may give them to
        another claim, which prepare then refuses rather than share them.

        Returns the UIDs unprepared; failures are logged and retried on the next call.
        Raises CheckpointTakenOverError, having asked the API server nothing, once another
        agent took the checkpoint over: the sweep is that agent's from then on.
        """
        cp = await self._checkpoint()
        await self._check_owner(cp)
        cleaned: list[str] = []
        for record in cp.claims():
            try:
                if await claims.current_uid(record.ref) == record.uid:
                    continue
                used = await claims.still_used(record.ref, record.pod, record.pod_uid)
            except Exception as exc:
                log.warning(
                    "cannot check claim", extra={"fields": {"claim": record.uid, "error": str(exc)}}
                )
                continue
            if used:
                if record.uid not in self._left_to_kubelet:
                    self._left_to_kubelet.add(record.uid)
                    log.warning(
                        "a claim was deleted while its pod still runs here; it stays prepared "
                        "until the pod ends and the kubelet unprepares it",
                        extra={"fields": {"claim": record.ref.describe(), "pod": record.pod}},
                    )
                continue
            error = await self._unprepare_one(record.ref)
            if error is None:
                cleaned.append(record.uid)
        self._left_to_kubelet &= {r.uid for r in cp.claims()}
        if cleaned:
            log.info("unprepared deleted claims", extra={"fields": {"claims": cleaned}})
        return cleaned
