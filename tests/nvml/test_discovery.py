"""Discovery turns NVML answers into upstream-compatible devices, all or nothing."""

from __future__ import annotations

import ctypes
import json
import random
from pathlib import Path
from typing import Any, cast

import pynvml
import pytest
from gpudra.driver import publish
from gpudra.driver.devices import (
    NUMA_NODE_ATTRIBUTE,
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    CounterSet,
    Device,
    DeviceType,
    DiscoveryError,
    Inventory,
    MigStrategy,
    Version,
    discover,
    mig_device_name,
    mig_profile_name,
    semver_from_cuda_version,
    semver_from_driver_version,
)
from gpudra.driver.nvml import NvmlLibrary, load_nvml
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile, parse_profile
from gpudra.driver.nvml.topology import SysfsTopology
from gpudra.driver.slices import DeviceLimitError, SliceLimits, plan_slices, validate_device

from e2e.sysfs import sysfs_numa_nodes
from tests.nvml.emulated import emulated, with_nvml_numa_nodes

H100_PROFILES = {  # GI profile ID -> (name, placements)
    19: ("1g.10gb", 7),
    20: ("1g.10gb+me", 7),
    15: ("1g.20gb", 4),
    14: ("2g.20gb", 3),
    9: ("3g.40gb", 2),
    5: ("4g.40gb", 1),
    0: ("7g.80gb", 1),
}


def h100_with_mig() -> NvmlEmulator:
    nvml = emulated("h100-80gb-hbm3-x8")
    nvml.nvmlInit()
    for i in range(nvml.nvmlDeviceGetCount()):
        nvml.nvmlDeviceSetMigMode(nvml.nvmlDeviceGetHandleByIndex(i), 1)
    nvml.nvmlShutdown()
    return nvml


def test_h100_node_is_eight_whole_gpus() -> None:
    inventory = discover(emulated("h100-80gb-hbm3-x8"))
    devices = inventory.devices()
    assert [d.name for d in devices] == [f"gpu-{i}" for i in range(8)]
    gpu = devices[4]
    assert gpu.type is DeviceType.GPU
    assert gpu.attributes == {
        "type": "gpu",
        "uuid": "GPU-d679a6a3-1afd-5e11-924e-9149ba92e6fe",
        "productName": "NVIDIA H100 80GB HBM3",
        "brand": "Nvidia",
        "architecture": "Hopper",
        "cudaComputeCapability": Version("9.0.0"),
        "driverVersion": Version("580.95.5"),
        "cudaDriverVersion": Version("13.0.0"),
        PCI_BUS_ID_ATTRIBUTE: "0000:9a:00.0",
        PCIE_ROOT_ATTRIBUTE: "pci0000:97",
        NUMA_NODE_ATTRIBUTE: 1,
    }
    assert gpu.capacity == {"memory": 81559 * 1024 * 1024}
    # MIG capable, MIG disabled: shown as the whole GPU only, in both strategies.
    assert all(g.mig_capable and not g.mig_enabled for g in inventory.gpus)
    assert inventory.devices(MigStrategy.DYNAMIC) == devices
    assert inventory.counter_sets(MigStrategy.DYNAMIC) == ()


def test_a100_static_mig_layout() -> None:
    inventory = discover(emulated("a100-40gb-mig-mixed"))
    names = [d.name for d in inventory.devices(MigStrategy.STATIC)]
    assert names == [
        "gpu-0-mig-1g5gb-19-2",
        "gpu-0-mig-1g5gb-19-3",
        "gpu-0-mig-2g10gb-14-0",
        "gpu-0-mig-3g20gb-9-4",
        "gpu-1-mig-1g5gb-me-20-6",
        "gpu-1-mig-4g20gb-5-0",
    ]
    mig = inventory.find("gpu-1-mig-1g5gb-me-20-6")
    assert mig is not None
    assert mig.type is DeviceType.MIG
    assert mig.uuid is not None and mig.uuid.startswith("MIG-")
    assert mig.attributes["uuid"] == mig.uuid
    assert mig.attributes["parentUUID"] == "GPU-1dc08328-d5a8-593c-b0bd-2aff893bbeb6"
    assert mig.attributes["profile"] == "1g.5gb+me"
    assert mig.attributes["productName"] == "NVIDIA A100-SXM4-40GB"
    assert mig.attributes["architecture"] == "Ampere"
    assert mig.attributes["driverVersion"] == Version("570.172.8")
    assert mig.attributes["cudaDriverVersion"] == Version("12.8.0")
    assert mig.attributes[PCI_BUS_ID_ATTRIBUTE] == "0000:0f:00.0"
    assert mig.capacity == {
        "multiprocessors": 14,
        "copyEngines": 1,
        "decoders": 1,
        "encoders": 0,
        "jpegEngines": 1,
        "ofaEngines": 1,
        "memory": 4864 * 1024 * 1024,
    }
    assert mig.placement is not None
    assert (mig.placement.profile_id, mig.placement.start, mig.placement.size) == (20, 6, 1)
    # MIG enabled: the whole GPU is never offered.
    assert "gpu-0" not in names and "gpu-1" not in names


