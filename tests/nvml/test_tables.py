"""The emulator's A100 40GB and H100 80GB numbers against what real cards report.

The tables below are written as `nvidia-smi mig -lgip` and `nvidia-smi -q` print them on
real cards (NVIDIA's MIG user guide), not copied from the profiles: asking the emulator
through NVML and comparing catches drift in any profile of these products, on every
branch. Neither card offers anything else: no -me / +me.all variant on any branch (a real
H200, the same GH100 chip, answers NOT_SUPPORTED for them on R580: tests/nvml/answers).
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
import pytest
from gpudra.driver.nvml import builtin_profile_names, load_nvml
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile

# name: (ID, instances, memory GiB as printed, SM, DEC, ENC, CE, JPEG, OFA, placements)
Row = tuple[int, int, str, int, int, int, int, int, int, str]
A100_40GB: dict[str, Row] = {
    "MIG 1g.5gb": (19, 7, "4.75", 14, 0, 0, 1, 0, 0, "{0,1,2,3,4,5,6}:1"),
    "MIG 1g.5gb+me": (20, 1, "4.75", 14, 1, 0, 1, 1, 1, "{0,1,2,3,4,5,6}:1"),
    "MIG 1g.10gb": (15, 4, "9.62", 14, 1, 0, 1, 0, 0, "{0,2,4,6}:2"),
    "MIG 2g.10gb": (14, 3, "9.62", 28, 1, 0, 2, 0, 0, "{0,2,4}:2"),
    "MIG 3g.20gb": (9, 2, "19.50", 42, 2, 0, 3, 0, 0, "{0,4}:4"),
    "MIG 4g.20gb": (5, 1, "19.50", 56, 2, 0, 4, 0, 0, "{0}:4"),
    "MIG 7g.40gb": (0, 1, "39.25", 98, 5, 0, 7, 1, 1, "{0}:8"),
}
H100_80GB: dict[str, Row] = {
    "MIG 1g.10gb": (19, 7, "9.75", 16, 1, 0, 1, 1, 0, "{0,1,2,3,4,5,6}:1"),
    "MIG 1g.10gb+me": (20, 1, "9.75", 16, 1, 0, 1, 1, 1, "{0,1,2,3,4,5,6}:1"),
    "MIG 1g.20gb": (15, 4, "19.62", 26, 1, 0, 1, 1, 0, "{0,2,4,6}:2"),
    "MIG 2g.20gb": (14, 3, "19.62", 32, 2, 0, 2, 2, 0, "{0,2,4}:2"),
    "MIG 3g.40gb": (9, 2, "39.50", 60, 3, 0, 3, 3, 0, "{0,4}:4"),
    "MIG 4g.40gb": (5, 1, "39.50", 64, 4, 0, 4, 4, 0, "{0}:4"),
    "MIG 7g.80gb": (0, 1, "79.25", 132, 7, 0, 8, 7, 1, "{0}:8"),
}
# nvidia-smi -q: product name, total memory (MiB), SMs, PCI device ID.
WHOLE = {
    "NVIDIA A100-SXM4-40GB": (40960, 108, 0x20B010DE),
    "NVIDIA H100 80GB HBM3": (81559, 132, 0x233010DE),
}


def mig_profiles_of(product_name: str) -> list[str]:
    """Every built-in profile with a MIG-enabled GPU of this product."""
    found = []
    for name in builtin_profile_names():
        spec = load_builtin_profile(name)
        for gpu in spec.gpus:
            product = spec.products[gpu.product]
            if product.name == product_name and gpu.migEnabled:
                found.append(name)
                break
    return found


def lgip(nvml: NvmlEmulator, index: int) -> dict[str, Row]:
    """What `nvidia-smi mig -lgip` prints for GPU `index`, asked through NVML."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    rows: dict[str, Row] = {}
    for profile in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info: Any = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, None, ctypes.byref(count))
        found = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, found, ctypes.byref(count))
        sizes = {p.size for p in found}
        assert len(sizes) == 1
        starts = ",".join(str(p.start) for p in found)
        rows[str(info.name)] = (
            int(info.id),
            int(info.instanceCount),
            f"{int(info.memorySizeMB) / 1024:.2f}",
            int(info.multiprocessorCount),
            int(info.decoderCount),
            int(info.encoderCount),
            int(info.copyEngineCount),
            int(info.jpegCount),
            int(info.ofaCount),
            f"{{{starts}}}:{sizes.pop()}",
        )
    return rows


TABLES = [("NVIDIA A100-SXM4-40GB", A100_40GB), ("NVIDIA H100 80GB HBM3", H100_80GB)]


@pytest.mark.parametrize(("product", "table"), TABLES)
def test_mig_tables_match_real_cards(product: str, table: dict[str, Row]) -> None:
    names = mig_profiles_of(product)
    assert len(names) >= 4  # at least one profile per emulated branch
    for name in names:
        nvml = load_nvml(f"emulated:{name}")
        assert isinstance(nvml, NvmlEmulator)
        nvml.nvmlInit()
        for index in range(nvml.nvmlDeviceGetCount()):
            if str(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index))) != product:
                continue
            assert lgip(nvml, index) == table, name
        nvml.nvmlShutdown()


@pytest.mark.parametrize("product", sorted(WHOLE))
def test_whole_gpu_numbers_match_real_cards(product: str) -> None:
    memory_mib, sms, pci_device = WHOLE[product]
    for name in mig_profiles_of(product):
        nvml = load_nvml(f"emulated:{name}")
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        assert str(nvml.nvmlDeviceGetName(handle)) == product
        # NVML gives no engine counts for a whole GPU's handle (tests/nvml/answers):
        # the product table keeps the card's.
        spec = load_builtin_profile(name)
        table = next(p for p in spec.products.values() if p.name == product)
        assert table.multiprocessorCount == sms
        assert int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // 2**20 == memory_mib
        assert int(nvml.nvmlDeviceGetPciInfo_v3(handle).pciDeviceId) == pci_device
        nvml.nvmlShutdown()
