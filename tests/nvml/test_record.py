"""Recordings: read-only capture of NVML, replayed through the emulator.

Any `*.json` in `fixtures/` is a recording (see gpudra.driver.nvml.record); each is
replayed here, so a recording of a real node dropped there is checked automatically.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest
from gpudra.driver.devices import NUMA_NODE_ATTRIBUTE, Inventory, MigStrategy, discover
from gpudra.driver.nvml import builtin_profile_names, load_nvml
from gpudra.driver.nvml.branches import EMULATED_BRANCHES, PLACEMENTS_WITHOUT_MIG_SINCE
from gpudra.driver.nvml.emulator import NvmlEmulator, parse_profile
from gpudra.driver.nvml.record import dumps, main, record, write_recording

from e2e.sysfs import sysfs_numa_nodes
from tests.nvml.emulated import emulated, with_gpu_answers, with_nvml_numa_nodes

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("*.json"))

# NVML entry points that change the machine; a recording must never call them.
MUTATING = (
    "Set",
    "Create",
    "Destroy",
    "Register",
    "Reset",
    "Clear",
)


class Spy:
    """Passes calls through to the emulator and notes their names."""

    def __init__(self, inner: NvmlEmulator) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if not name.startswith("nvml"):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return target(*args, **kwargs)

        return call


def summary(inventory: Inventory) -> list[tuple[str, object, object]]:
    """What a publisher would see, for comparing two inventories."""
    rows: list[tuple[str, object, object]] = []
    for strategy in MigStrategy:
        rows.extend(
            (d.name, dict(d.attributes), dict(d.capacity)) for d in inventory.devices(strategy)
        )
    return rows


@pytest.mark.parametrize("name", builtin_profile_names())
def test_recording_replays_the_same_node(name: str) -> None:
    original = emulated(name)
    spy = Spy(original)
    document = record(spy, topology=original.pci_topology)
    assert spy.calls, "record() must go through NVML"
    assert not [c for c in spy.calls if any(word in c for word in MUTATING)]
    replay = NvmlEmulator(parse_profile(document), source="recording")
    assert summary(discover(replay)) == summary(discover(emulated(name)))
    # Recording the replay gives the same document: nothing is lost or invented.
    assert record(replay, topology=replay.pci_topology) == document


def test_a_grace_recording_keeps_nvmls_numa_node_and_replays_sysfss(tmp_path: Path) -> None:
    """On Grace NVML's NUMA node (the GPU's HBM, 4) is not the one published (sysfs's,
    0): the recording keeps NVML's answer and sysfs's apart, and the replay publishes
    what the node did while its NVML answers what the real one did."""
    original = with_nvml_numa_nodes("h100-80gb-mig-r580", [4, 5])
    topology = sysfs_numa_nodes(tmp_path / "sys", {"0000:18:00.0": 0}, pcie_root="pci0000:15")
    document = record(original, topology=topology)
    assert [(g["numaNode"], g.get("pciNumaNode")) for g in document["gpus"]] == [(4, 0), (5, None)]
    replay = NvmlEmulator(parse_profile(document), source="recording")
    replayed = discover(replay)
    assert [g.device.attributes[NUMA_NODE_ATTRIBUTE] for g in replayed.gpus] == [0, 5]
    assert summary(replayed) == summary(discover(original, topology=topology))
    replay.nvmlInit()
    assert replay.nvmlDeviceGetNumaNodeId(replay.nvmlDeviceGetHandleByIndex(0)) == 4
    replay.nvmlShutdown()
    assert record(replay, topology=replay.pci_topology) == document


def test_a_recording_keeps_each_gpus_addressing_mode() -> None:
    """What a lent GPU answers is kept, so its replay publishes its `addressingMode`."""
    modes = [pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS, pynvml.NVML_DEVICE_ADDRESSING_MODE_NONE]
    original = with_gpu_answers("h100-80gb-mig-r580", "addressingMode", modes)
    document = record(original, topology=original.pci_topology)
    assert [g["addressingMode"] for g in document["gpus"]] == modes
    replayed = discover(NvmlEmulator(parse_profile(document), source="recording"))
    assert [g.device.attributes["addressingMode"] for g in replayed.gpus] == ["ATS", "None"]
    assert summary(replayed) == summary(discover(original))


def test_recording_keeps_mig_identities() -> None:
    original = emulated("a100-40gb-mig-mixed")
    document = record(original, topology=original.pci_topology)
    instances = document["gpus"][0]["migInstances"]
    assert {i["profileId"] for i in instances} == {9, 14, 19}
    assert all(i["uuid"].startswith("MIG-") for i in instances)
    replay = NvmlEmulator(parse_profile(document))
    static = discover(replay).devices(MigStrategy.STATIC)
    expected = discover(emulated("a100-40gb-mig-mixed")).devices(MigStrategy.STATIC)
    assert [(d.name, d.uuid, d.gpu_instance_id) for d in static] == [
        (d.name, d.uuid, d.gpu_instance_id) for d in expected
    ]


def test_written_recording_loads_as_a_profile(tmp_path: Path) -> None:
    original = emulated("h100-80gb-hbm3-x8")
    document = record(original, topology=original.pci_topology)
    path = tmp_path / "node.json"
    write_recording(path, document)
    assert json.loads(path.read_text()) == document
    assert path.read_text() == dumps(document)
    assert [p.name for p in tmp_path.iterdir()] == ["node.json"]  # no temp file left
    replay = load_nvml(f"emulated:{path}")
    assert [d.name for d in discover(replay).devices()] == [f"gpu-{i}" for i in range(8)]


def test_fixtures_exist() -> None:
    assert FIXTURES, "tests/nvml/fixtures holds at least one recording"


@pytest.mark.parametrize("path", FIXTURES, ids=[p.name for p in FIXTURES])
def test_replay_fixture(path: Path) -> None:
    document = json.loads(path.read_text())
    nvml = load_nvml(f"emulated:{path}")
    assert isinstance(nvml, NvmlEmulator)
    inventory = discover(nvml)
    assert [g.uuid for g in inventory.gpus] == [g["uuid"] for g in document["gpus"]]
    for gpu, recorded in zip(inventory.gpus, document["gpus"], strict=True):
        assert gpu.minor == recorded["minor"]
        assert gpu.mig_enabled == recorded.get("migEnabled", False)
        mig_uuids = {i["uuid"] for i in recorded.get("migInstances", ()) if "uuid" in i}
        assert {d.uuid for d in gpu.mig_devices} == mig_uuids
    again = record(nvml, topology=nvml.pci_topology, description=document.get("description", ""))
    assert again == document


@pytest.mark.parametrize("branch", EMULATED_BRANCHES)
def test_recording_a_gpu_with_mig_off_on_every_branch(branch: int) -> None:
    """MIG off: NVML answers a maximum of 0 MIG devices, and placements only from R550 on
    (older branches: NOT_SUPPORTED); the recording still validates and replays, with the
    NUMA node that R535's NVML cannot tell taken from the topology, as discovery does."""
    original = emulated(f"h100-80gb-mig-r{branch}")
    original.nvmlInit()
    for index in range(original.nvmlDeviceGetCount()):
        original.nvmlDeviceSetMigMode(original.nvmlDeviceGetHandleByIndex(index), 0)
    original.nvmlShutdown()
    document = record(original, topology=original.pci_topology)
    (product,) = document["products"].values()
    assert product["mig"]["maxMigDeviceCount"] == 7
    placements = [p["placements"] for p in product["mig"]["gpuInstanceProfiles"]]
    assert all(placements) if branch >= PLACEMENTS_WITHOUT_MIG_SINCE else not any(placements)
    replay = NvmlEmulator(parse_profile(document), source="recording")
    assert summary(discover(replay)) == summary(discover(original))
    assert record(replay, topology=replay.pci_topology) == document


