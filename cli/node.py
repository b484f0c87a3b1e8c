"""`gpudra node`: the per-node agent (discovery, health taints, ResourceSlices) and
the kubelet plugin that prepares claims on the node."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

import aiohttp
import anyio
from gpudra.api.names import dns_subdomain_problem, driver_name_problem
from gpudra.cli.cluster import add_kubeconfig
from gpudra.cli.flagvalues import seconds_within
from gpudra.common.backoff import Backoff
from gpudra.common.errors import exception_text
from gpudra.common.eventloop import run_event_loop
from gpudra.common.heap import freeze_startup_heap
from gpudra.common.kube import ApiError, Kube
from gpudra.common.metricsserver import DEADLINE_S as METRICS_DEADLINE_S
from gpudra.common.metricsserver import HEAD_DEADLINE_S as METRICS_HEAD_DEADLINE_S
from gpudra.common.metricsserver import MAX_CONNECTIONS as METRICS_MAX_CONNECTIONS
from gpudra.common.metricsserver import MAX_PER_CLIENT as METRICS_MAX_PER_CLIENT
from gpudra.common.metricsserver import serve_metrics
from gpudra.common.signals import stop_on_signal
from gpudra.driver.accounting import DEFAULT_IDLE_BELOW, DEFAULT_ZERO_WINDOW_S
from gpudra.driver.agent import AgentConfig
from gpudra.driver.checkpoint import CheckpointError
from gpudra.driver.devices import (
    SHARED_GPUS_FORMS,
    DiscoveryError,
    Inventory,
    MigStrategy,
    SharedGpus,
    SharedGpusError,
    discover,
)
from gpudra.driver.driverroot import DriverRoot
from gpudra.driver.gpushares import GpuShares, GpuSharesError, parse_node_override
from gpudra.driver.health import HealthPolicy, TaintEffect
from gpudra.driver.mpspods import PodTemplateError, load_template
from gpudra.driver.node import DEFAULT_STATE_DIR, NodeService, PluginConfig
from gpudra.driver.nvml import (
    NvmlLibrary,
    NvmlLoadError,
    ProfileError,
    labelled_nvml,
    load_nvml,
    preload_nvml,
)
from gpudra.driver.nvml.standin import (
    TOOLS_LOG_ENV,
    SmiGpu,
    device_numbers,
    install_driver_root,
)
from gpudra.driver.plugin import (
    DEFAULT_KUBELET_ROOT,
    DRA_APIS,
    KUBELET_CALL_TIMEOUT_S,
    plugin_socket_problem,
)
from gpudra.driver.prepare import CONFLICT_WAIT_S, MAX_CONFLICT_WAIT_S, PREPARE_STEPS
from gpudra.driver.sampling import DEFAULT_INTERVAL_S
from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

# Emulated GPUs: what the agent keeps under --state-dir.
EMULATED_NVML_STATE = "emulated-nvml.json"
EMULATED_DRIVER_ROOT = "emulated-driver"
EMULATED_TOOLS_LOG = "emulated-tools.log"
# Reading the node's profile label while the API server is not answering yet.
NODE_READ_BACKOFF = Backoff(first_s=0.5, max_s=10.0)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("node", help="run the node agent: discover GPUs and publish ResourceSlices")
    p.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        help="this node's name (default: $NODE_NAME)",
    )
    p.add_argument("--driver-name", default="gpu.nvidia.com", help="DRA driver name")
    p.add_argument(
        "--nvml",
        default="real",
        help="'real', 'emulated:<profile>' or 'emulated:<file.json>' (default: real). "
        "Emulated GPUs need no NVIDIA driver on the node: without --driver-root the "
        "kubelet plugin installs a stand-in driver root under --state-dir, and CDI specs "
        "carry device numbers instead of host /dev nodes",
    )
    p.add_argument(
        "--emulated-profile-label",
        default="",
        metavar="LABEL",
        help="emulated GPUs only: where this node carries the label LABEL, its value names "
        "the node's emulated profile (a built-in one), in place of --nvml's; nodes without "
        "it use --nvml's. Read when the agent starts (default: none)",
    )
    p.add_argument(
        "--nvml-state",
        type=Path,
        default=None,
        metavar="FILE",
        help="emulated GPUs only: keep their MIG instances and modes in FILE across "
        "restarts, as real GPUs keep them (default with the kubelet plugin: "
        f"<state-dir>/{EMULATED_NVML_STATE})",
    )
    p.add_argument(
        "--nvml-script",
        type=Path,
        default=None,
        metavar="FILE",
        help="emulated GPUs only: a JSON telemetry script (GPU index or UUID -> values such "
        'as {"utilization": 3}), re-read whenever it changes',
    )
    add_kubeconfig(p)
    p.add_argument(
        "--mig-strategy",
        choices=[s.value for s in MigStrategy],
        default="dynamic",
        help="publish existing MIG devices (static) or every placement (dynamic)",
    )
    p.add_argument(
        "--shared-gpus",
        default="none",
        metavar="GPUS",
        help=f"whole GPUs to publish shareable, handed out in memory slices: {SHARED_GPUS_FORMS}"
        " (default: none)",
    )
    p.add_argument(
        "--gpu-shares",
        type=int,
        default=0,
        metavar="N",
        help="publish every whole GPU with N integer shares, so up to N claims of one share "
        "each run on it (the device plugin's time-slicing replicas; default: 0, none)",
    )
    p.add_argument(
        "--gpu-shares-node",
        action="append",
        default=[],
        metavar="NODE=N",
        help="--gpu-shares for the node named NODE (repeatable)",
    )
    p.add_argument(
        "--gpu-shares-gpus",
        default="all",
        metavar="GPUS",
        help=f"the GPUs --gpu-shares applies to: {SHARED_GPUS_FORMS}; all (the default) "
        "leaves out MIG-enabled GPUs and those in --shared-gpus, naming one is refused",
    )
    p.add_argument(
        "--legacy-attributes",
        action="store_true",
        help="also publish the attributes the upstream driver removed in v25.8.0: 'index' "
        "and 'minor' on GPUs, 'index' and 'parentIndex' on MIG devices, for selectors "
        "written for older releases. Off by default: NVML indices and minor numbers can "
        "change across reboots and driver reloads, so such a selector may pick another GPU",
    )
    p.add_argument(
        "--numa-node-list",
        action="store_true",
        help="publish resource.kubernetes.io/numaNode as a list (KEP-6072): the GPU's NUMA "
        "node, then the nearest nodes of its socket, so that matchAttribute pairs it with "
        "devices of those nodes. Needs the DRAListTypeAttributes feature gate (alpha) on "
        "the API server, which otherwise refuses the list, and the scheduler, and "
        "Kubernetes 1.37 (1.36's scheduler never matches a list); off by default",
    )
    p.add_argument(
        "--health-checks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="watch NVML's XID, ECC and lost-GPU events and taint the devices they hit "
        "(default). --no-health-checks, like the device plugin's "
        "DP_DISABLE_HEALTHCHECKS=all: no health taints, a lost GPU leaves the slices at "
        "the next rescan, and the kubelet reads every device's health as Unknown",
    )
    p.add_argument(
        "--critical-xid-effect",
        choices=["NoSchedule", "NoExecute"],
        default="NoSchedule",
        help="taint effect for critical XIDs",
    )
    p.add_argument(
        "--application-xids",
        default="",
        help="extra comma-separated XIDs treated as application errors (effect None)",
    )
    p.add_argument(
        "--reset-xids",
        default="",
        help="extra comma-separated XIDs whose taint stays until the GPU is reset (create "
        "<state-dir>/reset/<GPU UUID> after resetting it), like 48, 79, 95 and the others "
        "NVIDIA's XID catalogue has reset",
    )
    p.add_argument(
        "--recovery-after",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="remove a health taint after this long without new errors (taints that wait "
        "for a GPU reset stay until it)",
    )
    k = p.add_argument_group("kubelet plugin")
    k.add_argument(
        "--kubelet-plugin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the kubelet plugin (prepare/unprepare claims); off: publish slices only",
    )
    k.add_argument(
        "--kubelet-root",
        type=Path,
        default=DEFAULT_KUBELET_ROOT,
        help="the kubelet's root directory (plugins_registry/ and plugins/ are in it)",
    )
    k.add_argument("--cdi-root", type=Path, default=Path("/var/run/cdi"), help="CDI spec folder")
    k.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="checkpoint, MPS folders and GPU reset marks; a host path seen at the same path here",
    )
    k.add_argument(
        "--driver-root",
        type=Path,
        default=Path("/"),
        help="where the NVIDIA driver's files are on the host (/ or a containerised driver)",
    )
    k.add_argument(
        "--dev-root", type=Path, default=Path("/"), help="the host folder that holds dev/nvidia*"
    )
    k.add_argument(
        "--host-root",
        type=Path,
        default=Path("/"),
        help="where this process sees the host's / (to check which files exist)",
    )
    k.add_argument(
        "--driver-library",
        action="append",
        default=[],
        metavar="PATH",
        help="a driver library or utility (path in the driver root) to mount; repeatable "
        "(default: the driver's libraries and utilities found under --driver-root)",
    )
    k.add_argument("--nvidia-smi", type=Path, default=None, help="path of nvidia-smi")
    k.add_argument("--mps-control", type=Path, default=None, help="path of nvidia-cuda-mps-control")
    k.add_argument(
        "--mps-daemon-pod-template",
        type=Path,
        default=None,
        metavar="FILE",
        help="run each MPS control daemon in a pod of its own made from this JSON Pod "
        "template (the chart renders it), so daemons outlive this process's container; "
        "default: daemons are this process's children",
    )
    k.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE") or "",
        help="namespace of the MPS daemon pods (default: $POD_NAMESPACE)",
    )
    k.add_argument(
        "--toolkit-cdi",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reference the NVIDIA container toolkit's CDI devices when its spec exists",
    )
    k.add_argument(
        "--pod-uid",
        default=os.environ.get("POD_UID") or None,
        help="include this in socket names, for rolling updates (default: $POD_UID)",
    )
    k.add_argument(
        "--cleanup-interval",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how often to unprepare claims deleted from the API",
    )
    k.add_argument(
        "--conflict-wait",
        type=_conflict_wait_seconds,
        default=CONFLICT_WAIT_S,
        metavar="SECONDS",
        help="a prepare whose device another claim still holds (a pod deleted with no "
        "grace whose containers are still stopping) waits this long for that claim's "
        "unprepare before it fails; 0: fail at once, the kubelet retrying at its next sync "
        f"of the pod (default: {CONFLICT_WAIT_S:g}, at most {MAX_CONFLICT_WAIT_S:g})",
    )
    k.add_argument(
        "--metrics-address",
        default="0.0.0.0:9477",
        metavar="HOST:PORT",
        help="serve Prometheus metrics here; empty: off",
    )
    k.add_argument(
        "--metrics-max-connections",
        type=int,
        default=METRICS_MAX_CONNECTIONS,
        metavar="N",
        help="metrics connections served at once, a thread each; one more is closed at once "
        f"(default: {METRICS_MAX_CONNECTIONS})",
    )
    k.add_argument(
        "--metrics-max-per-client",
        type=int,
        default=METRICS_MAX_PER_CLIENT,
        metavar="N",
        help="metrics connections served at once from one address (within "
        "--metrics-max-connections); one more from it is closed at once. Raise it where "
        f"several scrapers reach the agent from one address (default: {METRICS_MAX_PER_CLIENT})",
    )
    k.add_argument(
        "--metrics-head-deadline",
        type=float,
        default=METRICS_HEAD_DEADLINE_S,
        metavar="SECONDS",
        help="a metrics connection that has not sent its whole request this long after its "
        "accept (or --metrics-deadline, if sooner) is closed; raise it where scrapers reach "
        f"the agent over a slow link (default: {METRICS_HEAD_DEADLINE_S:g})",
    )
    k.add_argument(
        "--metrics-deadline",
        type=float,
        default=METRICS_DEADLINE_S,
        metavar="SECONDS",
        help="a metrics connection is closed this long after its accept, whatever it sent "
        f"(default: {METRICS_DEADLINE_S:g})",
    )
    k.add_argument(
        "--sample-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="SECONDS",
        help="read every device's utilization, memory, temperature, power, clocks and ECC "
        "this often for the device metrics and accounting; 0: off "
        f"(default: {DEFAULT_INTERVAL_S:g})",
    )
    k.add_argument(
        "--idle-threshold",
        type=float,
        default=DEFAULT_IDLE_BELOW,
        metavar="PERCENT",
        help="an allocated device whose utilization is under this counts as idle "
        f"(default: {DEFAULT_IDLE_BELOW:g})",
    )
    k.add_argument(
        "--accounting-zero-window",
        type=_zero_window_seconds,
        default=DEFAULT_ZERO_WINDOW_S,
        metavar="SECONDS",
        help="serve a new accounting counter at 0 (what it counted in "
        "gpudra_withheld_*_device_seconds) to every scrape for this long from its first, "
        "so that each Prometheus scraping at least this often counts its start; keep it "
        "above the longest scrape interval of any reader (default: "
        f"{DEFAULT_ZERO_WINDOW_S:g})",
    )
    k.add_argument(
        "--claim-status",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="show in each prepared ResourceClaim's status.devices what its devices are "
        "(GPU and MIG UUIDs, sharing, slice memory); needs patch on resourceclaims/status "
        "(default: off)",
    )
    k.add_argument(
        "--device-metadata",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="give each container that uses a claim a read-only file of its devices and "
        "their attributes (GPU UUID, product, PCI bus ID, MIG profile) at Kubernetes' "
        "device metadata path, /var/run/kubernetes.io/dra-device-attributes/ (KEP-5304); "
        "the files live under --state-dir (default: off)",
    )
    # Test hook: SIGKILL this process right after the named step of a prepare.
    k.add_argument("--crash-at", choices=PREPARE_STEPS, default=None, help=argparse.SUPPRESS)
    # Tests only: offer the kubelet one DRA API, to check each release's kubelet with it.
    k.add_argument(
        "--dra-api", action="append", choices=DRA_APIS, default=None, help=argparse.SUPPRESS
    )
    p.set_defaults(func=run)


def _xids(flag: str, raw: str) -> frozenset[int]:
    try:
        return frozenset(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"gpudra node: {flag} {raw!r}: give integers, e.g. 13,31") from None


def _shared_gpus(raw: str) -> SharedGpus:
    try:
        return SharedGpus.parse(raw)
    except SharedGpusError as e:
        raise SystemExit(f"gpudra node: --shared-gpus {raw!r}: {e}") from None


def _gpu_shares(args: argparse.Namespace) -> GpuShares:
    try:
        overrides = dict(parse_node_override(raw) for raw in args.gpu_shares_node)
        gpus = SharedGpus.parse(args.gpu_shares_gpus)
        return GpuShares(default=args.gpu_shares, by_node=overrides, gpus=gpus)
    except SharedGpusError as e:
        raise SystemExit(f"gpudra node: --gpu-shares-gpus {args.gpu_shares_gpus!r}: {e}") from None
    except GpuSharesError as e:
        raise SystemExit(f"gpudra node: {e}") from None


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    inner = group.exceptions[0]
    return _first(inner) if isinstance(inner, BaseExceptionGroup) else inner


def _start_refused(args: argparse.Namespace, error: BaseException) -> str:
    """One line: the first inventory cannot honour the sharing settings."""
    if isinstance(error, GpuSharesError):
        return f"gpudra node: {error}"  # names the GPU and the setting itself
    return f"gpudra node: --shared-gpus {args.shared_gpus!r}: {error}"


def _metrics_address(args: argparse.Namespace) -> tuple[str, int] | None:
    """The metrics listener's address, None for none; its bounds are checked with it."""
    if args.metrics_max_connections < 1:
        raise SystemExit(
            f"gpudra node: --metrics-max-connections {args.metrics_max_connections}: give at "
            f"least 1 (default: {METRICS_MAX_CONNECTIONS})"
        )
    if args.metrics_max_per_client < 1:
        raise SystemExit(
            f"gpudra node: --metrics-max-per-client {args.metrics_max_per_client}: give at "
            f"least 1 (default: {METRICS_MAX_PER_CLIENT})"
        )
    if not args.metrics_deadline > 0:
        raise SystemExit(
            f"gpudra node: --metrics-deadline {args.metrics_deadline:g}: give seconds, more "
            f"than 0 (default: {METRICS_DEADLINE_S:g})"
        )
    if not args.metrics_head_deadline > 0:
        raise SystemExit(
            f"gpudra node: --metrics-head-deadline {args.metrics_head_deadline:g}: give "
            f"seconds, more than 0 (default: {METRICS_HEAD_DEADLINE_S:g})"
        )
    raw: str = args.metrics_address
    if not raw:
        return None
    host, sep, port = raw.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise SystemExit(
            f"gpudra node: --metrics-address {raw!r}: give HOST:PORT, e.g. 0.0.0.0:9477"
        )
    return host or "0.0.0.0", int(port)  # noqa: S104


