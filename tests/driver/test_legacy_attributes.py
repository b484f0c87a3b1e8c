"""`--legacy-attributes`: upstream's `index`, `minor` and `parentIndex` of before v25.8.0
and `pcieBusID` of before v25.12.0, published through the one serializer, with NVML's
values, and only when asked."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pynvml
import pytest
from gpudra.cli.main import build_parser
from gpudra.cli.node import _agent_config
from gpudra.driver import publish
from gpudra.driver.devices import LEGACY_ATTRIBUTES, MigStrategy, discover
from gpudra.driver.nvml import load_nvml
from gpudra.driver.nvml.emulator import load_builtin_profile
from gpudra.driver.slices import SliceLimits, plan_slices


def _swapped_minors(tmp_path: Path) -> Path:
    """Two H100s whose minor numbers run against their NVML order, as on a node where
    the driver numbered them before the PCI order NVML reports."""
    data: dict[str, Any] = load_builtin_profile("h100-80gb-hbm3-x8").model_dump(mode="json")
    first, second = data["gpus"][0], data["gpus"][1]
    first["minor"], second["minor"] = second["minor"], first["minor"]
    path = tmp_path / "swapped.json"
    path.write_text(json.dumps(data))
    return path


def _published(profile: str, strategy: MigStrategy, *, legacy: bool) -> dict[str, Any]:
    inventory = discover(load_nvml(f"emulated:{profile}"))
    content = publish.pool_content(inventory, strategy, legacy=legacy)
    plan_slices(content, SliceLimits())  # what the API takes, with or without them
    return {d["name"]: d["attributes"] for d in content.devices}


def test_off_by_default_no_device_carries_them() -> None:
    for profile, strategy in (
        ("h100-80gb-hbm3-x8", MigStrategy.DYNAMIC),
        ("a100-40gb-mig-mixed", MigStrategy.STATIC),
        ("a100-40gb-mig-mixed", MigStrategy.DYNAMIC),
    ):
        for name, attrs in _published(profile, strategy, legacy=False).items():
            assert not set(LEGACY_ATTRIBUTES) & set(attrs), (profile, strategy, name)


def test_a_gpu_gets_its_nvml_index_and_minor_as_ints(tmp_path: Path) -> None:
    attrs = _published(str(_swapped_minors(tmp_path)), MigStrategy.DYNAMIC, legacy=True)
    # The device name follows the minor (upstream's `gpu-<minor>`), `index` NVML's order.
    assert (attrs["gpu-1"]["index"], attrs["gpu-1"]["minor"]) == ({"int": 0}, {"int": 1})
    assert (attrs["gpu-0"]["index"], attrs["gpu-0"]["minor"]) == ({"int": 1}, {"int": 0})
    assert (attrs["gpu-7"]["index"], attrs["gpu-7"]["minor"]) == ({"int": 7}, {"int": 7})
    assert "parentIndex" not in attrs["gpu-0"]


def test_a_static_mig_device_gets_its_nvml_mig_index_and_its_parents_index() -> None:
    nvml = load_nvml("emulated:a100-40gb-mig-mixed")
    attrs = _published("a100-40gb-mig-mixed", MigStrategy.STATIC, legacy=True)
    by_uuid = {a["uuid"]["string"]: a for a in attrs.values()}
    nvml.nvmlInit()
    expected = {}
    try:
        for parent in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(parent)
            for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
                except pynvml.NVMLError:  # no MIG device at this index
                    continue
                expected[str(nvml.nvmlDeviceGetUUID(mig))] = (j, parent)
    finally:
        nvml.nvmlShutdown()
    assert len(expected) == 6 and expected.keys() == by_uuid.keys()
    for uuid, (j, parent) in expected.items():
        got = by_uuid[uuid]
        assert (got["index"], got["parentIndex"]) == ({"int": j}, {"int": parent}), uuid
        assert "minor" not in got


def test_a_dynamic_mig_placement_has_only_its_parents_index_and_bus_id() -> None:
    attrs = _published("a100-40gb-mig-mixed", MigStrategy.DYNAMIC, legacy=True)
    migs = {n: a for n, a in attrs.items() if a["type"] == {"string": "mig"}}
    assert migs
    for name, got in migs.items():
        assert got["parentIndex"] == {"int": int(name.split("-")[1])}, name
        assert "pcieBusID" in got
        assert "index" not in got and "minor" not in got


def _nvml_bus_ids(profile: str) -> dict[str, str]:
    """GPU UUID -> the bus ID upstream published as `pcieBusID`: NVML's, as go-nvlib's
    GetPCIBusID spells it (lower case, the 8-digit domain cut to 4)."""
    nvml = load_nvml(f"emulated:{profile}")
    nvml.nvmlInit()
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        return {
            str(nvml.nvmlDeviceGetUUID(h)): str(nvml.nvmlDeviceGetPciInfo_v3(h).busId)
            .lower()
            .removeprefix("0000")
            for h in handles
        }
    finally:
        nvml.nvmlShutdown()


@pytest.mark.parametrize(
    ("profile", "strategy"),
    [
        ("h100-80gb-hbm3-x8", MigStrategy.DYNAMIC),
        ("a100-40gb-mig-mixed", MigStrategy.STATIC),
        ("a100-40gb-mig-mixed", MigStrategy.DYNAMIC),
    ],
)
def test_every_gpu_and_mig_device_gets_upstreams_pcie_bus_id(
    profile: str, strategy: MigStrategy
) -> None:
    """v25.3 and v25.8 published the GPU's bus ID as the string `pcieBusID` on the GPU
    and on each of its MIG devices; a selector on it fails in CEL where it is missing.
    Its value is that of `resource.kubernetes.io/pciBusID`, the key v25.12 moved it
    to."""
    bus_ids = _nvml_bus_ids(profile)
    attrs = _published(profile, strategy, legacy=True)
    assert {a["type"]["string"] for a in attrs.values()} == (
        {"gpu"} if profile.startswith("h100") else {"mig"}
    )
    for name, got in attrs.items():
        parent = (got["parentUUID"] if "parentUUID" in got else got["uuid"])["string"]
        assert got["pcieBusID"] == {"string": bus_ids[parent]}, name
        assert got["pcieBusID"] == got["resource.kubernetes.io/pciBusID"], name
    assert all(
        re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", b) for b in bus_ids.values()
    )


def test_the_flag_reaches_the_agent() -> None:
    base = ["node", "--node-name=n1"]
    assert not _agent_config(build_parser().parse_args(base)).legacy_attributes
    on = _agent_config(build_parser().parse_args([*base, "--legacy-attributes"]))
    assert on.legacy_attributes
