"""The per-node agent: discovery, health and ResourceSlice publishing, wired together.

Discovery runs in a worker thread (NVML blocks). The published pool is always built
from one complete inventory: a scan that fails keeps the last good one, and before
the first good scan nothing is published at all. A GPU that is lost (fell off the bus)
does not fail a scan: discovery leaves it out and publishes the others, and a GPU lost
after it was published keeps its last description (`Inventory.keeping_lost`), tainted
by the health watcher. The periodic rescan picks a lost GPU up again once it answers.

`--shared-gpus` is checked against the first complete inventory: a GPU it names that
the node lacks (or cannot share) stops the agent, since the admin asked for something
that would silently not happen. Later scans only warn, so a GPU that drops off the bus
does not take the rest of the node's pool with it; so does a first scan that found a
lost GPU, since the GPU named may be that one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread
from gpudra.common.backoff import Backoff
from gpudra.common.kube import Kube
from gpudra.driver.checkpoint import DEFAULT_BOOT_ID_PATH
from gpudra.driver.devices import (
    DiscoveryError,
    Inventory,
    MigKey,
    MigStrategy,
    SharedGpus,
    SharedGpusError,
    discover,
)
from gpudra.driver.gpuresets import GpuResets
from gpudra.driver.gpushares import GpuShares, GpuSharesError
from gpudra.driver.health import HealthPolicy, HealthState, NvmlHealthWatcher
from gpudra.driver.nvml import NvmlLibrary
from gpudra.driver.publish import pool_content
from gpudra.driver.slices import PoolContent, SliceController, SliceLimits
from gpudra.driver.timedtaints import TimedTaints

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentConfig:
    node_name: str
    driver_name: str = "gpu.nvidia.com"
    mig_strategy: MigStrategy = MigStrategy.DYNAMIC
    rescan_s: float = 60.0
    health: HealthPolicy = field(default_factory=HealthPolicy)
    # Watch NVML's events and taint the devices they hit (`--health-checks`). Off, no
    # event is read: no taint is raised, and a GPU that falls off the bus leaves the
    # slices at the next rescan rather than staying published tainted `gpu-lost`.
    health_events: bool = True
    # Where the taints that wait for a GPU reset or for quiet time outlive a restart, and
    # the admin marks GPUs reset (`gpudra.driver.gpuresets`, `gpudra.driver.timedtaints`);
    # None: in memory only, a restart lifts them.
    state_dir: Path | None = None
    boot_id_path: Path = DEFAULT_BOOT_ID_PATH
    slice_limits: SliceLimits | None = None
    # Whole GPUs published shareable, handed out in memory slices.
    shared_gpus: SharedGpus = field(default_factory=SharedGpus)
    # Integer shares per whole GPU (`gpudra.driver.gpushares`).
    gpu_shares: GpuShares = field(default_factory=GpuShares)
    # Upstream's `index`/`minor` attributes of before v25.8.0 (`publish` says why off).
    legacy_attributes: bool = False
    # The NUMA node attribute as a list (DRAListTypeAttributes; `publish` says why off).
    numa_node_list: bool = False


class NodeAgent:
    """Owns one node's inventory, health state and slice controller."""

    def __init__(
        self,
        config: AgentConfig,
        kube: Kube,
        nvml: NvmlLibrary,
        *,
        clock: Callable[[], float] | None = None,
        own_migs: Callable[[], Container[MigKey]] | None = None,
        stand_down: Callable[[], str | None] | None = None,
    ) -> None:
        self.config = config
        self.kube = kube
        self.nvml = nvml
        self._clock = clock
        # The MIG instances gpudra made for prepared claims (the kubelet plugin's
        # checkpoint); under dynamic MIG every other instance is kept out of the pool
        # (`Gpu.dynamic_view`). None: this agent prepares nothing, so none are its own.
        self._own_migs = own_migs
        self.inventory: Inventory | None = None
        self.shared: frozenset[str] = frozenset()  # device names published shareable
        self.shares: dict[str, int] = {}  # device name -> integer shares published
        self.health: HealthState | None = None
        self._resets = (
            GpuResets(config.state_dir, boot_id_path=config.boot_id_path)
            if config.state_dir is not None and config.health_events
            else None
        )
        self._timed = (
            TimedTaints(config.state_dir, boot_id_path=config.boot_id_path)
            if config.state_dir is not None and config.health_events
            else None
        )
        self.ready = anyio.Event()
        self.slices = SliceController(
            kube,
            driver=config.driver_name,
            node=config.node_name,
            source=self._content,
            limits=config.slice_limits,
            # Why another agent publishes the pool now (the plugin's checkpoint taken
            # over); None: this one does.
            stand_down=stand_down,
        )

    def _content(self) -> PoolContent:
        if self.inventory is None or self.health is None:
            raise DiscoveryError("no complete GPU inventory yet")
        return pool_content(
            self.inventory,
            self.config.mig_strategy,
            self.health.report(),
            shared=self.shared,
            driver=self.config.driver_name,
            shares=self.shares,
            legacy=self.config.legacy_attributes,
            lists=self.config.numa_node_list,
            own_migs=self._own_migs() if self._own_migs is not None else frozenset(),
        )

    async def scan(self) -> Inventory:
        """Discover; raises `SharedGpusError` or `GpuSharesError` when the first
        inventory cannot honour `--shared-gpus` or `--gpu-shares`."""
        inv = await anyio.to_thread.run_sync(discover, self.nvml)
        if self.inventory is not None and self.config.health_events:
            # Kept only to carry the `gpu-lost` taint, which only the watcher raises:
            # with health checks off it would be a dead GPU published healthy.
            inv = inv.keeping_lost(self.inventory)
        if inv != self.inventory:
            first = self.inventory is None and not inv.lost
            self.shared = self._shared(inv, first=first)
            self.shares = self._shares(inv, first=first)
            if self.health is None:
                # Taints that waited for a GPU reset or for quiet time before a restart,
                # raised before anything is published: a restart resets no GPU.
                resets, timed = self._resets, self._timed
                pending = await anyio.to_thread.run_sync(resets.load) if resets else {}
                kept = await anyio.to_thread.run_sync(timed.load) if timed else {}
                state = partial(
                    HealthState,
                    inv,
                    self.config.health,
                    resets=resets,
                    watched=self.config.health_events,
                )
                self.health = state(clock=self._clock) if self._clock else state()
                self.health.restore_resets(pending)
                self.health.restore_timed(kept)
            else:
                self.health.update_inventory(inv)
            self.inventory = inv
            self.slices.trigger()
        return inv

    def _shared(self, inv: Inventory, *, first: bool) -> frozenset[str]:
        names, problems = self.config.shared_gpus.resolve(inv)
        fields = {
            "node": self.config.node_name,
            "sharedGpus": str(self.config.shared_gpus),
            "shared": sorted(names),
        }
        if problems and first:
            raise SharedGpusError("; ".join(problems))
        if problems:
            log.error(
                "--shared-gpus names GPUs this node cannot share; publishing the rest",
                extra={"fields": {**fields, "problems": list(problems)}},
            )
        elif names != self.shared:
            log.info("GPUs published for memory slices", extra={"fields": fields})
        return names

    def _shares(self, inv: Inventory, *, first: bool) -> dict[str, int]:
        node = self.config.node_name
        shares, problems = self.config.gpu_shares.resolve(inv, node, self.shared)
        if problems and first:
            raise GpuSharesError(problems[0])
        fields = {"node": node, "shares": shares}
        if problems:
            log.error(
                "GPUs that cannot have shares are published without them",
                extra={"fields": {**fields, "problems": list(problems)}},
            )
        elif shares != self.shares:
            log.info("GPUs published with integer shares", extra={"fields": fields})
        return shares

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        fields = {"node": self.config.node_name, "driver": self.config.driver_name}
        delays = Backoff(first_s=1.0, max_s=60.0).delays()
        while self.inventory is None:
            try:
                inv = await self.scan()
                log.info(
                    "inventory discovered",
                    extra={
                        "fields": {
                            **fields,
                            "gpus": len(inv.gpus),
                            "devices": len(inv.devices(self.config.mig_strategy)),
                        }
                    },
                )
            except DiscoveryError as e:
                delay = next(delays)
                log.error(
                    "discovery failed; nothing published",
                    extra={"fields": {**fields, "error": str(e), "retry_s": delay}},
                )
                await anyio.sleep(delay)
        assert self.health is not None
        # Taken before the watcher starts: what its first events change (a GPU whose
        # events cannot be watched, one lost) reaches the slices as any later change.
        generation = self.health.generation
        if not self.config.health_events:
            log.warning(
                "health checks are off: no XID, ECC or lost-GPU event taints a device, "
                "and the kubelet reads every device's health as Unknown",
                extra={"fields": fields},
            )
        async with anyio.create_task_group() as tg:
            await tg.start(self.slices.run)
            if self.config.health_events:
                watcher = NvmlHealthWatcher(
                    self.nvml, self.health, resets=self._resets, timed=self._timed
                )
                await tg.start(watcher.run)
            tg.start_soon(self._follow_health, generation)
            tg.start_soon(self._rescan_loop)
            self.ready.set()
            task_status.started()

    async def _follow_health(self, generation: int) -> None:
        """Trigger the slices at every health change after `generation`."""
        assert self.health is not None
        while True:
            await self.health.wait_for_change(generation)
            generation = self.health.report().generation
            self.slices.trigger()

    async def _rescan_loop(self) -> None:
        while True:
            await anyio.sleep(self.config.rescan_s)
            try:
                await self.scan()
            except DiscoveryError as e:
                log.warning(
                    "rescan failed; keeping the last complete inventory",
                    extra={"fields": {"node": self.config.node_name, "error": str(e)}},
                )