def test_a100_dynamic_view_has_every_placement_with_counters() -> None:
    inventory = discover(emulated("a100-40gb-mig-mixed"))
    devices = inventory.devices(MigStrategy.DYNAMIC)
    assert len(devices) == 2 * 25
    assert all(d.uuid is None and "uuid" not in d.attributes for d in devices)
    sets = inventory.counter_sets(MigStrategy.DYNAMIC)
    assert [s.name for s in sets] == ["gpu-0-counter-set", "gpu-1-counter-set"]
    assert sets[0].counters["multiprocessors"] == 98
    assert sets[0].counters["memory"] == 40192 * 1024 * 1024
    assert [k for k in sets[0].counters if k.startswith("memory-slice-")] == [
        f"memory-slice-{i}" for i in range(8)
    ]
    assert inventory.gpus[0].mig_profiles == {
        19: "1g.5gb",
        20: "1g.5gb+me",
        15: "1g.10gb",
        14: "2g.10gb",
        9: "3g.20gb",
        5: "4g.20gb",
        0: "7g.40gb",
    }


def test_each_mig_profile_is_its_compute_slices_part_of_the_gpu() -> None:
    """Billing's share of a MIG device: compute slices over the 7g's, whatever the
    memory (1g.10gb and 1g.20gb alike) or the engines (+me); every view's name, the
    whole GPU all of it, and a name no view has none."""
    inventory = discover(h100_with_mig())
    gpu = inventory.gpus[0]
    by_profile = {name: gpu.compute_share(pid) for pid, name in gpu.mig_profiles.items()}
    sevenths = {name: share * 7 for name, share in by_profile.items() if share is not None}
    assert sevenths == pytest.approx(
        {
            "1g.10gb": 1,
            "1g.10gb+me": 1,
            "1g.20gb": 1,
            "2g.20gb": 2,
            "3g.40gb": 3,
            "4g.40gb": 4,
            "7g.80gb": 7,
        }
    )
    assert gpu.compute_share(99) is None  # a profile discovery did not read
    assert inventory.compute_share("gpu-0-mig-3g40gb-9-4") == pytest.approx(3 / 7)
    assert inventory.compute_share(gpu.device.name) == 1.0
    assert inventory.compute_share("gpu-9-mig-1g10gb-19-0") is None


def test_h100_partitionable_placements_when_mig_is_enabled() -> None:
    inventory = discover(h100_with_mig())
    per_gpu = sum(count for _, count in H100_PROFILES.values())
    devices = inventory.devices(MigStrategy.DYNAMIC)
    assert len(devices) == 8 * per_gpu == 200
    gpu0 = [d for d in devices if d.gpu_index == 0]
    expected = {
        f"gpu-0-mig-{name.replace('.', '').replace('+', '-')}-{pid}-{start}"
        for pid, (name, _) in H100_PROFILES.items()
        for start in {
            19: range(7),
            20: range(7),
            15: (0, 2, 4, 6),
            14: (0, 2, 4),
            9: (0, 4),
            5: (0,),
            0: (0,),
        }[pid]
    }
    assert {d.name for d in gpu0} == expected
    assert inventory.devices(MigStrategy.STATIC) == ()  # no MIG devices exist yet


def _consumption(device: Device) -> dict[str, int]:
    (consumption,) = device.consumes_counters
    return dict(consumption.counters)


