"""Record what a node's NVML answers, in the emulator's profile format.

A recording of a real node, dropped into `tests/nvml/fixtures/`, lets every test and
benchmark replay that node through the emulator: `record()` reads NVML through the same
calls discovery uses and produces a `ProfileSpec` document, and the emulator loads it like
any product profile.

Recording is strictly read-only: no MIG mode change, no instance creation, no setting of
any kind. A GPU with MIG disabled answers as drivers do then: no MIG devices (a maximum
MIG device count of 0), and placements only from R570 on; the recording keeps what the
GPU offers (its profiles, and placements where listed) and replays it MIG-disabled.

Run on a GPU node: `python -m gpudra.driver.nvml.record node.json`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import pynvml
from gpudra.driver.nvml import NvmlLibrary, load_nvml
from gpudra.driver.nvml.codes import (
    DRIVER_NOT_LOADED_FIX,
    describe_nvml_error,
    nvml_start_problem,
)
from gpudra.driver.nvml.emulator import PROFILE_FORMAT, parse_profile
from gpudra.driver.nvml.handles import mig_device_handles
from gpudra.driver.nvml.topology import PciTopology, pci_topology

PROG: Final = "python -m gpudra.driver.nvml.record"

_UNAVAILABLE = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
    }
)


class _Reader:
    def __init__(self, nvml: NvmlLibrary) -> None:
        self.nvml = nvml

    def get(self, name: str, *args: Any) -> Any:
        """Call NVML; None where the call is not available for this device."""
        try:
            return getattr(self.nvml, name)(*args)
        except AttributeError:
            return None
        except pynvml.NVMLError as err:
            if getattr(err, "value", None) in _UNAVAILABLE:
                return None
            raise


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def _short_bus_id(bus_id: str) -> str:
    lowered = bus_id.lower()
    return lowered.removeprefix("0000") if lowered != "0000" else lowered


def _pcie_root(bus_id: str, topology: PciTopology | None) -> str | None:
    root = topology.pcie_root(_short_bus_id(bus_id)) if topology is not None else None
    return str(root) if root is not None else None


def _numa_nodes(
    read: _Reader, handle: Any, bus_id: str, topology: PciTopology | None
) -> dict[str, int | None]:
    """`numaNode`: NVML's answer, else the topology's (NVML before R550 has no
    nvmlDeviceGetNumaNodeId). `pciNumaNode`: the topology's where it differs.

    Discovery publishes the topology's (sysfs) node before NVML's: on Grace NVML names
    the GPU's own HBM node, sysfs the CPU's. The replay must publish what the node did,
    and a replayed NVML must answer what the real one did, so a recording keeps both.
    """
    answer = read.get("nvmlDeviceGetNumaNodeId", handle)
    sysfs = topology.numa_node(_short_bus_id(bus_id)) if topology is not None else None
    nvml_node = int(answer) if answer is not None else sysfs
    if sysfs is None or sysfs == nvml_node:
        return {"numaNode": nvml_node}
    return {"numaNode": nvml_node, "pciNumaNode": int(sysfs)}


def _gi_profiles(read: _Reader, handle: Any) -> list[dict[str, Any]]:
    profiles: list[dict[str, Any]] = []
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        info = read.get("nvmlDeviceGetGpuInstanceProfileInfo", handle, index)
        if info is None:
            continue
        count = ctypes.c_uint(0)
        placements: list[dict[str, int]] = []
        if (
            read.get(
                "nvmlDeviceGetGpuInstancePossiblePlacements",
                handle,
                info.id,
                None,
                ctypes.byref(count),
            )
            is not None
            and count.value
        ):
            array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
            read.get(
                "nvmlDeviceGetGpuInstancePossiblePlacements",
                handle,
                info.id,
                array,
                ctypes.byref(count),
            )
            placements = [
                {"start": int(p.start), "size": int(p.size)} for p in array[: count.value]
            ]
        profiles.append(
            {
                "index": index,
                "id": int(info.id),
                "name": str(getattr(info, "name", "") or f"MIG profile {int(info.id)}"),
                "sliceCount": int(info.sliceCount),
                "instanceCount": int(info.instanceCount),
                "multiprocessorCount": int(info.multiprocessorCount),
                "copyEngineCount": int(info.copyEngineCount),
                "decoderCount": int(info.decoderCount),
                "encoderCount": int(info.encoderCount),
                "jpegCount": int(info.jpegCount),
                "ofaCount": int(info.ofaCount),
                "memorySizeMB": int(info.memorySizeMB),
                "isP2pSupported": int(info.isP2pSupported),
                "placements": placements,
            }
        )
    return profiles


def _mig_instances(read: _Reader, handle: Any) -> list[dict[str, Any]]:
    instances: list[dict[str, Any]] = []
    for mig in mig_device_handles(read.nvml, handle):
        gi_id = int(read.nvml.nvmlDeviceGetGpuInstanceId(mig))
        ci_id = int(read.nvml.nvmlDeviceGetComputeInstanceId(mig))
        gi = read.nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        gi_info = read.nvml.nvmlGpuInstanceGetInfo(gi)
        ci = read.nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
        ci_info = read.nvml.nvmlComputeInstanceGetInfo(ci)
        instances.append(
            {
                "profileId": int(gi_info.profileId),
                "placementStart": int(gi_info.placement.start),
                "computeInstanceProfileId": int(ci_info.profileId),
                "gpuInstanceId": gi_id,
                "computeInstanceId": ci_id,
                "uuid": str(read.nvml.nvmlDeviceGetUUID(mig)),
            }
        )
    return instances


def _record_gpu(
    read: _Reader, index: int, topology: PciTopology | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(product facts, per-GPU facts) of GPU `index`."""
    nvml = read.nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = str(nvml.nvmlDeviceGetName(handle))
    major, minor_cc = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    memory_v2 = read.get("nvmlDeviceGetMemoryInfo", handle, pynvml.nvmlMemory_v2)
    if memory_v2 is not None:
        memory = {
            "memoryTotal": int(memory_v2.total),
            "memoryReserved": int(memory_v2.reserved),
            "memoryUsed": int(memory_v2.used),
        }
    else:
        memory_v1 = nvml.nvmlDeviceGetMemoryInfo(handle)
        memory = {"memoryTotal": int(memory_v1.total), "memoryUsed": int(memory_v1.used)}
    pci = nvml.nvmlDeviceGetPciInfo_v3(handle)
    # Engine counts are for MIG device handles: a whole GPU's answers NOT_SUPPORTED
    # (seen on an H200, R580), and the recording keeps 0 for them.
    attrs = read.get("nvmlDeviceGetAttributes", handle)
    arch = int(nvml.nvmlDeviceGetArchitecture(handle))
    product: dict[str, Any] = {
        "name": name,
        "brand": int(nvml.nvmlDeviceGetBrand(handle)),
        "architecture": arch,
        "cudaComputeCapability": [int(major), int(minor_cc)],
        **memory,
        "multiprocessorCount": int(attrs.multiprocessorCount) if attrs is not None else 0,
        "copyEngineCount": int(attrs.sharedCopyEngineCount) if attrs is not None else 0,
        "decoderCount": int(attrs.sharedDecoderCount) if attrs is not None else 0,
        "encoderCount": int(attrs.sharedEncoderCount) if attrs is not None else 0,
        "jpegCount": int(attrs.sharedJpegCount) if attrs is not None else 0,
        "ofaCount": int(attrs.sharedOfaCount) if attrs is not None else 0,
        "pciDeviceId": int(pci.pciDeviceId),
        "pciSubSystemId": int(pci.pciSubSystemId),
    }
    events = read.get("nvmlDeviceGetSupportedEventTypes", handle)
    if events is not None:
        product["supportedEventTypes"] = int(events)
    bus_id = str(pci.busId).upper()
    gpu: dict[str, Any] = {
        "uuid": str(nvml.nvmlDeviceGetUUID(handle)),
        "minor": int(nvml.nvmlDeviceGetMinorNumber(handle)),
        "busId": bus_id,
        "pcieRoot": _pcie_root(bus_id, topology),
        **_numa_nodes(read, handle, bus_id, topology),
    }
    compute_mode = read.get("nvmlDeviceGetComputeMode", handle)
    if compute_mode is not None:
        gpu["computeMode"] = int(compute_mode)
    addressing_mode = read.get("nvmlDeviceGetAddressingMode", handle)
    if addressing_mode is not None:
        gpu["addressingMode"] = int(addressing_mode)
    mig_mode = read.get("nvmlDeviceGetMigMode", handle)
    if mig_mode is not None:
        max_count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        profiles = _gi_profiles(read, handle)
        if profiles:
            product["mig"] = {
                # NVML says 0 while MIG is disabled; the product's real maximum is
                # the instance count of its smallest profile (7 on A100 and H100).
                "maxMigDeviceCount": max_count or max(p["instanceCount"] for p in profiles),
                # Not reported by NVML: Hopper and newer switch without a reset.
                "toggleWithoutReset": arch >= pynvml.NVML_DEVICE_ARCH_HOPPER
                and arch != pynvml.NVML_DEVICE_ARCH_UNKNOWN,
                "gpuInstanceProfiles": profiles,
            }
            enabled = int(mig_mode[0]) == pynvml.NVML_DEVICE_MIG_ENABLE
            gpu["migEnabled"] = enabled
            gpu["migPendingEnabled"] = int(mig_mode[1]) == pynvml.NVML_DEVICE_MIG_ENABLE
            if enabled:
                gpu["migInstances"] = _mig_instances(read, handle)
    return product, gpu


