"""GpuTenant (``gpudra.io/v1alpha1``): per-tenant GPU rules for the admission webhook.

A cluster-scoped object selects namespaces (``namespaceSelector`` and/or an explicit
``namespaces`` list) and sets what pods and claims there may ask for: devices per pod,
DeviceClasses, MIG profiles, sharing modes, device taints a claim may tolerate, what
``nvidia.com/gpu`` means, and an aggregate device quota per DeviceClass.

The pydantic models here are the one definition: the webhook parses tenants with them
(strict types, unknown fields rejected, every error names its field path) and
`crd_manifest` derives the CRD's OpenAPI v3 structural schema from them, so the schema
the API server enforces cannot drift from what the webhook accepts. The rendered CRD is
committed as ``api/crds/gpudra.io_gputenants.yaml`` for the Helm chart; regenerate it
with ``python -m gpudra.api.tenants > api/crds/gpudra.io_gputenants.yaml``.

Overlapping tenants resolve by specificity (see `GpuTenantSpec.selects`): a tenant
that names a namespace in ``namespaces`` wins over one that only selects it by label,
and a label selector wins over an empty one (``namespaceSelector: {}``), which makes the
cluster's default tenant: it governs exactly the namespaces no other tenant selects, so
a namespace created without its team's labels still has GPU rules and a quota. Two
tenants of equal specificity are a conflict (two default tenants too), and the webhook
then denies GPU pods and claims there with a message naming both (no rule set is
silently picked).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, Any, Final, Literal, Self, TypeAlias, get_args

import yaml
from gpudra.api.config import loc_path
from gpudra.api.names import DnsLabel, DnsSubdomain
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "ANY_TAINT",
    "API_VERSION",
    "GROUP",
    "KIND",
    "MIG_PROFILE_RE",
    "MIG_SUFFIX_TOKENS",
    "PATH",
    "PLURAL",
    "QUOTA_RESOURCE_SUFFIX",
    "SHARING_MODES",
    "SYSTEM_NAMESPACES",
    "VERSION",
    "GpuResourceMapping",
    "GpuTenantSpec",
    "LabelSelector",
    "LabelSelectorRequirement",
    "SharingMode",
    "Specificity",
    "Tenant",
    "TenantError",
    "TenantReach",
    "crd_manifest",
    "crd_yaml",
    "excluded_namespace_list",
    "excluded_namespaces",
    "invalid_in_reach",
    "parse_tenant",
    "quota_key",
    "winning_tenants",
]

GROUP: Final = "gpudra.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "GpuTenant"
PLURAL: Final = "gputenants"
SINGULAR: Final = "gputenant"
PATH: Final = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
"""The collection's API path, for list and watch."""
SYSTEM_NAMESPACES: Final = ("kube-system",)
"""Never sent to the webhook (with gpudra's own namespace), so a broken webhook cannot
block its own recovery; a review for one is forged or misrouted and gets no write."""


def excluded_namespaces(own_namespace: str) -> frozenset[str]:
    """The namespaces the webhook never reviews: the system's and gpudra's own (`""`:
    not known, as for an agent run as a host process). No default tenant governs them
    (`GpuTenantSpec.selects`), for the webhook's rules and quotas and the agent's
    accounting alike."""
    return frozenset(excluded_namespace_list(own_namespace))


def excluded_namespace_list(own_namespace: str) -> tuple[str, ...]:
    """`excluded_namespaces` in the order the webhook registrations (and the chart's
    copies of them) list them: the system's, then gpudra's own, each once."""
    return tuple(dict.fromkeys(n for n in (*SYSTEM_NAMESPACES, own_namespace) if n))


# ResourceQuota counts the devices that claims in a namespace request per DeviceClass
# under "<class>.deviceclass.resource.k8s.io/devices" (checked on the real API server).
QUOTA_RESOURCE_SUFFIX: Final = ".deviceclass.resource.k8s.io/devices"
# A claim holds at most 32 devices; the quota counts allocationMode All as 32.
MAX_DEVICES_PER_CLAIM: Final = 32
MAX_QUOTA: Final = 1_000_000

