"""What a prepare did to each device, typed: the details of the checkpoint's device records.

Undo must know exactly which side effects a prepare made, the ones a crash
interrupted included, so each kind of side effect has its own record, written
before the effect (with `applied=False`, or without the IDs NVML has not returned
yet) and again right after it:

- `CreatedMig`: a MIG instance the claim creates at its allocated placement;
- `TimeSliceSet`: the GPU's time-slice, reset at undo, and the compute mode that
  time-slicing replaced with DEFAULT, restored with it;
- `ComputeModeSet`: the GPU's compute mode, restored to `previous` at undo;
- `MpsStarted`: the claim's MPS control daemon (and its /dev/shm folder),
  stopped at undo.

`UsedMig` names a MIG device that already existed (static MIG, admin access),
which undo leaves alone. The CDI spec needs no record: undo removes the claim's
spec whether or not it was written.

On disk the details are each device's `details` object, in the shape checkpoint
version 1 has always had, so files written before the records were typed load
unchanged and older releases read ours. Reading never fails on a value: a key
this release does not know (inside a record too) is kept and written back
verbatim; a side-effect record it cannot interpret is also kept verbatim and
becomes one of `problems`, which fail the claim's undo with the field named (the
record stays for a retry), so one bad record never stops the agent. The upstream
driver's checkpoints that a new release called corrupt are the lesson here.

Descriptive values are scalars and side effects are objects, in every release: an
object under a key this release does not know is a side effect of a kind a newer
release made, which this one cannot undo, so it is one of `problems` too. Forgetting
it with the record would leave what it names in place with nothing to say so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from gpudra.driver.processes import ProcessIdentity
from gpudra.driver.sharing import DaemonPod

__all__ = [
    "ComputeModeSet",
    "CreatedMig",
    "DeviceDetails",
    "MpsStarted",
    "TimeSliceSet",
    "UsedMig",
    "details_from_json",
    "details_to_json",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class UsedMig:
    """A MIG device that existed before the prepare; undo leaves it alone."""

    gi: int | None
    ci: int | None
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class CreatedMig:
    """A MIG instance the claim creates at its allocated placement.

    Recorded before NVML creates it, so a crash right after creation is still
    undone: `gi` and `ci` are None until NVML returns them, and undo then finds
    the instance by profile and placement.
    """

    profile_id: int
    profile: str
    start: int
    size: int
    gi: int | None = None
    ci: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class TimeSliceSet:
    """The time-slice of GPU `uuid` set to `interval`.

    `applied` False: recorded before the change, which may not have happened, so
    undo resets it on a best-effort basis and a failing reset does not pin the claim.

    `previous_compute_mode` is the GPU's compute mode before its first time-slicing
    claim set it to DEFAULT (None: it was DEFAULT, or the record predates the field).
    Claims sharing the GPU each carry it, handed on from the ones already there, so
    whichever leaves last restores it, as it resets the time-slice.
    """

    uuid: str
    interval: int
    applied: bool = True
    previous_compute_mode: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class ComputeModeSet:
    """The compute mode of GPU `uuid` changed from `previous` (restored at undo)."""

    uuid: str
    previous: int
    applied: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class MpsStarted:
    """The claim's MPS control daemon, recorded before it starts; one per claim,
    so every member device of the claim carries the same record.

    `shm_dir` is the claim's own /dev/shm (None in records older than it);
    `daemon` is the daemon process or pod, recorded once it runs: only this record,
    which the claim's containers cannot write, says which process or pod undo may stop.
    """

    pipe_dir: Path
    log_dir: Path
    uuids: tuple[str, ...] = ()
    shm_dir: Path | None = None
    daemon: ProcessIdentity | DaemonPod | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class DeviceDetails:
    """What a prepared device is, and what its prepare did to it.

    `gpu_uuid` is the GPU the device is or is part of (a created MIG instance lives
    there); `uuid` is the device's own, None until a created MIG device exists.
    `problems` maps each side-effect record this release could not interpret (kept
    verbatim in `extra`) to what is wrong with it: undo cannot know what to reverse,
    so it fails with them.
    """

    type: str = ""
    request: str = ""
    gpu_uuid: str | None = None
    gpu_minor: int | None = None
    uuid: str | None = None
    pod: str = ""
    pod_uid: str = ""
    """The UID of `pod` as the claim was reserved for it (records of releases before
    this one have none)."""
    mig: UsedMig | CreatedMig | None = None
    time_slice: TimeSliceSet | None = None
    compute_mode: ComputeModeSet | None = None
    mps: MpsStarted | None = None
    problems: Mapping[str, str] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)


# --- JSON ---------------------------------------------------------------------------------

_INFO_KEYS: Final = ("type", "request", "parentUuid", "gpuMinor", "uuid", "pod", "podUid")
_EFFECT_KEYS: Final = ("mig", "timeSlice", "computeMode", "mps")
_MIG_KEYS: Final = frozenset({"profileId", "profile", "start", "size", "created", "gi", "ci"})
_TIME_SLICE_KEYS: Final = frozenset({"uuid", "interval", "applied", "previousComputeMode"})
_COMPUTE_MODE_KEYS: Final = frozenset({"uuid", "previous", "applied"})
_MPS_KEYS: Final = frozenset(
    {
        "pipeDir",
        "logDir",
        "uuids",
        "shmDir",
        "daemonPid",
        "daemonStartTime",
        "daemonPod",
        "daemonPodUid",
    }
)


class _Unreadable(ValueError):
    pass


def _int(obj: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Unreadable(f"{key} must be an integer, not {_shown(value)}")
    return value


def _optional_int(obj: Mapping[str, Any], key: str) -> int | None:
    return None if obj.get(key) is None else _int(obj, key)


def _text(obj: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str) or not value:
        raise _Unreadable(f"{key} must be a non-empty string, not {_shown(value)}")
    return value


def _flag(obj: Mapping[str, Any], key: str) -> bool:
    value = obj.get(key, True)
    if not isinstance(value, bool):
        raise _Unreadable(f"{key} must be true or false, not {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    return "null" if value is None else repr(value)


def _rest(obj: Mapping[str, Any], known: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in known}


def _mig(obj: Mapping[str, Any]) -> UsedMig | CreatedMig:
    gi, ci = _optional_int(obj, "gi"), _optional_int(obj, "ci")
    created = obj.get("created", False)
    if not isinstance(created, bool):
        raise _Unreadable(f"created must be true or false, not {_shown(created)}")
    if not created:
        return UsedMig(gi=gi, ci=ci, extra=_rest(obj, _MIG_KEYS))
    return CreatedMig(
        profile_id=_int(obj, "profileId"),
        profile=str(obj.get("profile") or ""),
        start=_int(obj, "start"),
        size=_int(obj, "size", 0),
        gi=gi,
        ci=ci,
        extra=_rest(obj, _MIG_KEYS),
    )


def _time_slice(obj: Mapping[str, Any]) -> TimeSliceSet:
    return TimeSliceSet(
        uuid=_text(obj, "uuid"),
        interval=_int(obj, "interval"),
        applied=_flag(obj, "applied"),
        previous_compute_mode=_optional_int(obj, "previousComputeMode"),
        extra=_rest(obj, _TIME_SLICE_KEYS),
    )


def _compute_mode(obj: Mapping[str, Any]) -> ComputeModeSet:
    return ComputeModeSet(
        uuid=_text(obj, "uuid"),
        # Absent means DEFAULT, as the first records were written.
        previous=_int(obj, "previous", 0),
        applied=_flag(obj, "applied"),
        extra=_rest(obj, _COMPUTE_MODE_KEYS),
    )


def _mps(obj: Mapping[str, Any]) -> MpsStarted:
    pipe_dir = _text(obj, "pipeDir")
    # Absent (or empty) means the pipe folder, as the first records were written.
    log_dir = _text(obj, "logDir", pipe_dir) if obj.get("logDir") not in (None, "") else pipe_dir
    uuids = obj.get("uuids") or []
    if not isinstance(uuids, list) or not all(isinstance(u, str) for u in uuids):
        raise _Unreadable(f"uuids must be a list of strings, not {_shown(uuids)}")
    shm_dir = obj.get("shmDir")
    daemon: ProcessIdentity | DaemonPod | None = None
    if obj.get("daemonPod") is not None or obj.get("daemonPodUid") is not None:
        daemon = DaemonPod(_text(obj, "daemonPod"), _text(obj, "daemonPodUid"))
    elif obj.get("daemonPid") is not None or obj.get("daemonStartTime") is not None:
        daemon = ProcessIdentity(_int(obj, "daemonPid"), _int(obj, "daemonStartTime"))
    return MpsStarted(
        pipe_dir=Path(pipe_dir),
        log_dir=Path(log_dir),
        uuids=tuple(uuids),
        shm_dir=None if shm_dir is None else Path(_text(obj, "shmDir")),
        daemon=daemon,
        extra=_rest(obj, _MPS_KEYS),
    )


def _effect(
    raw: Mapping[str, Any],
    key: str,
    parse: Callable[[Mapping[str, Any]], T],
    problems: dict[str, str],
    kept: dict[str, Any],
) -> T | None:
    value = raw.get(key)
    if value is None:
        return None
    reason = f"must be an object, not {_shown(value)}"
    if isinstance(value, Mapping):
        try:
            return parse(value)
        except _Unreadable as exc:
            reason = str(exc)
    problems[key] = f"details.{key}: {reason}"
    kept[key] = value
    return None


def _info(raw: Mapping[str, Any], key: str, kind: type, kept: dict[str, Any]) -> Any:
    """A descriptive value: one of the wrong type is kept verbatim and otherwise
    ignored, as nothing needs it to undo a side effect."""
    value = raw.get(key)
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    kept[key] = value
    log.warning(
        "checkpoint detail of an unexpected type kept as is",
        extra={"fields": {"key": key, "value": _shown(value)}},
    )
    return None


def details_from_json(raw: Mapping[str, Any]) -> DeviceDetails:
    """The typed form of a device's `details`; never raises (see the module docstring)."""
    kept = {k: v for k, v in raw.items() if k not in _INFO_KEYS and k not in _EFFECT_KEYS}
    problems: dict[str, str] = {
        key: f"details.{key}: a side effect this release does not know (a newer release's?)"
        for key, value in kept.items()
        if isinstance(value, Mapping)
    }
    gpu_uuid = _info(raw, "parentUuid", str, kept)
    mig = _effect(raw, "mig", _mig, problems, kept)
    if isinstance(mig, CreatedMig) and not gpu_uuid:
        problems["parentUuid"] = (
            "details.parentUuid: must name the GPU of the created MIG instance, not "
            f"{_shown(raw.get('parentUuid'))}"
        )
    return DeviceDetails(
        type=_info(raw, "type", str, kept) or "",
        request=_info(raw, "request", str, kept) or "",
        gpu_uuid=gpu_uuid,
        gpu_minor=_info(raw, "gpuMinor", int, kept),
        uuid=_info(raw, "uuid", str, kept),
        pod=_info(raw, "pod", str, kept) or "",
        pod_uid=_info(raw, "podUid", str, kept) or "",
        mig=mig,
        time_slice=_effect(raw, "timeSlice", _time_slice, problems, kept),
        compute_mode=_effect(raw, "computeMode", _compute_mode, problems, kept),
        mps=_effect(raw, "mps", _mps, problems, kept),
        problems=problems,
        extra=kept,
    )


