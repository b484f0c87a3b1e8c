"""The emulated GPUs' stand-in for the NVIDIA driver on the node: device numbers and a
driver root whose tools record their calls."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from gpudra.driver.cdi import find_driver_files
from gpudra.driver.nvml.standin import (
    CAPS_MAJOR,
    NVIDIA_MAJOR,
    TOOLS_LOG_ENV,
    UVM_MAJOR,
    device_numbers,
    install_driver_root,
)


def test_device_numbers_follow_the_kernel_driver_layout() -> None:
    assert device_numbers("/dev/nvidia3") == (NVIDIA_MAJOR, 3)
    assert device_numbers("/dev/nvidiactl") == (NVIDIA_MAJOR, 255)
    assert device_numbers("/dev/nvidia-uvm-tools") == (UVM_MAJOR, 1)
    assert device_numbers("/dev/nvidia-caps/nvidia-cap138") == (CAPS_MAJOR, 138)
    assert device_numbers("/dev/nvidia-modeset") is None
    assert device_numbers("/dev/nvidia3x") is None


def test_driver_root_has_what_the_plugin_mounts_and_working_tools(tmp_path: Path) -> None:
    root = tmp_path / "state" / "emulated-driver"
    install_driver_root(root, "580.95.05")
    files = find_driver_files(root)
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05" in files
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.1" in files
    assert "/usr/bin/nvidia-smi" in files
    log = tmp_path / "tools.log"
    env = {**os.environ, TOOLS_LOG_ENV: str(log)}
    smi = root / "usr/bin/nvidia-smi"
    subprocess.run(
        [smi, "compute-policy", "-i", "GPU-1", "--set-timeslice", "3"], env=env, check=True
    )
    assert log.read_text() == "nvidia-smi compute-policy -i GPU-1 --set-timeslice 3\n"


def test_reinstall_replaces_the_root_and_leaves_no_temporaries(tmp_path: Path) -> None:
    root = tmp_path / "emulated-driver"
    install_driver_root(root, "550.1")
    (root / "leftover").write_text("from an older install")
    install_driver_root(root, "580.95.05")
    assert not (root / "leftover").exists()
    assert not (root / "usr/lib/x86_64-linux-gnu/libcuda.so.550.1").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["emulated-driver"]


def test_bad_version_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "emulated-driver"
    install_driver_root(root, "580.95.05")
    with pytest.raises(ValueError, match="not a version number"):
        install_driver_root(root, "../../etc")
    assert (root / "usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["emulated-driver"]
