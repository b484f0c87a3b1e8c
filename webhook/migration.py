"""What a cluster's NVIDIA device plugin configuration means under gpudra.

`gpudra migrate` reads the device plugin's config (its ``version: v1`` file, alone or as a
key of the ConfigMap its chart mounts), the cluster's nodes and pods, and says which
chart values and GpuTenants keep the same behaviour, and which pods would behave
differently once converted, and why. Pure functions: the CLI does the reading and writing.

A config gpudra cannot reproduce (an unknown MIG strategy, shared MIG devices, per-node
configs that differ in what the chart sets for every node) is an error that names the
field and what gpudra would do instead, so nothing is written for a migration that would
silently change what pods get.

Field semantics follow the device plugin's ``api/config/v1`` (NVIDIA/k8s-device-plugin):
``flags.migStrategy`` (none, single, mixed; default none; its ``--mig-strategy`` flag or
``MIG_STRATEGY`` variable overrides the file), ``sharing.timeSlicing`` and
``sharing.mps`` (mutually exclusive) with ``renameByDefault`` (advertise
``<name>.shared`` instead of ``<name>``), ``failRequestsGreaterThanOne`` (refuse
requests above 1; default false for time-slicing, true for MPS) and ``resources[]``
(``name``, ``replicas`` >= 1, shared above 1, ``rename``, ``devices``; the plugin ignores ``rename``
and ``devices`` with a warning, so every GPU is shared under its plain or ``.shared``
name, as ``renameByDefault`` alone says). Its chart's ConfigMap holds one config per
key; a node runs the one its label ``nvidia.com/device-plugin.config`` names, else the
chart's ``config.default``, else the key ``default``, else the only key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

import yaml
from gpudra.api.tenants import API_VERSION as TENANT_API_VERSION
from gpudra.api.tenants import KIND as TENANT_KIND
from gpudra.api.tenants import excluded_namespaces
from gpudra.webhook.convert import (
    GPU_RESOURCE,
    MIG_RESOURCE_PREFIX,
    SHARED_RESOURCE,
    ConversionError,
    ConversionPolicy,
    DeviceKind,
    convert_pod,
)

__all__ = [
    "CONFIG_LABEL",
    "MIG_STRATEGIES",
    "PLAN_FILES",
    "SHARES_BY_NODE_VALUE",
    "SHARES_VALUE",
    "DevicePluginConfig",
    "MigrationError",
    "NodeConfigs",
    "Plan",
    "PodChange",
    "ReplicatedResource",
    "config_texts",
    "node_configs",
    "parse_config",
    "plan",
    "render",
]

# The chart value that publishes every whole GPU with N shares (`gpudra node --gpu-shares`),
# the device plugin's time-slicing replicas, and its per-node override by node name.
SHARES_VALUE: Final = ("node", "gpuShares")
SHARES_BY_NODE_VALUE: Final = ("node", "gpuSharesByNode")
TENANT_NAME: Final = "device-plugin-sharing"
MIG_STRATEGIES: Final = ("none", "single", "mixed")
# The node label whose value names the config a node runs (the device plugin chart's
# config-manager), and the key it falls back to where no default is set.
CONFIG_LABEL: Final = "nvidia.com/device-plugin.config"
FALLBACK_CONFIG: Final = "default"
# Every file `render` can write, so that a rerun into the same folder can remove one
# this plan does not hold rather than leave an earlier run's beside it.
VALUES_FILE: Final = "values.yaml"
TENANTS_FILE: Final = "tenants.yaml"
PLAN_FILES: Final = (VALUES_FILE, TENANTS_FILE)
_TOP_FIELDS: Final = frozenset({"version", "flags", "resources", "sharing", "imex"})
_REPLICATED_FIELDS: Final = frozenset(
    {"renameByDefault", "failRequestsGreaterThanOne", "resources"}
)
_RESOURCE_FIELDS: Final = frozenset({"name", "rename", "devices", "replicas"})
Strategy = Literal["TimeSlicing", "MPS"]


class MigrationError(ValueError):
    """A config gpudra cannot reproduce: one line per problem, each naming its field,
    what the device plugin did and what gpudra would do instead."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


