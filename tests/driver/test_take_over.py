"""An agent whose checkpoint a newer agent took over changes nothing on the node.

A rolling update with a surge pod runs the new agent beside the old one, on the same
checkpoint; the new one's load takes the file over, and the old one's checkpoint writes
are refused from then on. A refused write comes after the device change it records, so
the old agent asks before every change: its prepares, unprepares and sweep of deleted
claims touch no device the new agent may hold under its own records, and it stops
publishing the node's ResourceSlices, which the two would otherwise keep superseding.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig
from gpudra.driver.checkpoint import CheckpointTakenOverError
from gpudra.driver.checkpoint import load as load_checkpoint
from gpudra.driver.claims import ClaimRef
from gpudra.driver.devices import MigStrategy
from gpudra.driver.health import XidEvent
from gpudra.driver.node import NodeService, PluginConfig
from gpudra.driver.nvml import NvmlEmulator

from tests.driver.test_prepare import (
    NODE,
    Node,
    _fixture_claim,
    discover,
    h100,
    h100_mig,
    mig_devices,
    node,  # noqa: F401  (the fixture)
    node_preparer,
)
from tests.driver.test_slices import ApiServer, api_server

pytestmark = pytest.mark.anyio

TAKEN_OVER = "a newer agent on this node took it over"


class AllDeleted:
    """The API server as the sweep asks it (a `ClaimLookup`): every claim deleted, no
    pod using it. `asked`: the claims it was asked about."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def current_uid(self, ref: ClaimRef) -> str | None:
        self.asked.append(ref.uid)
        return None

    async def still_used(self, ref: ClaimRef, pod: str, pod_uid: str) -> bool:
        return False


async def test_an_agent_whose_checkpoint_was_taken_over_changes_no_device(
    node: Node,  # noqa: F811  (test_prepare's fixture: this test's node folders)
) -> None:
    """The old agent holds a time-sliced GPU and a MIG instance when the new one starts.
    Its sweep (the claims deleted meanwhile) and the kubelet's unprepares then leave
    the CDI specs, the time-slice and the instance as they are, and its prepares write
    no CDI spec (and roll none back: a claim the new agent prepared would lose its
    own). Each fails naming the take-over; the new agent undoes them all."""
    emu = h100_mig()
    old = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC)
    held = [_fixture_claim(1), _fixture_claim(5)]  # time-sliced gpu-2, a MIG instance
    for claim in held:
        assert (await old.prepare([claim]))[claim.uid].error is None
    new = node_preparer(node, emu, strategy=MigStrategy.DYNAMIC)
    assert (await new.recover()).errors == ()  # its start takes the checkpoint over
    whole = _fixture_claim(0)  # gpu-1, prepared by the new agent only
    assert (await new.prepare([whole]))[whole.uid].error is None
    tools, migs = node.tool_calls(), mig_devices(emu)
    assert any("--set-timeslice" in call for call in tools) and migs

    def untouched() -> None:
        assert all(node.has_spec(c.uid) for c in (*held, whole))
        assert node.tool_calls() == tools  # no time-slice reset
        assert mig_devices(emu) == migs

    lookup = AllDeleted()
    with pytest.raises(CheckpointTakenOverError, match=TAKEN_OVER):
        await old.cleanup_deleted_claims(lookup)
    assert lookup.asked == []
    untouched()

    errors = await old.unprepare([c.ref for c in held])
    assert sorted(errors) == sorted(c.uid for c in held)
    assert all(TAKEN_OVER in (error or "") for error in errors.values())
    untouched()

    # One new to both (gpu-1 is free as the old agent sees it), and the one the new
    # agent prepared: neither gets a CDI spec written, nor rolled back.
    fresh = _fixture_claim(0, uid="00000000-0000-4000-8000-0000000000ff")
    for claim in (fresh, whole):
        error = (await old.prepare([claim]))[claim.uid].error
        assert error is not None and TAKEN_OVER in error
        assert not node.has_spec(fresh.uid)
    untouched()
    assert old.taken_over() is not None and new.taken_over() is None

    claims = [whole, *held]
    assert await new.unprepare([c.ref for c in claims]) == {c.uid: None for c in claims}
    assert mig_devices(emu) == {}
    assert not any(node.has_spec(c.uid) for c in claims)


