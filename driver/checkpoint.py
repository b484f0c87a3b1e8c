"""Crash-safe record of the claims this node has prepared.

The kubelet may call NodePrepareResources again after a plugin restart and
expects the same answer, and a crash half-way through a prepare leaves state
(MIG instances, MPS daemons, compute modes) that has to be rolled back. Both
need a record that survives the process; this is it.

Design choices, and why:
- Plain JSON written atomically (temp file in the same directory, fsync, rename,
  fsync of the directory): a reader sees the old or the new file, never a torn one,
  so no checksum is needed. The upstream driver's checksum over all fields made
  every release that added a field unable to read the previous release's file.
- `version` says which schema the writer knew. Any release reads any version;
  fields it does not know are kept verbatim and written back, so a downgrade
  followed by an upgrade loses nothing. A record it cannot interpret is kept as
  is and reported, never fatal.
- Tied to the boot ID: after a reboot the devices a prepare set up are gone, so
  the old boot's claims are moved to `previousBoot` (kept until the owner calls
  `clear_previous_boot`, so a crash during cleanup loses nothing) and reported
  for cleanup of anything that may outlive a boot, such as MIG instances.

Concurrency: a Checkpoint has a single owner that serialises every call (the
kubelet plugin holds one lock around prepare and unprepare); it is not safe to
share between threads or processes without that.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, NamedTuple

__all__ = [
    "CHECKPOINT_VERSION",
    "DEFAULT_BOOT_ID_PATH",
    "Checkpoint",
    "CheckpointError",
    "ClaimRecord",
    "ClaimRef",
    "ClaimState",
    "DeviceConflictError",
    "DeviceKey",
    "DeviceRecord",
    "load",
    "read_boot_id",
]

from gpudra.common.files import atomic_write
from gpudra.driver.claims import ClaimRef

log = logging.getLogger(__name__)

CHECKPOINT_VERSION: Final = 1
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
_TOP_KEYS: Final = frozenset({"version", "bootId", "claims", "previousBoot"})


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


class DeviceConflictError(CheckpointError):
    """A device would be prepared for a second claim while it is held exclusively."""


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
    `details` is free-form JSON for rollback and unprepare: created MIG GI/CI IDs,
    MPS daemon info, the compute mode to restore. `extra` holds fields written by
    another release and is written back unchanged.
    """

    pool: str
    device: str
    request_names: tuple[str, ...] = ()
    cdi_device_ids: tuple[str, ...] = ()
    share_id: str | None = None
    admin_access: bool = False
    exclusive: bool = True
    details: Mapping[str, Any] = field(default_factory=dict)
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
        details=details,
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
        details=dict(device.details),
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
        # A state from a newer release: treat it as unfinished so it gets rolled back.
        log.warning(
            "unknown claim state in checkpoint; treating it as PrepareStarted",
            extra={"fields": {"uid": obj.get("uid"), "state": raw_state}},
        )
        state = ClaimState.PREPARE_STARTED
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
    """Copies that share nothing with the caller and are known to be JSON-serialisable."""
    try:
        return tuple(_device_from_json(json.loads(json.dumps(_device_to_json(d)))) for d in devices)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"device record is not JSON-serialisable: {exc}") from None


# --- the checkpoint ---------------------------------------------------------------------------