def test_help_is_help_and_writes_nothing(tmp_path: Path) -> None:
    """`--help` and a missing file name are answered by the parser, never taken for the
    file to write."""
    done = subprocess.run(
        [sys.executable, "-m", "gpudra.driver.nvml.record", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m gpudra.driver.nvml.record [-h] OUTPUT.json")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as usage:
        main([])
    assert usage.value.code == 2


@pytest.mark.parametrize(
    ("code", "cause"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "no usable NVML library: loading libnvidia-ml.so.1"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "the NVIDIA kernel driver is not loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "NVML failed to start (Insufficient Permissions"),
    ],
    ids=["no-library", "no-kernel-driver", "other"],
)
def test_an_nvml_that_cannot_start_ends_with_one_line(
    tmp_path: Path, code: int, cause: str
) -> None:
    nvml = emulated("l4")
    nvml.fail_after(0, code)  # nvmlInit itself fails, as on a machine without the driver
    out = tmp_path / "node.json"
    with pytest.raises(SystemExit) as failed:
        main([str(out)], nvml=nvml)
    message = failed.value.code
    assert isinstance(message, str)
    assert message.startswith(f"python -m gpudra.driver.nvml.record: {cause}")
    assert "nothing was recorded" in message
    assert "\n" not in message
    assert not out.exists()


def test_main_writes_the_recording(tmp_path: Path) -> None:
    original = emulated("a100-40gb-mig-mixed")
    out = tmp_path / "node.json"
    assert main([str(out)], nvml=original) == 0
    assert json.loads(out.read_text()) == record(original, topology=original.pci_topology)
    with pytest.raises(SystemExit) as failed:
        main([str(tmp_path / "missing" / "node.json")], nvml=original)
    assert failed.value.code == (
        f"python -m gpudra.driver.nvml.record: cannot write {tmp_path}/missing/node.json: "
        "No such file or directory"
    )
