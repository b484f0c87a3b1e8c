"""The emulated GPUs' stand-in for the NVIDIA driver on the node: device numbers and a
driver root whose tools record their calls."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from gpudra.driver.cdi import find_driver_files
from gpudra.driver.nvml.standin import (
    CAPS_MAJOR,
    FAKEBIN,
    NVIDIA_MAJOR,
    TOOLS_LOG_ENV,
    UVM_MAJOR,
    SmiGpu,
    device_numbers,
    install_driver_root,
)
from gpudra.driver.processes import ProcessIdentity


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


def _smi(root: Path, *args: str, env: dict[str, str]) -> str:
    return subprocess.run(
        [root / "usr/bin/nvidia-smi", *args],
        env={"PATH": os.environ["PATH"], **env},
        check=True,
        capture_output=True,
        text=True,
    ).stdout


GPU0 = SmiGpu(0, "GPU-aaaa", "NVIDIA A100-SXM4-40GB", 40960, "0000:07:00.0", {19: ("1g.5gb", 4864)})
GPU1 = SmiGpu(
    1, "GPU-bbbb", "NVIDIA A100-SXM4-40GB", 40960, "0000:0F:00.0", {20: ("1g.5gb+me", 4864)}
)


def test_nvidia_smi_lists_exactly_the_devices_the_container_holds(tmp_path: Path) -> None:
    root = tmp_path / "emulated-driver"
    install_driver_root(root, "580.95.05", cuda_version="13.0", gpus=[GPU0, GPU1])
    held = {
        # A memory slice of GPU 1 twice (two shares), and a MIG device of GPU 1.
        "GPUDRA_DEVICE_GPU_1_MIG_1G5GB_ME_20_6_UUID": "MIG-cccc",
        "GPUDRA_DEVICE_GPU_0_UUID": "GPU-aaaa",
        "GPUDRA_DEVICE_GPU_0_8A2F_UUID": "GPU-aaaa",
        "OTHER": "x",
    }
    assert _smi(root, "-L", env=held).splitlines() == [
        "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-aaaa)",
        "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-bbbb)",
        "  MIG 1g.5gb+me    Device  0: (UUID: MIG-cccc)",
    ]
    table = _smi(root, env={"GPUDRA_DEVICE_GPU_1_MIG_1G5GB_ME_20_6_UUID": "MIG-cccc"})
    assert "Driver Version: 580.95.05" in table and "CUDA Version: 13.0" in table
    assert "MIG 1g.5gb+me" in table and "4864MiB" in table
    assert "NVIDIA A100" not in table  # the GPU this container does not hold


def test_nvidia_smi_outside_a_container_lists_every_gpu(tmp_path: Path) -> None:
    root = tmp_path / "emulated-driver"
    install_driver_root(root, "580.95.05", gpus=[GPU0, GPU1])
    assert _smi(root, "-L", env={}).splitlines() == [
        "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-aaaa)",
        "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-bbbb)",
    ]


def test_the_mps_daemon_ended_by_sigterm_takes_its_shm_mark_along(tmp_path: Path) -> None:
    """The stand-in daemon marks the /dev/shm it sees, which is the host's where the
    agent may not mount a claim's own. The agent ends a daemon that does not take
    `quit` by SIGTERM; the mark must go with it or the host's /dev/shm fills with them.
    What the real daemon leaves in its pipe folder stays, for the agent to remove."""
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    subprocess.run([FAKEBIN / "nvidia-cuda-mps-control", "-d"], env=env, check=True)
    pid_file = pipe / "nvidia-cuda-mps-control.pid"
    deadline = time.monotonic() + 10
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    daemon = ProcessIdentity.of(int(pid_file.read_text()))
    assert daemon is not None
    mark = Path(f"/dev/shm/gpudra-standin-mps.{daemon.pid}")
    assert mark.exists()

    assert daemon.signal(signal.SIGTERM)
    assert daemon.wait_gone(10.0)
    assert not mark.exists()
    assert (pipe / "control").exists() and pid_file.exists()
