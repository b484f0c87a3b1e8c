"""What a cluster's NVIDIA device plugin configuration means under gpudra.

`gpudra migrate` reads the device plugin's config (its ``version: v1`` file, alone or as a
key of the ConfigMap its chart mounts) and the cluster's pods, and says which chart
values and GpuTenants keep the same behaviour, and which pods would behave differently
once converted, and why. Pure functions: the CLI does the reading and writing.

A config gpudra cannot reproduce (an unknown MIG strategy, a renamed resource, shared MIG
devices) is an error that names the field and what gpudra would do instead, so nothing
is written for a migration that would silently change what pods get.

Field semantics follow the device plugin's ``api/config/v1`` (NVIDIA/k8s-device-plugin):
``flags.migStrategy`` (none, single, mixed; default none), ``sharing.timeSlicing`` and
``sharing.mps`` (mutually exclusive) with ``renameByDefault`` (advertise
``<name>.shared`` instead of ``<name>``), ``failRequestsGreaterThanOne`` (refuse
requests above 1; default false for time-slicing, true for MPS) and ``resources[]``
(``name``, ``replicas`` >= 1, shared above 1, ``rename``, ``devices``; the plugin ignores ``rename``
and ``devices`` with a warning, so every GPU is shared under its plain or ``.shared``
name).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import yaml
from gpudra.api.tenants import API_VERSION as TENANT_API_VERSION
from gpudra.api.tenants import KIND as TENANT_KIND
from gpudra.webhook.admission import SYSTEM_NAMESPACES
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
    "SHARES_VALUE",
    "DevicePluginConfig",
    "MigrationError",
    "Plan",
    "PodChange",
    "ReplicatedResource",
    "config_texts",
    "parse_config",
    "plan",
    "render",
]

# The chart value that publishes every whole GPU with N shares (`gpudra node --gpu-shares`),
# the device plugin's time-slicing replicas.
SHARES_VALUE: Final = ("node", "gpuShares")
TENANT_NAME: Final = "device-plugin-sharing"
MIG_STRATEGIES: Final = ("none", "single", "mixed")
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


def parse_config(text: str, source: str = "config") -> DevicePluginConfig:
    """Read one ``version: v1`` config; raises `MigrationError` naming every bad field."""
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
    mig = flags.get("migStrategy", "none") if isinstance(flags, Mapping) else "none"
    if mig == "single":
        problems.append(
            "flags.migStrategy: single: there nvidia.com/gpu means a MIG device of the "
            "node's one profile, but gpudra always converts nvidia.com/gpu to a whole GPU "
            "(and never offers a MIG-enabled GPU whole), so those pods would pend: move "
            "the device plugin to mixed and the pods to nvidia.com/mig-<profile> (gpudra "
            "converts those to mig.nvidia.com) first"
        )
    elif mig not in MIG_STRATEGIES:
        problems.append(
            f"flags.migStrategy: {mig!r} is not one of none, single, mixed; gpudra would "
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
    return DevicePluginConfig(mig_strategy=str(mig), sharing=sharing, notes=tuple(notes))


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
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            problems.append(
                f"{at}.replicas: {replicas!r}: give a whole number of at least 1 (the pods "
                "sharing one GPU), as the device plugin requires"
            )
            continue
        if replicas == 1:
            # The device plugin shares nothing unless some resource has replicas above 1.
            notes.append(f"{at}.replicas: 1 shares nothing; gpudra gives whole GPUs too")
            continue
        rename = entry.get("rename")
        if rename not in (None, "", SHARED_RESOURCE, "gpu.shared"):
            problems.append(
                f"{at}.rename: {rename!r}: gpudra converts only nvidia.com/gpu, "
                "nvidia.com/gpu.shared and nvidia.com/mig-<profile>, so pods asking for "
                f"{rename} would be left alone (the device plugin itself ignores rename): "
                "remove it, or set renameByDefault: true for nvidia.com/gpu.shared"
            )
            continue
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
            renamed=bool(rename_default) or rename in (SHARED_RESOURCE, "gpu.shared"),
            fail_requests_greater_than_one=bool(fail_above_one),
            field=at,
        )
    return found


def plan(config: DevicePluginConfig, pods: Iterable[Mapping[str, Any]] = ()) -> Plan:
    """Chart values and GpuTenants that keep `config`'s behaviour, and the `pods` whose
    behaviour would still change once the webhook converts them."""
    values: dict[str, Any] = {}
    tenants: list[dict[str, Any]] = []
    notes = list(config.notes)
    if config.mig_strategy == "mixed":
        # The device plugin offers only MIG devices that exist; so does `static`.
        values["node"] = {"migStrategy": "static"}
        notes.append(
            "node.migStrategy static publishes the MIG devices that exist, as the device "
            "plugin did; dynamic (gpudra's default) also creates them on demand"
        )
    policy = ConversionPolicy()
    share = config.sharing
    if share is not None:
        section: dict[str, Any] = values
        for key in SHARES_VALUE[:-1]:
            section = section.setdefault(key, {})
        section[SHARES_VALUE[-1]] = share.replicas
        shared: dict[str, Any] = {"strategy": share.strategy}
        if share.strategy == "MPS":
            # The device plugin gives each of the N clients 1/N of the GPU's compute.
            shared["mps"] = {"defaultActiveThreadPercentage": max(1, 100 // share.replicas)}
            notes.append(
                "deviceClasses.shared.mps.defaultPinnedDeviceMemoryLimit: the device plugin "
                f"gave each MPS client 1/{share.replicas} of the GPU's memory; set it to "
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
                f"GpuTenant {TENANT_NAME} selects every namespace, so nvidia.com/gpu means "
                "a shared GPU everywhere, as it did; where another GpuTenant selects a "
                "namespace by label too, both are a conflict: put its gpuResource into "
                "that tenant instead"
            )
            policy = ConversionPolicy(gpu_resource_kind=DeviceKind.SHARED)
    changes = [c for pod in pods if (c := _pod_change(pod, config, policy)) is not None]
    return Plan(values=values, tenants=tenants, notes=notes, pods=changes)


def _pod_change(
    pod: Mapping[str, Any], config: DevicePluginConfig, policy: ConversionPolicy
) -> PodChange | None:
    meta = pod.get("metadata") or {}
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    if meta.get("namespace") in SYSTEM_NAMESPACES:
        return None  # the webhook never sees them (registration.conversion_namespaces)
    change = PodChange(str(meta.get("namespace", "")), str(meta.get("name", "")), "")
    try:
        # As the webhook would: opted-out and already converted pods stay as they are.
        conversion = convert_pod(pod, policy)
    except ConversionError as exc:
        return _with(change, f"the webhook would deny it: {exc}")
    reasons: list[str] = []
    share = config.sharing
    for claim in conversion.claims:
        asked = dict(claim.containers)
        most = max(asked.values(), default=0)
        if claim.kind is DeviceKind.MIG and config.mig_strategy == "none":
            reasons.append(
                f"asks for {', '.join(claim.resources)}, which migStrategy none never "
                "advertised (it pended); gpudra gives it a MIG device"
            )
        if claim.kind is not DeviceKind.SHARED:
            if share is not None and share.renamed and GPU_RESOURCE in claim.resources:
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


def _with(change: PodChange, reason: str) -> PodChange:
    return PodChange(change.namespace, change.name, reason)


def render(result: Plan) -> dict[str, str]:
    """The plan as files: ``values.yaml`` for helm and ``tenants.yaml`` for kubectl."""
    values = "# Chart values that keep the device plugin's behaviour (gpudra migrate).\n"
    values += "\n".join(f"# {n}" for n in result.notes) + ("\n" if result.notes else "")
    values += yaml.safe_dump(result.values, sort_keys=False) if result.values else "{}\n"
    out = {"values.yaml": values}
    if result.tenants:
        out["tenants.yaml"] = yaml.safe_dump_all(result.tenants, sort_keys=False)
    return out