@dataclass(frozen=True)
class ReplicatedResource:
    """``sharing.<strategy>.resources[]`` for ``nvidia.com/gpu``: N pods per GPU."""

    strategy: Strategy
    replicas: int
    renamed: bool
    """Advertised as ``nvidia.com/gpu.shared`` (``renameByDefault``) instead of the plain name."""
    fail_requests_greater_than_one: bool
    field: str
    """Where it came from, for messages: ``sharing.timeSlicing.resources[0]``."""


@dataclass(frozen=True)
class DevicePluginConfig:
    """What of a device plugin config decides what pods get; the rest does not carry over."""

    mig_strategy: str = "none"
    sharing: ReplicatedResource | None = None
    notes: tuple[str, ...] = ()
    """Fields the device plugin ignores (and so gpudra can too), said once."""
    source: str = "config"
    """The ConfigMap key (or file) it came from, to name it when configs differ."""


@dataclass(frozen=True)
class NodeConfigs:
    """The configs a cluster's nodes run: one per node, chosen by a node label."""

    default: DevicePluginConfig
    """What nodes not named in `nodes` run, and so what gpudra gives every node."""
    nodes: Mapping[str, DevicePluginConfig] = field(default_factory=dict)
    """The nodes that run another config, by node name."""
    notes: tuple[str, ...] = ()
    """About the ConfigMap as a whole: the configs no node runs."""


@dataclass(frozen=True)
class PodChange:
    """A pod that would get something else once converted, and why."""

    namespace: str
    name: str
    reason: str


@dataclass(frozen=True)
class Plan:
    """Chart values and GpuTenants to apply, notes to read first, pods to look at."""

    values: dict[str, Any]
    tenants: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    pods: list[PodChange] = field(default_factory=list)


def config_texts(text: str, source: str = "config") -> dict[str, str]:
    """The named configs in `text`: each key of a ConfigMap's ``data`` (the device
    plugin chart's ``config.map``, one config per node label value), or a plain config
    file as one entry named after `source`."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise MigrationError(source, [f"not YAML: {exc}"]) from None
    if not isinstance(raw, Mapping) or raw.get("kind") != "ConfigMap":
        return {source: text}
    data = raw.get("data")
    if not isinstance(data, Mapping) or not data:
        raise MigrationError(
            source, ["data: the ConfigMap holds no config; give the one the device plugin mounts"]
        )
    return {str(k): str(v) for k, v in data.items()}


def parse_config(
    text: str, source: str = "config", *, mig_strategy: str | None = None
) -> DevicePluginConfig:
    """Read one ``version: v1`` config; raises `MigrationError` naming every bad field.

    `mig_strategy` is the device plugin's ``--mig-strategy`` (``MIG_STRATEGY``, which the
    GPU Operator's ``mig.strategy`` and its chart's ``migStrategy`` set): it overrides the
    file's ``flags.migStrategy`` there, so it does here, with the same consequences."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise MigrationError(source, [f"not YAML: {exc}"]) from None
    if not isinstance(raw, Mapping):
        raise MigrationError(source, ["not a device plugin config (expected a YAML mapping)"])
    problems: list[str] = []
    notes: list[str] = []
    problems += _unknown(raw, _TOP_FIELDS, "")
    version = raw.get("version", "v1")
    if version != "v1":
        problems.append(
            f"version: {version!r}: only the device plugin's v1 format is known; "
            "convert it to v1 first"
        )
    flags = raw.get("flags") or {}
    in_file = flags.get("migStrategy") if isinstance(flags, Mapping) else None
    mig_field = "flags.migStrategy"
    mig = "none" if in_file is None else in_file
    if mig_strategy is not None:
        if in_file is not None and in_file != mig_strategy:
            notes.append(
                f"flags.migStrategy: {in_file!r} is overridden by --mig-strategy "
                f"{mig_strategy}, as the device plugin's flag overrides its file"
            )
        mig_field, mig = "--mig-strategy", mig_strategy
    if mig == "single":
        problems.append(
            f"{mig_field}: single: there nvidia.com/gpu means a MIG device of the "
            "node's one profile, but gpudra always converts nvidia.com/gpu to a whole GPU "
            "(and never offers a MIG-enabled GPU whole), so those pods would pend: move "
            "the device plugin to mixed and the pods to nvidia.com/mig-<profile> (gpudra "
            "converts those to mig.nvidia.com) first"
        )
    elif mig not in MIG_STRATEGIES:
        problems.append(
            f"{mig_field}: {mig!r} is not one of none, single, mixed; gpudra would "
            "publish every MIG device (node.migStrategy dynamic)"
        )
    resources = raw.get("resources")
    if resources:
        notes.append(
            "resources: custom resource names are ignored by the device plugin ('not yet "
            "supported'), so pods asked for the standard names, which gpudra converts"
        )
    sharing_raw = raw.get("sharing") or {}
    sharing: ReplicatedResource | None = None
    if not isinstance(sharing_raw, Mapping):
        problems.append("sharing: expected a mapping with timeSlicing or mps")
    else:
        problems += _unknown(sharing_raw, frozenset({"timeSlicing", "mps"}), "sharing.")
        present = [k for k in ("timeSlicing", "mps") if sharing_raw.get(k)]
        if len(present) == 2:
            problems.append(
                "sharing: timeSlicing and mps are both set; the device plugin allows one "
                "(it would use mps): keep the one your nodes run"
            )
        for key in present[:1]:
            strategy: Strategy = "TimeSlicing" if key == "timeSlicing" else "MPS"
            sharing = _replicated(sharing_raw[key], strategy, f"sharing.{key}", problems, notes)
    if problems:
        raise MigrationError(source, problems)
    return DevicePluginConfig(
        mig_strategy=str(mig), sharing=sharing, notes=tuple(notes), source=source
    )