def _crash_at(step: str | None) -> Callable[[str], None] | None:
    if step is None:
        return None

    def fault(at: str) -> None:
        if at == step:
            log.warning("crashing on request", extra={"fields": {"step": at}})
            os.kill(os.getpid(), signal.SIGKILL)
            # Still here: we are PID 1 of a PID namespace, which ignores SIGKILL from
            # inside. Exit as abruptly (no cleanup), with the status SIGKILL gives.
            os._exit(128 + signal.SIGKILL)

    return fault


def _names(args: argparse.Namespace) -> None:
    """--driver-name and --node-name name the slices, the pool and the taint keys: a
    name the API refuses would fail every slice write, so the agent does not start."""
    if problem := driver_name_problem(args.driver_name):
        raise SystemExit(
            f"gpudra node: --driver-name {args.driver_name!r} {problem}: give the DRA driver "
            "name the DeviceClasses select, e.g. gpu.nvidia.com (the chart's driverName)"
        )
    if args.node_name and (problem := dns_subdomain_problem(args.node_name)):
        raise SystemExit(
            f"gpudra node: --node-name {args.node_name!r} {problem}: give this node's name "
            "as the API has it (default: $NODE_NAME, which the chart sets from spec.nodeName)"
        )


def _agent_config(args: argparse.Namespace) -> AgentConfig:
    _names(args)
    try:
        policy = HealthPolicy(
            driver_name=args.driver_name,
            critical_effect=TaintEffect(args.critical_xid_effect),
            extra_application_xids=_xids("--application-xids", args.application_xids),
            extra_reset_xids=_xids("--reset-xids", args.reset_xids),
            recovery_after_s=args.recovery_after,
        )
    except ValueError as e:
        raise SystemExit(f"gpudra node: {e}") from None
    return AgentConfig(
        node_name=args.node_name,
        driver_name=args.driver_name,
        mig_strategy=MigStrategy(args.mig_strategy),
        health=policy,
        health_events=args.health_checks,
        state_dir=args.state_dir,
        shared_gpus=_shared_gpus(args.shared_gpus),
        gpu_shares=_gpu_shares(args),
        legacy_attributes=args.legacy_attributes,
        numa_node_list=args.numa_node_list,
    )


