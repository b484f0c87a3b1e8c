"""A driver root laid out as Debian's own packages of the NVIDIA driver lay it out.

Read off bookworm's non-free packages of 535.261.03 (`libcuda1`, `libnvidia-ml1`,
`nvidia-smi` and the `nvidia-alternative` script that links them): each library is
installed in `/usr/lib/<triplet>/nvidia/current/`, with its soname link there
(relative), and the names programs look for are links through the alternatives
system, absolute at both steps:

    /usr/lib/x86_64-linux-gnu/libcuda.so.1
      -> /etc/alternatives/nvidia--libcuda.so.1-x86_64-linux-gnu
      -> /usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.1
      -> libcuda.so.535.261.03
    /usr/bin/nvidia-smi -> /etc/alternatives/nvidia--nvidia-smi
      -> /usr/lib/nvidia/current/nvidia-smi

`nvidia-cuda-mps-control` is a plain file in `/usr/bin`, and `nvidia-cuda-mps-server`
one in `/usr/sbin` (the `nvidia-cuda-mps` package). Seen from a container that mounts
the host under `/host`, those absolute links name the container's own files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

__all__ = ["LIBRARY_DIR", "debian_layout"]

LIBRARY_DIR: Final = "usr/lib/x86_64-linux-gnu"
_TRIPLET: Final = "x86_64-linux-gnu"
_SONAME_LINKS: Final = ("libcuda.so.1", "libnvidia-ml.so.1")
_ALTERNATIVE_TOOLS: Final = ("nvidia-smi",)


def debian_layout(root: Path) -> dict[str, Path]:
    """Move a driver root's libraries, `nvidia-smi` and the MPS server (as
    `install_driver_root` or the runfile installer leaves them: files beside their
    soname links in `LIBRARY_DIR`, tools in `usr/bin`) where Debian's packages put
    them, and link them as those do. Returns each moved library's file by soname, to be replaced by
    tests that load it."""
    libraries = root / LIBRARY_DIR
    current = libraries / "nvidia/current"
    current.mkdir(parents=True)
    alternatives = root / "etc/alternatives"
    alternatives.mkdir(parents=True, exist_ok=True)
    moved: dict[str, Path] = {}
    for soname in _SONAME_LINKS:
        link = libraries / soname
        versioned = link.readlink().name  # relative, beside it
        (libraries / versioned).rename(current / versioned)
        link.unlink()
        (current / soname).symlink_to(versioned)
        alternative = f"nvidia--{soname}-{_TRIPLET}"
        (alternatives / alternative).symlink_to(f"/{LIBRARY_DIR}/nvidia/current/{soname}")
        link.symlink_to(f"/etc/alternatives/{alternative}")
        moved[soname] = current / versioned
    server = root / "usr/bin/nvidia-cuda-mps-server"
    if server.exists():
        (root / "usr/sbin").mkdir(parents=True, exist_ok=True)
        server.rename(root / "usr/sbin" / server.name)
    tools = root / "usr/lib/nvidia/current"
    tools.mkdir(parents=True)
    for tool in _ALTERNATIVE_TOOLS:
        (root / "usr/bin" / tool).rename(tools / tool)
        (alternatives / f"nvidia--{tool}").symlink_to(f"/usr/lib/nvidia/current/{tool}")
        (root / "usr/bin" / tool).symlink_to(f"/etc/alternatives/nvidia--{tool}")
    return moved