def node_configs(
    texts: Mapping[str, str],
    nodes: Iterable[Mapping[str, Any]] | None,
    *,
    default: str | None = None,
    mig_strategy: str | None = None,
    source: str = "config",
) -> NodeConfigs:
    """The config of nodes not named otherwise, and the nodes that run another one.

    A ConfigMap of several configs is the device plugin chart's per-node setting: a node
    runs the key its `CONFIG_LABEL` names, else `default` (the chart's
    ``config.default``), else the key ``default``. Mapping one of them for every node
    would change what the others give, so several configs need `nodes` (the cluster's
    Node objects) to say which node keeps which; keys no node runs are left out, with a
    note. Raises `MigrationError` naming every problem of every config in use."""
    if default is not None and default not in texts:
        raise MigrationError(
            "--config-key", [f"{default!r} is not in the ConfigMap; it holds {sorted(texts)}"]
        )
    if len(texts) == 1:
        ((name, text),) = texts.items()
        return NodeConfigs(parse_config(text, name, mig_strategy=mig_strategy))
    if nodes is None:
        raise MigrationError(
            "--nodes",
            [
                f"the ConfigMap holds {len(texts)} configs ({', '.join(sorted(texts))}), "
                f"chosen per node by the label {CONFIG_LABEL}: give --nodes FILE "
                "(`kubectl get nodes -o yaml`) or --cluster-nodes, so that each node keeps "
                "its own"
            ],
        )
    problems: list[str] = []
    key = default if default is not None else FALLBACK_CONFIG
    if key not in texts:
        problems.append(
            f"--config-key: the ConfigMap has no config named {FALLBACK_CONFIG!r}: name the "
            f"one nodes without the label {CONFIG_LABEL} run (the device plugin chart's "
            "config.default); gpudra gives it to every node not labelled, later ones too"
        )
    by_node: dict[str, str] = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        label = (meta.get("labels") or {}).get(CONFIG_LABEL) or key
        if label not in texts:
            problems.append(
                f"node {meta.get('name')}: label {CONFIG_LABEL}={label!r} names no config "
                f"of the ConfigMap (it holds {', '.join(sorted(texts))}), so the device "
                "plugin could not start there: fix the label"
            )
        elif label != key:
            by_node[str(meta.get("name", ""))] = label
    parsed: dict[str, DevicePluginConfig] = {}
    for name in sorted({key, *by_node.values()} & texts.keys()):
        try:
            parsed[name] = parse_config(texts[name], name, mig_strategy=mig_strategy)
        except MigrationError as exc:
            problems += [f"{name}: {p}" for p in exc.problems]
    if problems:
        raise MigrationError(source, problems)
    unused = sorted(texts.keys() - parsed.keys())
    return NodeConfigs(
        default=parsed[key],
        nodes={node: parsed[name] for node, name in by_node.items()},
        notes=tuple(f"{name}: no node runs this config, so it is left out" for name in unused),
    )