def _emulated(args: argparse.Namespace) -> bool:
    return str(args.nvml).startswith("emulated:")


async def _node_nvml(args: argparse.Namespace) -> str:
    """The NVML of this node by its label (`--emulated-profile-label`): its Node read
    once, before discovery, as the profile decides every device it publishes."""
    label, node = args.emulated_profile_label, args.node_name
    labelled_nvml(args.nvml, label=label, node=node, labels={})  # --nvml real: before connecting
    kube = await Kube.connect(args.kubeconfig)
    try:
        return await node_nvml(kube, node, args.nvml, label)
    finally:
        await kube.close()


async def node_nvml(
    kube: Kube, node: str, spec: str, label: str, backoff: Backoff = NODE_READ_BACKOFF
) -> str:
    """`labelled_nvml` for `node` as the API has it. An API server not answering yet
    (the agent starts with the node) is waited for; a refusal (no RBAC, no such node)
    stops the agent with the reason, as no retry mends it."""
    delays = backoff.delays()
    while True:
        try:
            obj = await kube.request("GET", f"/api/v1/nodes/{node}")
            break
        except ApiError as e:
            if e.status < 500 and e.status != 429:  # 429: the server asks us to wait
                raise NvmlLoadError(
                    f"--emulated-profile-label {label}: reading node {node}: {e} (the agent "
                    "needs get on nodes, which the chart grants, and --node-name its node)"
                ) from None
            problem = str(e)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            problem = exception_text(e)
        delay = next(delays)
        log.warning(
            "cannot read this node's labels yet; retrying",
            extra={"fields": {"node": node, "label": label, "error": problem, "retry_s": delay}},
        )
        await anyio.sleep(delay)
    labels = obj["metadata"].get("labels") or {}
    chosen = labelled_nvml(spec, label=label, node=node, labels=labels)
    log.info(
        "emulated profile chosen",
        extra={"fields": {"node": node, "label": label, "nvml": chosen}},
    )
    return chosen


