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
wrote is ignored.

File format, written by this module only:
`{"version": 1, "bootId": "...", "gpus": {"<GPU UUID>": [{"device": "gpu-0",
"taint": "xid=48"}, {"device": "gpu-0", "taint": "ecc=double-bit"}]}}`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpudra.common.files import atomic_write
from gpudra.driver.checkpoint import DEFAULT_BOOT_ID_PATH, read_boot_id

__all__ = ["RESETS_FILE", "RESET_DIR", "GpuResets", "PendingReset"]

log = logging.getLogger(__name__)

RESET_DIR: Final = "reset"
RESETS_FILE: Final = "health-resets.json"
_VERSION: Final = 1
_ECC_TAINT: Final = "ecc=double-bit"
_XID_TAINT = re.compile(r"xid=([1-9][0-9]{0,5})")
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


class _FileError(ValueError):
    """The file holds something this release did not write."""


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
        doc = {
            "version": _VERSION,
            "bootId": self._boot_id,
            "gpus": {
                uuid: sorted(({"device": p.device, "taint": p.taint()} for p in items), key=str)
                for uuid, items in sorted(pending.items())
                if items
            },
        }
        data = json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
        atomic_write(self.path, data, folder_mode=0o755)

    def load(self) -> dict[str, tuple[PendingReset, ...]]:
        """What waited for a reset when the agent last ran in this boot (GPU UUID -> its
        taints); nothing after a reboot, or where the file cannot be read (logged)."""
        fields: dict[str, Any] = {"path": str(self.path)}
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.error(
                "cannot read the health taints that wait for a GPU reset; none are raised "
                "again: check the GPUs by hand",
                extra={"fields": {**fields, "error": str(exc)}},
            )
            return {}
        try:
            boot_id, pending = _parse(raw)
        except _FileError as exc:
            log.error(
                "the file of health taints that wait for a GPU reset is malformed; none are "
                "raised again: check the GPUs by hand, and remove the file (the agent "
                "writes it again)",
                extra={"fields": {**fields, "error": str(exc)}},
            )
            return {}
        if boot_id is not None and self._boot_id is not None and boot_id != self._boot_id:
            if pending:
                log.info(
                    "the node rebooted since the GPUs below needed a reset; their taints "
                    "are not raised again",
                    extra={"fields": {**fields, "gpus": sorted(pending)}},
                )
            return {}
        return pending


def _parse(raw: bytes) -> tuple[str | None, dict[str, tuple[PendingReset, ...]]]:
    """(boot ID, pending resets) of the file; _FileError names the field at fault."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _FileError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _FileError("must hold a JSON object")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise _FileError(f"version {version!r} is not a positive whole number")
    if version > _VERSION:
        raise _FileError(f"version {version} was written by a newer gpudra release")
    boot_id = doc.get("bootId")
    if boot_id is not None and not isinstance(boot_id, str):
        raise _FileError(f"bootId {boot_id!r} is not a string")
    gpus = doc.get("gpus", {})
    if not isinstance(gpus, dict):
        raise _FileError("gpus must be a JSON object of GPU UUID -> list of taints")
    pending: dict[str, tuple[PendingReset, ...]] = {}
    for uuid, items in gpus.items():
        if not isinstance(items, list):
            raise _FileError(f"gpus.{uuid} must be a list")
        pending[uuid] = tuple(_entry(f"gpus.{uuid}[{i}]", item) for i, item in enumerate(items))
    return boot_id, pending


def _entry(where: str, item: object) -> PendingReset:
    if not isinstance(item, dict) or not isinstance(item.get("device"), str):
        raise _FileError(f"{where} must be an object with a string device")
    taint = item.get("taint")
    if taint == _ECC_TAINT:
        return PendingReset(item["device"])
    match = _XID_TAINT.fullmatch(taint) if isinstance(taint, str) else None
    if match is None:
        raise _FileError(f"{where}.taint {taint!r} is neither xid=<number> nor {_ECC_TAINT}")
    return PendingReset(item["device"], int(match.group(1)))
