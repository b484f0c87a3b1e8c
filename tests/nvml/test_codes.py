"""NVML codes and topology for any backend: what discovery, health and MIG code use."""

from __future__ import annotations

import pynvml
from gpudra.driver.nvml import load_nvml
from gpudra.driver.nvml.codes import constant_names, describe_nvml_error
from gpudra.driver.nvml.topology import SysfsTopology, pci_topology


def test_errors_name_the_code_pynvml_cannot_spell() -> None:
    err = pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    assert describe_nvml_error(err) == (
        "NVML Error with code 23 (NVML_ERROR_INSUFFICIENT_RESOURCES)"
    )
    lost = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    assert describe_nvml_error(lost) == "GPU is lost (NVML_ERROR_GPU_IS_LOST)"
    assert describe_nvml_error(pynvml.NVMLError(12345)) == "NVML Error with code 12345"
    assert describe_nvml_error(ValueError("not NVML")) == "not NVML"


def test_constant_names_skip_counts() -> None:
    names = constant_names("NVML_BRAND_")
    assert names[pynvml.NVML_BRAND_TESLA] == "NVML_BRAND_TESLA"
    assert "NVML_BRAND_COUNT" not in names.values()


def test_a_backend_reports_its_own_topology_and_libnvml_gets_sysfs() -> None:
    # The emulated machine has no sysfs: its profile places GPU 0 under pci0000:15.
    topology = pci_topology(load_nvml("emulated:h100-80gb-hbm3-x8"))
    assert topology.pcie_root("0000:18:00.0") == "pci0000:15"
    assert topology.numa_node("0000:18:00.0") == 0
    # The pynvml module (the real backend) reports nothing of its own.
    assert pci_topology(pynvml) == SysfsTopology()