class Checkpoint:
    """Prepared claims of this node; every mutating method persists before it returns."""

    def __init__(
        self,
        path: Path,
        *,
        boot_id: str | None,
        claims: Mapping[str, ClaimRecord] | None = None,
        previous_boot: Sequence[ClaimRecord] = (),
        unreadable: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        file_version: int | None = None,
    ) -> None:
        self._path = path
        self._boot_id = boot_id
        self._claims: dict[str, ClaimRecord] = dict(claims or {})
        self._previous_boot: tuple[ClaimRecord, ...] = tuple(previous_boot)
        self._unreadable: dict[str, Any] = dict(unreadable or {})
        self._extra: dict[str, Any] = dict(extra or {})
        self._file_version = file_version

    @classmethod
    def load(cls, path: Path, *, boot_id_path: Path = DEFAULT_BOOT_ID_PATH) -> Checkpoint:
        """Read `path` (a missing file is an empty checkpoint).

        Raises CheckpointError only when the file is not a JSON object at all,
        because starting empty then would forget devices that are still in use.
        """
        boot_id = read_boot_id(boot_id_path)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls(path, boot_id=boot_id)
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint {path} is not valid JSON ({exc}); move it aside to start "
                "empty, after releasing the devices it lists"
            ) from None
        if not isinstance(doc, dict):
            raise CheckpointError(f"checkpoint {path} must hold a JSON object")

        version = doc.get("version")
        file_version = version if isinstance(version, int) else None
        if file_version is not None and file_version > CHECKPOINT_VERSION:
            log.info(
                "checkpoint written by a newer release; unknown fields are kept",
                extra={"fields": {"path": str(path), "version": file_version}},
            )

        claims: dict[str, ClaimRecord] = {}
        unreadable: dict[str, Any] = {}
        raw_claims = doc.get("claims") or {}
        if not isinstance(raw_claims, dict):
            raise CheckpointError(f"checkpoint {path}: claims must be a JSON object")
        for uid, raw_claim in raw_claims.items():
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

        previous: list[ClaimRecord] = []
        raw_previous = doc.get("previousBoot") or []
        for raw_claim in raw_previous if isinstance(raw_previous, list) else []:
            try:
                previous.append(_claim_from_json(raw_claim))
            except _MalformedError:
                log.warning("unreadable previous-boot record dropped")

        stored_boot = doc.get("bootId") if isinstance(doc.get("bootId"), str) else None
        checkpoint = cls(
            path,
            boot_id=boot_id or stored_boot,
            claims=claims,
            previous_boot=previous,
            unreadable=unreadable,
            extra={k: v for k, v in doc.items() if k not in _TOP_KEYS},
            file_version=file_version,
        )
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
                    "unreadable": sorted(self._unreadable),
                    "stored_boot_id": stored_boot,
                    "boot_id": self._boot_id,
                }
            },
        )
        self._save(
            claims={},
            previous_boot=(*self._previous_boot, *self._claims.values()),
            unreadable={},
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
        """Every claim (prepared or being prepared) holding the device, with its record."""
        key = DeviceKey(*device_key)
        return [(c, d) for c in self._claims.values() for d in c.devices if d.key == key]

    def previous_boot(self) -> list[ClaimRecord]:
        """Claims prepared before the last reboot, kept until `clear_previous_boot`.

        Their devices are gone, but `details` may name things that need cleanup
        (MIG instances of a GPU whose MIG mode persists).
        """
        return list(self._previous_boot)

    def unreadable(self) -> dict[str, Any]:
        """Claim records this release cannot interpret, by UID; kept and written back."""
        return copy.deepcopy(self._unreadable)

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
        self._check_conflicts(claim.uid, detached)
        record = ClaimRecord(
            uid=claim.uid,
            namespace=claim.namespace,
            name=claim.name,
            state=ClaimState.PREPARE_STARTED,
            devices=detached,
        )
        if persist:
            self._save(claims={**self._claims, claim.uid: record})
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
        """Mark the claim prepared with its final devices."""
        return self._replace_devices(self._require(uid), devices, ClaimState.PREPARE_COMPLETED)

    def remove(self, uid: str) -> bool:
        """Forget a claim after unprepare or rollback; False when it was not recorded."""
        if uid not in self._claims and uid not in self._unreadable:
            return False
        claims = {k: v for k, v in self._claims.items() if k != uid}
        unreadable = {k: v for k, v in self._unreadable.items() if k != uid}
        self._save(claims=claims, unreadable=unreadable)
        return True

    def clear_previous_boot(self) -> None:
        """Forget the previous boot's claims once their leftovers are cleaned up."""
        if self._previous_boot:
            self._save(previous_boot=())

    # --- internals ---

    def _require(self, uid: str) -> ClaimRecord:
        record = self._claims.get(uid)
        if record is None:
            raise CheckpointError(f"claim {uid} has no checkpoint record; call begin_prepare")
        return record

    def _replace_devices(
        self, record: ClaimRecord, devices: Sequence[DeviceRecord], state: ClaimState
    ) -> ClaimRecord:
        detached = _detached(devices)
        self._check_conflicts(record.uid, detached)
        updated = replace(record, state=state, devices=detached)
        self._save(claims={**self._claims, record.uid: updated})
        return updated

    def _check_conflicts(self, uid: str, devices: Sequence[DeviceRecord]) -> None:
        problems: list[str] = []
        for device in devices:
            if device.admin_access:
                continue
            for holder, held in self.holders(device.key):
                if holder.uid == uid or held.admin_access:
                    continue
                if device.exclusive or held.exclusive:
                    problems.append(
                        f"device {device.pool}/{device.device} is already prepared "
                        f"{'exclusively ' if held.exclusive else ''}for claim "
                        f"{holder.namespace}/{holder.name} ({holder.uid})"
                    )
        if problems:
            raise DeviceConflictError("; ".join(problems))

    def _document(
        self,
        claims: Mapping[str, ClaimRecord],
        previous_boot: Sequence[ClaimRecord],
        unreadable: Mapping[str, Any],
    ) -> dict[str, Any]:
        doc = dict(self._extra)
        doc["version"] = CHECKPOINT_VERSION
        if self._boot_id is not None:
            doc["bootId"] = self._boot_id
        all_claims: dict[str, Any] = dict(unreadable)
        all_claims.update({uid: _claim_to_json(c) for uid, c in claims.items()})
        doc["claims"] = all_claims
        if previous_boot:
            doc["previousBoot"] = [_claim_to_json(c) for c in previous_boot]
        return doc

    def _save(
        self,
        *,
        claims: Mapping[str, ClaimRecord] | None = None,
        previous_boot: Sequence[ClaimRecord] | None = None,
        unreadable: Mapping[str, Any] | None = None,
    ) -> None:
        """Write the new state, then adopt it in memory, so memory never runs ahead of
        disk (but for the in-memory reservations of `begin_prepare(persist=False)`)."""
        new_claims = dict(self._claims if claims is None else claims)
        new_previous = tuple(self._previous_boot if previous_boot is None else previous_boot)
        new_unreadable = dict(self._unreadable if unreadable is None else unreadable)
        data = json.dumps(
            self._document(new_claims, new_previous, new_unreadable), indent=2
        ).encode()
        self._path.parent.mkdir(parents=True, exist_ok=True)
        try:
            atomic_write(self._path, data + b"\n", mode=0o600)
        except OSError as exc:
            raise CheckpointError(f"cannot write checkpoint {self._path}: {exc}") from exc
        self._claims = new_claims
        self._previous_boot = new_previous
        self._unreadable = new_unreadable
        self._file_version = CHECKPOINT_VERSION


def load(path: Path, *, boot_id_path: Path = DEFAULT_BOOT_ID_PATH) -> Checkpoint:
    """Read the checkpoint at `path`; see `Checkpoint.load`."""
    return Checkpoint.load(path, boot_id_path=boot_id_path)