def record(
    nvml: NvmlLibrary, *, topology: PciTopology | None = None, description: str = "recorded node"
) -> dict[str, Any]:
    """Read every GPU through NVML and return a profile document (JSON-ready dict).

    `topology` supplies PCIe roots and the NUMA nodes sysfs gives (on a real node pass
    `SysfsTopology()`). NVML errors other than "not supported" propagate: a
    half-read recording would replay a machine that never existed.
    """
    read = _Reader(nvml)
    nvml.nvmlInit()
    try:
        driver = str(nvml.nvmlSystemGetDriverVersion())
        cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
        nvml_version = read.get("nvmlSystemGetNVMLVersion")
        products: dict[str, dict[str, Any]] = {}
        gpus: list[dict[str, Any]] = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            product, gpu = _record_gpu(read, index, topology)
            key = next((k for k, v in products.items() if v == product), None)
            if key is None:
                base = _slug(product["name"])
                key = base
                n = 2
                while key in products:
                    key = f"{base}-{n}"
                    n += 1
                products[key] = product
            gpus.append({"product": key, **gpu})
    finally:
        nvml.nvmlShutdown()
    document: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "description": description,
        "driverVersion": driver,
        "cudaDriverVersion": cuda,
        "products": products,
        "gpus": gpus,
    }
    if nvml_version is not None:
        document["nvmlVersion"] = str(nvml_version)
    spec = parse_profile(document, source="recording")
    dumped: dict[str, Any] = spec.model_dump(mode="json", exclude_none=True)
    return dumped


