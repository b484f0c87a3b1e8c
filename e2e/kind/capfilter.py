"""The private Docker engine's default OCI runtime: runc, after dropping from the
container's spec every capability this machine's bounding set lacks.

Why: a sandboxed machine can withhold capabilities even from root (here
CAP_SYS_RESOURCE). `docker run --privileged`, which kind needs for its nodes, asks for
every capability the engine knows, and runc then fails with "unable to apply caps:
operation not permitted". Asking only for what the machine has gives the node every
capability it can get, which is what privileged means. On a machine with every
capability the spec passes through unchanged.

The engine execs this file for every runc call, so it is a script of the standard
library only (the engine writes it with the system Python's path as its interpreter).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Linux capability numbers are ABI: the name of capability N is CAPABILITIES[N].
CAPABILITIES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
)


def bounding_set(status: str) -> frozenset[str]:
    """The capability names in the CapBnd line of a /proc/<pid>/status text."""
    for line in status.splitlines():
        if line.startswith("CapBnd:"):
            mask = int(line.split()[1], 16)
            return frozenset(n for i, n in enumerate(CAPABILITIES) if mask >> i & 1)
    raise ValueError("no CapBnd line in /proc/self/status")


def filter_process(process: dict[str, Any], allowed: frozenset[str]) -> bool:
    """Drops capabilities outside `allowed` from an OCI process object, in every set
    (bounding, effective, permitted, inheritable, ambient); True if any was dropped.
    Names this table does not know are kept: a newer kernel may have them."""
    changed = False
    for key, names in (process.get("capabilities") or {}).items():
        kept = [n for n in names if n in allowed or n not in CAPABILITIES]
        if kept != names:
            process["capabilities"][key] = kept
            changed = True
    return changed


def spec_files(argv: Sequence[str]) -> list[tuple[Path, bool]]:
    """The OCI files a runc command line names: the bundle's config.json (`create`,
    `run`: the process under "process") and an `exec --process` file (the process at
    the top). Each with whether it is a whole config."""
    out: list[tuple[Path, bool]] = []
    for i, arg in enumerate(argv):
        key, eq, inline = arg.partition("=")
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if key in ("--bundle", "-b") and value:
            out.append((Path(value) / "config.json", True))
        elif key in ("--process", "-p") and value:
            out.append((Path(value), False))
    return out


def rewrite(argv: Sequence[str], allowed: frozenset[str]) -> None:
    """Filters the capabilities of every spec file `argv` names, in place."""
    for path, whole in spec_files(argv):
        if not path.is_file():
            continue
        try:
            spec = json.loads(path.read_text())
        except ValueError:
            continue  # not a spec: leave it to runc
        process = spec.get("process") if whole else spec
        if isinstance(process, dict) and filter_process(process, allowed):
            path.write_text(json.dumps(spec))


def main(argv: Sequence[str]) -> None:
    allowed = bounding_set(Path("/proc/self/status").read_text())
    rewrite(argv, allowed)
    runc = os.environ.get("GPUDRA_RUNC", "runc")
    os.execvp(runc, [runc, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