def test_counters_are_consistent() -> None:
    inventory = discover(h100_with_mig())
    for gpu in inventory.gpus:
        counter_set = gpu.counter_set
        assert isinstance(counter_set, CounterSet)
        for device in gpu.partitions:
            (consumption,) = device.consumes_counters
            assert consumption.counter_set == counter_set.name == f"gpu-{gpu.minor}-counter-set"
            consumed = dict(consumption.counters)
            assert set(consumed) <= set(counter_set.counters)
            assert all(v <= counter_set.counters[k] for k, v in consumed.items())
            assert device.placement is not None
            start, size = device.placement.start, device.placement.size
            assert {k for k in consumed if k.startswith("memory-slice-")} == {
                f"memory-slice-{s}" for s in range(start, start + size)
            }
            # Capacities and counters describe the same amounts.
            assert consumed["memory"] == device.capacity["memory"]
            assert consumed["copy-engines"] == device.capacity["copyEngines"]
    full = inventory.find("gpu-0-mig-7g80gb-0-0")
    assert full is not None
    assert _consumption(full)["multiprocessors"] == 132


def _fits(used: dict[str, int], totals: dict[str, int], wanted: dict[str, int]) -> bool:
    return all(used.get(k, 0) + v <= totals[k] for k, v in wanted.items())


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("profile", [None, "h100-80gb-mig-r580", "a100-40gb-mig-r535"])
def test_counters_never_allow_what_nvml_refuses(profile: str | None, seed: int) -> None:
    """A scheduler honouring the counters only picks layouts NVML can create, and vice
    versa (the +me profile takes the GPU's one OFA engine)."""
    nvml = h100_with_mig() if profile is None else emulated(profile)
    inventory = discover(nvml)
    gpu = inventory.gpus[0 if profile is None else -1]
    assert not gpu.mig_devices
    assert gpu.counter_set is not None
    totals = dict(gpu.counter_set.counters)
    order = list(gpu.partitions)
    random.Random(seed).shuffle(order)
    used: dict[str, int] = {}
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
    created = 0
    for device in order:
        wanted = _consumption(device)
        assert device.placement is not None
        placement = pynvml.c_nvmlGpuInstancePlacement_t(
            device.placement.start, device.placement.size
        )
        allowed = _fits(used, totals, wanted)
        try:
            nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                handle, device.placement.profile_id, ctypes.byref(placement)
            )
            accepted = True
        except pynvml.NVMLError_InsufficientResources:
            accepted = False
        assert allowed == accepted, device.name
        if allowed:
            created += 1
            for k, v in wanted.items():
                used[k] = used.get(k, 0) + v
    assert created >= 1


def test_nvml_failing_mid_scan_raises_and_returns_nothing() -> None:
    """All or nothing; a lost GPU (GPU_IS_LOST) is the exception: test_degraded.py."""
    probe = emulated("a100-40gb-mig-mixed")
    discover(probe)
    total_calls = probe.call_count
    assert total_calls > 40
    seen_calls = set()
    for n in range(total_calls):  # the failure hits each counted call in turn
        nvml = emulated("a100-40gb-mig-mixed")
        nvml.fail_after(n, pynvml.NVML_ERROR_UNKNOWN)
        result: Inventory | None = None
        with pytest.raises(DiscoveryError) as err:
            result = discover(nvml)
        assert result is None
        assert err.value.call is not None and err.value.call.startswith("nvml")
        assert err.value.call in str(err.value)
        assert isinstance(err.value.nvml_error, pynvml.NVMLError_Unknown)
        if err.value.gpu_index is not None:
            assert f"GPU index {err.value.gpu_index}" in str(err.value)
        seen_calls.add(err.value.call)
    assert {"nvmlDeviceGetUUID", "nvmlDeviceGetMigDeviceHandleByIndex"} <= seen_calls


class _FailingGpu:
    """An NVML whose GPU `index` answers `code` to its handle lookup."""

    def __init__(self, nvml: NvmlEmulator, index: int, code: int) -> None:
        self._nvml, self._index, self._code = nvml, index, code

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nvml, name)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if index == self._index:
            raise pynvml.NVMLError(self._code)
        return self._nvml.nvmlDeviceGetHandleByIndex(index)