def _unknown(raw: Mapping[str, Any], known: frozenset[str], prefix: str) -> list[str]:
    return [
        f"{prefix}{k}: unknown field (the device plugin ignores it, and so would gpudra); "
        f"fix its name or remove it (known: {', '.join(sorted(known))})"
        for k in raw
        if k not in known
    ]


def _replicated(
    raw: Any, strategy: Strategy, where: str, problems: list[str], notes: list[str]
) -> ReplicatedResource | None:
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: expected a mapping with resources")
        return None
    problems += _unknown(raw, _REPLICATED_FIELDS, f"{where}.")
    rename_default = raw.get("renameByDefault", False)
    # The device plugin's own defaults: MPS refuses requests above 1 unless told otherwise.
    fail_above_one = raw.get("failRequestsGreaterThanOne", strategy == "MPS")
    for key, value in (
        ("renameByDefault", rename_default),
        ("failRequestsGreaterThanOne", fail_above_one),
    ):
        if not isinstance(value, bool):
            problems.append(f"{where}.{key}: {value!r} is not true or false")
    entries = raw.get("resources")
    if not isinstance(entries, list) or not entries:
        problems.append(f"{where}.resources: no resources specified (the device plugin refuses it)")
        return None
    found: ReplicatedResource | None = None
    for i, entry in enumerate(entries):
        at = f"{where}.resources[{i}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{at}: expected a mapping with name and replicas")
            continue
        problems += _unknown(entry, _RESOURCE_FIELDS, f"{at}.")
        name = entry.get("name")
        replicas = entry.get("replicas")
        if name not in (GPU_RESOURCE, "gpu"):
            problems.append(
                f"{at}.name: {name!r}: gpudra shares whole GPUs only; a MIG device goes to "
                "one claim, so each pod would get a device of its own (replicas times fewer "
                "pods fit): remove this entry, or keep these pods on the device plugin"
                if isinstance(name, str) and name.startswith(("mig-", MIG_RESOURCE_PREFIX))
                else f"{at}.name: {name!r}: only nvidia.com/gpu (and MIG resources) can be "
                "shared; gpudra would leave this resource alone"
            )
            continue
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2:
            # The device plugin refuses to start with fewer ("number of replicas must
            # be >= 2"), so no node served GPUs under such a config.
            problems.append(
                f"{at}.replicas: {replicas!r}: give a whole number of at least 2 (the pods "
                "sharing one GPU), as the device plugin requires: it does not start with "
                "fewer, so no node served GPUs with this config"
            )
            continue
        rename = entry.get("rename")
        if rename not in (None, ""):
            # The device plugin drops `rename` (DisableResourceNamingInConfig): the
            # name is nvidia.com/gpu.shared with renameByDefault, nvidia.com/gpu without.
            advertised = SHARED_RESOURCE if rename_default is True else GPU_RESOURCE
            notes.append(
                f"{at}.rename: {rename!r}: ignored by the device plugin ('not yet "
                f"supported'), so it advertised {advertised} (renameByDefault decides); "
                "gpudra maps that name"
            )
        devices = entry.get("devices", "all")
        if devices != "all":
            notes.append(
                f"{at}.devices: ignored by the device plugin ('not yet supported'), so it "
                "shared every GPU; gpudra shares every GPU of the node too"
            )
        if found is not None:
            problems.append(f"{at}: nvidia.com/gpu is listed twice; keep one entry")
            continue
        found = ReplicatedResource(
            strategy=strategy,
            replicas=replicas,
            renamed=rename_default is True,
            fail_requests_greater_than_one=bool(fail_above_one),
            field=at,
        )
    return found


