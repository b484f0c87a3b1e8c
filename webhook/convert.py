"""Conversion of legacy device-plugin GPU pods to DRA ResourceClaimTemplates.

Pure functions, no I/O: the admission server feeds in the Pod from the AdmissionReview
and a `ConversionPolicy`, and gets back an RFC 6902 patch plus the ResourceClaimTemplates
the patched pod refers to. Keeping the policy an explicit input lets tenant limits or
quota rules be layered on without touching the conversion itself.

Legacy resources handled (everything else under ``nvidia.com/``, such as NIC device
plugins, is left untouched):

- ``nvidia.com/gpu: N``        N whole GPUs (or shared GPUs, if the policy says so)
- ``nvidia.com/gpu.shared: N`` N time-sliced shared GPUs
- ``nvidia.com/mig-<profile>``  N MIG devices of that profile (``1g.10gb``, and
  ``1g.10gb.me`` as the device plugin spells profile ``1g.10gb+me``: `parse_mig_profile`)

Why templates, not claims: a claim created at admission has no owner (the pod UID is
not known yet) and leaks when the pod is rejected later, and it cannot be named for a
``generateName`` pod. A ``resourceClaimTemplateName`` reference makes the
controller-manager create the claim owned by the pod, so it is garbage-collected with it.

Claim layout
------------
The pod gets one claim per device type (whole GPU, shared GPU, each MIG profile), named
``<prefix>-gpu``, ``<prefix>-gpu-shared`` or ``<prefix>-mig-<profile token>``. Device-
plugin semantics give a pod max(largest init container, app containers + sidecars)
devices, and init containers reuse the app containers' devices. DRA hands a container
every device of each request it references, so exact per-container counts need the
claim to be cut into requests along container boundaries:

1. Device indices are laid out as: restartable sidecars in pod order, then the app
   containers; each occupies a contiguous interval. Together they run concurrently.
2. A regular init container runs while only the sidecars declared before it run, so it
   takes the interval starting right after those sidecars. It overlaps (reuses) later
   sidecars' and app containers' devices, none of which have started yet. This is the
   Kubernetes effective-request rule: max over init containers of (own count + earlier
   sidecars), and all sidecars + app containers.
3. Every interval end is a cut point; the pieces between cuts become the claim's
   requests ``part-0``, ``part-1``, ... with those counts, and each container references
   exactly the pieces inside its interval (``resources.claims`` with ``request``; only
   ``name`` when it uses the whole claim).

Example: init container (2), app containers a (1) and b (1) -> requests part-0 (1),
part-1 (1); a uses part-0, b part-1, the init container both: two GPUs in total.

Shared GPUs
-----------
A shared device (``nvidia.com/gpu.shared``, or ``nvidia.com/gpu`` under a policy that
maps it to TimeSlicing or MPS) is one share of a GPU, as a device-plugin time-slicing
replica was: each request is ``firstAvailable`` of a ``share`` subrequest for one
integer share per device (``capacity.requests: {shares: 1}``, which only GPUs
published with shares offer; see ``gpudra node --gpu-shares``) and a ``gpu``
subrequest for whole GPUs, which the scheduler tries only when no GPU has a share
free, so pods still run on nodes that publish no shares, as before. Both carry the
sharing config. Up to N pods share a GPU with N shares, pod N+1 gets a share of the
next GPU, and a whole-GPU claim never fits a GPU with a share taken. Two shares of
one pod may land on the same GPU, as two device-plugin replicas could.

Without the fallback (``ConversionPolicy.shared_whole_gpu_fallback`` off, ``gpudra
webhook --no-shared-whole-gpu-fallback``) each request is the ``share`` subrequest alone,
as ``exactly``: the pod runs only where GPUs are published with shares, as it ran only
on time-sliced nodes under the device plugin. A queue counting ``nvidia.com/gpu.shared``
(Kueue) then charges what the pod gets, one share per unit, never a whole GPU; and
Kueue (v0.19.2) cannot count a ``firstAvailable`` request, so a plain pod it queues
(its Pod integration reads the pod as converted) is admitted only in this form
(docs/kueue.md).

Each converted pod carries the annotation ``gpudra.nvidia.com/converted``: per claim,
which legacy resources it replaced, with the claim, template, class and sharing.

Templates are named by type and piece counts (``gpudra-gpu-2``, ``gpudra-gpu-1-1``,
``gpudra-mig-1g10gb-1``), so pods of the same shape share one template. Templates are
immutable, so when the policy changes their content (class names, time-slice interval,
no whole-GPU fallback) the name gets a content hash suffix; a name longer than 63
characters is cut and hashed.

Pods left alone (empty patch): those labelled ``gpudra.nvidia.com/convert: "false"``
(a label, so the webhook's ``objectSelector`` can also skip them without a call; the
chart allows it only in namespaces the cluster admin names), those with a pod claim
exactly as the conversion writes it (already converted, which makes reinvocation a
no-op; other claims under the prefix are the author's and change nothing), and those
without legacy GPU resources. Hand-written claims
under other names are kept and ours are added beside them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Any, Final

from gpudra.api.config import INTERVALS, STRATEGIES
from gpudra.api.deviceclasses import mig_profile_class, mig_profile_selector
from gpudra.api.names import DNS_LABEL_MAX, check_dns_label
from gpudra.api.quantity import QuantityError, parse_quantity
from gpudra.api.sharing import SHARES_CAPACITY
from gpudra.api.tenants import MIG_PROFILE_RE, MIG_SUFFIX_TOKENS

__all__ = [
    "CONVERTED_ANNOTATION",
    "DEFAULT_POLICY",
    "GPU_RESOURCE",
    "MIG_RESOURCE_PREFIX",
    "OPT_OUT_LABEL",
    "SHARED_RESOURCE",
    "Conversion",
    "ConversionError",
    "ConversionPolicy",
    "ConvertedClaim",
    "DeviceKind",
    "convert_pod",
    "generated_template_name",
    "is_legacy_resource",
    "parse_mig_profile",
    "same_claim_spec",
]

GPU_RESOURCE: Final = "nvidia.com/gpu"
_SHARED_SUFFIX: Final = ".shared"
"""How the device plugin names a time-shared replica of a device (``renameByDefault``)."""
SHARED_RESOURCE: Final = GPU_RESOURCE + _SHARED_SUFFIX
MIG_RESOURCE_PREFIX: Final = "nvidia.com/mig-"
OPT_OUT_LABEL: Final = "gpudra.nvidia.com/convert"
CONVERTED_ANNOTATION: Final = "gpudra.nvidia.com/converted"
# The subrequests of a shared device's request: one share first, else a whole GPU.
SHARE_SUBREQUEST: Final = "share"
WHOLE_SUBREQUEST: Final = "gpu"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE: Final = "gpudra-webhook"

# resource.k8s.io/v1 limit: at most 32 devices allocated to one claim.
MAX_DEVICES_PER_CLAIM: Final = 32
_HASH_LEN: Final = 8
# Names are `<prefix>-<device type>[-...]`: a short prefix leaves room for the rest.
_MAX_PREFIX: Final = 20
_CONFIG_API_VERSION: Final = "resource.nvidia.com/v1beta1"
_TIME_SLICE_INTERVALS: Final = frozenset(INTERVALS)
_SHARED_STRATEGIES: Final = frozenset(STRATEGIES)

# GPU-instance profiles by their NVML names; one pattern shared with GpuTenant.
_MIG_PROFILE = MIG_PROFILE_RE
# The device plugin's resource names spell each "+" of a profile as "." (a resource name
# has no "+"): each suffix so spelled, and the profile suffix it stands for.
_DEVICE_PLUGIN_SUFFIXES: Final = tuple(
    (suffix.replace("+", "."), suffix) for suffix in MIG_SUFFIX_TOKENS if "+" in suffix
)
# A converted pod claim's name after the prefix, and its template's name after the claim's.
_CLAIM_TOKEN: Final = re.compile(r"gpu|gpu-shared|mig-[0-9a-z]+")
_TEMPLATE_COUNTS: Final = re.compile(r"[0-9]+(-[0-9]+)*(-[0-9a-f]{8})?|[0-9a-z-]*-[0-9a-f]{8}")


class DeviceKind(StrEnum):
    """What a legacy resource becomes."""

    GPU = "gpu"
    SHARED = "shared"
    MIG = "mig"


class ConversionError(ValueError):
    """A pod the webhook cannot convert; the message names the field and the fix."""


@dataclass(frozen=True)
class ConversionPolicy:
    """Where legacy resources go; explicit so tenant rules can be added on top."""

    gpu_resource_kind: DeviceKind = DeviceKind.GPU
    """What plain ``nvidia.com/gpu`` becomes: GPU (default) or SHARED for clusters whose
    device plugin time-sliced GPUs without renaming them."""
    gpu_class: str = "gpu.nvidia.com"
    mig_class: str = "mig.nvidia.com"
    shared_class: str = "gpu-shared.nvidia.com"
    driver: str = "gpu.nvidia.com"
    time_slice_interval: str = "Default"
    shared_strategy: str = "TimeSlicing"
    """How shared GPUs are shared between the pod's containers: TimeSlicing or MPS."""
    mps_config: tuple[tuple[str, Any], ...] = ()
    """The shared class's ``mpsConfig`` fields (wire name, value), carried by converted MPS
    claims: their own config replaces the class's, so the cluster's defaults must be in it."""
    name_prefix: str = "gpudra"
    max_devices_per_claim: int = MAX_DEVICES_PER_CLAIM
    native_resources: frozenset[str] = frozenset()
    """Legacy names a DeviceClass maps itself (`extendedResourceName`): the scheduler
    allocates those, so the webhook leaves them in the pod untouched. The admission keeps
    only those a stored class carries (`Admission._stored_natives`)."""
    mig_profile_classes: tuple[str, ...] = ()
    """MIG profiles served by their own DeviceClass (`mig_profile_class`, the chart's
    `deviceClasses.mig.profiles`): converted ``nvidia.com/mig-<profile>`` claims request
    it, so a quota per class (Kueue's, a GpuTenant's) counts them under their profile."""
    shared_whole_gpu_fallback: bool = True
    """A shared device may be a whole GPU where no GPU offers a share (``firstAvailable``:
    pods keep running on nodes without ``--gpu-shares``). Off, it is a share or nothing
    (``exactly``): one unit of ``nvidia.com/gpu.shared`` a quota counts is then never a
    whole GPU, and Kueue, which cannot count ``firstAvailable``, admits converted pods."""
    left_to_device_plugin: bool = False
    """The pod keeps its device-plugin requests, which the device plugin serves (its
    namespace is not converted, or the webhook does not patch it): `convert_pod` only
    reads what it asks for, for the tenant rules (`tenant_rules.rules_view`), and returns
    those claims with no patch and no templates. No claim is made, so the limits that
    only a claim has do not apply: more devices than `max_devices_per_claim`, and a MIG
    resource whose profile gpudra cannot read, which counts as a MIG device of the
    profile its name gives (no ``allowedMigProfiles`` can list it), time-shared where
    the name says so (`sharing`)."""

    def device_class(self, kind: DeviceKind, profile: str = "") -> str:
        """The DeviceClass a converted claim of `kind` (and MIG `profile`) requests."""
        if kind is DeviceKind.GPU:
            return self.gpu_class
        if kind is DeviceKind.SHARED:
            return self.shared_class
        if profile in self.mig_profile_classes:
            return mig_profile_class(profile)
        return self.mig_class

    @functools.cached_property
    def profile_classes(self) -> Mapping[str, str]:
        """Each per-profile MIG class and its profile (built once: validation asks for
        each request of each claim)."""
        return {mig_profile_class(p): p for p in self.mig_profile_classes}

    def sharing(self, kind: DeviceKind, profile: str) -> str:
        """The sharing mode of a converted device of `kind` and MIG `profile`:
        Exclusive, TimeSlicing or MPS.

        A MIG resource the device plugin time-shares (``nvidia.com/mig-<profile>.shared``,
        only ever left to it: `parse_mig_profile` reads no such profile) is a replica
        of a MIG device as ``nvidia.com/gpu.shared`` is one of a GPU, so it shares as
        that does; read as its profile alone it would pass for Exclusive.
        """
        shared = kind is DeviceKind.SHARED or (
            kind is DeviceKind.MIG and profile.endswith(_SHARED_SUFFIX)
        )
        return self.shared_strategy if shared else "Exclusive"

    def sharing_label(self, kind: DeviceKind, profile: str) -> str:
        """The sharing mode with its interval, as the converted annotation shows it."""
        mode = self.sharing(kind, profile)
        return f"{mode}/{self.time_slice_interval}" if mode == "TimeSlicing" else mode

    def __post_init__(self) -> None:
        if self.gpu_resource_kind not in (DeviceKind.GPU, DeviceKind.SHARED):
            raise ValueError(
                f"gpu_resource_kind must be {DeviceKind.GPU!s} or {DeviceKind.SHARED!s}, "
                f"not {self.gpu_resource_kind!s}: a MIG profile cannot be inferred"
            )
        if self.shared_strategy not in _SHARED_STRATEGIES:
            raise ValueError(
                f"shared_strategy {self.shared_strategy!r} must be one of "
                f"{sorted(_SHARED_STRATEGIES)}"
            )
        if self.time_slice_interval not in _TIME_SLICE_INTERVALS:
            raise ValueError(
                f"time_slice_interval {self.time_slice_interval!r} must be one of "
                f"{sorted(_TIME_SLICE_INTERVALS)}"
            )
        check_dns_label(self.name_prefix, "name_prefix", max_length=_MAX_PREFIX)
        for profile in self.mig_profile_classes:
            mig_profile_class(profile)  # a clear error for a profile that is not one
        if not 1 <= self.max_devices_per_claim <= MAX_DEVICES_PER_CLAIM:
            raise ValueError(f"max_devices_per_claim must be between 1 and {MAX_DEVICES_PER_CLAIM}")