def test_failure_names_the_gpu_index() -> None:
    nvml = _FailingGpu(emulated("h100-80gb-hbm3-x8"), 5, pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(DiscoveryError) as err:
        discover(cast(NvmlLibrary, nvml))
    assert err.value.gpu_index == 5
    assert err.value.call == "nvmlDeviceGetHandleByIndex"
    assert "GPU index 5" in str(err.value)


def _profile_file(tmp_path: Path, name: str, mutate: Any) -> Path:
    data = load_builtin_profile(name).model_dump(mode="json")
    mutate(data)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def test_attribute_over_the_api_limit_names_device_and_field(tmp_path: Path) -> None:
    def long_name(data: dict[str, Any]) -> None:
        data["products"]["l4"]["name"] = "NVIDIA L4 " + "x" * 60

    nvml = load_nvml(f"emulated:{_profile_file(tmp_path, 'l4', long_name)}")
    content = publish.pool_content(discover(nvml), MigStrategy.STATIC)
    with pytest.raises(DeviceLimitError) as err:
        plan_slices(content, SliceLimits())
    assert err.value.device == "gpu-0"
    assert err.value.field == "attribute productName"
    assert "64" in str(err.value)


def test_version_normalisation() -> None:
    assert semver_from_driver_version("580.95.05") == "580.95.5"
    assert semver_from_driver_version("535.261.03") == "535.261.3"
    assert semver_from_driver_version("470.82") == "470.82.0"
    with pytest.raises(DiscoveryError, match="driver version"):
        semver_from_driver_version("580.95.05-beta")
    assert semver_from_cuda_version(13000) == "13.0.0"
    assert semver_from_cuda_version(12080) == "12.8.0"
    assert semver_from_cuda_version(12020) == "12.2.0"


def test_profile_names_follow_nvidia_smi() -> None:
    h100 = 81559 * 1024 * 1024
    assert mig_profile_name(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 1, 1, 9984, h100) == "1g.10gb"
    assert (
        mig_profile_name(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 1, 1, 9984, h100)
        == "1g.10gb+me"
    )
    assert (
        mig_profile_name(pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 7, 7, 81152, h100) == "7g.80gb"
    )
    assert mig_profile_name(pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 3, 1, 40448, h100) == (
        "1c.3g.40gb"
    )


@pytest.mark.parametrize(
    ("index", "name", "device"),
    [
        (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, "1g.24gb-me", "1g24gb-me"),
        (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, "1g.24gb+me.all", "1g24gb-meall"),
        (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX, "1g.24gb+gfx", "1g24gb-gfx"),
    ],
)
def test_variant_profile_names_follow_nvidia_smi(index: int, name: str, device: str) -> None:
    """The variant suffixes, for a card that offers them (mig-parted's defaults list them
    for the RTX PRO 6000 Blackwell, 96 GB in four slices; no emulated card has them)."""
    total = 96 * 1024 * 1024 * 1024
    assert mig_profile_name(index, 1, 1, 24576, total) == name
    assert mig_device_name(0, name, 99, 0) == f"gpu-0-mig-{device}-99-0"


def test_pre_ampere_and_ada_have_no_mig() -> None:
    for name, product, arch, cc in (
        ("t4", "Tesla T4", "Turing", "7.5.0"),
        ("l4", "NVIDIA L4", "Ada Lovelace", "8.9.0"),
    ):
        inventory = discover(emulated(name))
        (gpu,) = inventory.gpus
        assert not gpu.mig_capable
        (device,) = inventory.devices(MigStrategy.DYNAMIC)
        assert device.name == "gpu-0"
        assert device.attributes["productName"] == product
        assert device.attributes["architecture"] == arch
        assert device.attributes["cudaComputeCapability"] == Version(cc)
        assert NUMA_NODE_ATTRIBUTE not in device.attributes  # NVML and the profile have none


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (pynvml.NVML_DEVICE_ARCH_BLACKWELL, "Blackwell"),
        (pynvml.NVML_DEVICE_ARCH_RUBIN, "Rubin"),
        (pynvml.NVML_DEVICE_ARCH_DLA, "Unknown"),
    ],
)
def test_architecture_is_spelt_as_upstreams_go_nvlib(code: int, name: str) -> None:
    """go-nvlib's `GetArchitectureAsString` gives upstream's `architecture` attribute,
    Rubin included since the release vendored after v0.4.1: a selector written for it
    matches here. An architecture it has no name for is "Unknown" here, where upstream
    fails the GPU's discovery."""
    document = load_builtin_profile("l4").model_dump(mode="json")
    for product in document["products"].values():
        product["architecture"] = code
    inventory = discover(NvmlEmulator(parse_profile(document), source=f"l4 as {name}"))
    assert inventory.gpus[0].device.attributes["architecture"] == name