def _nvml_state(args: argparse.Namespace) -> Path | None:
    """Emulated GPUs keep their MIG instances across agent restarts, as real ones do,
    so instances a crash left behind are found and cleaned at the next start."""
    if args.nvml_state is None and _emulated(args) and args.kubelet_plugin:
        return Path(args.state_dir) / EMULATED_NVML_STATE
    return args.nvml_state  # type: ignore[no-any-return]


def _emulated_driver(
    args: argparse.Namespace, nvml: NvmlLibrary, plugin: PluginConfig
) -> PluginConfig:
    """What emulated GPUs need on a node without the NVIDIA driver: device numbers in
    the specs, the tools' call log, and (unless --driver-root names one) a stand-in
    driver root under the state dir, seen at the same path on the host."""
    log_path = os.environ.get(TOOLS_LOG_ENV) or str(plugin.state_dir / EMULATED_TOOLS_LOG)
    plugin = dataclasses.replace(
        plugin, device_numbers=device_numbers, tool_env={TOOLS_LOG_ENV: log_path}
    )
    if plugin.driver_root != Path("/") or plugin.driver_libraries:
        return plugin
    nvml.nvmlInit()
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        cuda = nvml.nvmlSystemGetCudaDriverVersion()
    finally:
        nvml.nvmlShutdown()
    try:
        gpus = _smi_gpus(discover(nvml))
    except DiscoveryError as e:
        raise SystemExit(f"gpudra node: --nvml {args.nvml}: {e}") from None
    root = plugin.state_dir / EMULATED_DRIVER_ROOT
    try:
        install_driver_root(
            root, version, cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}", gpus=gpus
        )
    except OSError as e:
        raise SystemExit(
            f"gpudra node: --state-dir {str(plugin.state_dir)!r}: cannot install the emulated "
            f"driver root there ({e}); give a writable --state-dir or an existing --driver-root"
        ) from None
    log.info("emulated driver root installed", extra={"fields": {"path": str(root)}})
    return dataclasses.replace(plugin, driver_root=root, host_root=Path("/"))