async def test_a_prepare_that_waited_for_a_devices_holder_asks_again_who_owns_the_checkpoint(
    node: Node,  # noqa: F811  (test_prepare's fixture: this test's node folders)
) -> None:
    """A prepare waits for another claim's unprepare (up to `CONFLICT_WAIT_S`), and a
    newer agent may take the checkpoint over meanwhile: the waiting prepare, once
    the unprepare lets it go on, changes nothing on the node and says why."""
    emu = h100()
    old = node_preparer(node, emu, conflict_wait=3600)
    holder = _fixture_claim(0)  # gpu-1
    waiting = _fixture_claim(0, uid="00000000-0000-4000-8000-0000000000fe")  # gpu-1 too
    assert (await old.prepare([holder]))[holder.uid].error is None
    errors: list[str | None] = []

    async def prepare() -> None:
        errors.append((await old.prepare([waiting]))[waiting.uid].error)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(prepare)
            await anyio.wait_all_tasks_blocked()
            assert errors == []  # waiting
            assert await old.unprepare([holder.ref]) == {holder.uid: None}
            # Before the waiting prepare runs again: a newer agent's start.
            load_checkpoint(node.checkpoint, boot_id_path=node.boot_id, take_over=True)

    [error] = errors
    assert error is not None and TAKEN_OVER in error
    assert not node.has_spec(waiting.uid)


def node_service(
    folders: Node,
    kube: Kube,
    nvml: NvmlEmulator,
    *,
    kubelet_root: Path | None = None,
    driver_name: str | None = None,
    health_checks: bool = False,
    **every: float,
) -> NodeService:
    """`gpudra node` with its kubelet plugin in `folders`, sampling nothing; `every`
        sets intervals (`cleanup_interval_s=0`: sweeping deleted claims at every turn of
        the event loop); `driver_name`: `--driver-name`; `health_checks`: `--health-checks`
    (off: tests that watch no NVML events). A plugin that serves needs a short
        `kubelet_root`: a unix socket's path is 107 bytes at most."""
    plugin = PluginConfig(
        kubelet_root=kubelet_root or folders.root / "kubelet",
        cdi_root=folders.cdi_dir,
        state_dir=folders.checkpoint.parent,
        dev_root=folders.dev_root,
        proc_root=folders.proc,
        boot_id_path=folders.boot_id,
        toolkit_spec=False,
        sample_interval_s=0,
        **every,
    )
    named = {} if driver_name is None else {"driver_name": driver_name}
    config = AgentConfig(node_name=NODE, health_events=health_checks, **named)
    return NodeService(config, kube, nvml, plugin)


async def test_the_sweep_of_deleted_claims_stops_once_the_checkpoint_is_taken_over(
    node: Node,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The claim's ResourceClaim and pod are gone (the API server answers 404), so the
    old agent's sweep would unprepare it: taken over, the sweep asks the API server
    nothing, leaves the claim's CDI spec, says why once and sweeps no more."""
    emu = h100()
    asked: list[str] = []
    server = ApiServer(on_request=lambda _method, path: asked.append(path))
    async with api_server(server) as kube:
        old = node_service(node, kube, emu, cleanup_interval_s=0)
        await old.agent.scan()
        assert old.preparer is not None
        await old.preparer.recover()  # its start: the checkpoint is its own
        claim = _fixture_claim(0)
        assert (await old.preparer.prepare([claim]))[claim.uid].error is None
        await node_preparer(node, emu).recover()  # the new agent's start

        def warnings() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "no longer swept" in r.getMessage()]

        with caplog.at_level(logging.WARNING, logger="gpudra.driver.node"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(old._sweep_deleted_claims)
                with anyio.fail_after(10):
                    while not warnings():
                        await anyio.lowlevel.checkpoint()
                for _ in range(100):  # turns in which a sweep still going would run again
                    await anyio.lowlevel.checkpoint()
                tg.cancel_scope.cancel()
    (record,) = warnings()
    assert record.levelno == logging.WARNING
    assert TAKEN_OVER in record.__dict__["fields"]["error"]
    assert not any("resourceclaims" in path or "/pods/" in path for path in asked)
    assert node.has_spec(claim.uid)


async def test_the_old_agent_stops_publishing_the_slices_once_its_checkpoint_is_taken_over(
    node: Node,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before the take-over the old agent publishes the node's pool; after it, a change
    it would publish (a GPU's XID) writes and deletes nothing: the new agent publishes
    the pool, and the two would otherwise supersede each other's generations. Said
    once, naming why."""
    emu = h100()
    server = ApiServer()
    async with api_server(server) as kube:
        old = node_service(node, kube, emu, cleanup_interval_s=0)
        await old.agent.scan()
        assert old.preparer is not None and old.agent.health is not None
        await old.preparer.recover()
        await old.agent.slices.reconcile_once()
        published = list(server.writes)
        assert published
        await node_preparer(node, emu).recover()  # the new agent's start

        old.agent.health.apply(XidEvent(discover(emu).gpus[3].uuid, 48))
        old.agent.slices.trigger()
        with caplog.at_level(logging.WARNING, logger="gpudra.driver.slices"):
            await old.agent.slices.reconcile_once()
            old.agent.slices.trigger()
            await old.agent.slices.reconcile_once()
    assert server.writes == published
    (record,) = [r for r in caplog.records if r.name == "gpudra.driver.slices"]
    assert record.levelno == logging.WARNING
    assert "ResourceSlices" in record.getMessage()
    assert TAKEN_OVER in record.__dict__["fields"]["reason"]
    assert old.agent.slices.stood_down is not None