DEFAULT_POLICY: Final = ConversionPolicy()


@dataclass(frozen=True, order=True)
class _DeviceType:
    kind: DeviceKind
    profile: str = ""

    @property
    def token(self) -> str:
        """Name fragment: ``gpu``, ``gpu-shared`` or ``mig-<profile token>``."""
        if self.kind is DeviceKind.GPU:
            return "gpu"
        if self.kind is DeviceKind.SHARED:
            return "gpu-shared"
        match = _MIG_PROFILE.fullmatch(self.profile)
        assert match is not None  # validated by parse_mig_profile
        ci = f"{match['ci']}c" if match["ci"] else ""
        suffix = MIG_SUFFIX_TOKENS.get(match["suffix"] or "", "")
        return f"mig-{ci}{match['gi']}g{match['mem']}gb{suffix}"


@dataclass(frozen=True)
class ConvertedClaim:
    """One pod claim the conversion added (for logs, warnings and metrics)."""

    pod_claim_name: str
    template_name: str
    kind: DeviceKind
    profile: str
    devices: int
    device_class: str = ""
    resources: tuple[str, ...] = ()
    """The legacy resource names behind this claim, sorted."""
    containers: tuple[tuple[str, int], ...] = ()
    """(container name, devices it asked for), in pod order (init containers first)."""
    sharing: str = "Exclusive"
    """How its devices are shared: ``Exclusive``, ``TimeSlicing/<interval>`` or ``MPS``."""
    requested: tuple[tuple[str, int], ...] = ()
    """(legacy resource, the pod's total of it), sorted by resource."""

    def describe(self) -> str:
        """One line of the converted annotation: what became what."""
        asked = ", ".join(f"{name}: {count}" for name, count in self.requested)
        unit = "one share each" if self.kind is DeviceKind.SHARED else "whole"
        what = "MIG device" if self.kind is DeviceKind.MIG else "GPU"
        plural = "" if self.devices == 1 else "s"
        return (
            f"{asked} -> claim {self.pod_claim_name} (template {self.template_name}, class "
            f"{self.device_class}, {self.devices} {what}{plural} {unit}, sharing {self.sharing})"
        )