def dumps(document: object, *, width: int = 96) -> str:
    """JSON text with short lists and objects kept on one line, for readable diffs."""

    def render(value: object, depth: int) -> str:
        flat = json.dumps(value, separators=(", ", ": "))
        pad = "  " * depth
        if not isinstance(value, dict | list) or len(flat) + len(pad) <= width:
            return flat
        inner = "  " * (depth + 1)
        if isinstance(value, dict):
            items = [f"{inner}{json.dumps(k)}: {render(v, depth + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        items = [f"{inner}{render(v, depth + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"

    return render(document, 0) + "\n"


def write_recording(path: Path, document: object) -> None:
    """Write atomically: a reader never sees a half-written recording."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or Path())
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(dumps(document))
            out.flush()
            os.fsync(out.fileno())
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Record what this machine's NVML reports, read-only, as an emulator "
        "profile: replay it with `--nvml emulated:OUTPUT.json`, or drop it into "
        "tests/nvml/fixtures/.",
        allow_abbrev=False,
    )
    parser.add_argument("output", metavar="OUTPUT.json", type=Path, help="the file to write")
    return parser


def _init(nvml: NvmlLibrary) -> None:
    """nvmlInit, with a missing library or kernel driver named as such in one line."""
    try:
        nvml.nvmlInit()
    except pynvml.NVMLError as err:
        code = getattr(err, "value", None)
        problem = nvml_start_problem(code)
        if problem is None:
            cause, fix = "NVML failed to start", "check the NVIDIA driver with nvidia-smi"
        elif code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
            cause, fix = problem, DRIVER_NOT_LOADED_FIX
        else:
            cause = problem
            fix = "run it on a node with the NVIDIA driver, or add the driver's library folder "
            fix += "to LD_LIBRARY_PATH"
        msg = f"{PROG}: {cause} ({describe_nvml_error(err)}); nothing was recorded: {fix}"
        raise SystemExit(msg) from None


def main(argv: Sequence[str] | None = None, *, nvml: NvmlLibrary | None = None) -> int:
    """Record the real NVML of this machine (or `nvml`) into the file named on the
    command line. A machine without NVML ends with one line naming the cause."""
    args = _parser().parse_args(argv)
    output: Path = args.output
    if nvml is None:
        nvml = load_nvml("real")
    _init(nvml)
    try:
        document = record(nvml, topology=pci_topology(nvml), description="recorded node")
    finally:
        nvml.nvmlShutdown()
    try:
        write_recording(output, document)
    except OSError as err:
        raise SystemExit(f"{PROG}: cannot write {output}: {err.strerror or err}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
