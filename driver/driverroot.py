"""The NVIDIA driver's root as this process sees it: where its libraries and tools are.

The driver root is a host path: `/` for a driver installed on the node, or
`/run/nvidia/driver` for the GPU Operator's driver container. The agent may see the
host elsewhere: the chart runs it in a container of its own image, which holds no
NVIDIA files, with the driver root mounted read-only at `/host<driver root>` and
`--host-root=/host`. Whatever opens or runs the driver's files (the CDI spec's list of
libraries, NVML, `nvidia-smi`, the MPS control daemon) looks for them through
`DriverRoot`, so all of them find the same files. Paths written into CDI specs stay
host paths: the container runtime reads them on the host.

A symbolic link inside the root is followed inside the root (`DriverRoot.resolve`), as
if the root were `/`: an absolute target is a path of the root's own tree. Debian's
packages link the files a container needs through the alternatives system, absolute
links all (`/usr/lib/x86_64-linux-gnu/libcuda.so.1 -> /etc/alternatives/nvidia--
libcuda.so.1-x86_64-linux-gnu -> /usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.1`,
`/usr/bin/nvidia-smi -> ... /usr/lib/nvidia/current/nvidia-smi`), and a driver
container's tree links the same way to its own `/`. Followed by this process, which
sees the host under `/host`, such a link would name a file of the agent's own image;
followed by the container runtime, a file of the host outside a driver container's
root. So the files are looked for by their resolved path here, and the CDI spec mounts
the file a link resolves to under the link's name. A name that does not resolve to a
regular file (a dangling link, a folder named like a library) is skipped, so that it
neither shadows the file in a later folder nor fails the container's start.
"""

from __future__ import annotations

import logging
import os
import stat
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "CUDA_LIBRARY",
    "DRIVER_LIBRARY_DIRS",
    "DRIVER_LIBRARY_PATTERNS",
    "DRIVER_TOOL_DIRS",
    "NVML_LIBRARY",
    "DriverRoot",
]