def _smi_gpus(inventory: Inventory) -> list[SmiGpu]:
    """What the stand-in nvidia-smi shows of each GPU: the discovered inventory."""
    mib = 1024 * 1024
    return [
        SmiGpu(
            minor=gpu.minor,
            uuid=gpu.uuid,
            name=gpu.product_name,
            memory_mib=gpu.device.capacity.get("memory", 0) // mib,
            bus_id=gpu.pci_bus_id,
            mig_profiles={
                d.placement.profile_id: (
                    d.placement.profile,
                    d.capacity.get("memory", 0) // mib,
                )
                for d in (*gpu.partitions, *gpu.mig_devices)
                if d.placement is not None
            },
        )
        for gpu in inventory.gpus
    ]


def _zero_window_seconds(raw: str) -> float:
    """--accounting-zero-window: seconds, finite and 0 or more (0: the first scrape
    only)."""
    value = seconds_within(raw, 0)
    if value is None:
        msg = (
            f"{raw!r}: give seconds, 0 or more, longer than the longest scrape interval of "
            f"any reader of the metrics, e.g. {DEFAULT_ZERO_WINDOW_S:g}"
        )
        raise argparse.ArgumentTypeError(msg)
    return value


def _conflict_wait_seconds(raw: str) -> float:
    """--conflict-wait: seconds, 0 to `MAX_CONFLICT_WAIT_S`."""
    value = seconds_within(raw, 0, MAX_CONFLICT_WAIT_S)
    if value is None:
        msg = (
            f"{raw!r}: give seconds, 0 to {MAX_CONFLICT_WAIT_S:g} (0: fail at once): the "
            f"kubelet gives a prepare {KUBELET_CALL_TIMEOUT_S:g} s in all, and the prepare's "
            f"own work comes after the wait (default: {CONFLICT_WAIT_S:g})"
        )
        raise argparse.ArgumentTypeError(msg)
    return value


