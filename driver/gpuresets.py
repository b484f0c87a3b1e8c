"""Health taints that wait for a GPU reset: kept across agent restarts, lifted by hand.

NVIDIA's XID catalogue has some errors end with the GPU reset (or the node rebooted)
before it is used again; a quiet spell proves nothing there, so `gpudra.driver.health`
keeps those taints until there is evidence of a reset. The health watcher sees one kind
itself (the GPU was lost and answers again); the other is an admin's word, given the
way this agent takes other work done by hand (`<stateDir>/undone/<claim UID>` in
`gpudra.driver.prepare`): after resetting a GPU the admin creates the file
`<stateDir>/reset/<GPU UUID>`, and the agent lifts that GPU's taints and removes it.

An agent restart (an upgrade) resets no GPU, so the taints waiting for a reset are
written to `<stateDir>/health-resets.json` (atomically, with the kernel's boot ID) and
raised again when the agent starts. A reboot resets every GPU: a file another boot
wrote is ignored. A GPU discovery leaves out at start (still lost) is not taken as
reset: its taints are held, written again with the rest, and raised once a rescan
finds it; its mark drops them meanwhile. A GPU removed from the node for good keeps
them in the file until the next reboot voids it.

File format, written by this module only:
`{"version": 1, "bootId": "...", "gpus": {"<GPU UUID>": [{"device": "gpu-0",
"taint": "xid=48"}, {"device": "gpu-0", "taint": "ecc=double-bit"}]}}`. That frame (a
version, the boot ID, each GPU's list of taints) is `save_for_boot` and `load_for_boot`,
which the taints that lift after quiet time share (`gpudra.driver.timedtaints`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from gpudra.common.files import atomic_write
from gpudra.driver.checkpoint import DEFAULT_BOOT_ID_PATH, read_boot_id

__all__ = [
    "RESETS_FILE",
    "RESET_DIR",
    "XID_TAINT",
    "FileError",
    "GpuResets",
    "PendingReset",
    "load_for_boot",
    "save_for_boot",
]

log = logging.getLogger(__name__)

RESET_DIR: Final = "reset"
RESETS_FILE: Final = "health-resets.json"
_VERSION: Final = 1
_ECC_TAINT: Final = "ecc=double-bit"
XID_TAINT: Final = re.compile(r"xid=([1-9][0-9]{0,5})")
"""An XID taint as the files spell it (its key and value): `xid=48`."""
# A GPU UUID becomes a file name: letters, digits, dots and dashes only (NVML's are
# `GPU-<hex and dashes>`), never `.` or `..`.
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,127}")


@dataclass(frozen=True, slots=True)
class PendingReset:
    """One taint waiting for its GPU's reset: XID `xid` on `device`, or, with `xid`
    None, a double-bit ECC error."""

    device: str
    xid: int | None = None

    def taint(self) -> str:
        """How the file (and the taint's key and value) spell it: `xid=48`."""
        return _ECC_TAINT if self.xid is None else f"xid={self.xid}"


class FileError(ValueError):
    """The file holds something this release did not write."""


_T = TypeVar("_T")


class GpuResets:
    """The pending-reset file and the admin's reset marks of one state folder.

    Blocking file I/O: call from a worker thread. `boot_id_path` is read once, here.
    """

    def __init__(self, state_dir: Path, *, boot_id_path: Path = DEFAULT_BOOT_ID_PATH) -> None:
        self.path = state_dir / RESETS_FILE
        self.reset_dir = state_dir / RESET_DIR
        self._boot_id = read_boot_id(boot_id_path)
        self._listing_error: str | None = None

    def marker(self, gpu_uuid: str) -> Path | None:
        """The file an admin creates after resetting GPU `gpu_uuid`; None for a UUID no
        file can be named after."""
        if not _FILE_NAME.fullmatch(gpu_uuid):
            return None
        return self.reset_dir / gpu_uuid

    def marked(self) -> frozenset[str]:
        """The names of the marks there are (GPU UUIDs, if the admin named them right)."""
        try:
            names = frozenset(p.name for p in self.reset_dir.iterdir())
        except FileNotFoundError:
            return frozenset()
        except OSError as exc:
            if str(exc) != self._listing_error:  # once per problem, not every wait
                log.warning(
                    "cannot read the GPU reset marks; GPUs marked reset keep their taints",
                    extra={"fields": {"path": str(self.reset_dir), "error": str(exc)}},
                )
                self._listing_error = str(exc)
            return frozenset()
        self._listing_error = None
        return names

    def unmark(self, gpu_uuid: str) -> bool:
        """Remove the mark once its GPU's taints are lifted (and the file saved); False
        where it stays (logged: the admin removes it)."""
        marker = self.marker(gpu_uuid)
        if marker is None:
            return True
        try:
            marker.unlink(missing_ok=True)
        except OSError as exc:
            log.warning(
                "cannot remove a GPU reset mark; it is ignored until removed by hand",
                extra={"fields": {"path": str(marker), "error": str(exc)}},
            )
            return False
        return True

    def save(self, pending: Mapping[str, Sequence[PendingReset]]) -> None:
        """Replace the file with `pending` (GPU UUID -> its taints); raises OSError."""
        gpus = {
            uuid: [{"device": p.device, "taint": p.taint()} for p in items]
            for uuid, items in pending.items()
        }
        save_for_boot(self.path, self._boot_id, gpus)

    def load(self) -> dict[str, tuple[PendingReset, ...]]:
        """What waited for a reset when the agent last ran in this boot (GPU UUID -> its
        taints); nothing after a reboot, or where the file cannot be read (logged)."""
        return load_for_boot(
            self.path,
            self._boot_id,
            _entry,
            what="health taints that wait for a GPU reset",
            otherwise="check the GPUs by hand",
        )


def save_for_boot(
    path: Path,
    boot_id: str | None,
    gpus: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    durable: bool = True,
) -> None:
    """Replace `path` with each GPU's taints (GPU UUID -> entries), stamped with this
    boot's ID, atomically: a crash leaves the old file or the new one, never a torn one.
    Raises OSError. `durable=False` for a file a power loss may lose (`atomic_write`)."""
    doc = {
        "version": _VERSION,
        "bootId": boot_id,
        "gpus": {uuid: sorted(items, key=str) for uuid, items in sorted(gpus.items()) if items},
    }
    data = json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
    atomic_write(path, data, folder_mode=0o755, durable=durable)


def load_for_boot(
    path: Path,
    boot_id: str | None,
    entry: Callable[[str, object], _T],
    *,
    what: str,
    otherwise: str,
) -> dict[str, tuple[_T, ...]]:
    """Each GPU's taints `save_for_boot` wrote in this boot, read by `entry` (which names
    the field at fault with FileError). Nothing where the file is missing, was written
    in another boot (a reboot resets every GPU), or cannot be read or parsed: then an
    error names the file, the fault and `otherwise`, what the admin does instead, and
    the agent goes on. `what` names the file's taints in the log."""
    fields: dict[str, Any] = {"path": str(path)}
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.error(
            f"cannot read the file of {what}; none are raised again: {otherwise}",
            extra={"fields": {**fields, "error": str(exc)}},
        )
        return {}
    try:
        stored_boot, gpus = _parse(raw, entry)
    except FileError as exc:
        log.error(
            f"the file of {what} is malformed; none are raised again: {otherwise}, "
            "and remove the file (the agent writes it again)",
            extra={"fields": {**fields, "error": str(exc)}},
        )
        return {}
    if stored_boot is not None and boot_id is not None and stored_boot != boot_id:
        if gpus:
            log.info(
                f"the node rebooted since the file of {what} was written; the taints of "
                "the GPUs below are not raised again",
                extra={"fields": {**fields, "gpus": sorted(gpus)}},
            )
        return {}
    return gpus


def _parse(
    raw: bytes, entry: Callable[[str, object], _T]
) -> tuple[str | None, dict[str, tuple[_T, ...]]]:
    """(boot ID, each GPU's taints) of the file; FileError names the field at fault."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise FileError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise FileError("must hold a JSON object")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FileError(f"version {version!r} is not a positive whole number")
    if version > _VERSION:
        raise FileError(f"version {version} was written by a newer gpudra release")
    boot_id = doc.get("bootId")
    if boot_id is not None and not isinstance(boot_id, str):
        raise FileError(f"bootId {boot_id!r} is not a string")
    gpus = doc.get("gpus", {})
    if not isinstance(gpus, dict):
        raise FileError("gpus must be a JSON object of GPU UUID -> list of taints")
    parsed: dict[str, tuple[_T, ...]] = {}
    for uuid, items in gpus.items():
        if not isinstance(items, list):
            raise FileError(f"gpus.{uuid} must be a list")
        parsed[uuid] = tuple(entry(f"gpus.{uuid}[{i}]", item) for i, item in enumerate(items))
    return boot_id, parsed


def _entry(where: str, item: object) -> PendingReset:
    if not isinstance(item, dict) or not isinstance(item.get("device"), str):
        raise FileError(f"{where} must be an object with a string device")
    taint = item.get("taint")
    if taint == _ECC_TAINT:
        return PendingReset(item["device"])
    match = XID_TAINT.fullmatch(taint) if isinstance(taint, str) else None
    if match is None:
        raise FileError(f"{where}.taint {taint!r} is neither xid=<number> nor {_ECC_TAINT}")
    return PendingReset(item["device"], int(match.group(1)))