@dataclass(frozen=True)
class Conversion:
    """Result of `convert_pod`; an empty patch means the pod is admitted unchanged."""

    patch: tuple[dict[str, Any], ...] = ()
    templates: tuple[dict[str, Any], ...] = ()
    claims: tuple[ConvertedClaim, ...] = ()
    skipped: str = ""
    """Why nothing was converted ("" when converted)."""

    @property
    def changed(self) -> bool:
        return bool(self.patch)


@dataclass(frozen=True)
class _Container:
    label: str  # for messages: 'container "app"', 'init container "setup"'
    name: str  # the container's name ("" when missing)
    pointer: str  # JSON pointer: /spec/containers/0
    role: str  # "app" | "sidecar" | "init"
    demands: dict[_DeviceType, int]
    legacy: list[tuple[str, str]]  # (section, resource) pairs to remove
    sources: dict[_DeviceType, set[str]]  # legacy resource names behind each type
    has_claims_list: bool
    counts: dict[str, int]  # legacy resource name -> count asked for


def is_legacy_resource(name: str) -> bool:
    """True for the device-plugin resources this webhook converts."""
    return name in (GPU_RESOURCE, SHARED_RESOURCE) or name.startswith(MIG_RESOURCE_PREFIX)


def parse_mig_profile(profile: str) -> str:
    """The MIG profile a legacy ``nvidia.com/mig-<profile>`` resource asks for, by the
    name gpudra uses for it (NVML's, as nvidia-smi and the driver's devices spell it).

    A resource name cannot hold a ``+``, so the device plugin names a profile's
    resource with each ``+`` spelled ``.``: ``mig-1g.10gb.me`` is profile ``1g.10gb+me``,
    ``mig-1g.24gb.me.all`` is ``1g.24gb+me.all``, ``mig-1g.10gb.gfx`` is ``1g.10gb+gfx``,
    and ``-me`` and suffix-less profiles are spelled alike. Claims, DeviceClasses and
    GpuTenant rules name a profile as the driver does, so every legacy name is read here
    and nowhere else. The ``+`` spelling is read too: the conversion removes it from a
    pod before the API server validates the names.
    """
    for dotted, suffix in _DEVICE_PLUGIN_SUFFIXES:
        named = profile.removesuffix(dotted) + suffix if profile.endswith(dotted) else ""
        if _MIG_PROFILE.fullmatch(named):
            return named
    if not _MIG_PROFILE.fullmatch(profile):
        raise ConversionError(
            f'unknown MIG profile "{profile}": expected <slices>g.<memory>gb with an '
            "optional suffix as the device plugin names it (.me, .me.all, .gfx, -me), for "
            'example "1g.10gb" or "1g.10gb.me"; use a profile your GPUs offer'
        )
    return profile


