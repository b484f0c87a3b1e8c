"""Health taints that lift after quiet time, kept across agent restarts within one boot.

`gpudra.driver.health` lifts most taints once their device stayed quiet for
`recovery_after_s`: a critical XID that needs no reset (74, an NVLink error, which
NVIDIA's catalogue has decoded first), a GPU that was lost and answers again, and the
informational taint of an application XID. Held in memory only, such a taint would go
with the agent: a crash loop, an upgrade or an OOM kill would put a device that just
failed back in service at once. So they are written to `<stateDir>/health-timed.json`
and raised again when the agent starts, each with the time it was raised and the time
its device last had the error: it lifts when it would have, had the agent not stopped,
and one whose quiet time ran out while the agent was down is not raised at all.

Kept here rather than read back from the node's published ResourceSlices (their taints
carry `timeAdded`): the agent raises them before it publishes anything, when the API
server may not answer, and a slice knows when a taint was raised, not when its device
last had the error. The state folder is the host's and the agent's alone: no tenant's
container can write it.

Times: `quietSince` is the kernel's monotonic clock (`time.monotonic`), which counts
from boot for every process of that boot and does not step with the wall clock (NTP)
while the agent is down; the file is read in the boot that wrote it only (its boot ID,
as `gpudra.driver.gpuresets` keeps its file; a reboot resets every GPU). Where the boot
ID cannot be read the file is trusted, as there: a `quietSince` from another boot is
at worst a taint that stays `recovery_after_s` from the start. `timeAdded` is the wall
clock, as the published taint shows it.

The gpu-lost taint of a GPU still lost is kept too, marked `"lost": true`: its quiet
time has not begun, and the GPU may answer again (come back, or be reset) while the
agent is down. Its `quietSince` is when the agent found it lost; the agent that reads
it does not count from there, since the GPU may have stayed lost long after, unseen,
but from the latest time it may still have been lost: its own start, for a GPU that
answers then, else (discovery leaves a GPU lost at start out of the pool) the scan
that finds it answering, as a running agent counts. Either way a GPU that flaps
across a restart waits its quiet time, as it would have without one. The previous
release, which kept no such entry, reads it as a lost GPU that answers again, quiet
since it was found lost (it ignores fields it does not know, and the version stays 1
so that it reads the rest of the file).

Not kept: the taints that wait for a GPU reset (`gpudra.driver.gpuresets` keeps those),
and `unmonitored`, which the agent derives afresh at every start from what NVML lets it
watch.

The file is replaced atomically but not synced to disk: a power loss is a reboot, which
voids it anyway, so it costs one rename per change however often a device repeats an
error. File format, written by this module only (the frame is `gpuresets.save_for_boot`):
`{"version": 1, "bootId": "...", "gpus": {"<GPU UUID>": [{"device": "gpu-0",
"taint": "xid=74", "effect": "NoSchedule", "timeAdded": "2026-11-01T12:00:00+00:00",
"quietSince": 123456.5}]}}`; `"taint": "gpu-lost"` for a lost GPU, with `"lost": true`
while it is still lost (written only then, so a file without lost GPUs reads as before).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final

from gpudra.driver.checkpoint import DEFAULT_BOOT_ID_PATH, read_boot_id
from gpudra.driver.gpuresets import XID_TAINT, FileError, load_for_boot, save_for_boot

__all__ = ["TIMED_FILE", "TimedTaint", "TimedTaints"]

TIMED_FILE: Final = "health-timed.json"
_GPU_LOST_TAINT: Final = "gpu-lost"


@dataclass(frozen=True, slots=True)
class TimedTaint:
    """One taint that lifts after quiet time: XID `xid` on `device`, or, with `xid` None,
    a GPU that was lost: `lost` while it still was when written (its quiet time has
    not begun; module docstring), else it answers again. `effect` as resource.k8s.io
    spells it (`health.TaintEffect` checks it when raising it again); `time_added` the
    wall clock when it was raised; `quiet_since` the monotonic clock when the device
    last had the error (for a GPU still lost, when it was found lost)."""

    device: str
    xid: int | None
    effect: str
    time_added: datetime
    quiet_since: float
    lost: bool = False

    def taint(self) -> str:
        """How the file spells the taint's key and value: `xid=74`, `gpu-lost`."""
        return _GPU_LOST_TAINT if self.xid is None else f"xid={self.xid}"


class TimedTaints:
    """The file of taints that lift after quiet time, in one state folder.

    Blocking file I/O: call from a worker thread. `boot_id_path` is read once, here.
    """

    def __init__(self, state_dir: Path, *, boot_id_path: Path = DEFAULT_BOOT_ID_PATH) -> None:
        self.path = state_dir / TIMED_FILE
        self._boot_id = read_boot_id(boot_id_path)

    def save(self, taints: Mapping[str, Sequence[TimedTaint]]) -> None:
        """Replace the file with `taints` (GPU UUID -> its taints); raises OSError."""
        gpus = {
            uuid: [
                {
                    "device": t.device,
                    "taint": t.taint(),
                    "effect": t.effect,
                    "timeAdded": t.time_added.isoformat(),
                    "quietSince": t.quiet_since,
                    **({"lost": True} if t.lost else {}),
                }
                for t in items
            ]
            for uuid, items in taints.items()
        }
        save_for_boot(self.path, self._boot_id, gpus, durable=False)

    def load(self) -> dict[str, tuple[TimedTaint, ...]]:
        """What was tainted for a while when the agent last ran in this boot (GPU UUID ->
        its taints); nothing after a reboot, or where the file cannot be read (logged)."""
        return load_for_boot(
            self.path,
            self._boot_id,
            _entry,
            what="health taints that lift after quiet time",
            otherwise="the devices they tainted are in service before their quiet time is up",
        )


def _entry(where: str, item: object) -> TimedTaint:
    if not isinstance(item, dict) or not isinstance(item.get("device"), str):
        raise FileError(f"{where} must be an object with a string device")
    taint = item.get("taint")
    xid: int | None = None
    if taint != _GPU_LOST_TAINT:
        match = XID_TAINT.fullmatch(taint) if isinstance(taint, str) else None
        if match is None:
            raise FileError(f"{where}.taint {taint!r} is neither xid=<number> nor gpu-lost")
        xid = int(match.group(1))
    effect = item.get("effect")
    if not isinstance(effect, str):
        raise FileError(f"{where}.effect {effect!r} is not a string")
    added = item.get("timeAdded")
    try:
        time_added = datetime.fromisoformat(added) if isinstance(added, str) else None
    except ValueError:
        time_added = None
    if time_added is None or time_added.tzinfo is None:
        raise FileError(f"{where}.timeAdded {added!r} is not a date and time with a zone")
    quiet = item.get("quietSince")
    if not isinstance(quiet, int | float) or isinstance(quiet, bool) or not math.isfinite(quiet):
        raise FileError(f"{where}.quietSince {quiet!r} is not a number of seconds")
    lost = item.get("lost", False)
    if not isinstance(lost, bool):
        raise FileError(f"{where}.lost {lost!r} is neither true nor false")
    if lost and xid is not None:
        raise FileError(f"{where}.lost is true for taint {taint!r}: only gpu-lost can be")
    return TimedTaint(item["device"], xid, effect, time_added, float(quiet), lost)
