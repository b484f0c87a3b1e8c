"""An agent whose checkpoint was taken over stops once the agent that took it over is gone.

The new agent of a rolling update with a surge pod takes the checkpoint over, and the
old one stands down (`test_take_over`). Should the new one go away while the old one
runs on (the surge pod failed or was deleted, a rollback), the old one would refuse
every prepare for good, and its liveness probe would never tell: it watches the new
one's owner lock and stops once that is released, so that its restart takes the
checkpoint over again. One that took the file over without an owner file (an earlier
release) is left alone.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from gpudra.common.files import atomic_write
from gpudra.driver.checkpoint import (
    CHECKPOINT_MAJOR_VERSION,
    CheckpointOwnerGoneError,
    CheckpointTooNewError,
    load,
)
from gpudra.driver.owners import owners_folder

from tests.driver.test_plugin import root  # noqa: F401  (the fixture)
from tests.driver.test_prepare import (
    Node,
    _fixture_claim,
    h100,
    node,  # noqa: F401  (the fixture)
    node_preparer,
)
from tests.driver.test_slices import ApiServer, api_server
from tests.driver.test_take_over import node_service

pytestmark = pytest.mark.anyio

GONE = "took the checkpoint over from this one are gone"

# An agent that takes the checkpoint over and runs until killed: in a process of its
# own, as a surge pod's agent is.
OWNER = """
import sys
from pathlib import Path
from gpudra.driver.checkpoint import load
# Held: its owner lock lasts as long as the checkpoint object.
checkpoint = load(Path(sys.argv[1]), boot_id_path=Path(sys.argv[2]), take_over=True)
print("took over", flush=True)
sys.stdin.read()
"""


def owner_files(folders: Node) -> set[str]:
    folder = owners_folder(folders.checkpoint)
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


async def test_the_old_agent_stops_once_the_agent_that_took_over_stops(
    node: Node,  # noqa: F811  (test_prepare's fixture: this test's node folders)
) -> None:
    """While the new agent runs, the old one stands down and is not asked to stop; once
    the new one stops (its pod deleted by a rollback), the old one is, naming why. Its
    restart takes the checkpoint over and prepares again, and its registration leaves
    only its own owner file: the dead one is removed, never a live one."""
    emu = h100()
    old = node_preparer(node, emu)
    await old.recover()
    (old_file,) = owner_files(node)
    new = node_preparer(node, emu)
    await new.recover()  # takes the checkpoint over
    assert old_file in owner_files(node) and len(owner_files(node)) == 2  # both alive
    assert old.taken_over() is not None and new.taken_over() is None

    assert await old.owner_gone() is None
    assert await new.owner_gone() is None
    assert old_file not in owner_files(node)  # taken over: no longer an owner
    assert await old.owner_gone() is None

    await new.close()  # the new agent's stop
    reason = await old.owner_gone()
    assert reason is not None and GONE in reason

    restarted = node_preparer(node, emu)
    await restarted.recover()
    assert restarted.taken_over() is None and len(owner_files(node)) == 1
    claim = _fixture_claim(0)
    assert (await restarted.prepare([claim]))[claim.uid].error is None


async def test_an_owner_killed_releases_its_lock_to_the_agent_it_took_over(
    node: Node,  # noqa: F811
) -> None:
    """The new agent in a process of its own, killed (an OOM kill, a failing surge pod):
    the kernel releases its lock, and the old agent, told nothing, is asked to stop."""
    emu = h100()
    old = node_preparer(node, emu)
    await old.recover()
    async with await anyio.open_process(
        [sys.executable, "-c", OWNER, str(node.checkpoint), str(node.boot_id)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as owner:
        assert owner.stdout is not None
        with anyio.fail_after(60):
            said = await BufferedByteReceiveStream(owner.stdout).receive_until(b"\n", 100)
        assert said == b"took over"
        assert old.taken_over() is not None
        assert await old.owner_gone() is None
        owner.send_signal(signal.SIGKILL)
        assert await owner.wait() == -signal.SIGKILL
    reason = await old.owner_gone()
    assert reason is not None and GONE in reason


async def test_an_agent_that_leaves_no_owner_file_is_never_taken_for_gone(
    node: Node,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The agent that took the checkpoint over stopped long since without resigning, so
    its owner file is there, unlocked; then one that registers none (an earlier release,
    in a downgrade with a surge pod) takes the file from the new one. That file is older
    than the new one's: the new one stands down on, says once that it cannot tell when
    to stop, and leaves the earlier release the node."""
    emu = h100()
    old = node_preparer(node, emu)
    await old.recover()
    new = node_preparer(node, emu)
    await new.recover()
    await old.close()  # stopped before it learnt it was taken over: its file stays
    assert len(owner_files(node)) == 2

    # The earlier release's take-over: the file replaced, no owner file made.
    atomic_write(node.checkpoint, node.checkpoint.read_bytes())
    assert new.taken_over() is not None
    with caplog.at_level(logging.WARNING, logger="gpudra.driver.owners"):
        assert await new.owner_gone() is None
        assert await new.owner_gone() is None
    (record,) = [r for r in caplog.records if r.name == "gpudra.driver.owners"]
    assert "leaves no owner file" in record.getMessage()


def test_a_start_refused_leaves_no_owner_file(node: Node) -> None:  # noqa: F811
    """A load refused (a checkpoint of a newer `majorVersion`) took nothing over: its owner
    file, left unlocked, would tell the agent it never took the file from that the agent
    that did is gone."""
    node.checkpoint.parent.mkdir(parents=True)
    node.checkpoint.write_text(json.dumps({"majorVersion": CHECKPOINT_MAJOR_VERSION + 1}))
    with pytest.raises(CheckpointTooNewError):
        load(node.checkpoint, boot_id_path=node.boot_id, take_over=True)
    assert owner_files(node) == set()


async def test_the_node_service_ends_with_an_error_once_the_owner_is_gone(
    node: Node,  # noqa: F811
    root: Path,  # noqa: F811  (test_plugin's: short enough for the plugin's sockets)
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`gpudra node` serving, taken over: it serves on while the new agent runs, and
    ends with CheckpointOwnerGoneError (which `gpudra node` exits non-zero on, for the
    kubelet to restart it) once that agent stops, having logged why."""
    emu = h100()
    async with api_server(ApiServer()) as kube:
        old = node_service(node, kube, emu, kubelet_root=root, owner_check_s=0)
        with pytest.raises(BaseExceptionGroup) as ended:
            async with anyio.create_task_group() as tg:
                await tg.start(old.run)
                (old_file,) = owner_files(node)
                new = node_preparer(node, emu)
                await new.recover()
                with anyio.fail_after(10):
                    while old_file in owner_files(node):  # looked, resigned
                        await anyio.lowlevel.checkpoint()
                for _ in range(100):  # turns in which a wrong stop would happen
                    await anyio.lowlevel.checkpoint()
                assert old.ready.is_set()
                with caplog.at_level(logging.ERROR, logger="gpudra.driver.node"):
                    await new.close()
                    with anyio.fail_after(10):
                        await anyio.sleep_forever()
    gone, rest = ended.value.split(CheckpointOwnerGoneError)
    assert rest is None and gone is not None
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "stopping" in record.getMessage()
    assert GONE in record.__dict__["fields"]["reason"]