def convert_pod(
    pod: Mapping[str, Any], policy: ConversionPolicy = DEFAULT_POLICY, *, every_pod: bool = False
) -> Conversion:
    """Compute the JSON patch and ResourceClaimTemplates that move `pod` to DRA.

    `every_pod` converts opted-out and seemingly converted pods too: the tenant rules
    look at what every pod asks for, whether or not the webhook will patch it.

    Raises `ConversionError` for pods that ask for legacy GPUs in a way the device
    plugin would not have accepted either (the admission server turns it into a denial).
    """
    if not isinstance(pod, Mapping):
        raise ConversionError("the admitted object must be a Pod object")
    metadata = _mapping(pod.get("metadata"), "metadata")
    labels = _mapping(metadata.get("labels"), "metadata.labels")
    if labels.get(OPT_OUT_LABEL) == "false" and not every_pod:
        return Conversion(skipped=f'opted out by label {OPT_OUT_LABEL}="false"')
    spec = _mapping(pod.get("spec"), "spec")
    existing_claims = spec.get("resourceClaims")
    if existing_claims is not None and not isinstance(existing_claims, list):
        raise ConversionError("spec.resourceClaims must be a list")
    if not every_pod and any(_is_converted(c, policy) for c in existing_claims or ()):
        return Conversion(skipped="already converted")

    containers = _read_containers(spec, policy)
    if not any(c.legacy for c in containers):
        return Conversion(skipped="no legacy GPU resources")

    device_types = sorted({t for c in containers for t, n in c.demands.items() if n > 0})
    if policy.left_to_device_plugin:
        counted = (
            _converted_claim(t, containers, *_layout(t, containers), policy) for t in device_types
        )
        return Conversion(claims=tuple(counted), skipped="left to the device plugin")
    templates: list[dict[str, Any]] = []
    converted: list[ConvertedClaim] = []
    refs: dict[str, list[dict[str, str]]] = {}  # container pointer -> resources.claims entries
    for device_type in device_types:
        claim, template, claim_refs = _plan_claim(device_type, containers, policy)
        converted.append(claim)
        templates.append(template)
        for pointer, entries in claim_refs.items():
            refs.setdefault(pointer, []).extend(entries)

    patch: list[dict[str, Any]] = []
    for c in containers:
        for section, resource in c.legacy:
            patch.append(
                {"op": "remove", "path": f"{c.pointer}/resources/{section}/{_escape(resource)}"}
            )
        container_refs = refs.get(c.pointer)
        if container_refs:
            claims_path = f"{c.pointer}/resources/claims"
            if c.has_claims_list:
                patch.extend(
                    {"op": "add", "path": f"{claims_path}/-", "value": r} for r in container_refs
                )
            else:
                patch.append({"op": "add", "path": claims_path, "value": container_refs})
    patch.append(_annotation_patch(metadata, converted))
    entries = [
        {"name": c.pod_claim_name, "resourceClaimTemplateName": c.template_name} for c in converted
    ]
    if entries:
        if isinstance(existing_claims, list):
            patch.extend(
                {"op": "add", "path": "/spec/resourceClaims/-", "value": e} for e in entries
            )
        else:
            patch.append({"op": "add", "path": "/spec/resourceClaims", "value": entries})
    return Conversion(patch=tuple(patch), templates=tuple(templates), claims=tuple(converted))


