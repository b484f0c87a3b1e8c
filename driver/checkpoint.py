"""Crash-safe record of the claims this node has prepared.

The kubelet may call NodePrepareResources again after a plugin restart and
expects the same answer, and a crash half-way through a prepare leaves state
(MIG instances, MPS daemons, compute modes) that has to be rolled back. Both
need a record that survives the process; this is it.

Design choices, and why:
- Plain JSON written atomically (temp file in the same directory, fsync, rename,
  fsync of the directory): a reader sees the old or the new file, never a torn one,
  so no checksum is needed. The directory's fsync is skipped for the changes made
  after the node's last step for a claim (a prepare's end, a removal, forgetting
  cleaned-up previous-boot claims), which a power loss may undo harmlessly: one sync
  fewer on every prepare's and unprepare's path (`Checkpoint._save` says why that is
  safe, and when every write syncs anyway). The upstream driver's checksum over all
  fields made every release that added a field unable to read the previous
  release's file.
- `version` says which schema the writer knew. Any release reads any version;
  fields it does not know are kept verbatim and written back, so a downgrade
  followed by an upgrade loses nothing. A record it cannot interpret is kept as
  is and reported, never fatal.
- `majorVersion` (absent: 1) is raised only by a change an older release would
  misread (an existing field with a new meaning), never by an addition. A release
  that finds a higher one refuses to load the file and leaves it untouched: guessing
  would unprepare or double-book devices that running pods hold. The file alone
  misses what the changes file holds (below), so while an agent may still append
  to it, the file says 2; the agent's stop folds the changes in and writes 1. A
  release from before the changes file reads 1 only: after an agent killed without
  stopping it refuses the file rather than roll back prepares that ended (and destroy
  a running pod's MIG instance) or miss removals.
- Device details are typed records in memory (`gpudra.driver.records`) and keep
  the JSON shape of version 1 on disk, so the version is still 1: releases from
  before the typed records read this release's files and the other way round.
- Tied to the boot ID: after a reboot the devices a prepare set up are gone, so
  the old boot's claims are moved to `previousBoot` (each kept until the owner calls
  `forget_previous_boot` for it, so a crash during cleanup loses nothing) and reported
  for cleanup of anything that may outlive a boot, such as MIG instances.
  A `previousBoot` record this release cannot read stays there as it is, never cleaned
  up or forgotten: what it names only the release that wrote it can tell, so a
  downgrade and an upgrade back lose none of that release's clean-up. At a reboot, a
  claim whose record this release cannot read moves there as it is too, as the release
  that wrote it would have moved it: its devices are void like the others', and
  dropping it would lose the clean-up of whatever it set up that outlives a boot.

- One claim per line, each encoded once and reused until the claim changes: a
  write costs the claims that changed, not the whole file.
- Changes that a power loss may undo (a prepare's end, a removal) are not written by
  replacing the file: through a `GroupCommit` they are appended, unsynced, to a changes
  file beside it (`gpudra.driver.checkpoint_changes`, which says why and how a reader
  knows what to apply). That spares a whole-GPU prepare and unprepare each an fsync and
  a hand-off to a worker thread. The next change that must survive a power loss, a
  changes file grown past `_CHANGES_LIMIT`, or the agent's stop replaces the file whole
  and empties the changes file, so a release that reads the file alone still finds every
  change once the agent has stopped.

Concurrency: a Checkpoint has a single owner. Called directly, every mutation
writes before it returns, and the owner must serialise the calls. Through a
`GroupCommit`, concurrent tasks of one event loop change it in memory at once and
share writes: while one write and fsync run, the changes made meanwhile queue up
and go to disk together in the next one, and each task resumes only once a write
holding its change has finished (its rename synced too where the change must
survive a power loss).

Between processes: a rolling update with a surge pod runs the new agent beside the old
one, on the same files. Every write holds a lock file beside the checkpoint and checks
that the files are as this process left them; the new agent's load takes the file over
(reads and replaces it under the lock, making the changes file anew), so the old agent's
later writes are refused, not lost, and its stop leaves the new agent's records. A refused
write comes too late for a device change made before it, so the old agent also asks
`Checkpoint.check_owner` before it changes any device (a prepare, an unprepare, the sweep
of deleted claims): once its checkpoint is taken over it changes no device, since the new
agent may hold them under its own records, and it stops publishing the node's
ResourceSlices, which the new agent publishes. Should the new agent go away while the old
one runs on (its pod failed or deleted, a rollback), the old one must not stand down for
good: every agent's load that takes the file over also locks an owner file of its own, for
the life of its process (`gpudra.driver.owners`). An agent taken over that finds every
owner file made after its own unlocked (`Checkpoint.owner_gone`) stops, so that its
restart takes the file over again; one that finds none (a release from before owner files
took the file over) stands down on. Tools that only read (`load` without `take_over`,
`document`) take no lock.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, NamedTuple, TypeAlias, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

__all__ = [
    "CHECKPOINT_MAJOR_VERSION",
    "CHECKPOINT_VERSION",
    "DEFAULT_BOOT_ID_PATH",
    "Checkpoint",
    "CheckpointError",
    "CheckpointOwnerGoneError",
    "CheckpointTakenOverError",
    "CheckpointTooNewError",
    "ClaimRecord",
    "ClaimRef",
    "ClaimState",
    "DeviceConflictError",
    "DeviceKey",
    "DeviceRecord",
    "GroupCommit",
    "document",
    "document_of",
    "load",
    "read_boot_id",
]

from gpudra.api import jsonbytes
from gpudra.common.files import ProcessLock, atomic_write
from gpudra.driver.checkpoint_changes import (
    ChangedError,
    ChangesFile,
    Replayed,
    base_of,
    encode_line,
    replay,
)
from gpudra.driver.claims import ClaimRef
from gpudra.driver.owners import OwnerFile, owners_folder
from gpudra.driver.records import DeviceDetails, details_from_json, details_to_json

log = logging.getLogger(__name__)

T = TypeVar("T")

CHECKPOINT_VERSION: Final = 1
CHECKPOINT_MAJOR_VERSION: Final = 2
"""The highest `majorVersion` this release reads."""
_EXTENDED_MAJOR_VERSION: Final = 2
"""A changes file may extend the file (an agent that may append has written it); a
file that holds every change says nothing, which reads as 1."""
DEFAULT_BOOT_ID_PATH: Final = Path("/proc/sys/kernel/random/boot_id")

_DEVICE_KEYS: Final = frozenset(
    {
        "pool",
        "device",
        "requestNames",
        "cdiDeviceIds",
        "shareId",
        "adminAccess",
        "exclusive",
        "details",
    }
)
_CLAIM_KEYS: Final = frozenset({"uid", "namespace", "name", "state", "devices"})
_TOP_KEYS: Final = frozenset(
    {"version", "majorVersion", "bootId", "claims", "previousBoot", "writeId"}
)
_CHANGES_LIMIT: Final = 1 << 20
"""Bytes of appended changes past which the next change replaces the file whole."""


def read_boot_id(path: Path = DEFAULT_BOOT_ID_PATH) -> str | None:
    """The kernel's boot ID, or None when unreadable (then nothing is discarded)."""
    try:
        boot_id = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        log.warning(
            "cannot read the boot ID; prepared claims are kept as they are",
            extra={"fields": {"path": str(path), "error": str(exc)}},
        )
        return None
    return boot_id or None


class CheckpointError(Exception):
    """The checkpoint cannot be read or a change to it is not allowed."""


class CheckpointTakenOverError(CheckpointError):
    """Another process changed the file since this one read or wrote it: a newer agent
    took it over (a rolling update with a surge pod) or someone edited it. A class of
    its own: this process is done with the file for good, unlike a full or failing disk,
    which the next write may get past."""