def _mig_to_json(mig: UsedMig | CreatedMig) -> dict[str, Any]:
    out = dict(mig.extra)
    if isinstance(mig, UsedMig):
        out.update(gi=mig.gi, ci=mig.ci, created=False)
        return out
    out.update(
        profileId=mig.profile_id, profile=mig.profile, start=mig.start, size=mig.size, created=True
    )
    if mig.gi is not None:
        out["gi"] = mig.gi
    if mig.ci is not None:
        out["ci"] = mig.ci
    return out


def details_to_json(details: DeviceDetails) -> dict[str, Any]:
    """`details` in the file's shape; the inverse of `details_from_json`."""
    out = dict(details.extra)
    d = details
    info = {
        "type": d.type,
        "request": d.request,
        "parentUuid": d.gpu_uuid,
        "gpuMinor": d.gpu_minor,
        "uuid": d.uuid,
        "pod": d.pod,
        "podUid": d.pod_uid,
    }
    # A planned device (it has a type) lists all of these, as every release wrote
    # them; for other records only what is set, so a record is written back as read.
    # A value of the wrong type was kept in `extra` and is written back as it was.
    out.update((k, v) for k, v in info.items() if k not in out and (d.type or v not in (None, "")))
    if d.mig is not None:
        out["mig"] = _mig_to_json(d.mig)
    if d.time_slice is not None:
        ts = d.time_slice
        time_slice: dict[str, Any] = {
            **ts.extra,
            "uuid": ts.uuid,
            "interval": ts.interval,
            "applied": ts.applied,
        }
        if ts.previous_compute_mode is not None:
            time_slice["previousComputeMode"] = ts.previous_compute_mode
        out["timeSlice"] = time_slice
    if d.compute_mode is not None:
        cm = d.compute_mode
        out["computeMode"] = {
            **cm.extra,
            "uuid": cm.uuid,
            "previous": cm.previous,
            "applied": cm.applied,
        }
    if d.mps is not None:
        mps = d.mps
        out["mps"] = {
            **mps.extra,
            "pipeDir": str(mps.pipe_dir),
            "logDir": str(mps.log_dir),
            "uuids": list(mps.uuids),
        }
        if mps.shm_dir is not None:
            out["mps"]["shmDir"] = str(mps.shm_dir)
        if isinstance(mps.daemon, DaemonPod):
            out["mps"].update(daemonPod=mps.daemon.name, daemonPodUid=mps.daemon.uid)
        elif mps.daemon is not None:
            out["mps"].update(daemonPid=mps.daemon.pid, daemonStartTime=mps.daemon.start_time)
    return out