def _annotation_patch(
    metadata: Mapping[str, Any], converted: Sequence[ConvertedClaim]
) -> dict[str, Any]:
    """Marks the pod with what was converted into what (`CONVERTED_ANNOTATION`)."""
    value = "; ".join(c.describe() for c in converted)
    annotations = _mapping(metadata.get("annotations"), "metadata.annotations")
    if annotations:
        path = f"/metadata/annotations/{_escape(CONVERTED_ANNOTATION)}"
        return {"op": "add", "path": path, "value": value}
    return {"op": "add", "path": "/metadata/annotations", "value": {CONVERTED_ANNOTATION: value}}


def _is_converted(entry: object, policy: ConversionPolicy) -> bool:
    """A pod claim exactly as the conversion writes it: a generated claim name referring
    to a template of that claim's generated name shape. Any other ``<prefix>-`` claim is
    the pod author's, and does not stop the conversion (or the tenant rules)."""
    if not isinstance(entry, Mapping):
        return False
    name = entry.get("name")
    template = entry.get("resourceClaimTemplateName")
    if not isinstance(name, str) or not isinstance(template, str):
        return False
    token = name.removeprefix(f"{policy.name_prefix}-")
    if token == name or not _CLAIM_TOKEN.fullmatch(token):
        return False
    counts = template.removeprefix(f"{name}-")
    return counts != template and bool(_TEMPLATE_COUNTS.fullmatch(counts))


def _read_containers(spec: Mapping[str, Any], policy: ConversionPolicy) -> list[_Container]:
    result: list[_Container] = []
    for key, role_name in (("initContainers", "init container"), ("containers", "container")):
        items = spec.get(key)
        if items is None:
            continue
        if not isinstance(items, list):
            raise ConversionError(f"spec.{key} must be a list")
        for index, raw in enumerate(items):
            pointer = f"/spec/{key}/{index}"
            if not isinstance(raw, Mapping):
                raise ConversionError(f"spec.{key}[{index}] must be an object")
            name = raw.get("name")
            label = f'{role_name} "{name}"' if isinstance(name, str) else f"spec.{key}[{index}]"
            if key == "containers":
                role = "app"
            else:
                role = "sidecar" if raw.get("restartPolicy") == "Always" else "init"
            result.append(_read_container(raw, label, pointer, role, policy))
    return result