def test_discovery_keeps_nvml_initialised_for_its_caller() -> None:
    nvml = emulated("l4")
    nvml.nvmlInit()
    discover(nvml)
    assert nvml.nvmlDeviceGetCount() == 1  # still initialised


def test_api_shapes_keep_driver_keys_unqualified() -> None:
    """The published form: keys of the driver's own domain go out bare, as upstream
    publishes them; the standard `resource.kubernetes.io/` ones carry their domain."""
    inventory = discover(emulated("a100-40gb-mig-mixed"))
    device = inventory.devices(MigStrategy.DYNAMIC)[0]  # 1g.5gb, placements from the top
    api = publish.device(device)
    assert api["name"] == device.name
    assert api["attributes"]["type"] == {"string": "mig"}
    assert api["attributes"]["driverVersion"] == {"version": "570.172.8"}
    assert api["attributes"][NUMA_NODE_ATTRIBUTE] == {"int": 0}
    assert api["capacity"]["memory"] == {"value": str(4864 * 1024 * 1024)}
    assert api["consumesCounters"][0]["counterSet"] == "gpu-0-counter-set"
    assert api["consumesCounters"][0]["counters"]["memory-slice-6"] == {"value": "1"}
    validate_device(api, SliceLimits())
    counter_set = publish.counter_set(inventory.counter_sets(MigStrategy.DYNAMIC)[0])
    assert counter_set["counters"]["multiprocessors"] == {"value": "98"}


def test_sysfs_topology(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    device = root / "devices" / "pci0000:15" / "0000:15:01.0" / "0000:18:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    (links / "0000:18:00.0").symlink_to(device)
    topology = SysfsTopology(root)
    assert topology.pcie_root("0000:18:00.0") == "pci0000:15"
    assert topology.numa_node("0000:18:00.0") == 1
    assert topology.pcie_root("0000:99:00.0") is None
    (device / "numa_node").write_text("-1\n")
    assert topology.numa_node("0000:18:00.0") is None


@pytest.mark.parametrize("branch", [535, 550])
def test_numa_node_comes_from_sysfs_and_from_nvml_only_where_sysfs_has_none(
    tmp_path: Path, branch: int
) -> None:
    """The standard attribute is the PCI device's node in sysfs (KEP-6072), on every
    branch: here GPU 0 on node 1, where NVML from R550 on says 0. GPU 1 is not in
    sysfs: R535's NVML has no nvmlDeviceGetNumaNodeId (first in NVML 12.4, R550), so
    it has no node there; from R550 on NVML's answer (0, from the profile) is taken."""
    topology = sysfs_numa_nodes(tmp_path / "sys", {"0000:07:00.0": 1})
    nvml = emulated(f"a100-40gb-mig-r{branch}")
    gpu0, gpu1 = discover(nvml, topology=topology).gpus
    assert gpu0.device.attributes[NUMA_NODE_ATTRIBUTE] == 1
    assert gpu0.device.attributes[PCIE_ROOT_ATTRIBUTE] == "pci0000:00"
    assert all(d.attributes[NUMA_NODE_ATTRIBUTE] == 1 for d in gpu0.partitions)
    if branch < 550:
        assert NUMA_NODE_ATTRIBUTE not in gpu1.device.attributes
    else:
        assert gpu1.device.attributes[NUMA_NODE_ATTRIBUTE] == 0


def test_on_grace_the_numa_node_is_the_cpus_not_the_gpus_own(tmp_path: Path) -> None:
    """NVML's nvmlDeviceGetNumaNodeId "only applies to platforms where the GPUs are NUMA
    nodes" (nvml.h): on GH200/GB200 it answers the GPU's HBM node (4 and 5 here), while
    sysfs gives the node of the CPU and NICs the GPU is near, the one the attribute
    means (0). GPU 1, absent from sysfs, still gets NVML's."""
    nvml = with_nvml_numa_nodes("h100-80gb-mig-r580", [4, 5])
    topology = sysfs_numa_nodes(tmp_path / "sys", {"0000:18:00.0": 0}, pcie_root="pci0000:15")
    gpu0, gpu1 = discover(nvml, topology=topology).gpus
    assert gpu0.device.attributes[NUMA_NODE_ATTRIBUTE] == 0
    assert gpu0.partitions
    assert all(d.attributes[NUMA_NODE_ATTRIBUTE] == 0 for d in gpu0.partitions)
    assert gpu1.device.attributes[NUMA_NODE_ATTRIBUTE] == 5