SharingMode: TypeAlias = Literal["Exclusive", "TimeSlicing", "MPS"]
SHARING_MODES: Final[tuple[SharingMode, ...]] = get_args(SharingMode)
TimeSliceInterval: TypeAlias = Literal["Default", "Short", "Medium", "Long"]

# GPU-instance profiles by their NVML names, as nvidia-smi and the driver's devices spell
# them ("1g.10gb", "1g.10gb+me", "1g.24gb-me", "1g.24gb+me.all", "1g.24gb+gfx"), optionally
# with a compute-instance prefix ("1c.3g.40gb"). The device plugin's resource names spell
# each "+" as "." (nvidia.com/mig-1g.10gb.me); the conversion webhook reads those back
# to these names, and uses the same pattern.
MIG_PROFILE_RE: Final = re.compile(
    r"(?:(?P<ci>[1-7])c\.)?(?P<gi>[1-7])g\.(?P<mem>[1-9][0-9]{0,3})gb"
    r"(?P<suffix>\+me\.all|\+me|\+gfx|-me)?"
)
MIG_SUFFIX_TOKENS: Final[Mapping[str, str]] = {
    "+me": "me",
    "+me.all": "meall",
    "+gfx": "gfx",
    "-me": "nome",
}
"""Readable, injective name tokens for the profile suffixes (in claim and class names)."""
# Schema patterns take no named groups.
_MIG_PROFILE_PATTERN: Final = "^" + re.sub(r"\?P<\w+>", "?:", MIG_PROFILE_RE.pattern) + "$"
_MAX_MAP_KEYS: Final = 64

NamespaceName: TypeAlias = DnsLabel
DeviceClassName: TypeAlias = DnsSubdomain
MigProfile = Annotated[str, Field(pattern=_MIG_PROFILE_PATTERN, max_length=32)]
ANY_TAINT: Final = "*"
"""In `allowedTaintTolerations`: any toleration, also one without a key (every taint)."""
_TAINT_KEY_PATTERN: Final = (
    r"^(\*|([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$"
)
TaintKey = Annotated[str, Field(pattern=_TAINT_KEY_PATTERN, max_length=317)]
"""A device taint key (a label key: an optional DNS-subdomain prefix and a name), or "*"."""


def quota_key(device_class: str) -> str:
    """The ResourceQuota resource name that counts `device_class` devices."""
    return device_class + QUOTA_RESOURCE_SUFFIX


class TenantError(ValueError):
    """An invalid GpuTenant; one line per problem, each naming its field path."""

    def __init__(self, name: str, issues: list[str]) -> None:
        self.name = name
        self.issues = tuple(issues)
        super().__init__(f"GpuTenant {name}: " + "; ".join(issues))


class _Model(BaseModel):
    """Wire model: camelCase names only, strict JSON types, unknown fields rejected."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        validate_by_alias=True,
        validate_by_name=False,
        serialize_by_alias=True,
    )


class LabelSelectorRequirement(_Model):
    """One matchExpressions entry, as in a Kubernetes LabelSelector."""

    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] | None = None

    @model_validator(mode="after")
    def _values_fit_operator(self) -> Self:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs a non-empty values list")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values; remove values")
        return self

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        inside = self.key in labels and labels[self.key] in (self.values or ())
        return inside if self.operator == "In" else not inside


class LabelSelector(_Model):
    """Kubernetes LabelSelector semantics: all terms must hold; empty selects everything."""

    match_labels: dict[str, str] | None = Field(default=None, alias="matchLabels")
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, alias="matchExpressions"
    )

    @property
    def empty(self) -> bool:
        """No term at all (``{}``): selects every namespace, as the default tenant."""
        return not self.match_labels and not self.match_expressions

    def matches(self, labels: Mapping[str, str]) -> bool:
        for key, value in (self.match_labels or {}).items():
            if labels.get(key) != value:
                return False
        return all(r.matches(labels) for r in self.match_expressions or ())


class GpuResourceMapping(_Model):
    """What a legacy ``nvidia.com/gpu: N`` request becomes in the tenant's namespaces."""

    sharing: SharingMode = Field(
        default="Exclusive",
        description="Exclusive: N whole GPUs; TimeSlicing or MPS: N GPUs shared between "
        "the pod's containers with that strategy (also applies to nvidia.com/gpu.shared).",
    )
    time_slicing_interval: TimeSliceInterval | None = Field(
        default=None,
        alias="timeSlicingInterval",
        description="Time slice for sharing TimeSlicing (default: Default).",
    )

    @model_validator(mode="after")
    def _interval_needs_time_slicing(self) -> Self:
        if self.time_slicing_interval is not None and self.sharing != "TimeSlicing":
            raise ValueError(
                f"timeSlicingInterval only applies to sharing TimeSlicing (sharing is "
                f"{self.sharing}); remove it or set sharing: TimeSlicing"
            )
        return self