def _read_container(
    raw: Mapping[str, Any], label: str, pointer: str, role: str, policy: ConversionPolicy
) -> _Container:
    resources = _mapping(raw.get("resources"), f"{label}: resources")
    limits = _mapping(resources.get("limits"), f"{label}: resources.limits")
    requests = _mapping(resources.get("requests"), f"{label}: resources.requests")
    claims = resources.get("claims")
    if claims is not None and not isinstance(claims, list):
        raise ConversionError(f"{label}: resources.claims must be a list")
    demands: dict[_DeviceType, int] = {}
    legacy: list[tuple[str, str]] = []
    sources: dict[_DeviceType, set[str]] = {}
    counts: dict[str, int] = {}
    names = sorted(
        {
            n
            for n in (*limits, *requests)
            if is_legacy_resource(str(n)) and str(n) not in policy.native_resources
        }
    )
    for resource in names:
        device_type = _device_type(resource, label, policy)
        if resource not in limits:
            raise ConversionError(
                f'{label}: "{resource}" is set in resources.requests but not in '
                f"resources.limits; device-plugin resources must be set in limits: set "
                f'limits["{resource}"] (requests may be left out)'
            )
        count = _count(limits[resource], label, "limits", resource)
        if resource in requests:
            requested = _count(requests[resource], label, "requests", resource)
            if requested != count:
                raise ConversionError(
                    f'{label}: requests["{resource}"] is {requested} but limits["{resource}"] '
                    f"is {count}; device-plugin resources need requests equal to limits: "
                    "drop the request or make them equal"
                )
        legacy.append(("limits", resource))
        if resource in requests:
            legacy.append(("requests", resource))
        if count > policy.max_devices_per_claim and not policy.left_to_device_plugin:
            raise ConversionError(
                f'{label}: "{resource}" asks for {count} devices; at most '
                f"{policy.max_devices_per_claim} fit in one claim: lower the count"
            )
        demands[device_type] = demands.get(device_type, 0) + count
        counts[resource] = count
        sources.setdefault(device_type, set()).add(resource)
    name = raw.get("name")
    return _Container(
        label=label,
        name=name if isinstance(name, str) else "",
        pointer=pointer,
        role=role,
        demands=demands,
        legacy=legacy,
        sources=sources,
        has_claims_list=isinstance(claims, list),
        counts=counts,
    )


def _device_type(resource: str, label: str, policy: ConversionPolicy) -> _DeviceType:
    if resource == GPU_RESOURCE:
        return _DeviceType(policy.gpu_resource_kind)
    if resource == SHARED_RESOURCE:
        return _DeviceType(DeviceKind.SHARED)
    profile = resource.removeprefix(MIG_RESOURCE_PREFIX)
    try:
        return _DeviceType(DeviceKind.MIG, parse_mig_profile(profile))
    except ConversionError as exc:
        if policy.left_to_device_plugin:
            return _DeviceType(DeviceKind.MIG, profile)
        raise ConversionError(f'{label}: "{resource}": {exc}') from None


def _count(value: object, label: str, section: str, resource: str) -> int:
    """A device count: a whole, non-negative number (quantity string or JSON number)."""
    where = f'{label}: {section}["{resource}"]'
    fix = 'device counts must be whole numbers of devices, for example "1"'
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 10:
        return int(value)  # the canonical form the API server sends
    amount: Fraction
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConversionError(f"{where} is {json.dumps(value)}; {fix}")
    if isinstance(value, int):
        amount = Fraction(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ConversionError(f"{where} is {value}; {fix}")
        amount = Fraction(value)
    else:
        try:
            amount = parse_quantity(value.strip(), allow_negative=True).amount
        except QuantityError as exc:
            raise ConversionError(f"{where} {exc}; {fix}") from None
    if amount < 0:
        raise ConversionError(f"{where} is {value!r}, a negative count; {fix}")
    if amount.denominator != 1:
        raise ConversionError(f"{where} is {value!r}, not a whole number; {fix}")
    return int(amount)


def _plan_claim(
    device_type: _DeviceType, containers: Sequence[_Container], policy: ConversionPolicy
) -> tuple[ConvertedClaim, dict[str, Any], dict[str, list[dict[str, str]]]]:
    """Lay out one device type's claim (see the module docstring).

    Returns the pod claim, its template, and each container's ``resources.claims``
    entries keyed by the container's JSON pointer.
    """
    used, total = _layout(device_type, containers)
    if total > policy.max_devices_per_claim:
        counted = _converted_claim(device_type, containers, used, total, policy)
        resource = " and ".join(f'"{name}"' for name in counted.resources)
        raise ConversionError(
            f"the pod needs {total} devices for {resource} (the larger of the biggest "
            "init container and all app containers plus sidecars); one claim holds at most "
            f"{policy.max_devices_per_claim}: lower the counts or split the pod"
        )
    cuts = sorted({0, total} | {start for _, start, _ in used} | {s + n for _, s, n in used})
    pieces = [(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)]
    segments = [end - start for start, end in pieces]

    spec = _claim_spec(device_type, segments, policy)
    template_name = _template_name(device_type, segments, spec, policy)
    pod_claim_name = f"{policy.name_prefix}-{device_type.token}"
    refs: dict[str, list[dict[str, str]]] = {}
    for c, start, count in used:
        parts = [i for i, (s, e) in enumerate(pieces) if s >= start and e <= start + count]
        if len(parts) == len(pieces):
            refs[c.pointer] = [{"name": pod_claim_name}]
        else:
            refs[c.pointer] = [{"name": pod_claim_name, "request": f"part-{i}"} for i in parts]
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": template_name, "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE}},
        "spec": {"spec": spec},
    }
    claim = _converted_claim(
        device_type, containers, used, total, policy, pod_claim_name, template_name
    )
    return claim, template, refs


