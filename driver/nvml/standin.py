"""What emulated GPUs need from the node besides NVML: numbers for their device nodes
and a driver root holding the files and tools the kubelet plugin uses.

With these, an agent in emulated mode prepares claims that a real container runtime
starts on a node without the NVIDIA driver (kind, CI, demos): the CDI spec carries
each device node's type and numbers, so the runtime creates the node inside the
container without looking for it on the host, and the stand-in driver root supplies
the libraries the spec mounts and the `nvidia-smi` / `nvidia-cuda-mps-control` that
time-slicing and MPS run (shell stand-ins that record each call in a log).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

__all__ = [
    "CAPS_MAJOR",
    "FAKEBIN",
    "NVIDIACTL_MINOR",
    "NVIDIA_MAJOR",
    "TOOLS",
    "TOOLS_LOG_ENV",
    "UVM_MAJOR",
    "SmiGpu",
    "device_numbers",
    "install_driver_root",
]

# The NVIDIA kernel driver's fixed character major and its control node's minor.
NVIDIA_MAJOR: Final = 195
NVIDIACTL_MINOR: Final = 255
# The kernel hands these out dynamically; these are free where no NVIDIA driver is
# loaded, and the container only needs the numbers to be consistent.
UVM_MAJOR: Final = 510
CAPS_MAJOR: Final = 511
# The stand-in tools, shipped with the package.
FAKEBIN: Final = Path(__file__).resolve().parent / "fakebin"
TOOLS: Final = ("nvidia-smi", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
# Where the stand-in tools append one line per call (and per MPS command).
TOOLS_LOG_ENV: Final = "GPUDRA_FAKEBIN_LOG"
_LIBRARIES: Final = ("libcuda.so", "libnvidia-ml.so")
_LIBRARY_DIR: Final = "usr/lib/x86_64-linux-gnu"
_GPU = re.compile(r"/dev/nvidia(\d+)")
_CAP = re.compile(r"/dev/nvidia-caps/nvidia-cap(\d+)")


def device_numbers(path: str) -> tuple[int, int] | None:
    """(major, minor) of an emulated GPU's device node, or None for other paths."""
    fixed = {
        "/dev/nvidiactl": (NVIDIA_MAJOR, NVIDIACTL_MINOR),
        "/dev/nvidia-uvm": (UVM_MAJOR, 0),
        "/dev/nvidia-uvm-tools": (UVM_MAJOR, 1),
    }
    if path in fixed:
        return fixed[path]
    if m := _GPU.fullmatch(path):
        return NVIDIA_MAJOR, int(m.group(1))
    if m := _CAP.fullmatch(path):
        return CAPS_MAJOR, int(m.group(1))
    return None


@dataclass(frozen=True)
class SmiGpu:
    """What the stand-in `nvidia-smi` tells of one GPU (`-L` and the default table).

    `mig_profiles` maps each GPU instance profile ID to its name and memory in MiB,
    so a container holding a MIG device is shown its profile.
    """

    minor: int
    uuid: str
    name: str
    memory_mib: int
    bus_id: str
    mig_profiles: Mapping[int, tuple[str, int]] = field(default_factory=dict)


def _smi_text(value: object) -> str:
    """A value safe inside the script's single-quoted, '|'-separated table."""
    return re.sub(r"['|\n\\]", " ", str(value))


def _smi_script(driver_version: str, cuda_version: str, gpus: Sequence[SmiGpu]) -> str:
    rows: list[str] = []
    for gpu in gpus:
        rows.append(
            "|".join(
                _smi_text(v)
                for v in ("gpu", gpu.minor, gpu.uuid, gpu.name, gpu.memory_mib, gpu.bus_id)
            )
        )
        for profile_id, (name, memory) in sorted(gpu.mig_profiles.items()):
            rows.append(
                "|".join(_smi_text(v) for v in ("mig", gpu.minor, profile_id, name, memory))
            )
    text = (FAKEBIN / "nvidia-smi").read_text()
    values = {
        "DRIVER_VERSION": _smi_text(driver_version),
        "CUDA_VERSION": _smi_text(cuda_version),
        "GPUS": "\n".join(rows),
    }
    for var, value in values.items():
        text = text.replace(f"\n{var}=''\n", f"\n{var}='{value}'\n", 1)
    return text


def install_driver_root(
    root: Path,
    driver_version: str,
    *,
    cuda_version: str = "",
    gpus: Sequence[SmiGpu] = (),
) -> None:
    """Make `root` a driver root for `driver_version`: the libraries (with soname
    links) and the stand-in tools, `nvidia-smi` knowing `gpus`. Rebuilt in a sibling
    folder and swapped in, so an agent that dies half-way leaves either the old root
    or the new one."""
    if not re.fullmatch(r"[0-9][0-9A-Za-z.\-]*", driver_version):
        raise ValueError(f"driver version {driver_version!r} is not a version number")
    root.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        lib = build / _LIBRARY_DIR
        lib.mkdir(parents=True)
        for name in _LIBRARIES:
            (lib / f"{name}.{driver_version}").write_text(f"stand-in for {name}.{driver_version}\n")
            (lib / f"{name}.1").symlink_to(f"{name}.{driver_version}")
        tools = build / "usr/bin"
        tools.mkdir(parents=True)
        for tool in TOOLS:
            if tool == "nvidia-smi":
                (tools / tool).write_text(_smi_script(driver_version, cuda_version, gpus))
            else:
                shutil.copyfile(FAKEBIN / tool, tools / tool)
            (tools / tool).chmod(0o755)
        build.chmod(0o755)
        old = root.with_name(f".{root.name}-old")
        shutil.rmtree(old, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            root.rename(old)
        build.rename(root)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