class Specificity(IntEnum):
    """How a tenant selects a namespace; the higher value wins an overlap.

    DEFAULT is an empty ``namespaceSelector``: it selects every namespace, but only to
    govern those no other tenant selects, so an admin can give the whole cluster GPU
    rules without a conflict in every namespace a team's tenant selects.
    """

    DEFAULT = 0
    LABEL = 1
    NAME = 2


def _as_default(namespace: str, excluded: Container[str]) -> Specificity | None:
    """How a default tenant (an empty ``namespaceSelector``) selects `namespace`: not at
    all where it is `excluded` (`excluded_namespaces`: the webhook never reviews it, so
    the tenant's rules would not be enforced there, and its quota would limit the
    system's own claims). The one rule, for valid tenants (`GpuTenantSpec.selects`) and
    invalid ones (`TenantReach.selects`) alike."""
    return None if namespace in excluded else Specificity.DEFAULT


class GpuTenantSpec(_Model):
    """Which namespaces belong to the tenant and what GPU use is allowed there."""

    namespace_selector: LabelSelector | None = Field(
        default=None,
        alias="namespaceSelector",
        description="Namespaces whose labels match belong to the tenant. {} (no "
        "matchLabels, no matchExpressions) makes the default tenant: it governs every "
        "namespace that no other tenant selects by label or name, except kube-system and "
        "the namespace gpudra is installed in; two default tenants conflict.",
    )
    namespaces: list[NamespaceName] | None = Field(
        default=None,
        description="Namespaces that belong to the tenant by name; a namespace listed here "
        "wins over tenants that only select it by label.",
    )
    max_devices_per_pod: int | None = Field(
        default=None,
        alias="maxDevicesPerPod",
        ge=1,
        le=MAX_DEVICES_PER_CLAIM * 8,
        description="Most devices one pod may ask for through nvidia.com/* resources, and "
        "one hand-written ResourceClaim or ResourceClaimTemplate may request.",
    )
    allowed_device_classes: list[DeviceClassName] | None = Field(
        default=None,
        alias="allowedDeviceClasses",
        description="The driver's DeviceClasses the tenant may use (unset: all).",
    )
    allowed_mig_profiles: list[MigProfile] | None = Field(
        default=None,
        alias="allowedMigProfiles",
        description="MIG profiles the tenant may use, e.g. 1g.10gb (unset: all; empty: none).",
    )
    allowed_sharing: list[SharingMode] | None = Field(
        default=None,
        alias="allowedSharing",
        description="Sharing modes the tenant may use: Exclusive, TimeSlicing, MPS (unset: all).",
    )
    allow_mps_multi_user: bool = Field(
        default=False,
        alias="allowMpsMultiUser",
        description="Whether the tenant's claims may run MPS in multi-user mode "
        "(mpsConfig.multiUser: true), so that their containers need not run CUDA as one "
        "user. NVIDIA's MPS server then runs as root for the clients of every user, in "
        "the node's MPS daemon pod, where otherwise it runs as the user of its client. "
        "Default: false.",
    )
    allowed_taint_tolerations: list[TaintKey] | None = Field(
        default=None,
        alias="allowedTaintTolerations",
        description="Device taint keys the tenant's claims may tolerate (tolerations[].key "
        'of a request for the driver\'s devices), e.g. gpu.nvidia.com/xid; "*" allows '
        "any toleration, also one without a key (every taint). Unset or empty: none, so a "
        "tenant never gets a device that a health check or an admin's DeviceTaintRule took "
        "out of service, nor stays on one that NoExecute drains. Keys only: a key allows "
        "every value and effect of it, so give each tenant's taints a key of their own.",
    )
    gpu_resource: GpuResourceMapping | None = Field(
        default=None,
        alias="gpuResource",
        description="What nvidia.com/gpu maps to (default: whole, exclusive GPUs).",
    )
    device_quota: dict[DeviceClassName, Annotated[int, Field(ge=0, le=MAX_QUOTA)]] | None = Field(
        default=None,
        alias="deviceQuota",
        description="Most devices per DeviceClass that claims in each selected namespace "
        "may request together; enforced by a ResourceQuota the webhook keeps there. The "
        "driver's classes it does not name get 0 (several classes give the same GPUs); "
        "empty, no GPUs at all.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.namespace_selector is None and self.namespaces is None:
            raise ValueError(
                "selects no namespace: set namespaceSelector (a label selector) or "
                "namespaces (a list of names)"
            )
        mapped = self.gpu_resource.sharing if self.gpu_resource else "Exclusive"
        if self.allowed_sharing is not None and mapped not in self.allowed_sharing:
            raise ValueError(
                f"gpuResource.sharing is {mapped} but allowedSharing is "
                f"[{', '.join(self.allowed_sharing)}], so every nvidia.com/gpu pod would be "
                f"denied: add {mapped} to allowedSharing or change gpuResource.sharing"
            )
        return self

    @property
    def is_default(self) -> bool:
        """An empty ``namespaceSelector``: the default tenant (`Specificity.DEFAULT`)."""
        return self.namespace_selector is not None and self.namespace_selector.empty

    def selects(
        self, namespace: str, labels: Mapping[str, str], excluded: Container[str] = ()
    ) -> Specificity | None:
        """How this tenant selects `namespace` (None: not at all). `excluded`: the
        namespaces no default tenant governs (`excluded_namespaces`); one listed by name
        is still selected by name."""
        if self.namespaces is not None and namespace in self.namespaces:
            return Specificity.NAME
        if self.namespace_selector is not None and self.namespace_selector.matches(labels):
            if self.namespace_selector.empty:
                return _as_default(namespace, excluded)
            return Specificity.LABEL
        return None

    @property
    def gpu_sharing(self) -> SharingMode:
        return self.gpu_resource.sharing if self.gpu_resource else "Exclusive"

    def allows_sharing(self, mode: str) -> bool:
        return self.allowed_sharing is None or mode in self.allowed_sharing

    def allows_class(self, device_class: str) -> bool:
        return self.allowed_device_classes is None or device_class in self.allowed_device_classes

    def allows_mig_profile(self, profile: str) -> bool:
        return self.allowed_mig_profiles is None or profile in self.allowed_mig_profiles

    def allows_toleration(self, key: str) -> bool:
        """Whether a claim may tolerate taints of `key` ("": a toleration of every taint)."""
        allowed = self.allowed_taint_tolerations or ()
        return ANY_TAINT in allowed or (key != "" and key in allowed)


@dataclass(frozen=True)
class Tenant:
    """A parsed GpuTenant object."""

    name: str
    spec: GpuTenantSpec
    generation: int = 0

    @property
    def label(self) -> str:
        """How messages name it: ``tenant "team-a" (GpuTenant team-a)``."""
        return f'tenant "{self.name}" ({KIND} {self.name})'


def winning_tenants(
    namespace: str,
    labels: Mapping[str, str] | None,
    tenants: Iterable[Tenant],
    excluded: Container[str] = (),
) -> list[Tenant] | None:
    """The tenants of highest specificity that select `namespace`, in `tenants`' order.

    The one rule for which tenant a namespace belongs to, shared by the webhook (whose
    rules apply) and the node agent (whose name labels the metrics): one winner is the
    tenant; none, no tenant; several, a conflict the caller reports. `labels` None: the
    namespace is not known yet, so the answer is None wherever labels would decide (a
    default tenant decides alone only where no tenant selects by label). `excluded`: the
    namespaces the webhook never reviews (kube-system, its own), which a default tenant
    does not govern (`GpuTenantSpec.selects`).
    """
    best: Specificity | None = None
    winners: list[Tenant] = []
    for tenant in tenants:
        spec = tenant.spec
        # An empty selector matches any labels, so without them only a label selector
        # that the name does not outrank leaves the answer unknown.
        how = spec.selects(namespace, labels or {}, excluded)
        by_label = spec.namespace_selector is not None and not spec.is_default
        if labels is None and by_label and how is not Specificity.NAME:
            return None
        if how is None:
            continue
        if best is None or how > best:
            best, winners = how, [tenant]
        elif how == best:
            winners.append(tenant)
    return winners


@dataclass(frozen=True)
class TenantReach:
    """Which namespaces an invalid GpuTenant would select, read from its object as far as
    it can be. Its rules are unknown, so where it would decide (`invalid_in_reach`), no
    valid tenant's rules may stand in for them: the webhook denies GPU pods there and the
    node agent bills the namespace to no tenant."""

    names: frozenset[str]
    selector: LabelSelector | None
    everywhere: bool
    """Its selector could not be read: taken to select every namespace by label."""

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> TenantReach:
        spec = obj.get("spec")
        spec = spec if isinstance(spec, Mapping) else {}
        names = spec.get("namespaces")
        names = names if isinstance(names, list) else []
        listed = frozenset(n for n in names if isinstance(n, str))
        raw = spec.get("namespaceSelector")
        if raw is None:
            return cls(listed, None, everywhere=not listed)
        try:
            return cls(listed, LabelSelector.model_validate(raw), everywhere=False)
        except ValueError:
            return cls(listed, None, everywhere=True)

    def selects(
        self, namespace: str, labels: Mapping[str, str] | None, excluded: Container[str] = ()
    ) -> Specificity | None:
        """As `GpuTenantSpec.selects` (and `winning_tenants`' `excluded`); `labels` None
        (not known yet): a selector might."""
        if namespace in self.names:
            return Specificity.NAME
        if self.selector is not None and self.selector.empty:
            return _as_default(namespace, excluded)
        if self.everywhere or (
            self.selector is not None and (labels is None or self.selector.matches(labels))
        ):
            return Specificity.LABEL
        return None


def invalid_in_reach(
    namespace: str,
    labels: Mapping[str, str] | None,
    winners: Sequence[Tenant],
    reach: Mapping[str, TenantReach],
    excluded: Container[str] = (),
) -> str | None:
    """The first (by name) invalid tenant in `reach` that would select `namespace` at
    least as specifically as the valid `winners` (`winning_tenants`) do: it would win or
    tie, so its unknown rules decide and no valid tenant's apply."""
    best = winners[0].spec.selects(namespace, labels or {}, excluded) if winners else None
    for name in sorted(reach):
        how = reach[name].selects(namespace, labels, excluded)
        if how is not None and (best is None or how >= best):
            return name
    return None


def parse_tenant(obj: Mapping[str, Any]) -> Tenant:
    """Validate a GpuTenant API object; raises TenantError naming each bad field."""
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not name:
        raise TenantError("<unnamed>", ["metadata.name: required field is missing"])
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") != KIND:
        raise TenantError(
            name,
            [
                f"apiVersion/kind must be {API_VERSION} {KIND}, got {obj.get('apiVersion')!r} "
                f"{obj.get('kind')!r}"
            ],
        )
    raw_spec = obj.get("spec")
    if not isinstance(raw_spec, Mapping):
        raise TenantError(name, ["spec: required object is missing"])
    try:
        spec = GpuTenantSpec.model_validate(raw_spec)
    except ValidationError as exc:
        raise TenantError(name, _issues(exc)) from None
    generation = metadata.get("generation", 0) if isinstance(metadata, Mapping) else 0
    return Tenant(name, spec, generation if isinstance(generation, int) else 0)


def _issues(exc: ValidationError) -> list[str]:
    issues: list[str] = []
    for error in exc.errors(include_url=False):
        path = loc_path("spec", error["loc"])
        if error["type"] == "extra_forbidden":
            message = "unknown field; remove it (see the GpuTenant CRD for the accepted fields)"
        else:
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] != "value_error" and "input" in error:
                message += f" (got {error['input']!r})"
        issues.append(f"{path}: {message}")
    return issues