def _plugin_config(args: argparse.Namespace) -> PluginConfig:
    for flag in ("kubelet_root", "cdi_root", "state_dir", "driver_root", "dev_root", "host_root"):
        path: Path = getattr(args, flag)
        if not path.is_absolute():
            raise SystemExit(
                f"gpudra node: --{flag.replace('_', '-')} {str(path)!r} must be an absolute path"
            )
    if problem := plugin_socket_problem(args.kubelet_root, args.driver_name, args.pod_uid):
        raise SystemExit(
            f"gpudra node: --kubelet-root {str(args.kubelet_root)!r}: {problem}: give the "
            "kubelet's root folder (its --root-dir) as a plain absolute path, without %, ? "
            "or #, short enough for the sockets under it, or a shorter --driver-name"
        )
    if args.cleanup_interval <= 0:
        raise SystemExit("gpudra node: --cleanup-interval must be positive")
    if args.sample_interval < 0:
        raise SystemExit(
            f"gpudra node: --sample-interval {args.sample_interval:g}: give seconds, or 0 for off"
        )
    if not 0 <= args.idle_threshold <= 100:
        raise SystemExit(
            f"gpudra node: --idle-threshold {args.idle_threshold:g}: give a percentage, 0 to 100"
        )
    template = None
    if args.mps_daemon_pod_template is not None:
        if not args.namespace:
            raise SystemExit(
                "gpudra node: --mps-daemon-pod-template needs --namespace (or $POD_NAMESPACE) "
                "for the daemon pods"
            )
        try:
            template = load_template(args.mps_daemon_pod_template)
        except PodTemplateError as exc:
            raise SystemExit(f"gpudra node: --mps-daemon-pod-template {exc}") from None
    return PluginConfig(
        kubelet_root=args.kubelet_root,
        cdi_root=args.cdi_root,
        state_dir=args.state_dir,
        driver_root=args.driver_root,
        dev_root=args.dev_root,
        host_root=args.host_root,
        pod_uid=args.pod_uid,
        nvidia_smi=args.nvidia_smi,
        mps_control=args.mps_control,
        toolkit_spec=args.toolkit_cdi,
        driver_libraries=tuple(args.driver_library),
        cleanup_interval_s=args.cleanup_interval,
        conflict_wait_s=args.conflict_wait,
        sample_interval_s=args.sample_interval,
        idle_below=args.idle_threshold,
        zero_window_s=args.accounting_zero_window,
        claim_status=args.claim_status,
        device_metadata=args.device_metadata,
        dra_apis=tuple(args.dra_api or DRA_APIS),
        mps_pod_template=template,
        namespace=args.namespace,
    )


