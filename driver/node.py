"""One node's whole driver: inventory and slices, the kubelet plugin, housekeeping.

`NodeService` wires the pieces that `gpudra node` runs in one process, in the order
that keeps the kubelet's view consistent:

1. the agent discovers the GPUs (nothing is published before a complete scan);
2. the preparer rolls back what a crash interrupted (`recover`) before any socket
   exists, so the kubelet never sees half-prepared claims;
3. the kubelet plugin serves: it reads and checks each claim from the API server
   (`ApiClaims`) and hands it to the preparer; its health stream reads the agent's
   health state, restricted to the devices the slices publish;
4. a periodic sweep unprepares claims deleted from the API while the kubelet was
   not looking;
5. with the plugin, the sampler reads every device's NVML telemetry on an interval
   for the device metrics and accounting (`gpudra.driver.sampling`), and the claim
   status writer shows in each prepared claim what its devices really are
   (`gpudra.driver.claimstatus`); neither is on a prepare's path, which only tells
   the sampler's log when each claim starts and stops holding its devices (an append,
   so accounting bills the times between). The sampler labels
   holders with their namespace's GpuTenant, watched as the webhook watches it
   (`gpudra.driver.tenancy`), and with the containers that use each claim, read from
   its pod on the same interval (`gpudra.driver.podclaims`).

The plugin's Prometheus metrics go to `registry`; `gpudra node` serves them on its
metrics address.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from gpudra.common.kube import Kube
from gpudra.common.periodic import run_every
from gpudra.driver.accounting import DEFAULT_IDLE_BELOW, DEFAULT_ZERO_WINDOW_S, Accounting
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.cdi import (
    DEFAULT_CDI_ROOT,
    CdiSpecStore,
    DeviceNumbers,
    claim_kind,
    find_driver_files,
    find_toolkit_spec,
)
from gpudra.driver.checkpoint import (
    DEFAULT_BOOT_ID_PATH,
    CheckpointOwnerGoneError,
    CheckpointTakenOverError,
    ClaimRecord,
)
from gpudra.driver.claimreader import ApiClaims
from gpudra.driver.claimstatus import ClaimStatusWriter
from gpudra.driver.devices import MigKey
from gpudra.driver.holders import ClaimInfos
from gpudra.driver.metrics import ClaimMetrics, DeviceMetrics, DiscoveryGaps
from gpudra.driver.mig import recorded_instances
from gpudra.driver.mpspods import MpsDaemonPods
from gpudra.driver.nvml import NvmlLibrary
from gpudra.driver.plugin import (
    DEFAULT_KUBELET_ROOT,
    DRA_APIS,
    DeviceHealth,
    HealthSnapshot,
    KubeletPlugin,
)
from gpudra.driver.podclaims import ClaimContainers
from gpudra.driver.prepare import CONFLICT_WAIT_S, ClaimPreparer
from gpudra.driver.sampling import DEFAULT_INTERVAL_S, Sampler
from gpudra.driver.sharing import NvidiaSharing
from gpudra.driver.tenancy import NamespaceTenants
from prometheus_client import CollectorRegistry

__all__ = ["AgentHealth", "NodeService", "PluginConfig"]

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.json"
DEFAULT_STATE_DIR = Path("/var/lib/gpudra")


@dataclass(frozen=True)
class PluginConfig:
    """Where the kubelet plugin finds the host, and how it behaves."""

    kubelet_root: Path = DEFAULT_KUBELET_ROOT
    cdi_root: Path = DEFAULT_CDI_ROOT
    state_dir: Path = DEFAULT_STATE_DIR
    driver_root: Path = Path("/")
    dev_root: Path = Path("/")
    proc_root: Path = Path("/proc")
    host_root: Path = Path("/")
    boot_id_path: Path = DEFAULT_BOOT_ID_PATH
    pod_uid: str | None = None
    nvidia_smi: Path | None = None
    mps_control: Path | None = None
    toolkit_spec: bool = True
    # Empty: find the driver's libraries and utilities under driver_root.
    driver_libraries: tuple[str, ...] = ()
    cleanup_interval_s: float = 60.0
    # How long a prepare whose device another claim still holds waits for that claim's
    # unprepare before it fails; 0: at once.
    conflict_wait_s: float = CONFLICT_WAIT_S
    # How often an agent whose checkpoint was taken over looks whether the agent that
    # took it over still runs (`_watch_owner`).
    owner_check_s: float = 5.0
    # Device telemetry for metrics and accounting: every this many seconds; 0: off.
    sample_interval_s: float = DEFAULT_INTERVAL_S
    idle_below: float = DEFAULT_IDLE_BELOW  # utilization percent under which a device idles
    # Seconds a new accounting counter is served at zero from its first scrape.
    zero_window_s: float = DEFAULT_ZERO_WINDOW_S
    claim_status: bool = False  # write status.devices of prepared claims
    # Write each prepared request's device metadata file for its containers.
    device_metadata: bool = False
    # Emulated GPUs: device node numbers for the CDI specs, and the tools' environment.
    device_numbers: DeviceNumbers | None = None
    tool_env: Mapping[str, str] = field(default_factory=dict)
    # The DRA gRPC APIs offered to the kubelet (tests hold a kubelet to one of them).
    dra_apis: tuple[str, ...] = DRA_APIS
    # MPS control daemons in pods of their own (`gpudra.driver.mpspods`), made from
    # this Pod template in `namespace`; None: daemons are this process's children.
    mps_pod_template: Mapping[str, Any] | None = None
    namespace: str = ""

    @property
    def checkpoint_path(self) -> Path:
        return self.state_dir / CHECKPOINT_FILE


class AgentHealth:
    """The agent's health state as the kubelet health stream reads it (`HealthSource`).

    Only devices the slices publish are listed: the kubelet matches health by pool
    and device name, and a name it never saw allocated would only be noise. Before
    the first discovery the list is empty at generation 0; afterwards generations
    are the health state's plus one, so they only grow.
    """

    def __init__(self, agent: NodeAgent) -> None:
        self._agent = agent

    def snapshot(self) -> HealthSnapshot:
        agent = self._agent
        health, inventory = agent.health, agent.inventory
        if health is None or inventory is None:
            return HealthSnapshot(0, ())
        report = health.report()
        published = {d.name for d in inventory.devices(agent.config.mig_strategy)}
        pool = agent.config.node_name
        devices = tuple(
            DeviceHealth(
                pool_name=pool,
                device_name=name,
                # Unknown, not Healthy, where no event of its GPU reaches the agent
                # (health checks off included).
                healthy=state.healthy if state.monitored or not state.healthy else None,
                updated_at=state.updated_at,
                message=state.message,
            )
            for name, state in sorted(report.devices.items())
            if name in published
        )
        return HealthSnapshot(report.generation + 1, devices)

    async def wait_for_change(self, generation: int) -> None:
        await self._agent.ready.wait()
        health = self._agent.health
        assert health is not None
        if generation == 0:
            return
        await health.wait_for_change(generation - 1)


class NodeService:
    """Runs the agent and, with a `PluginConfig`, the kubelet plugin beside it."""

    def __init__(
        self,
        agent_config: AgentConfig,
        kube: Kube,
        nvml: NvmlLibrary,
        plugin: PluginConfig | None = None,
        *,
        registry: CollectorRegistry | None = None,
        fault: Callable[[str], None] | None = None,
    ) -> None:
        self.agent = NodeAgent(
            agent_config, kube, nvml, own_migs=self._own_migs, stand_down=self._taken_over
        )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(DiscoveryGaps(lambda: self.agent.inventory))
        self.ready = anyio.Event()
        self._plugin_config = plugin
        self.preparer: ClaimPreparer | None = None
        self.plugin: KubeletPlugin | None = None
        self.sampler: Sampler | None = None
        self.status_writer: ClaimStatusWriter | None = None
        self.tenants = NamespaceTenants(own_namespace=plugin.namespace if plugin else "")
        self.containers = ClaimContainers(kube)
        self._kube = kube
        self._infos = ClaimInfos()
        # Only the sampler and the claim status writer read what the claim reader
        # remembers, and only their passes forget it (`_prepared_claims`): without
        # either, it would keep every claim ever read.
        consumed = plugin is not None and (plugin.sample_interval_s > 0 or plugin.claim_status)
        self._claims = ApiClaims(
            kube,
            driver=agent_config.driver_name,
            pool=agent_config.node_name,
            infos=self._infos if consumed else None,
        )
        if plugin is None:
            return
        toolkit = find_toolkit_spec() if plugin.toolkit_spec else None
        libraries = plugin.driver_libraries or find_driver_files(
            plugin.driver_root, host_view=plugin.host_root
        )
        log.info(
            "driver files to mount",
            extra={"fields": {"driver_root": str(plugin.driver_root), "files": list(libraries)}},
        )
        if plugin.sample_interval_s > 0:
            self.sampler = self._sampler(plugin)
        self.preparer = ClaimPreparer(
            node_name=agent_config.node_name,
            legacy_attributes=agent_config.legacy_attributes,
            numa_node_list=agent_config.numa_node_list,
            nvml=nvml,
            inventory=lambda: self.agent.inventory,
            shares=lambda: self.agent.shares,
            cdi=CdiSpecStore(plugin.cdi_root, kind=claim_kind(agent_config.driver_name)),
            checkpoint_path=plugin.checkpoint_path,
            sharing=NvidiaSharing(
                driver_root=plugin.driver_root,
                host_view=plugin.host_root,
                nvidia_smi=plugin.nvidia_smi,
                mps_control=plugin.mps_control,
                env=plugin.tool_env,
                pods=None
                if plugin.mps_pod_template is None
                else MpsDaemonPods(
                    kube,
                    namespace=plugin.namespace,
                    node_name=agent_config.node_name,
                    template=plugin.mps_pod_template,
                ),
            ),
            driver_root=plugin.driver_root,
            dev_root=plugin.dev_root,
            proc_root=plugin.proc_root,
            state_dir=plugin.state_dir,
            boot_id_path=plugin.boot_id_path,
            device_metadata=agent_config.driver_name if plugin.device_metadata else None,
            driver_libraries=libraries,
            host_view=plugin.host_root,
            toolkit=toolkit,
            mig_strategy=agent_config.mig_strategy,
            registry=self.registry,
            device_numbers=plugin.device_numbers,
            fault=fault,
            # Accounting bills each claim from its prepare to its unprepare, by these.
            holdings=self.sampler.holdings if self.sampler is not None else None,
            conflict_wait=plugin.conflict_wait_s,
        )
        self.plugin = KubeletPlugin(
            agent_config.driver_name,
            self.preparer,
            claims=self._claims,
            metrics=ClaimMetrics(self.registry),
            kubelet_root=plugin.kubelet_root,
            pod_uid=plugin.pod_uid,
            health=AgentHealth(self.agent),
            dra_apis=plugin.dra_apis,
        )
        if plugin.claim_status:
            self.status_writer = ClaimStatusWriter(
                kube,
                driver=agent_config.driver_name,
                pool=agent_config.node_name,
                prepared=self._prepared_claims,
                claim_info=self._infos.snapshot,
            )

    def _own_migs(self) -> frozenset[MigKey]:
        """The MIG instances the checkpoint records as gpudra's (none before it is
        loaded: until then every instance counts as foreign, which hides a prepared
        claim's placement for a moment but never offers a taken one)."""
        cp = self.preparer.checkpoint_now() if self.preparer is not None else None
        return recorded_instances(cp.claims()) if cp is not None else frozenset()

    def _taken_over(self) -> str | None:
        """Why this agent no longer publishes the node's slices: another agent (a
        rolling update's surge pod) took the kubelet plugin's checkpoint over, and
        publishes them. None while none has (always, without the plugin)."""
        return self.preparer.taken_over() if self.preparer is not None else None

    def _prepared_claims(self) -> tuple[ClaimRecord, ...]:
        """The preparer's claims now, read without its lock; what the claim reader
        remembered of claims no longer prepared is dropped."""
        cp = self.preparer.checkpoint_now() if self.preparer is not None else None
        claims = tuple(cp.claims()) if cp is not None else ()
        self._infos.retain(c.uid for c in claims)
        return claims

    def _sampler(self, plugin: PluginConfig) -> Sampler:
        accounting = Accounting(idle_below=plugin.idle_below, zero_window_s=plugin.zero_window_s)
        sampler = Sampler(
            self.agent.nvml,
            pool=self.agent.config.node_name,
            inventory=lambda: self.agent.inventory,
            prepared=self._prepared_claims,
            claim_info=self._infos.snapshot,
            tenant_of=self.tenants.tenant_of,
            containers=self.containers.snapshot,
            shares=lambda: self.agent.shares,
            health=lambda: self.agent.health,
            interval_s=plugin.sample_interval_s,
            on_sample=(accounting.observe,),
        )
        self.registry.register(DeviceMetrics(sampler, accounting))
        return sampler

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self.agent.run)
            if self.preparer is not None and self.plugin is not None:
                try:
                    await self._serve(tg, task_status)
                finally:
                    # Also when stopped during recovery: what it appended goes into the file.
                    await self.preparer.close()
            else:
                self.ready.set()
                task_status.started()

    async def _serve(
        self, tg: anyio.abc.TaskGroup, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        """Recover, then serve the kubelet until cancelled."""
        assert self.preparer is not None and self.plugin is not None
        report = await self.preparer.recover()
        log.info("recovered from the checkpoint", extra={"fields": {"report": str(report)}})
        self.agent.slices.trigger()  # the checkpoint now names gpudra's MIG instances
        try:
            await self.plugin.start()
            if self.sampler is not None or self.status_writer is not None:
                tg.start_soon(self._reread_prepared_claims)
            if self.sampler is not None:
                await tg.start(self.tenants.run, self._kube)
                tg.start_soon(self._read_holding_pods, self.sampler.interval_s)
                await tg.start(self.sampler.run)
            if self.status_writer is not None:
                await tg.start(self.status_writer.run)
            tg.start_soon(self._watch_owner)
            self.ready.set()
            task_status.started()
            await self._sweep_deleted_claims()
        finally:
            await self.plugin.stop()

    async def _reread_prepared_claims(self) -> None:
        """Read the claims prepared before this start again, for what the checkpoint does
        not keep (DeviceClass, slice memory, integer shares), so their accounting survives
        a restart; a failed read is retried until it succeeds or the claim is gone."""
        await self._claims.read_unknown(self._prepared_claims)

    async def _read_holding_pods(self, interval_s: float) -> None:
        """Read, on the sampling interval, which containers use each prepared claim."""
        await run_every(
            interval_s,
            lambda: self.containers.refresh(self._prepared_claims(), self._infos.snapshot()),
            failed="reading the pods of prepared claims failed; trying again next interval",
            logger=log,
        )

    async def _sweep_deleted_claims(self) -> None:
        """Unprepare deleted claims on every cleanup interval, until another agent takes
        the checkpoint over: the sweep is that agent's from then on, under its own
        records, and this one's would undo devices it may hold. The plugin serves on
        (refusing every change) until this agent stops."""
        assert self.preparer is not None and self._plugin_config is not None
        while True:
            await anyio.sleep(self._plugin_config.cleanup_interval_s)
            try:
                await self.preparer.cleanup_deleted_claims(self._claims)
            except CheckpointTakenOverError as exc:
                log.warning(
                    "deleted claims no longer swept: another agent on this node took the "
                    "checkpoint over",
                    extra={"fields": {"error": str(exc)}},
                )
                break
            except Exception:
                log.exception("cleanup of deleted claims failed; retrying later")
        await anyio.sleep_forever()

    async def _watch_owner(self) -> None:
        """Once another agent took the checkpoint over, stop this one when that agent is
        gone (its pod failed or deleted, a rollback): raises CheckpointOwnerGoneError, which
        ends `gpudra node` with an error, and the restart takes the checkpoint over again.
        Standing down on, this agent would refuse every prepare for good while its liveness
        probe, which prepares nothing, still passes.

        Every `owner_check_s` (5 s), not the sweep's minute: until it stops, the node
        prepares nothing. Each look is one stat while the checkpoint is this agent's, a
        read of a few owner files once it is not (`ClaimPreparer.owner_gone`)."""
        assert self.preparer is not None and self._plugin_config is not None
        while True:
            await anyio.sleep(self._plugin_config.owner_check_s)
            try:
                gone = await self.preparer.owner_gone()
            except Exception:
                # Unsure is not gone: taking the file back from an agent that runs would
                # leave that one refusing every change.
                log.exception("checking the checkpoint's owner failed; retrying later")
                continue
            if gone is not None:
                log.error(
                    "stopping: the agent that took the checkpoint over is gone; this agent's "
                    "restart takes it over again",
                    extra={"fields": {"reason": gone}},
                )
                raise CheckpointOwnerGoneError(gone)