# --- CRD ----------------------------------------------------------------------------------

# JSON-schema keys a CRD structural schema keeps; everything else (titles, defaults that
# would be written into stored objects, additionalProperties: false) is dropped.
_KEEP: Final = frozenset(
    {"type", "description", "enum", "pattern", "minimum", "maximum", "minLength", "maxLength"}
)


def _structural(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    """Turn pydantic's JSON schema into an OpenAPI v3 structural schema (no refs, no
    anyOf with null, every node typed)."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express {node} in a structural schema")
        rest = {k: v for k, v in node.items() if k not in ("anyOf", "default")}
        return _structural({**options[0], **rest}, defs)
    if "const" in node:
        node = {**node, "enum": [node["const"]]}
    out = {k: v for k, v in node.items() if k in _KEEP}
    if "enum" in node and "type" not in out:
        out["type"] = "string"
    kind = out.get("type")
    if kind == "object":
        properties = node.get("properties")
        if properties:
            out["properties"] = {k: _structural(v, defs) for k, v in properties.items()}
            if node.get("required"):
                out["required"] = list(node["required"])
        extra = node.get("additionalProperties")
        if isinstance(extra, Mapping):
            out["additionalProperties"] = _structural(extra, defs)
        keyed = node.get("patternProperties")
        if keyed:
            # Constrained map keys: CRDs have no patternProperties, so the key rule becomes
            # a CEL validation and the value schema the additionalProperties.
            ((key_pattern, value_schema),) = keyed.items()
            out["additionalProperties"] = _structural(value_schema, defs)
            out["maxProperties"] = _MAX_MAP_KEYS
            out["x-kubernetes-validations"] = [
                {
                    "rule": f"self.all(k, k.matches(r'{key_pattern}'))",
                    "message": "keys must be DeviceClass names (lowercase DNS subdomains)",
                }
            ]
    elif kind == "array":
        out["items"] = _structural(node["items"], defs)
    return out


def crd_manifest() -> dict[str, Any]:
    """The GpuTenant CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    schema = GpuTenantSpec.model_json_schema(by_alias=True, mode="validation")
    spec_schema = _structural(schema, schema.get("$defs", {}))
    spec_schema["x-kubernetes-validations"] = [
        {
            "rule": "has(self.namespaceSelector) || has(self.namespaces)",
            "message": "selects no namespace: set namespaceSelector or namespaces",
        }
    ]
    spec_schema["description"] = (
        "Which namespaces belong to the tenant and what GPU use is allowed there. Set "
        "namespaceSelector and/or namespaces."
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
            },
            "scope": "Cluster",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "GPU rules and device quota for a set of "
                            "namespaces, enforced by the gpudra admission webhook.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                            },
                        }
                    },
                    "additionalPrinterColumns": [
                        {
                            "name": "Max/Pod",
                            "type": "integer",
                            "jsonPath": ".spec.maxDevicesPerPod",
                        },
                        {
                            "name": "GPU",
                            "type": "string",
                            "jsonPath": ".spec.gpuResource.sharing",
                        },
                        {
                            "name": "Age",
                            "type": "date",
                            "jsonPath": ".metadata.creationTimestamp",
                        },
                    ],
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as the committed YAML file holds it."""
    header = "# Generated by `python -m gpudra.api.tenants` from api/tenants.py; do not edit.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
