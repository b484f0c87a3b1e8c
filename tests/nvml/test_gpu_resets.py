"""Taints that wait for a GPU reset: lifted by the admin's mark, kept across agent
restarts within one boot, forgotten after a reboot."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import anyio
import pytest
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import discover
from gpudra.driver.gpuresets import GpuResets, PendingReset
from gpudra.driver.health import HealthPolicy, HealthState, NvmlHealthWatcher
from gpudra.driver.nvml.emulator import NvmlEmulator
from gpudra.driver.timedtaints import TimedTaints

from tests.nvml.emulated import emulated

pytestmark = pytest.mark.anyio

BOOT = "6f1e3c2a-0b8d-4f7e-9a51-2c3d4e5f6a7b"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def boot_id(tmp_path: Path, value: str = BOOT) -> Path:
    path = tmp_path / "boot_id"
    path.write_text(value + "\n")
    return path


@asynccontextmanager
async def watching(
    nvml: NvmlEmulator,
    state: HealthState,
    resets: GpuResets | None = None,
    timed: TimedTaints | None = None,
) -> AsyncIterator[None]:
    """The health watcher running, writing what waits for a reset to `resets` and what
    waits for quiet time to `timed`."""
    watcher = NvmlHealthWatcher(nvml, state, wait_timeout_ms=20, resets=resets, timed=timed)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        yield
        tg.cancel_scope.cancel()


async def until(condition: object) -> None:
    with anyio.fail_after(10):  # a hang guard, not a timing assertion
        while not callable(condition) or not condition():
            await anyio.sleep(0.01)


def saved(resets: GpuResets) -> dict[str, object]:
    doc: dict[str, object] = json.loads(resets.path.read_text())
    return doc


async def test_the_admins_mark_lifts_the_taint_and_is_removed(tmp_path: Path) -> None:
    nvml = emulated("h100-80gb-hbm3-x8")
    inventory = discover(nvml)
    resets = GpuResets(tmp_path / "state", boot_id_path=boot_id(tmp_path))
    state = HealthState(inventory, HealthPolicy(recovery_after_s=0), resets=resets)
    uuid = inventory.gpus[1].uuid
    async with watching(nvml, state, resets):
        nvml.inject_xid(1, 48)
        # Written as soon as it is raised, with this boot's ID, in the taint's spelling.
        await until(lambda: resets.path.exists() and saved(resets)["gpus"])
        assert saved(resets) == {
            "version": 1,
            "bootId": BOOT,
            "gpus": {uuid: [{"device": "gpu-1", "taint": "xid=48"}]},
        }
        await anyio.sleep(0.1)  # recovery_after_s=0: quiet time alone would lift it now
        assert state.report().unhealthy() == ("gpu-1",)
        marker = tmp_path / "state" / "reset" / uuid
        assert str(marker) in state.report().devices["gpu-1"].message
        marker.parent.mkdir()
        marker.touch()
        await until(lambda: not marker.exists())
        assert state.report().unhealthy() == ()
        assert saved(resets)["gpus"] == {}


async def test_a_mark_naming_no_gpu_is_reported_and_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = emulated("l4")
    resets = GpuResets(tmp_path, boot_id_path=boot_id(tmp_path))
    state = HealthState(discover(nvml), HealthPolicy(), resets=resets)
    stray = tmp_path / "reset" / "gpu-0"  # a device name, not a GPU UUID
    stray.parent.mkdir()
    stray.touch()
    with caplog.at_level(logging.WARNING, logger="gpudra.driver.health"):
        async with watching(nvml, state, resets):
            await until(lambda: "names no GPU" in caplog.text)
            await anyio.sleep(0.1)
    assert stray.exists()
    assert caplog.text.count("names no GPU") == 1  # once, not at every wait


async def test_an_agent_restart_raises_the_taints_again_before_publishing(
    tmp_path: Path,
) -> None:
    """An upgrade restarts the agent but resets no GPU: what waited for a reset is raised
    again by the first scan, before the slices are published."""
    nvml = emulated("a100-40gb-mig-mixed")
    inventory = discover(nvml)
    gpu = inventory.gpus[0]
    mig = sorted(gpu.mig_devices, key=lambda d: d.name)[0]
    state_dir = tmp_path / "state"
    resets = GpuResets(state_dir, boot_id_path=boot_id(tmp_path))
    resets.save({gpu.uuid: (PendingReset(mig.name, 95), PendingReset(mig.name))})

    config = AgentConfig(node_name="n1", state_dir=state_dir, boot_id_path=boot_id(tmp_path))
    agent = NodeAgent(config, cast(Kube, object()), nvml)
    await agent.scan()
    assert agent.health is not None
    report = agent.health.report()
    assert {(t.key, t.value) for t in report.taints(mig.name)} == {
        ("gpu.nvidia.com/xid", "95"),
        ("gpu.nvidia.com/ecc", "double-bit"),
    }
    assert not report.devices[mig.name].healthy
    assert str(state_dir / "reset" / gpu.uuid) in report.devices[mig.name].message
    assert agent.health.xid_counts() == {}  # raised again, not seen again
    assert report.devices[inventory.gpus[1].device.name].healthy


async def test_a_reboot_resets_every_gpu(tmp_path: Path) -> None:
    nvml = emulated("l4")
    uuid = discover(nvml).gpus[0].uuid
    state_dir = tmp_path / "state"
    GpuResets(state_dir, boot_id_path=boot_id(tmp_path, "the-boot-before")).save(
        {uuid: (PendingReset("gpu-0", 79),)}
    )
    config = AgentConfig(node_name="n1", state_dir=state_dir, boot_id_path=boot_id(tmp_path))
    agent = NodeAgent(config, cast(Kube, object()), nvml)
    await agent.scan()
    assert agent.health is not None
    assert agent.health.report().devices["gpu-0"].healthy


async def test_a_restart_follows_the_policy_of_now(tmp_path: Path) -> None:
    """An XID the admin has since made an application XID is not raised again, and a
    device that is gone is skipped, with the rest still raised."""
    nvml = emulated("h100-80gb-hbm3-x8")
    uuid = discover(nvml).gpus[0].uuid
    state_dir = tmp_path / "state"
    GpuResets(state_dir, boot_id_path=boot_id(tmp_path)).save(
        {uuid: (PendingReset("gpu-0", 109), PendingReset("gpu-9", 48), PendingReset("gpu-0"))}
    )
    policy = HealthPolicy(extra_application_xids=frozenset({109}))
    config = AgentConfig(
        node_name="n1", health=policy, state_dir=state_dir, boot_id_path=boot_id(tmp_path)
    )
    agent = NodeAgent(config, cast(Kube, object()), nvml)
    await agent.scan()
    assert agent.health is not None
    assert [t.key for t in agent.health.report().taints("gpu-0")] == ["gpu.nvidia.com/ecc"]


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"{", "not JSON"),
        (b'{"version": 2, "gpus": {}}', "newer gpudra release"),
        (b'{"version": 1, "gpus": {"GPU-1": [{"device": "gpu-0", "taint": "xid=x"}]}}', "taint"),
        (b'{"version": 1, "gpus": {"GPU-1": [{"taint": "xid=48"}]}}', "gpus.GPU-1[0]"),
    ],
)
def test_a_malformed_file_is_named_and_raises_nothing(
    tmp_path: Path, content: bytes, error: str, caplog: pytest.LogCaptureFixture
) -> None:
    resets = GpuResets(tmp_path, boot_id_path=boot_id(tmp_path))
    resets.path.write_bytes(content)
    with caplog.at_level(logging.ERROR, logger="gpudra.driver.gpuresets"):
        assert resets.load() == {}
    (record,) = caplog.records
    fields = record.__dict__["fields"]
    assert fields["path"] == str(resets.path)
    assert error in fields["error"]
    assert "check the GPUs by hand" in record.getMessage()


def test_without_a_boot_id_the_file_is_trusted(tmp_path: Path) -> None:
    """Where the boot ID cannot be read, keeping a taint beats dropping one."""
    written = GpuResets(tmp_path, boot_id_path=boot_id(tmp_path))
    written.save({"GPU-1": (PendingReset("gpu-0", 48),)})
    unknown = GpuResets(tmp_path, boot_id_path=tmp_path / "no-such-file")
    assert unknown.load() == {"GPU-1": (PendingReset("gpu-0", 48),)}
    assert unknown.marker("../etc") is None  # never a path outside the folder