def plan(
    configs: DevicePluginConfig | NodeConfigs,
    pods: Iterable[Mapping[str, Any]] = (),
    *,
    own_namespace: str = "",
) -> Plan:
    """Chart values and GpuTenants that keep the behaviour of `configs` (one for every
    node, or one per node), and the `pods` whose behaviour would still change once the
    webhook converts them.

    `own_namespace` is the namespace gpudra is (or will be) installed in (`""`: not
    known, only the system's): the webhook never reviews pods there or in the system's
    (`excluded_namespaces`), so their device-plugin requests are never converted and
    they are reported as pods that pend once the device plugin is gone.

    Only the shares per GPU can differ per node (``node.gpuSharesByNode``); what the
    chart sets for every node must be the same in every config in use, or the plan is
    refused with a `MigrationError` naming the configs."""
    if isinstance(configs, DevicePluginConfig):
        configs = NodeConfigs(configs)
    config, nodes = configs.default, configs.nodes
    used = list({c.source: c for c in (config, *nodes.values())}.values())
    share = _common(used)
    values: dict[str, Any] = {}
    tenants: list[dict[str, Any]] = []
    many = len(used) > 1
    notes = [f"{c.source}: {n}" if many else n for c in used for n in c.notes]
    notes += configs.notes
    if config.mig_strategy == "mixed":
        # The device plugin offers only MIG devices that exist; so does `static`.
        values["node"] = {"migStrategy": "static"}
        notes.append(
            "node.migStrategy static publishes the MIG devices that exist, as the device "
            "plugin did; dynamic (gpudra's default) also creates them on demand"
        )
    policy = ConversionPolicy()
    if share is not None:
        shares = _shares(config)
        _set(values, SHARES_VALUE, shares)
        by_node = {n: s for n, c in sorted(nodes.items()) if (s := _shares(c)) != shares}
        if by_node:
            _set(values, SHARES_BY_NODE_VALUE, by_node)
        notes.append(
            "node.gpuShares needs the DRAConsumableCapacity feature gate on the API server "
            "and the scheduler (alpha, off by default, in Kubernetes 1.34 and 1.35; on by "
            "default from 1.36): without it every GPU is published whole and each "
            "converted pod gets a GPU of "
            "its own, so fewer pods fit and the rest pend; turn the gate on before moving "
            "these nodes, or keep them on the device plugin"
        )
        shared: dict[str, Any] = {"strategy": share.strategy}
        if share.strategy == "MPS":
            # The device plugin's 1/N of the compute is not carried over: see the note.
            n = share.replicas
            notes.append(
                f"sharing.mps replicas {n}: the device plugin ran a GPU's {n} clients side "
                f"by side in one MPS server, each held to 1/{n} of its compute (active "
                f"thread percentage {max(1, 100 // n)}); gpudra runs an MPS daemon per "
                "claim, and time-slices a GPU between the claims holding its shares, which "
                f"already gives each of {n} busy pods about 1/{n} of the GPU, so the plan "
                f"sets no thread percentage (it would make that 1/{n} of 1/{n}); a pod "
                f"alone on its GPU gets all of it, where the device plugin held it to "
                f"1/{n}: to keep that cap, set "
                "deviceClasses.shared.mps.defaultActiveThreadPercentage"
            )
            notes.append(
                "deviceClasses.shared.mps.defaultPinnedDeviceMemoryLimit: the device plugin "
                f"gave each MPS client 1/{n} of the GPU's memory; set it to "
                "that amount for your GPUs (e.g. 8Gi for 80 GB and replicas 10)"
            )
        values["deviceClasses"] = {"shared": shared}
        if not share.renamed:
            tenants.append(
                {
                    "apiVersion": TENANT_API_VERSION,
                    "kind": TENANT_KIND,
                    "metadata": {"name": TENANT_NAME},
                    "spec": {"namespaceSelector": {}, "gpuResource": {"sharing": share.strategy}},
                }
            )
            notes.append(
                f"GpuTenant {TENANT_NAME} is the default tenant (namespaceSelector: {{}}), "
                "so nvidia.com/gpu means a shared GPU in every namespace no other "
                "GpuTenant selects, as it did; a namespace another GpuTenant selects follows "
                "that tenant's rules instead: give it the same gpuResource"
            )
            if any(c.sharing is None for c in used):
                notes.append(
                    "on nodes whose config shares nothing (gpuShares 0) a converted "
                    "nvidia.com/gpu pod gets whole GPUs, as the device plugin gave there"
                )
            policy = ConversionPolicy(gpu_resource_kind=DeviceKind.SHARED)
    # Plain nvidia.com/gpu vanished only where every node advertised it renamed.
    everywhere = all(c.sharing is not None for c in used)
    excluded = excluded_namespaces(own_namespace)
    changes = [
        c
        for pod in pods
        if (c := _pod_change(pod, config, share, everywhere, policy, excluded)) is not None
    ]
    return Plan(values=values, tenants=tenants, notes=notes, pods=changes)