async def _freeze_when_ready(service: NodeService) -> None:
    """Once the agent has built what it keeps, keep it out of full collections (see
    `gpudra.common.heap`): they would otherwise stall prepares for tens of ms."""
    await service.ready.wait()
    frozen = freeze_startup_heap()
    log.info("start-up heap frozen", extra={"fields": {"objects": frozen}})


async def _run_until_signalled(service: NodeService) -> None:
    """SIGTERM and SIGINT stop the service cleanly: the kubelet plugin removes its
    registration socket first, so the kubelet deregisters it instead of timing out."""
    async with stop_on_signal() as tg:
        tg.start_soon(service.run)
        tg.start_soon(_freeze_when_ready, service)


def run(args: argparse.Namespace) -> int:
    if not args.node_name:
        raise SystemExit("gpudra node: --node-name is required (or set NODE_NAME)")
    config = _agent_config(args)  # flag values first: they need no NVML
    plugin = _plugin_config(args) if args.kubelet_plugin else None
    state_path = _nvml_state(args)
    spec = args.nvml
    if args.emulated_profile_label:
        try:
            spec = anyio.run(_node_nvml, args)
        except NvmlLoadError as e:
            raise SystemExit(f"gpudra node: {e}") from None
    try:
        if state_path is not None:
            state_path.parent.mkdir(parents=True, exist_ok=True)
        nvml = load_nvml(spec, state_path=state_path, script_path=args.nvml_script)
    except OSError as e:
        raise SystemExit(
            f"gpudra node: --nvml-state {str(state_path)!r}: {e.strerror}; give a writable "
            "--state-dir or --nvml-state"
        ) from None
    except (NvmlLoadError, ProfileError) as e:
        raise SystemExit(f"gpudra node: --nvml: {e}") from None
    # Before discovery's first nvmlInit, and held while the agent runs: the driver
    # root's NVML, which this process's linker would not find by its soname alone.
    _driver_nvml = (
        preload_nvml(DriverRoot(args.driver_root, args.host_root)) if spec == "real" else None
    )
    if plugin is not None and _emulated(args):
        plugin = _emulated_driver(args, nvml, plugin)
    metrics = _metrics_address(args)
    registry = CollectorRegistry()

    async def main() -> None:
        kube = await Kube.connect(args.kubeconfig)
        try:
            service = NodeService(
                config, kube, nvml, plugin, registry=registry, fault=_crash_at(args.crash_at)
            )
            if metrics is not None:
                try:
                    server, _thread = serve_metrics(
                        metrics[0],
                        metrics[1],
                        registry,
                        max_connections=args.metrics_max_connections,
                        max_per_client=args.metrics_max_per_client,
                        deadline_s=args.metrics_deadline,
                        head_deadline_s=args.metrics_head_deadline,
                    )
                except OSError as e:
                    raise SystemExit(
                        f"gpudra node: --metrics-address {args.metrics_address}: {e}"
                    ) from None
            try:
                await _run_until_signalled(service)
            finally:
                if metrics is not None:
                    server.shutdown()
        finally:
            await kube.close()

    try:
        run_event_loop(main)
    except BaseExceptionGroup as group:
        # A checkpoint this release cannot read stops recovery before any socket is
        # served; the file is left as it is.
        unreadable, _rest = group.split(CheckpointError)
        if unreadable is not None:
            raise SystemExit(f"gpudra node: {_first(unreadable)}") from None
        # Checked against the first inventory, deep in the agent's task groups.
        shared, _rest = group.split((SharedGpusError, GpuSharesError))
        if shared is None:
            raise
        raise SystemExit(_start_refused(args, _first(shared))) from None
    except CheckpointError as e:
        raise SystemExit(f"gpudra node: {e}") from None
    except (SharedGpusError, GpuSharesError) as e:
        raise SystemExit(_start_refused(args, e)) from None
    return 0