def _layout(
    device_type: _DeviceType, containers: Sequence[_Container]
) -> tuple[list[tuple[_Container, int, int]], int]:
    """Each container asking for `device_type` with the interval of device indices it
    takes (its start and count), and the devices the pod needs in all: the device-plugin
    semantics of the module docstring, whether or not a claim is made of them."""
    intervals: list[tuple[_Container, int, int]] = []
    offset = 0
    init_intervals: list[tuple[_Container, int, int]] = []
    for c in containers:
        count = c.demands.get(device_type, 0)
        if c.role == "sidecar":
            intervals.append((c, offset, count))
            offset += count
        elif c.role == "init":
            init_intervals.append((c, offset, count))
    for c in containers:
        if c.role == "app":
            count = c.demands.get(device_type, 0)
            intervals.append((c, offset, count))
            offset += count
    intervals.extend(init_intervals)
    used = [(c, start, count) for c, start, count in intervals if count > 0]
    return used, max(start + count for _, start, count in used)


def _converted_claim(
    device_type: _DeviceType,
    containers: Sequence[_Container],
    used: Sequence[tuple[_Container, int, int]],
    total: int,
    policy: ConversionPolicy,
    pod_claim_name: str = "",
    template_name: str = "",
) -> ConvertedClaim:
    """What one device type of the pod amounts to (`_layout`), for the tenant rules, logs
    and the annotation; no names where no claim is made (`left_to_device_plugin`)."""
    resource_names = sorted({n for c, _, _ in used for n in c.sources[device_type]})
    return ConvertedClaim(
        pod_claim_name=pod_claim_name,
        template_name=template_name,
        kind=device_type.kind,
        profile=device_type.profile,
        devices=total,
        device_class=policy.device_class(device_type.kind, device_type.profile),
        resources=tuple(resource_names),
        containers=tuple(
            (c.name or c.pointer, c.demands[device_type])
            for c in containers
            if c.demands.get(device_type, 0) > 0
        ),
        sharing=policy.sharing_label(device_type.kind, device_type.profile),
        requested=tuple(
            (name, sum(c.counts.get(name, 0) for c, _, _ in used)) for name in resource_names
        ),
    )


def _claim_spec(
    device_type: _DeviceType, segments: Sequence[int], policy: ConversionPolicy
) -> dict[str, Any]:
    """The ResourceClaimSpec (resource.k8s.io/v1) for one device type and piece layout."""
    requests: list[dict[str, Any]] = []
    device_class = policy.device_class(device_type.kind, device_type.profile)
    for index, count in enumerate(segments):
        exactly: dict[str, Any] = {
            "deviceClassName": device_class,
            "allocationMode": "ExactCount",
            "count": count,
        }
        if device_type.kind is DeviceKind.MIG:
            expression = mig_profile_selector(policy.driver, device_type.profile)
            exactly["selectors"] = [{"cel": {"expression": expression}}]
        if device_type.kind is DeviceKind.SHARED:
            one_share = {**exactly, "capacity": {"requests": {SHARES_CAPACITY: "1"}}}
            if not policy.shared_whole_gpu_fallback:
                requests.append({"name": f"part-{index}", "exactly": one_share})
                continue
            share = {"name": SHARE_SUBREQUEST, **one_share}
            whole = {"name": WHOLE_SUBREQUEST, **exactly}
            requests.append({"name": f"part-{index}", "firstAvailable": [share, whole]})
            continue
        requests.append({"name": f"part-{index}", "exactly": exactly})
    devices: dict[str, Any] = {"requests": requests}
    if device_type.kind is DeviceKind.SHARED:
        sharing: dict[str, Any] = {"strategy": policy.shared_strategy}
        if policy.shared_strategy == "TimeSlicing":
            sharing["timeSlicingConfig"] = {"interval": policy.time_slice_interval}
        elif policy.mps_config:
            sharing["mpsConfig"] = dict(policy.mps_config)
        devices["config"] = [
            {
                "opaque": {
                    "driver": policy.driver,
                    "parameters": {
                        "apiVersion": _CONFIG_API_VERSION,
                        "kind": "GpuConfig",
                        "sharing": sharing,
                    },
                }
            }
        ]
    return {"devices": devices}


