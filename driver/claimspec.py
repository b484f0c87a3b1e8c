"""What goes into a prepared claim's CDI spec.

Each device gets its GPU's device node and, for a MIG device, the nodes of its GPU
instance's and compute instance's access capabilities; an environment variable
with its UUID; and, when it joins the claim's MPS daemon, the daemon's pipe folder
and the claim's own /dev/shm folder. The driver's control nodes and libraries are
common to all devices and found once. When the container toolkit's own spec knows
every device of the claim, the devices refer to it instead and carry no nodes of
their own.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio.to_thread
from gpudra.driver.cdi import (
    CdiDevice,
    ContainerEdits,
    DeviceNode,
    DeviceNumbers,
    Mount,
    ToolkitSpec,
    driver_common_edits,
    numbered,
)
from gpudra.driver.mig import caps_major, mig_capability_minors
from gpudra.driver.planning import Entry
from gpudra.driver.sharing import MpsDaemon

__all__ = ["MPS_PIPE_DIR_IN_CONTAINER", "ClaimSpecs"]

MPS_PIPE_DIR_IN_CONTAINER: Final = "/tmp/nvidia-mps"
_RW_BIND: Final = ("rw", "nosuid", "nodev", "rbind", "rprivate")
_ENV_UNSAFE: Final = re.compile(r"[^A-Za-z0-9]")
# Whole devices whose spec entries are kept (a node has a few dozen at most; a node
# whose GPUs changed keeps the newest).
_WHOLE_DEVICES_KEPT: Final = 256


def _env_key(name: str) -> str:
    return _ENV_UNSAFE.sub("_", name).upper()


@dataclass(frozen=True, slots=True)
class _Entries:
    """A device's spec entry with its own nodes (`own`), and the one referring to the
    toolkit's spec instead, where that spec knows the device (`referring`): a claim's
    devices use the second only when all of them have one."""

    own: CdiDevice
    referring: CdiDevice | None


class ClaimSpecs:
    """Builds the spec contents of prepared claims on one node.

    `dev_root`, `driver_root` and `proc_root` are where the host's /dev, driver
    files and /proc are; `host_view` is where this process sees the host's `/`;
    `device_numbers` (emulated GPUs) numbers the device nodes, for hosts that lack
    them.
    """

    def __init__(
        self,
        *,
        driver_root: Path = Path("/"),
        dev_root: Path = Path("/"),
        proc_root: Path = Path("/proc"),
        driver_libraries: Sequence[str] = (),
        host_view: Path | None = Path("/"),
        toolkit: ToolkitSpec | None = None,
        device_numbers: DeviceNumbers | None = None,
    ) -> None:
        self._driver_root = driver_root
        self._dev_root = dev_root
        # Where the host's /dev is seen from here, as a string ("" for "/"): joined on
        # every prepare, cheaper than Path arithmetic.
        self._dev_prefix = "" if dev_root == Path("/") else str(dev_root)
        self._proc_root = proc_root
        self._libraries = tuple(driver_libraries)
        self._host_view = host_view
        self._toolkit = toolkit
        self._device_numbers = device_numbers
        self._common: ContainerEdits | None = None
        # Each whole device's entries, the same on every prepare of it: one object each,
        # so that the CDI store converts their edits once (`cdi.ConvertedEdits`).
        self._whole: dict[tuple[str, str | None, int], _Entries] = {}
        # The common edits of a claim whose devices all refer to the toolkit's spec.
        self._toolkit_common = ContainerEdits(env={"NVIDIA_VISIBLE_DEVICES": "void"})

    async def claim(
        self, entries: Sequence[Entry], daemon: MpsDaemon | None
    ) -> tuple[list[CdiDevice], ContainerEdits]:
        """The devices of one claim's spec, and the edits common to all of them."""
        common = await self._common_edits()
        devices = [self._device(e, daemon) for e in entries]
        if all(d.referring is not None for d in devices):
            return [d.referring for d in devices if d.referring is not None], self._toolkit_common
        return [d.own for d in devices], common

    async def _common_edits(self) -> ContainerEdits:
        """Control nodes and driver libraries; they do not change while we run."""
        if self._common is None:
            edits = await anyio.to_thread.run_sync(
                functools.partial(
                    driver_common_edits,
                    driver_root=self._driver_root,
                    dev_root=self._dev_root,
                    libraries=self._libraries,
                    host_view=self._host_view,
                    device_numbers=self._device_numbers,
                )
            )
            self._common = dataclasses.replace(
                edits, env={**edits.env, "NVIDIA_VISIBLE_DEVICES": "void"}
            )
        return self._common

    def _node_path(self, path: str) -> DeviceNode:
        host = f"{self._dev_prefix}/{path.lstrip('/')}" if self._dev_prefix else None
        numbers = self._device_numbers(path) if self._device_numbers is not None else None
        return numbered(path, host, numbers)

    def _device(self, entry: Entry, daemon: MpsDaemon | None) -> _Entries:
        if (
            entry.details.mig is not None
            or entry.share_id is not None
            or (entry.mps and daemon is not None)
        ):
            return self._build_device(entry, daemon)  # made for this claim
        # A whole device without MPS: its nodes, UUID and name alone decide its entry.
        key = (entry.cdi_name, entry.uuid, entry.gpu.minor)
        device = self._whole.get(key)
        if device is None:
            device = self._build_device(entry, None)
            if len(self._whole) >= _WHOLE_DEVICES_KEPT:
                del self._whole[next(iter(self._whole))]
            self._whole[key] = device
        return device

    def _build_device(self, entry: Entry, daemon: MpsDaemon | None) -> _Entries:
        nodes = [self._node_path(f"/dev/nvidia{entry.gpu.minor}")]
        mig = entry.details.mig
        if mig is not None and mig.gi is not None and mig.ci is not None:
            nodes.extend(self._cap_nodes(entry.gpu.minor, mig.gi, mig.ci))
        env = {f"GPUDRA_DEVICE_{_env_key(entry.cdi_name)}_UUID": entry.uuid or ""}
        mounts: tuple[Mount, ...] = ()
        if entry.mps and daemon is not None:
            env["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE_DIR_IN_CONTAINER
            # The claim's own /dev/shm, never the host's: MPS clients and their
            # daemon share memory through it, and no one else may.
            mounts = (Mount(str(daemon.pipe_dir), MPS_PIPE_DIR_IN_CONTAINER, _RW_BIND),)
            if daemon.shm_dir is not None:
                mounts += (Mount(str(daemon.shm_dir), "/dev/shm", _RW_BIND),)
        toolkit_ids: tuple[str, ...] = ()
        if self._toolkit is not None and entry.uuid:
            toolkit_ids = tuple(self._toolkit.device_ids(entry.uuid))
        edits = ContainerEdits(env=env, device_nodes=tuple(nodes), mounts=mounts)
        own = CdiDevice(name=entry.cdi_name, edits=edits)
        if not toolkit_ids:
            return _Entries(own, None)
        # The toolkit's spec brings the device's nodes and the driver's files.
        referring = CdiDevice(
            name=entry.cdi_name,
            edits=dataclasses.replace(edits, device_nodes=()),
            toolkit_ids=toolkit_ids,
        )
        return _Entries(own, referring)

    def _cap_nodes(self, gpu_minor: int, gi: int, ci: int) -> list[DeviceNode]:
        major = caps_major(self._proc_root)
        nodes = []
        for minor, mode in mig_capability_minors(self._proc_root, gpu_minor, gi, ci):
            node = self._node_path(f"/dev/nvidia-caps/nvidia-cap{minor}")
            if major is not None and node.major is None:
                # With the numbers the runtime can create the node even where
                # nvidia-modprobe has not made it on the host yet.
                node = dataclasses.replace(node, type="c", major=major, minor=minor, file_mode=mode)
            nodes.append(node)
        return nodes