# Where a driver installs its user-space files (Debian/Ubuntu, RHEL/SUSE, others), and
# which of them a container needs: the set the NVIDIA container toolkit mounts for
# compute and utility workloads.
DRIVER_LIBRARY_DIRS: Final = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib64",
)
DRIVER_LIBRARY_PATTERNS: Final = (
    "libcuda.so.*",
    "libcudadebugger.so.*",
    "libnvidia-ml.so.*",
    "libnvidia-ptxjitcompiler.so.*",
    "libnvidia-nvvm.so.*",
    "libnvidia-cfg.so.*",
    "libnvidia-opencl.so.*",
    "libnvidia-gpucomp.so.*",
    "libnvidia-allocator.so.*",
    "libnvidia-pkcs11*.so.*",
)
# Where a driver installation keeps its programs (nvidia-smi, the MPS control daemon and
# server, ...), searched in this order: the NVIDIA container toolkit's folders (its
# default PATH), `usr/bin` first, where the driver's installer puts them. Debian's
# packages put `nvidia-cuda-mps-server` in `usr/sbin`.
DRIVER_TOOL_DIRS: Final = ("usr/bin", "usr/local/bin", "bin", "usr/sbin", "usr/local/sbin", "sbin")
# The sonames pynvml and the driver's tools ask the dynamic linker for: NVML (pynvml,
# nvidia-smi, the MPS control daemon) and CUDA (the MPS server).
NVML_LIBRARY: Final = "libnvidia-ml.so.1"
CUDA_LIBRARY: Final = "libcuda.so.1"
_TOOL_LIBRARIES: Final = (NVML_LIBRARY, CUDA_LIBRARY)
_ELF_MAGIC: Final = b"\x7fELF"
# Linux's MAXSYMLINKS: more links than this in one path is a loop (ELOOP).
_MAX_LINKS: Final = 40

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DriverRoot:
    """The driver root `path` on the host, seen by this process under `host_view`
    (where it sees the host's `/`).

    Nothing is cached: a driver container may mount its root after the agent started
    (the chart's mount propagates it), so every question looks again.
    """

    path: Path = Path("/")
    host_view: Path = Path("/")

    @property
    def seen(self) -> Path:
        """The driver root where this process finds its files."""
        return self.host_view / str(self.path).lstrip("/")

    def resolve(self, path: str) -> str | None:
        """The regular file `path` (a path inside the root, with or without its
        leading '/') names once every symbolic link on the way is followed inside the
        root, as a path inside the root with a leading '/'; None where it names
        nothing, a dangling link, a link loop or something other than a regular file.

        Component by component, as the kernel walks a path under `chroot`: an absolute
        target starts again at the root, and `..` stops at it, so no link leads out of
        the root, whoever made it."""
        todo = deque(path.split("/"))
        done: list[str] = []
        links = 0
        mode = 0  # the last component's, once walked
        while todo:
            part = todo.popleft()
            if part in ("", "."):
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            here = self.seen.joinpath(*done, part)
            try:
                mode = os.lstat(here).st_mode
            except OSError:
                return None
            if stat.S_ISLNK(mode):
                links += 1
                if links > _MAX_LINKS:
                    return None
                try:
                    target = str(here.readlink())
                except OSError:
                    return None
                if target.startswith("/"):
                    done = []
                todo.extendleft(reversed(target.split("/")))
                continue
            if todo and not stat.S_ISDIR(mode):
                return None
            done.append(part)
        if not done or not stat.S_ISREG(mode):
            return None
        return "/" + "/".join(done)

    def libraries(self) -> dict[str, tuple[str, ...]]:
        """The driver's libraries by folder, relative to the root, in the order of
        `DRIVER_LIBRARY_DIRS`: versioned names and soname links alike, sorted, those
        that resolve to a regular file (`resolve`) only; folders without any are left
        out."""
        found: dict[str, tuple[str, ...]] = {}
        for folder in DRIVER_LIBRARY_DIRS:
            where = self.seen / folder
            if not where.is_dir():
                continue
            names = {p.name for pattern in DRIVER_LIBRARY_PATTERNS for p in where.glob(pattern)}
            kept = tuple(sorted(n for n in names if self._is_file(f"{folder}/{n}")))
            if kept:
                found[folder] = kept
        return found

    def library(self, name: str) -> Path | None:
        """The file `name` in the first of the root's library folders that holds it
        resolves to (`resolve`), as seen here."""
        for folder in DRIVER_LIBRARY_DIRS:
            resolved = self.resolve(f"{folder}/{name}")
            if resolved is not None:
                return self.seen / resolved.lstrip("/")
        return None

    def tool(self, name: str) -> tuple[str, str] | None:
        """The program `name` in the first of `DRIVER_TOOL_DIRS` where it resolves to
        an executable regular file, as two paths inside the root: the one that names
        it, and the file it resolves to (`resolve`); None where none does. `bin` is
        often a link to `usr/bin`: the first folder names it."""
        for folder in DRIVER_TOOL_DIRS:
            named = f"/{folder}/{name}"
            resolved = self.resolve(named)
            if resolved is not None and os.access(self.seen / resolved.lstrip("/"), os.X_OK):
                return named, resolved
        return None

    def _is_file(self, path: str) -> bool:
        """Whether `path` inside the root resolves to a regular file; a name that
        does not is logged, since it is skipped where a library was expected."""
        if self.resolve(path) is not None:
            return True
        log.info(
            "driver file skipped: not a regular file inside the driver root",
            extra={"fields": {"driver_root": str(self.path), "path": f"/{path}"}},
        )
        return False

    def tool_preload(self) -> str:
        """`LD_PRELOAD` for the driver's tools run from this root: its NVML and CUDA
        libraries by full path, as seen here. The tools load them by soname, which a
        linker whose `/` is not the driver's does not find; loaded first, they are the
        objects of that soname. Not `LD_LIBRARY_PATH` naming the root's library
        folders: those hold the root's own C library too, which the tools would then
        load beside this process's dynamic linker, a pair that fails unless both come
        from one glibc build. Files that are not ELF objects (emulated GPUs'
        stand-ins) are left out, as the linker would refuse them with an error in
        every process. Empty where the root is this process's `/`: the linker's own
        search covers it."""
        if self.seen == Path("/"):
            return ""
        found = (self.library(name) for name in _TOOL_LIBRARIES)
        return ":".join(str(path) for path in found if path is not None and _is_elf(path))


def _is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(_ELF_MAGIC)) == _ELF_MAGIC
    except OSError:
        return False