class CheckpointOwnerGoneError(CheckpointError):
    """The agents that took the file over from this process are gone (`owner_gone`):
    this process stops, for its restart to take the file over again."""


class CheckpointTooNewError(CheckpointError):
    """The file's `majorVersion` is one this release cannot read."""


class DeviceConflictError(CheckpointError):
    """A device would be prepared for a second claim while it is held exclusively.

    `prepared`: whether a readable record holds it (unprepare that claim);
    `unreadable`: the claims whose unreadable records name it, each of which an admin
    has to undo by hand: the two need different remedies in the caller's message."""

    def __init__(
        self, message: str, *, prepared: bool = False, unreadable: Sequence[str] = ()
    ) -> None:
        super().__init__(message)
        self.prepared = prepared
        self.unreadable = tuple(unreadable)


class ClaimState(StrEnum):
    PREPARE_STARTED = "PrepareStarted"
    PREPARE_COMPLETED = "PrepareCompleted"


class DeviceKey(NamedTuple):
    pool: str
    device: str


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """One device prepared for a claim.

    `exclusive` is False for a device shared on purpose (time-slicing, MPS,
    consumable capacity); `admin_access` devices never block or are blocked.
    `details` says what the device is and records each side effect of its
    prepare, for rollback and unprepare (see `gpudra.driver.records`). `extra`
    holds fields written by another release and is written back unchanged.
    """

    pool: str
    device: str
    request_names: tuple[str, ...] = ()
    cdi_device_ids: tuple[str, ...] = ()
    share_id: str | None = None
    admin_access: bool = False
    exclusive: bool = True
    details: DeviceDetails = field(default_factory=DeviceDetails)
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def key(self) -> DeviceKey:
        return DeviceKey(self.pool, self.device)


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    uid: str
    namespace: str
    name: str
    state: ClaimState
    devices: tuple[DeviceRecord, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ref(self) -> ClaimRef:
        return ClaimRef(namespace=self.namespace, uid=self.uid, name=self.name)

    @property
    def completed(self) -> bool:
        return self.state is ClaimState.PREPARE_COMPLETED

    @property
    def pod(self) -> str:
        """The pod the claim was prepared for (the first it was reserved for); "" when
        not recorded."""
        return next((d.details.pod for d in self.devices if d.details.pod), "")

    @property
    def pod_uid(self) -> str:
        """The UID of `pod`; "" when not recorded (records of earlier releases)."""
        return next((d.details.pod_uid for d in self.devices if d.details.pod), "")

    def name_seen_from(self, namespace: str) -> str | None:
        """``namespace/name`` for a message another claim of `namespace` reads, None for
        one of another namespace: such messages reach that claim's pod events, and another
        namespace may be another tenant's."""
        return f"{self.namespace}/{self.name}" if self.namespace == namespace else None


# --- JSON mapping ---------------------------------------------------------------------------


class _MalformedError(ValueError):
    pass


def _str(obj: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str):
        raise _MalformedError(f"{key} must be a string")
    return value


def _str_list(obj: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = obj.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _MalformedError(f"{key} must be a list of strings")
    return tuple(value)


def _bool(obj: Mapping[str, Any], key: str, default: bool) -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise _MalformedError(f"{key} must be a boolean")
    return value


def _device_from_json(obj: Any) -> DeviceRecord:
    if not isinstance(obj, dict):
        raise _MalformedError("device must be an object")
    share_id = obj.get("shareId")
    if share_id is not None and not isinstance(share_id, str):
        raise _MalformedError("shareId must be a string")
    details = obj.get("details") or {}
    if not isinstance(details, dict):
        raise _MalformedError("details must be an object")
    return DeviceRecord(
        pool=_str(obj, "pool"),
        device=_str(obj, "device"),
        request_names=_str_list(obj, "requestNames"),
        cdi_device_ids=_str_list(obj, "cdiDeviceIds"),
        share_id=share_id,
        admin_access=_bool(obj, "adminAccess", False),
        exclusive=_bool(obj, "exclusive", True),
        details=details_from_json(details),
        extra={k: v for k, v in obj.items() if k not in _DEVICE_KEYS},
    )


def _device_to_json(device: DeviceRecord) -> dict[str, Any]:
    out = dict(device.extra)
    out.update(
        pool=device.pool,
        device=device.device,
        requestNames=list(device.request_names),
        cdiDeviceIds=list(device.cdi_device_ids),
        adminAccess=device.admin_access,
        exclusive=device.exclusive,
        details=details_to_json(device.details),
    )
    if device.share_id is not None:
        out["shareId"] = device.share_id
    return out


def _claim_from_json(obj: Any) -> ClaimRecord:
    if not isinstance(obj, dict):
        raise _MalformedError("claim record must be an object")
    raw_state = _str(obj, "state")
    try:
        state = ClaimState(raw_state)
    except ValueError:
        # A newer release's state: its claim may be prepared and in use, so rolling it
        # back could take a running pod's devices. The record is kept as it is and
        # reported, as any record this release cannot read.
        raise _MalformedError(
            f"state {raw_state!r} is not one this release knows (a newer release's?)"
        ) from None
    devices = obj.get("devices") or []
    if not isinstance(devices, list):
        raise _MalformedError("devices must be a list")
    return ClaimRecord(
        uid=_str(obj, "uid"),
        namespace=_str(obj, "namespace", ""),
        name=_str(obj, "name", ""),
        state=state,
        devices=tuple(_device_from_json(d) for d in devices),
        extra={k: v for k, v in obj.items() if k not in _CLAIM_KEYS},
    )


def _keyed_claim_from_json(uid: str, obj: Any) -> ClaimRecord:
    record = _claim_from_json(obj)
    if record.uid != uid:
        raise _MalformedError(f"record uid {record.uid!r} differs from its key {uid!r}")
    return record


def _member(key: str, value: Any) -> bytes:
    """`"<key>":<value>`, one member of a JSON object: the checkpoint file and its
    changes lines hold the claims one encoded member each."""
    return jsonbytes.dumps(key) + b":" + jsonbytes.dumps(value)


def _claim_to_json(claim: ClaimRecord) -> dict[str, Any]:
    out = dict(claim.extra)
    out.update(
        uid=claim.uid,
        namespace=claim.namespace,
        name=claim.name,
        state=claim.state.value,
        devices=[_device_to_json(d) for d in claim.devices],
    )
    return out


def _detached(devices: Iterable[DeviceRecord]) -> tuple[DeviceRecord, ...]:
    """Copies that share nothing with the caller and are known to be JSON-serialisable.
    A record of plain values only (`_plain`) is its own copy: nothing in it can change."""
    try:
        return tuple(
            d if _plain(d) else _device_from_json(jsonbytes.copy(_device_to_json(d)))
            for d in devices
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"device record is not JSON-serialisable: {exc}") from None


_STR: Final = (str,)
_BOOL: Final = (bool,)
_OPTIONAL_STR: Final = (str, type(None))
_OPTIONAL_INT: Final = (int, type(None))


def _plain(device: DeviceRecord) -> bool:
    """Whether the record holds strings, whole numbers, booleans and tuples of strings
    only, with no side effect and nothing kept for another release (a whole GPU's, as
    a prepare's plan has it): such a record cannot change and reads back from its JSON
    as it is, so it needs no copy. Exact types: a subclass could carry anything."""
    details = device.details
    # Plain loops over the values, no generators: it runs for every device of every
    # prepare, and generators cost more than the tests.
    return (
        type(device) is DeviceRecord
        and type(details) is DeviceDetails
        and not (device.extra or details.extra or details.problems)
        and details.mig is None
        and details.time_slice is None
        and details.compute_mode is None
        and details.mps is None
        and details.type != ""  # a planned device's: its file shape lists every value
        and _types_in(
            (
                device.pool,
                device.device,
                details.type,
                details.request,
                details.pod,
                details.pod_uid,
            ),
            _STR,
        )
        and _types_in((device.share_id, details.gpu_uuid, details.uuid), _OPTIONAL_STR)
        and _types_in((device.admin_access, device.exclusive), _BOOL)
        and type(details.gpu_minor) in _OPTIONAL_INT
        and type(device.request_names) is tuple
        and _types_in(device.request_names, _STR)
        and type(device.cdi_device_ids) is tuple
        and _types_in(device.cdi_device_ids, _STR)
    )


def _types_in(values: tuple[object, ...], types: tuple[type, ...]) -> bool:
    """Whether the exact type of every one of `values` is one of `types`."""
    for value in values:  # noqa: SIM110 - a loop: no generator built on every prepare
        if type(value) not in types:
            return False
    return True


# --- the checkpoint ---------------------------------------------------------------------------


class Checkpoint:
    """Prepared claims of this node; every mutating method persists before it returns
    (through a `GroupCommit`: before the GroupCommit returns)."""

    def __init__(
        self,
        path: Path,
        *,
        boot_id: str | None,
        claims: Mapping[str, ClaimRecord] | None = None,
        previous_boot: Sequence[ClaimRecord] = (),
        unreadable: Mapping[str, Any] | None = None,
        previous_unreadable: Sequence[Any] = (),
        extra: Mapping[str, Any] | None = None,
        file_version: int | None = None,
        lock: ProcessLock | None = None,
    ) -> None:
        self._path = path
        self._boot_id = boot_id
        self._claims: dict[str, ClaimRecord] = dict(claims or {})
        self._previous_boot: tuple[ClaimRecord, ...] = tuple(previous_boot)
        self._unreadable: dict[str, Any] = dict(unreadable or {})
        # `previousBoot` records this release cannot read, as read: written back, never
        # cleaned up or forgotten here (see the module docstring).
        self._previous_unreadable: tuple[Any, ...] = tuple(previous_unreadable)
        self._extra: dict[str, Any] = dict(extra or {})
        self._file_version = file_version
        # Whether a reboot is recognised by the boot ID: the machine's was read, and the
        # file on disk names it. Until then every write syncs its rename (see `_save`).
        self._boot_known = False
        self._boot_on_disk = False
        # Writes run in worker threads; one at a time, and never an older snapshot over
        # a newer one (see `_write`).
        self._write_lock = threading.Lock()
        self._on_disk_seq = -1
        # Every dict and tuple above is replaced, never changed in place, so a
        # snapshot is a set of references that a writer thread can encode safely.
        # Encoded claims by UID, reused while the record is the same object.
        self._encoded: dict[str, tuple[ClaimRecord, bytes]] = {}
        # The changes file (see the module docstring): the file on disk it extends
        # (None: the next write replaces the file whole), its lines and the bytes that
        # may be in it.
        self._changes = ChangesFile(path)
        # Taken around every write, and around an agent's load and first write: a
        # rolling update with a surge pod runs the new agent beside the old one, on the
        # same files. `_identity` is the file as this process last read or wrote it
        # (None: none); one changed since by another process is never written over.
        self._lock = lock if lock is not None else _Lock(_lock_path(path), folder_mode=0o777)
        self._identity: _Identity | None = None
        self._base: str | None = None
        self._changes_n = 0
        self._changes_bytes: int | None = 0
        # Whether changes may be appended: set by a GroupCommit until it folds them in
        # (`GroupCommit.compact`, at the agent's stop). While set, every file written
        # says `_EXTENDED_MAJOR_VERSION`, so that no release reads it without the
        # changes file; and only a file saying so is extended (`_file_extended`).
        self._extended = False
        self._file_extended = False
        # This process's owner file (`gpudra.driver.owners`): an agent's load's only.
        self._owner: OwnerFile | None = None
        # Set by GroupCommit while it applies a change: `_save` then only stages.
        self._staging = False
        # Changes staged so far, and what each replaced, for undo of a failed write.
        self._seq = 0
        self._journal: list[_Change] = []

    @classmethod
    def load(
        cls, path: Path, *, boot_id_path: Path = DEFAULT_BOOT_ID_PATH, take_over: bool = False
    ) -> Checkpoint:
        """Read `path` (a missing file is an empty checkpoint).

        Raises CheckpointError only when the file is not a JSON object at all,
        because starting empty then would forget devices that are still in use.

        `take_over` (the agent's load) also replaces the file at once, under the lock
        that every write takes: from then on any other process still holding the old
        one (the agent a rolling update is replacing) is refused its writes, and its
        stop does not put its state back over this one (`_check_owner`). It registers an
        owner file first, under the same lock, which this process holds locked while it
        runs (`owner_gone`); once the file is taken over, the dead owner files are removed.
        """
        lock = _Lock(_lock_path(path), folder_mode=0o777)
        with _taken(lock) if take_over else contextlib.nullcontext():
            owner = _registered(path) if take_over else None
            try:
                checkpoint = cls._read_files(path, read_boot_id(boot_id_path), lock)
            except BaseException:
                if owner is not None:
                    with contextlib.suppress(OSError):  # the load's error is the one to tell
                        owner.resign()  # never took it over: no agent may wait for it
                raise
            checkpoint._owner = owner
            # The agent's: its changes are appended (`GroupCommit`), so the file it
            # writes says so from the first.
            checkpoint._extended = take_over
            if take_over and checkpoint._on_disk_seq < 0:
                try:
                    checkpoint._save(durable=True)
                except CheckpointError as exc:
                    # A full disk must not stop the agent's start (its recovery reports
                    # what it cannot do); the next write that succeeds takes it over.
                    log.warning(
                        "checkpoint not taken over yet", extra={"fields": {"error": str(exc)}}
                    )
            if owner is not None:
                _forget_dead(owner)
        return checkpoint

    @classmethod
    def _read_files(cls, path: Path, boot_id: str | None, lock: ProcessLock) -> Checkpoint:
        read = _read(path)
        if read is None:
            empty = cls(path, boot_id=boot_id, lock=lock)
            empty._boot_known = boot_id is not None
            empty._changes_bytes = len(empty._changes.read())  # emptied by the first write
            return empty
        doc, base, replayed, identity = read

        major = doc.get("majorVersion", 1)  # absent: a file that holds every change
        if not isinstance(major, int) or isinstance(major, bool) or major < 1:
            raise CheckpointError(
                f"checkpoint {path}: majorVersion {major!r} is not a positive whole number; "
                "the file is left as is: restore it from the release that wrote it"
            )
        if major > CHECKPOINT_MAJOR_VERSION:
            raise CheckpointTooNewError(
                f"checkpoint {path} has majorVersion {major}, written by a newer gpudra "
                f"release; this release reads majorVersion {CHECKPOINT_MAJOR_VERSION} at most. "
                "The file is left as is: run that release or a newer one on this node "
                "(or drain the node, then move the file aside)"
            )
        version = doc.get("version")
        file_version = version if isinstance(version, int) else None
        if file_version is not None and file_version > CHECKPOINT_VERSION:
            log.info(
                "checkpoint written by a newer release; unknown fields are kept",
                extra={"fields": {"path": str(path), "version": file_version}},
            )

        claims: dict[str, ClaimRecord] = {}
        unreadable: dict[str, Any] = {}
        encoded: dict[str, tuple[ClaimRecord, bytes]] = {}
        for uid, raw_claim in doc["claims"].items():
            try:
                record = _keyed_claim_from_json(uid, raw_claim)
            except _MalformedError as exc:
                log.warning(
                    "unreadable claim record kept as is",
                    extra={"fields": {"path": str(path), "uid": uid, "error": str(exc)}},
                )
                unreadable[uid] = raw_claim
                continue
            claims[uid] = record
            # Written back as read until the claim changes: a record another release
            # wrote keeps its shape (no field this release would add), also through the
            # take-over's write (`load`).
            encoded[uid] = (record, _member(uid, raw_claim))

        previous: list[ClaimRecord] = []
        previous_unreadable: list[Any] = []
        raw_previous = doc.get("previousBoot") or []
        for raw_claim in raw_previous if isinstance(raw_previous, list) else []:
            try:
                previous.append(_claim_from_json(raw_claim))
            except _MalformedError as exc:
                # A newer release's, maybe, with clean-up still to do that only it knows:
                # kept for it, and logged with what it says for an admin meanwhile.
                log.warning(
                    "unreadable previous-boot record kept as is",
                    extra={"fields": {"path": str(path), "error": str(exc), "record": raw_claim}},
                )
                previous_unreadable.append(raw_claim)

        stored_boot = doc.get("bootId") if isinstance(doc.get("bootId"), str) else None
        checkpoint = cls(
            path,
            boot_id=boot_id or stored_boot,
            claims=claims,
            previous_boot=previous,
            unreadable=unreadable,
            previous_unreadable=previous_unreadable,
            extra={k: v for k, v in doc.items() if k not in _TOP_KEYS},
            file_version=file_version,
            lock=lock,
        )
        checkpoint._identity = identity
        checkpoint._encoded = encoded
        checkpoint._boot_known = boot_id is not None
        checkpoint._boot_on_disk = boot_id is not None and stored_boot == boot_id
        checkpoint._changes_bytes = replayed.size + replayed.ignored
        checkpoint._file_extended = major >= _EXTENDED_MAJOR_VERSION
        if not replayed.ignored:
            # Appends go on after the lines read; after ignored ones they could not be
            # read back, so the first write then replaces the file and empties this one.
            checkpoint._base, checkpoint._changes_n = base, replayed.lines
        if boot_id is not None and stored_boot is not None and stored_boot != boot_id:
            checkpoint._discard_previous_boot(stored_boot)
        return checkpoint

    def _discard_previous_boot(self, stored_boot: str) -> None:
        log.warning(
            "node rebooted since the checkpoint was written; its prepared claims are void",
            extra={
                "fields": {
                    "path": str(self._path),
                    "claims": sorted(self._claims),
                    # Moved as they are, for the release that can read them to clean up;
                    # what they say, for an admin to check what survived the reboot.
                    "unreadable": self._unreadable,
                    "stored_boot_id": stored_boot,
                    "boot_id": self._boot_id,
                }
            },
        )
        claims: dict[str, ClaimRecord] = {}
        previous_boot = (*self._previous_boot, *self._claims.values())
        unreadable: dict[str, Any] = {}
        # Adopted before the write, which takes it from here (`_save` has no argument
        # for it): it changes only here, at the load, where a failed write is adopted all
        # the same (below), so no GroupCommit ever stages or undoes a change of it.
        self._previous_unreadable = (*self._previous_unreadable, *self._unreadable.values())
        try:
            self._save(claims=claims, previous_boot=previous_boot, unreadable=unreadable)
        except CheckpointError as exc:
            # A full state disk (a tenant's plain-folder MPS files, which only the
            # recovery this write precedes removes) must not stop the agent's start.
            # Adopted in memory all the same: the file still names the previous boot,
            # so the next write replaces it whole (`_appendable`), and a load before
            # that moves the same claims again.
            log.warning(
                "the previous boot's claims not recorded as such yet",
                extra={"fields": {"path": str(self._path), "error": str(exc)}},
            )
            self._claims, self._previous_boot, self._unreadable = (
                claims,
                previous_boot,
                unreadable,
            )

    # --- queries ---

    @property
    def path(self) -> Path:
        return self._path

    @property
    def boot_id(self) -> str | None:
        return self._boot_id

    @property
    def file_version(self) -> int | None:
        """The `version` the file was written with (None: new or unversioned)."""
        return self._file_version

    def get(self, uid: str) -> ClaimRecord | None:
        return self._claims.get(uid)

    def claims(self) -> list[ClaimRecord]:
        return list(self._claims.values())

    def incomplete(self) -> list[ClaimRecord]:
        """Claims left in PrepareStarted by a crash or failure: roll these back at start."""
        return [c for c in self._claims.values() if not c.completed]

    def holders(
        self, device_key: DeviceKey | tuple[str, str]
    ) -> list[tuple[ClaimRecord, DeviceRecord]]:
        """Every claim (prepared or being prepared) holding the device, with its record.
        (Compared field by field: run for each device of each prepare, over every claim.)"""
        pool, device = device_key
        return [
            (c, d)
            for c in self._claims.values()
            for d in c.devices
            if d.device == device and d.pool == pool
        ]

    def previous_boot(self) -> list[ClaimRecord]:
        """Claims prepared before the last reboot, kept until `forget_previous_boot`.

        Their devices are gone, but their details may name things that need
        cleanup (MIG instances of a GPU whose MIG mode persists). Records this
        release cannot read are not among them: they are kept in the file for the
        release that wrote them (see the module docstring).
        """
        return list(self._previous_boot)

    def unreadable(self) -> dict[str, Any]:
        """Claim records this release cannot interpret, by UID; kept and written back."""
        return copy.deepcopy(self._unreadable)

    def unreadable_problem(self, uid: str) -> str | None:
        """Why the record of claim `uid` cannot be interpreted (the field and what is
        wrong with it); None when it is not an unreadable record."""
        if uid not in self._unreadable:
            return None
        try:
            _keyed_claim_from_json(uid, self._unreadable[uid])
        except _MalformedError as exc:
            return str(exc)
        return "it was not readable when loaded"

    def unreadable_holders(self, device_key: DeviceKey | tuple[str, str]) -> list[str]:
        """Unreadable records that name the device (not for admin access), as far as
        their pool and device can be read: whatever they set up may still be in place."""
        key = DeviceKey(*device_key)
        holders = []
        for uid, raw in self._unreadable.items():
            devices = raw.get("devices") if isinstance(raw, dict) else None
            for device in devices if isinstance(devices, list) else ():
                if (
                    isinstance(device, dict)
                    and (device.get("pool"), device.get("device")) == key
                    and device.get("adminAccess") is not True
                ):
                    holders.append(uid)
                    break
        return holders

    def unreadable_naming(
        self, text: str, *, excluding: str = "", devices: Iterable[DeviceKey] = ()
    ) -> list[str]:
        """Claims other than `excluding` whose record, or a device's side effect in it,
        this release cannot read, and whose stored JSON names `text` (a GPU's UUID) or,
        for a whole record, one of `devices`: whatever they set up on that GPU may still
        be in place and relied on."""
        by_device = {uid for key in devices for uid in self.unreadable_holders(key)}
        found = [
            uid
            for uid, raw in self._unreadable.items()
            if uid != excluding and (text in str(raw) or uid in by_device)
        ]
        found += [
            record.uid
            for record in self._claims.values()
            if record.uid != excluding
            and any(d.details.problems and text in str(_device_to_json(d)) for d in record.devices)
        ]
        return found

    # --- mutations ---

    def begin_prepare(
        self, claim: ClaimRef, devices: Sequence[DeviceRecord] = (), *, persist: bool = True
    ) -> ClaimRecord:
        """Record that a prepare starts, before anything on the node changes.

        An existing record is returned unchanged and nothing is written: a
        completed one is the answer to a repeated prepare, an unfinished one
        must be rolled back first. `devices` (planned, possibly partial) are
        checked against other claims' exclusive devices.

        `persist=False` reserves the devices in memory only, for prepares whose
        only effect on the node is a CDI spec: a crash before `complete_prepare`
        then leaves no record, and the start-up sweep removes the orphaned spec.
        That saves one fsynced write per prepare.
        """
        existing = self._claims.get(claim.uid)
        if existing is not None:
            return existing
        detached = _detached(devices)
        self._check_conflicts(claim.uid, claim.namespace, detached)
        record = ClaimRecord(
            uid=claim.uid,
            namespace=claim.namespace,
            name=claim.name,
            state=ClaimState.PREPARE_STARTED,
            devices=detached,
        )
        if persist:
            self._save(claims={**self._claims, claim.uid: record}, uid=claim.uid)
        else:
            self._claims = {**self._claims, claim.uid: record}
        return record

    def record_progress(self, uid: str, devices: Sequence[DeviceRecord]) -> ClaimRecord:
        """Store what an unfinished prepare has set up so far (for rollback)."""
        record = self._require(uid)
        if record.completed:
            raise CheckpointError(f"claim {uid} is already prepared; unprepare it first")
        return self._replace_devices(record, devices, ClaimState.PREPARE_STARTED)

    def complete_prepare(self, uid: str, devices: Sequence[DeviceRecord]) -> ClaimRecord:
        """Mark the claim prepared with its final devices. Nothing on the node changes
        after it, so the write may be lost with the power (see `_save`)."""
        return self._replace_devices(
            self._require(uid), devices, ClaimState.PREPARE_COMPLETED, durable=False
        )

    def release_time_slice(self, uid: str, gpu_uuid: str) -> ClaimRecord | None:
        """Drop `uid`'s time-slice steps on GPU `gpu_uuid` once its undo has reset the
        setting or left it to the claims still relying on it, so that it no longer
        counts as one of them while the rest of its undo runs."""
        record = self._claims.get(uid)
        if record is None:
            return None
        devices = tuple(
            replace(d, details=replace(d.details, time_slice=None))
            if d.details.time_slice is not None and d.details.time_slice.uuid == gpu_uuid
            else d
            for d in record.devices
        )
        updated = replace(record, devices=devices)
        self._save(claims={**self._claims, uid: updated}, uid=uid)
        return updated

    def remove(self, uid: str, *, durable: bool = False) -> bool:
        """Forget a claim after unprepare or rollback; False when it was not recorded.
        `durable`: the caller's next step relies on the removal surviving a power loss
        (it deletes the admin's mark that the claim was undone by hand)."""
        if uid not in self._claims and uid not in self._unreadable:
            return False
        claims = dict(self._claims)
        claims.pop(uid, None)
        unreadable = None
        if uid in self._unreadable:
            unreadable = dict(self._unreadable)
            del unreadable[uid]
        # Its devices are undone already: unless the caller relies on it next, the write
        # may be lost with the power (`_save`).
        self._save(claims=claims, unreadable=unreadable, durable=durable, uid=uid)
        return True

    def forget_previous_boot(
        self, records: Iterable[ClaimRecord], *, durable: bool = False
    ) -> None:
        """Forget these previous-boot claims once their leftovers are cleaned up; the
        others stay, as do the records this release cannot read (`previous_boot`). By
        record, not UID: after two reboots one UID may have two.
        `durable`: the caller's next step relies on it surviving a power loss."""
        gone = [id(r) for r in records]
        kept = tuple(r for r in self._previous_boot if id(r) not in gone)
        if len(kept) != len(self._previous_boot):
            self._save(previous_boot=kept, durable=durable)  # cleaned up already

    # --- internals ---

    def _require(self, uid: str) -> ClaimRecord:
        record = self._claims.get(uid)
        if record is None:
            raise CheckpointError(f"claim {uid} has no checkpoint record; call begin_prepare")
        return record

    def _replace_devices(
        self,
        record: ClaimRecord,
        devices: Sequence[DeviceRecord],
        state: ClaimState,
        *,
        durable: bool = True,
    ) -> ClaimRecord:
        detached = _detached(devices)
        self._check_conflicts(record.uid, record.namespace, detached)
        updated = replace(record, state=state, devices=detached)
        self._save(claims={**self._claims, record.uid: updated}, durable=durable, uid=record.uid)
        return updated

    def _check_conflicts(self, uid: str, namespace: str, devices: Sequence[DeviceRecord]) -> None:
        problems: list[str] = []
        unreadable: list[str] = []
        prepared = False
        for device in devices:
            if device.admin_access:
                continue
            for other in self.unreadable_holders(device.key):
                if other != uid:
                    unreadable.append(other)
                    problems.append(
                        f"device {device.pool}/{device.device} is named by the checkpoint "
                        f"record of claim {other}, which cannot be read "
                        f"({self.unreadable_problem(other)})"
                    )
            for holder, held in self.holders(device.key):
                if holder.uid == uid or held.admin_access:
                    continue
                if device.exclusive or held.exclusive:
                    prepared = True
                    name = holder.name_seen_from(namespace)
                    problems.append(
                        f"device {device.pool}/{device.device} is already prepared "
                        f"{'exclusively ' if held.exclusive else ''}for claim "
                        f"{f'{name} ' if name else ''}({holder.uid})"
                    )
        if problems:
            raise DeviceConflictError(
                "; ".join(problems), prepared=prepared, unreadable=list(dict.fromkeys(unreadable))
            )

    def _snapshot(self) -> _Snapshot:
        return _Snapshot(
            self._seq,
            self._claims,
            self._previous_boot,
            self._unreadable,
            self._previous_unreadable,
        )

    def _encode(self, snap: _Snapshot, *, extended: bool) -> bytes:
        """The file for `snap`: one claim per line, unchanged claims not re-encoded;
        `extended` where a changes file may extend it."""
        top = dict(self._extra)
        top["version"] = CHECKPOINT_VERSION
        if extended:
            top["majorVersion"] = _EXTENDED_MAJOR_VERSION
        if self._boot_id is not None:
            top["bootId"] = self._boot_id
        # Fresh in every file, so that no two files share a changes-file base.
        top["writeId"] = secrets.token_hex(8)
        dumps = jsonbytes.dumps
        lines = [
            _member(uid, raw) for uid, raw in snap.unreadable.items() if uid not in snap.claims
        ]
        previous = self._encoded
        encoded: dict[str, tuple[ClaimRecord, bytes]] = {}
        for uid, record in snap.claims.items():
            cached = previous.get(uid)
            if cached is None or cached[0] is not record:
                cached = (record, _member(uid, _claim_to_json(record)))
            encoded[uid] = cached
            lines.append(cached[1])
        self._encoded = encoded
        claims = b"{\n" + b",\n".join(lines) + b"\n}" if lines else b"{}"
        parts = [dumps(top)[:-1], b',"claims":', claims]
        if snap.previous_boot or snap.previous_unreadable:
            readable = [_claim_to_json(c) for c in snap.previous_boot]
            parts += [b',"previousBoot":', dumps([*readable, *snap.previous_unreadable])]
        parts.append(b"}\n")
        return b"".join(parts)

    def _write(self, snap: _Snapshot, *, durable: bool = True) -> None:
        """Write `snap`, unless a newer one is on disk already; `durable=False` leaves
        the rename to the folder's next sync (see `_save`).

        A write whose caller went away (a cancel asyncio does not let a shield stop)
        may still be running in its thread when the next one starts: the lock keeps
        them apart, and the older snapshot is skipped rather than put back over the
        newer one, which holds all it held (or its undoing, for a failed write)."""
        with self._write_lock, self._lock:
            if snap.seq >= self._on_disk_seq:
                self._replace(snap, durable=durable)

    def _replace(self, snap: _Snapshot, *, durable: bool) -> None:
        """Replace the file with `snap` (both locks held)."""
        self._check_owner()
        self._check_changes()  # lines another process appended are never dropped
        extended = self._extended
        data = self._encode(snap, extended=extended)
        durable = durable or not self._boot_on_disk
        try:
            # The folder is created on first use (and again if someone removed it).
            atomic_write(self._path, data, mode=0o600, sync_folder=durable, folder_mode=0o777)
        except OSError as exc:
            # It may have failed after the rename (syncing the folder): the file is then
            # this process's, and the changes file no longer extends it.
            self._base = None
            with contextlib.suppress(OSError):
                self._identity = _identity_of(self._path)
            raise CheckpointError(f"cannot write checkpoint {self._path}: {exc}") from exc
        try:
            self._identity = _identity_of(self._path)
        except OSError as exc:
            self._base = None
            raise CheckpointError(f"cannot read checkpoint {self._path}: {exc}") from exc
        self._on_disk_seq = snap.seq
        self._file_extended = extended
        if durable and self._boot_known:
            self._boot_on_disk = True  # the file names this boot from now on
        self._restart_changes(data)

    def _check_changes(self) -> bool:
        """Whether the changes file holds just the lines this process appended (False:
        removed, or unknown after a failed append); raises CheckpointError where
        another process wrote to it (an agent that could not take the file over)."""
        try:
            return self._changes.check(self._changes_bytes)
        except ChangedError as exc:
            raise CheckpointError(
                f"checkpoint changes {self._changes.path} were written by another process "
                f"({exc}): this agent no longer writes the checkpoint; restart it to read "
                "it again"
            ) from None
        except OSError as exc:
            raise CheckpointError(f"cannot read {self._changes.path}: {exc}") from exc

    def _check_owner(self) -> bool:
        """Whether the file is there as this process last read or wrote it (False:
        gone, to be written anew); raises CheckpointTakenOverError where another
        process changed it since: a newer agent took it over, or someone edited it."""
        try:
            identity = _identity_of(self._path)
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {self._path}: {exc}") from exc
        if identity is None:
            return False
        if identity != self._identity:
            raise CheckpointTakenOverError(
                f"checkpoint {self._path} was changed by another process since this agent "
                "read it (a newer agent on this node took it over, as in a rolling update "
                "with a surge pod, or the file was edited): this agent no longer writes "
                "it or changes devices; restart the agent to read it again"
            )
        return True

    def check_owner(self, *, wait: bool = True) -> bool:
        """Raise CheckpointTakenOverError where another process took the file over (or
        edited it) since this one last read or wrote it: for a caller about to change a
        device, which the new owner may hold under its own records by now. Its refused
        write would come after the change; this comes before it. One stat.

        Under the lock of this process's writes: one running in a worker thread replaces
        the file before it records the new file's identity, and must not read as another
        process's. With `wait=False` such a write is not waited for (the event loop must
        not wait for a sync): then nothing is checked and the answer is False (call again,
        waiting, in a worker thread); otherwise True."""
        if not self._write_lock.acquire(blocking=wait):
            return False
        try:
            self._check_owner()
        finally:
            self._write_lock.release()
        return True

    def owner_gone(self) -> str | None:
        """Why this process should stop: the file was taken over from it, and every agent
        that took it over since is gone (`gpudra.driver.owners`), so its restart takes the
        file over again. None while the file is this process's, while such an agent runs,
        and where none can be watched: one that registers no owner file took the file over
        (an earlier release), or someone edited it. Once taken over, this process's owner
        file is removed first. Waits for a write of this process, and reads the owner
        files: call it in a worker thread."""
        if self._owner is None:
            return None
        try:
            self.check_owner()
        except CheckpointTakenOverError:
            return self._owner.successor_gone()
        except CheckpointError:
            return None  # unreadable, not taken over: the next write says why
        return None

    def _restart_changes(self, data: bytes) -> None:
        """The file is now `data`: the changes file starts again, empty, on it. Made
        anew even when it was empty, since another process may hold it open (`empty`
        says why). If that fails, nothing is appended to it (every write replaces the
        file), and its lines, whose base is an older file, are never read."""
        self._base = None
        try:
            self._changes.empty()
        except OSError as exc:
            log.warning(
                "cannot empty the checkpoint's changes file; every change now replaces "
                "the checkpoint file",
                extra={"fields": {"path": str(self._changes.path), "error": str(exc)}},
            )
            return
        self._base, self._changes_n, self._changes_bytes = base_of(data), 0, 0

    def _appendable(self, after: int, upto: int) -> bool:
        """Whether the staged changes (after, upto] may be appended to the changes file:
        none must survive a power loss (nor may any write, before the boot ID is on
        disk), none changes the previous boot's claims or adds an unreadable record,
        and the changes file extends the file on disk and is not too long."""
        if (
            not (self._extended and self._file_extended)
            or self._base is None
            or self._changes_bytes is None
            or not self._boot_on_disk
            or self._changes_bytes >= _CHANGES_LIMIT
        ):
            return False
        for change in self._journal:
            if after < change.seq <= upto and (
                change.durable
                or change.previous_before is not None
                or any(new is not _MISSING for _, new in change.unreadable.values())
            ):
                return False
        return True

    def _append(self, snap: _Snapshot, after: int) -> None:
        """Append the claims the staged changes (after, snap.seq] changed, as `snap` has
        them, to the changes file (`_appendable` said they may be)."""
        with self._write_lock, self._lock:
            if snap.seq < self._on_disk_seq:
                return
            # Held open, the changes file tells a take-over (it is removed) and another
            # writer (it grew). The checkpoint file is looked at too (one stat): edited in
            # place it keeps its inode, and lines appended on a base it no longer has would
            # be dropped at the next start, with the claims they prepared.
            if self._base is None or not self._check_owner() or not self._check_changes():
                # Emptied by a write that failed after `_appendable`, or removed: the
                # whole file again, which restarts the changes file.
                self._replace(snap, durable=False)
                return
            uids: dict[str, None] = {}
            for change in self._journal:
                if after < change.seq <= snap.seq:
                    uids.update(dict.fromkeys(change.claims))
                    uids.update(dict.fromkeys(change.unreadable))
            line = encode_line(self._base, self._changes_n, map(self._fragment(snap), uids))
            try:
                self._changes.append(line)
            except OSError as exc:
                # Part of the line may be there: nothing more goes after it, and the
                # next write replaces the file and empties this one.
                self._base = None
                self._changes_bytes = None
                raise CheckpointError(
                    f"cannot write checkpoint changes {self._changes.path}: {exc}"
                ) from exc
            self._changes_n += 1
            self._changes_bytes = (self._changes_bytes or 0) + len(line)
            self._on_disk_seq = snap.seq

    def _fragment(self, snap: _Snapshot) -> Callable[[str], bytes]:
        """A claim's `"<uid>":<record>` as `snap` has it (null: removed), encoded once."""

        def fragment(uid: str) -> bytes:
            record = snap.claims.get(uid)
            if record is not None:
                cached = self._encoded.get(uid)
                if cached is None or cached[0] is not record:
                    cached = self._encoded[uid] = (record, _member(uid, _claim_to_json(record)))
                return cached[1]
            self._encoded.pop(uid, None)
            return _member(uid, snap.unreadable.get(uid))  # None: null, removed

        return fragment

    def close(self) -> None:
        """Close the changes file and the lock (opened again if written after); after a
        write still running in a thread (see `_write`), which holds them."""
        with self._write_lock:
            self._changes.close()
            self._lock.close()
            if self._owner is not None:
                self._owner.close()  # the file left unlocked: see `owner_gone`

    def _save(
        self,
        *,
        claims: dict[str, ClaimRecord] | None = None,
        previous_boot: Sequence[ClaimRecord] | None = None,
        unreadable: dict[str, Any] | None = None,
        durable: bool = True,
        uid: str | None = None,
    ) -> None:
        """Write the new state, then adopt it in memory, so memory never runs ahead of
        disk (but for the in-memory reservations of `begin_prepare(persist=False)`).
        While staging for a GroupCommit, adopt it at once and journal what it replaced;
        the GroupCommit writes it before the caller goes on, or undoes it.

        Every write is whole on disk before the rename, so a power loss never leaves a
        torn file. `durable` also syncs the rename before the caller goes on: a change
        that something outliving a reboot depends on (a MIG instance a passthrough GPU
        keeps, an MPS folder on disk) is recorded that way before that thing is made.
        A change made after the node's last step for the claim (a prepare's end, a
        claim's removal once its devices are undone, forgetting previous-boot claims
        once cleaned up) is not: a restarted process reads it all the same, and only a
        power loss (or a kernel crash) can undo it. The file found then is one an
        earlier write left whole, and the boot ID tells the reboot: its claims go to
        `previousBoot`, whose clean-up destroys a MIG instance only where its recorded
        MIG UUID proves it the one gpudra made, so a record of an instance undone since,
        or of one that survived in a passthrough GPU, is handled as before. That needs
        the boot ID, so until this boot's ID is read and on disk (`load`), every write
        syncs its rename. A change that is not synced reaches the disk with the next
        one that is, or with the file system's own commit.

        `claims` and `unreadable`, where given, are new mappings, adopted as they are
        (never changed afterwards: snapshots share them); `uid` says that only that
        claim's entries differ, so that a change of one claim is journaled without a
        comparison of every claim."""
        new_claims = self._claims if claims is None else claims
        new_previous = self._previous_boot if previous_boot is None else tuple(previous_boot)
        new_unreadable = self._unreadable if unreadable is None else unreadable
        if self._staging:
            self._seq += 1
            self._journal.append(
                _Change(
                    self._seq,
                    _diff(self._claims, new_claims, uid),
                    _diff(self._unreadable, new_unreadable, uid),
                    None if new_previous == self._previous_boot else self._previous_boot,
                    new_previous,
                    durable,
                )
            )
        else:
            self._seq += 1  # a newer state than any snapshot written before
            snap = _Snapshot(
                self._seq, new_claims, new_previous, new_unreadable, self._previous_unreadable
            )
            self._write(snap, durable=durable)
            self._file_version = CHECKPOINT_VERSION
        self._claims = new_claims
        self._previous_boot = new_previous
        self._unreadable = new_unreadable

    def _durable_between(self, after: int, upto: int) -> bool:
        """Whether a staged change numbered (after, upto] must be durable."""
        return any(c.durable for c in self._journal if after < c.seq <= upto)

    def _written(self, seq: int) -> None:
        """Changes up to `seq` are on disk: their undo entries can go."""
        self._journal = [c for c in self._journal if c.seq > seq]
        self._file_version = CHECKPOINT_VERSION

    def _revert(self, after: int, upto: int) -> None:
        """Undo the staged changes numbered (after, upto], newest first, where no later
        change has replaced them since (those keep their own, later value)."""
        undone = [c for c in self._journal if after < c.seq <= upto]
        claims, unreadable = dict(self._claims), dict(self._unreadable)
        for change in reversed(undone):
            _undo(claims, change.claims)
            _undo(unreadable, change.unreadable)
            if change.previous_before is not None and self._previous_boot is change.previous_after:
                self._previous_boot = change.previous_before
        self._claims, self._unreadable = claims, unreadable
        self._journal = [c for c in self._journal if not after < c.seq <= upto]


_MISSING: Final = object()


@dataclass(frozen=True, slots=True)
class _Snapshot:
    seq: int
    claims: Mapping[str, ClaimRecord]
    previous_boot: tuple[ClaimRecord, ...]
    unreadable: Mapping[str, Any]
    previous_unreadable: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class _Change:
    """One staged change: per key, the value before and after (`_MISSING`: absent)."""

    seq: int
    claims: dict[str, tuple[Any, Any]]
    unreadable: dict[str, tuple[Any, Any]]
    previous_before: tuple[ClaimRecord, ...] | None
    previous_after: tuple[ClaimRecord, ...]
    durable: bool


def _diff(
    old: Mapping[str, Any], new: Mapping[str, Any], only: str | None = None
) -> dict[str, tuple[Any, Any]]:
    """Per key whose value differs, its value in `old` and in `new`; `only`: no key but
    that one can differ."""
    changed: dict[str, tuple[Any, Any]] = {}
    if old is new:
        return changed
    for key in (only,) if only is not None else old.keys() | new.keys():
        before, after = old.get(key, _MISSING), new.get(key, _MISSING)
        if before is not after:
            changed[key] = (before, after)
    return changed


def _undo(current: dict[str, Any], changed: Mapping[str, tuple[Any, Any]]) -> None:
    for key, (before, after) in changed.items():
        if current.get(key, _MISSING) is not after:
            continue
        if before is _MISSING:
            del current[key]
        else:
            current[key] = before


@dataclass(eq=False, slots=True)
class _Batch:
    """One write of a GroupCommit. `done` is made by the first change that waits for
    it (most writes carry one change, whose caller runs the write itself): an anyio
    Event costs more to make than to wait for."""

    upto: int
    done: anyio.Event | None = None
    error: CheckpointError | None = None


class GroupCommit:
    """Applies checkpoint changes of concurrent tasks and lets them share writes.

    Each change is made in memory at once, so the next change's conflict checks see
    it, and its caller waits until a write that includes it has finished. The first
    waiter writes (in a worker thread); changes made meanwhile wait for the write
    after it, which carries them all: with many claims in flight, far fewer than one
    write and fsync per change. Writes are taken in order, so the file never goes
    back to an older state, and a caller never resumes before its change is written,
    and durable where the change asked (`Checkpoint._save`), even when cancelled. A
    write syncs the folder when any change it carries asked for that. A failed write
    undoes the changes it carried (unless a later change replaced them) and raises
    CheckpointError in their callers. Route every change through one GroupCommit,
    from one event loop; `lock`, when given, is held around each write (to keep file
    cleanups out), taken after a turn of the event loop that lets changes staged
    meanwhile join the write.

    A change that is the only one not yet written and needs no more than a line of
    the changes file (`Checkpoint._appendable`) is appended by its caller at once,
    where `lock` is free: no turn of the loop, nothing awaited, so nothing can come
    between the change and its line. On a node calls arrive spread out, and most
    such changes find no other to share a line with: the turn would cost each a task
    switch and a cancel scope for nothing.
    """

    def __init__(self, checkpoint: Checkpoint, *, lock: anyio.Lock | None = None) -> None:
        self._cp = checkpoint
        checkpoint._extended = True  # its first change replaces the file, saying so
        self._lock = lock
        self._written = checkpoint._seq
        self._batch: _Batch | None = None
        self.writes = 0

    @property
    def checkpoint(self) -> Checkpoint:
        return self._cp

    async def apply(self, change: Callable[[Checkpoint], T]) -> T:
        """Run `change` (Checkpoint mutations) now; return its result once written.

        Whatever `change` raises leaves nothing staged, as with a direct call. A
        change that changes nothing still waits for pending writes of what it saw.
        """
        cp = self._cp
        alone = self._batch is None and self._written == cp._seq
        cp._staging = True
        try:
            result = change(cp)
        finally:
            cp._staging = False
        if self._written == cp._seq:
            return result  # nothing changed, nothing pending: nothing to wait for
        if (
            alone
            and (self._lock is None or not self._lock.locked())
            and cp._appendable(self._written, cp._seq)
        ):
            # The only change not yet written, and a line: appended here and now, with
            # no turn of the loop for others to join it and nothing to shield. The lock
            # is free and stays so, as nothing here awaits. Alone, its failure undoes
            # nothing but this change, whose caller gets the error.
            batch = _Batch(cp._seq)
            self._append(batch, cp._snapshot())
            if batch.error is not None:
                raise batch.error
            return result
        with anyio.CancelScope(shield=True):
            await self._durable(cp._seq)
        return result

    async def compact(self) -> None:
        """Replace the checkpoint file with the whole state, synced, saying majorVersion
        1, and close the changes file: a release that reads the checkpoint file alone
        (one from before the changes file) then finds every change. The agent calls it
        when it stops; any later change replaces the file whole."""
        cp = self._cp
        cp._extended = False
        if cp._file_extended or cp._changes_bytes != 0:  # None: unknown after a failed line
            try:
                await self.apply(lambda c: c._save(durable=True))
            except CheckpointTakenOverError:
                # Another agent has the file now: its state, not this one's, stays, as
                # it should (this agent warned of the take-over when it learnt of it).
                log.info("checkpoint left to the agent that took it over")
            except CheckpointError as exc:
                log.warning("checkpoint not compacted", extra={"fields": {"error": str(exc)}})
        cp.close()

    async def _durable(self, seq: int) -> None:
        while self._written < seq:
            batch = self._batch
            if batch is None:
                batch = await self._write_batch()
            else:
                if batch.done is None:
                    batch.done = anyio.Event()
                await batch.done.wait()
            if batch.error is not None and seq <= batch.upto:
                raise batch.error

    async def _write_batch(self) -> _Batch:
        cp = self._cp
        batch = self._batch = _Batch(cp._seq)
        try:
            if self._lock is None:
                await self._write(batch)
            else:
                # One turn of the event loop before the snapshot, so that changes other
                # claims stage meanwhile join this write. Plain, and the lock taken
                # without its own: the caller is shielded (`apply`), and anyio's turn
                # checks for cancellation again, in a cancel scope of its own.
                await anyio.lowlevel.checkpoint()
                async with self._lock:
                    await self._write(batch)
        finally:
            self._batch = None
            if batch.done is not None:
                batch.done.set()
        return batch

    async def _write(self, batch: _Batch) -> None:
        cp = self._cp
        snap = cp._snapshot()  # taken now: changes staged while waiting for the lock too
        batch.upto = snap.seq
        if cp._appendable(self._written, snap.seq):
            # A line of a few hundred bytes, not synced: cheaper here than the hand-off
            # to a worker thread and back.
            self._append(batch, snap)
            return
        failure: Exception | None = None
        try:
            write = functools.partial(
                cp._write, snap, durable=cp._durable_between(self._written, snap.seq)
            )
            await anyio.to_thread.run_sync(write)
        except Exception as exc:
            failure = exc
        self._settle(batch, snap, failure)

    def _append(self, batch: _Batch, snap: _Snapshot) -> None:
        """Append the changes up to `snap` as a line of the changes file, on the loop
        (`Checkpoint._appendable` said they may be)."""
        failure: Exception | None = None
        try:
            self._cp._append(snap, self._written)
        except Exception as exc:
            failure = exc
        self._settle(batch, snap, failure)

    def _settle(self, batch: _Batch, snap: _Snapshot, failure: Exception | None) -> None:
        """After the write of `snap`: the changes it carried are written, or undone and
        the write's failure is the batch's error."""
        cp = self._cp
        if failure is not None:
            batch.error = (
                failure
                if isinstance(failure, CheckpointError)
                else CheckpointError(f"cannot write checkpoint {cp.path}: {failure}")
            )
        self.writes += 1
        if batch.error is None:
            self._written = snap.seq
            cp._written(snap.seq)
        else:
            cp._revert(self._written, snap.seq)


def load(
    path: Path, *, boot_id_path: Path = DEFAULT_BOOT_ID_PATH, take_over: bool = False
) -> Checkpoint:
    """Read the checkpoint at `path`; see `Checkpoint.load`."""
    return Checkpoint.load(path, boot_id_path=boot_id_path, take_over=take_over)


def document(path: Path) -> dict[str, Any]:
    """The checkpoint at `path` as one JSON object: the file with its changes file
    applied, as `load` reads it ({} when there is none). For tools and tests that read
    the checkpoint's JSON: the file alone may lack the latest changes."""
    read = _read(path)
    return read[0] if read is not None else {}


def document_of(raw: bytes, changes: bytes, *, where: str = "checkpoint") -> dict[str, Any]:
    """`document` for the bytes of a checkpoint file and of its changes file, read
    elsewhere (through a container, say); `where` names them in errors."""
    return _parse(raw, changes, where)[0]


_Identity: TypeAlias = tuple[int, int, int, int]


def _identity_of(path: Path) -> _Identity | None:
    """What tells one version of a file from another (None: no file): its inode, for a
    file replaced, and size and modification time, for one edited in place."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class _Lock(ProcessLock):
    """The checkpoint's lock between processes: an error taking it is a CheckpointError."""

    def __enter__(self) -> None:
        try:
            super().__enter__()
        except OSError as exc:
            raise CheckpointError(f"cannot lock checkpoint {self.path}: {exc}") from exc


@contextlib.contextmanager
def _taken(lock: ProcessLock) -> Iterator[None]:
    """`lock` held, or, where it cannot be taken (its file cannot be made: a full or
    read-only disk), not: that must not stop the agent's start, and every write then
    tries it again and fails with the reason."""
    try:
        lock.__enter__()
    except CheckpointError as exc:
        log.warning("checkpoint lock not taken", extra={"fields": {"error": str(exc)}})
        yield
        return
    try:
        yield
    finally:
        lock.__exit__()


def _registered(path: Path) -> OwnerFile | None:
    """This agent's owner file beside the checkpoint `path`, or, where it cannot be made
    (a full or read-only disk), none: that must not stop the agent's start. The agents
    this one takes the file over from then see no owner file after theirs, and stand
    down on as they did before owner files (`gpudra.driver.owners`)."""
    try:
        return OwnerFile.register(owners_folder(path))
    except OSError as exc:
        log.warning("checkpoint owner file not made", extra={"fields": {"error": str(exc)}})
        return None


def _forget_dead(owner: OwnerFile) -> None:
    """Remove the owner files of agents gone: housekeeping, never worth a failed start."""
    try:
        owner.forget_dead()
    except OSError as exc:
        log.warning(
            "dead checkpoint owner files not removed", extra={"fields": {"error": str(exc)}}
        )


def _lock_path(path: Path) -> Path:
    """The lock file beside the checkpoint (hidden: not a checkpoint file itself)."""
    return path.with_name(f".{path.name}.lock")


def _read(path: Path) -> tuple[dict[str, Any], str, Replayed, _Identity | None] | None:
    """The checkpoint file at `path` with its changes applied (`_parse`) and the
    file's identity; None when there is no file."""
    try:
        identity = _identity_of(path)
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    changes = ChangesFile(path)
    try:
        data = changes.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint changes {changes.path}: {exc}") from exc
    return (*_parse(raw, data, str(path)), identity)


def _parse(raw: bytes, changes: bytes, where: str) -> tuple[dict[str, Any], str, Replayed]:
    """A checkpoint file's JSON object with `changes` applied to its claims, the file's
    changes-file base and what was applied.

    Raises CheckpointError only when the file is not a JSON object at all, because
    starting empty then would forget devices that are still in use."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise CheckpointError(
            f"checkpoint {where} is not valid JSON ({exc}); move it aside to start "
            "empty, after releasing the devices it lists"
        ) from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"checkpoint {where} must hold a JSON object")
    claims = doc.get("claims") or {}
    if not isinstance(claims, dict):
        raise CheckpointError(f"checkpoint {where}: claims must be a JSON object")
    doc["claims"] = claims
    base = base_of(raw)
    replayed = replay(claims, changes, base)
    if replayed.ignored:
        # After a power loss: changes that were not to survive one did not.
        log.warning(
            "checkpoint changes after a torn or stale line ignored",
            extra={
                "fields": {
                    "checkpoint": where,
                    "applied_lines": replayed.lines,
                    "ignored_bytes": replayed.ignored,
                }
            },
        )
    return doc, base, replayed