def _shares(config: DevicePluginConfig) -> int:
    """The shares per GPU of nodes running `config`; 0 publishes GPUs whole."""
    return config.sharing.replicas if config.sharing is not None else 0


def _set(values: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        values = values.setdefault(key, {})
    values[path[-1]] = value


def _common(configs: Sequence[DevicePluginConfig]) -> ReplicatedResource | None:
    """The sharing of every config in use, as the chart sets it for every node.

    Raises `MigrationError` where the configs differ in what no per-node value carries:
    the MIG strategy, the sharing strategy, the name shared GPUs were advertised under
    and, for MPS, the replicas (each client's part of the GPU). A config that shares
    nothing fits beside any other: its nodes get ``gpuShares`` 0."""
    problems: list[str] = []

    def differ(what: str, seen: Mapping[str, object], why: str) -> None:
        if len(set(seen.values())) > 1:
            said = "; ".join(f"{name}: {value}" for name, value in seen.items())
            problems.append(f"{what}: the configs differ ({said}), but {why}")

    differ(
        "flags.migStrategy",
        {c.source: c.mig_strategy for c in configs},
        "gpudra's node.migStrategy is one for every node: if the nodes of the none "
        "configs have no MIG-enabled GPU, give --mig-strategy mixed (there mixed "
        "advertises what none did); otherwise keep the nodes of one strategy on the "
        "device plugin and give --nodes the others only",
    )
    sharing = {c.source: c.sharing for c in configs if c.sharing is not None}
    differ(
        "sharing",
        {name: s.strategy for name, s in sharing.items()},
        "deviceClasses.shared.strategy is one for every node: make them agree, or keep "
        "the nodes of one strategy on the device plugin and give --nodes the others only",
    )
    differ(
        "renameByDefault",
        {name: s.renamed for name, s in sharing.items()},
        "what nvidia.com/gpu means (the GpuTenant) is one for every node: make them agree",
    )
    differ(
        "sharing.mps replicas",
        {name: s.replicas for name, s in sharing.items() if s.strategy == "MPS"},
        "each MPS client's part of a GPU's memory "
        "(deviceClasses.shared.mps.defaultPinnedDeviceMemoryLimit) is one for every node: "
        "make them agree",
    )
    if problems:
        raise MigrationError("per-node configs", problems)
    if not sharing:
        return None
    # A request the device plugin refused on some nodes is reported as refused.
    refused = any(s.fail_requests_greater_than_one for s in sharing.values())
    return replace(next(iter(sharing.values())), fail_requests_greater_than_one=refused)


def _pod_change(
    pod: Mapping[str, Any],
    config: DevicePluginConfig,
    share: ReplicatedResource | None,
    everywhere: bool,
    policy: ConversionPolicy,
    excluded: frozenset[str],
) -> PodChange | None:
    meta = pod.get("metadata") or {}
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    change = PodChange(str(meta.get("namespace", "")), str(meta.get("name", "")), "")
    if change.namespace in excluded:
        return _never_reviewed(pod, change, policy)
    try:
        # As the webhook would: opted-out and already converted pods stay as they are.
        conversion = convert_pod(pod, policy)
    except ConversionError as exc:
        return _with(change, f"the webhook would deny it: {exc}")
    reasons: list[str] = []
    for claim in conversion.claims:
        asked = dict(claim.containers)
        most = max(asked.values(), default=0)
        if claim.kind is DeviceKind.MIG and config.mig_strategy == "none":
            reasons.append(
                f"asks for {', '.join(claim.resources)}, which migStrategy none never "
                "advertised (it pended); gpudra gives it a MIG device"
            )
        if claim.kind is not DeviceKind.SHARED:
            if (
                share is not None
                and share.renamed
                and everywhere
                and GPU_RESOURCE in claim.resources
            ):
                reasons.append(
                    "asks for nvidia.com/gpu, which nodes with renameByDefault no longer "
                    "advertised (only nvidia.com/gpu.shared); gpudra gives it whole GPUs"
                )
            continue
        if share is None or (SHARED_RESOURCE in claim.resources and not share.renamed):
            reasons.append(
                "asks for nvidia.com/gpu.shared, which no node with this config advertised "
                "(it pended); gpudra gives it a share of a GPU"
            )
        elif most > 1 and share.fail_requests_greater_than_one:
            reasons.append(
                f"asks for {most} shared GPUs in one container, which the device plugin "
                "refused (failRequestsGreaterThanOne: true); gpudra admits it"
            )
        elif most > 1:
            reasons.append(
                f"asks for {most} shared GPUs in one container: the device plugin gave "
                f"{most} replicas, possibly of one GPU; gpudra gives {most} shares, which "
                "the scheduler may place on different GPUs"
            )
    return _with(change, "; ".join(reasons)) if reasons else None


def _never_reviewed(
    pod: Mapping[str, Any], change: PodChange, policy: ConversionPolicy
) -> PodChange | None:
    """A pod in a namespace the webhook never reviews (`excluded_namespaces`, which its
    registrations leave out), if it asks for device-plugin resources: they are never
    converted, so once the device plugin is gone no node advertises them and it pends.

    What it asks for is read as the tenant rules read a pod the webhook does not patch
    (`left_to_device_plugin`, every pod), so an opted-out pod counts too and no limit
    that only a claim has hides one."""
    where = (
        f"{change.namespace}, which the webhook never reviews (it leaves out the system's "
        "namespace and gpudra's own)"
    )
    try:
        asked = convert_pod(pod, replace(policy, left_to_device_plugin=True), every_pod=True)
    except ConversionError as exc:
        return _with(change, f"is in {where}, and its GPU requests cannot be read: {exc}")
    resources = sorted({r for claim in asked.claims for r in claim.resources})
    if not resources:
        return None
    return _with(
        change,
        f"asks for {', '.join(resources)} in {where}, so it is never converted: once the "
        "device plugin is removed no node advertises it (but nvidia.com/gpu where "
        "deviceClasses.gpu.extendedResourceName names it) and the pod pends (a running one "
        "keeps running until it is recreated); move the workload to another namespace, "
        "or give it a ResourceClaim by hand",
    )


def _with(change: PodChange, reason: str) -> PodChange:
    return PodChange(change.namespace, change.name, reason)


def render(result: Plan) -> dict[str, str]:
    """The plan as files: ``values.yaml`` for helm and, when it has GpuTenants,
    ``tenants.yaml`` for kubectl (which refuses a file with no object to apply)."""
    values = "# Chart values that keep the device plugin's behaviour (gpudra migrate).\n"
    values += "\n".join(f"# {n}" for n in result.notes) + ("\n" if result.notes else "")
    values += yaml.safe_dump(result.values, sort_keys=False) if result.values else "{}\n"
    out = {VALUES_FILE: values}
    if result.tenants:
        out[TENANTS_FILE] = yaml.safe_dump_all(result.tenants, sort_keys=False)
    return out