def _template_name(
    device_type: _DeviceType,
    segments: Sequence[int],
    spec: Mapping[str, Any],
    policy: ConversionPolicy,
) -> str:
    """Readable shape name; content-hashed when the content is not the default's."""
    readable = f"{policy.name_prefix}-{device_type.token}-{'-'.join(map(str, segments))}"
    default_content = _claim_spec(device_type, segments, DEFAULT_POLICY) == spec
    if default_content and len(readable) <= DNS_LABEL_MAX:
        return readable
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(canonical).hexdigest()[:_HASH_LEN]
    return f"{readable[: DNS_LABEL_MAX - _HASH_LEN - 1].rstrip('-')}-{digest}"


def generated_template_name(spec: object, policy: ConversionPolicy) -> str | None:
    """The name the conversion gives a template of exactly this ResourceClaimSpec, or None.

    This binds a generated name to its content: a template whose name starts with the
    policy prefix is the webhook's only if this returns its name, so one written by hand
    under such a name (asking for more devices, another class, other configs) is told
    apart from ours by content, never trusted for its name.
    """
    if not isinstance(spec, Mapping):
        return None
    devices = spec.get("devices")
    requests = devices.get("requests") if isinstance(devices, Mapping) else None
    if not isinstance(requests, list) or not requests:
        return None
    first = _first_exact(requests[0])
    if not isinstance(first, Mapping):
        return None
    kinds = {policy.gpu_class: DeviceKind.GPU, policy.shared_class: DeviceKind.SHARED}
    kinds[policy.mig_class] = DeviceKind.MIG
    kinds.update(dict.fromkeys(policy.profile_classes, DeviceKind.MIG))
    kind = kinds.get(str(first.get("deviceClassName")))
    if kind is None:
        return None
    profile = ""
    if kind is DeviceKind.MIG:
        selectors = first.get("selectors")
        expression = ""
        if isinstance(selectors, list) and selectors and isinstance(selectors[0], Mapping):
            expression = str((selectors[0].get("cel") or {}).get("expression", ""))
        prefix = mig_profile_selector(policy.driver, "").removesuffix('"')
        profile = expression.removeprefix(prefix).removesuffix('"')
        if not expression.startswith(prefix) or not _MIG_PROFILE.fullmatch(profile):
            return None
    segments: list[int] = []
    for request in requests:
        exactly = _first_exact(request)
        count = exactly.get("count") if isinstance(exactly, Mapping) else None
        if isinstance(count, bool) or not isinstance(count, int):
            return None
        if not 1 <= count <= policy.max_devices_per_claim:
            return None
        segments.append(count)
    if sum(segments) > policy.max_devices_per_claim:
        return None
    device_type = _DeviceType(kind, profile)
    expected = _claim_spec(device_type, segments, policy)
    if not same_claim_spec(spec, expected):
        return None
    return _template_name(device_type, segments, expected, policy)


def _first_exact(request: object) -> Mapping[str, Any] | None:
    """A request's `exactly` (every kind; shared devices without the whole-GPU fallback),
    or its first `firstAvailable` subrequest (shared devices with it)."""
    if not isinstance(request, Mapping):
        return None
    exactly = request.get("exactly")
    if exactly is not None:
        return exactly if isinstance(exactly, Mapping) else None
    subs = request.get("firstAvailable")
    if isinstance(subs, list) and subs and isinstance(subs[0], Mapping):
        return subs[0]
    return None


def same_claim_spec(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two ResourceClaimSpecs are equal once the API server's defaults are filled in.

    The API server stores ``allocationMode: ExactCount`` and ``count: 1`` where a
    request leaves them out, so a spec read back is compared in that form.
    """
    return bool(_defaulted(a) == _defaulted(b))


def _defaulted(spec: Mapping[str, Any]) -> Any:
    result = json.loads(json.dumps(spec))
    devices = result.get("devices") if isinstance(result, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    for request in requests if isinstance(requests, list) else ():
        if not isinstance(request, dict):
            continue
        subs = request.get("firstAvailable")
        for exact in [request.get("exactly"), *(subs if isinstance(subs, list) else ())]:
            if isinstance(exact, dict):
                exact.setdefault("allocationMode", "ExactCount")
                if exact["allocationMode"] == "ExactCount":
                    exact.setdefault("count", 1)
    return result


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConversionError(f"{where} must be an object")
    return value


def _escape(key: str) -> str:
    """RFC 6901 escaping of one JSON pointer segment."""
    return key.replace("~", "~0").replace("/", "~1")
