"""Validation of hand-written ResourceClaims and ResourceClaimTemplates.

Claims that bypass the pod conversion are held to the same rules: the namespace's
GpuTenant (device classes, MIG profiles, sharing modes, devices per claim) and the
resolution prepare runs (`gpudra.api.sharing.resolve_sharing`: the DeviceClass's
configs, then the claim's, then the memory-slice rule), so a claim the webhook admits
can be prepared and its sharing mode is counted as the node will set it up. A config
that would fail at prepare time is refused at creation, with its field path and the
accepted values. Opaque configs addressed to other drivers are not ours to judge and are
skipped; so are requests for DeviceClasses that are not the driver's.

The object is parsed into typed models first, so a field of the wrong type (a config
entry that is null, `requests: 5`) is an error naming that field, not a crash.

Pure functions, no I/O: the admission server passes the object, the DeviceClasses'
configs and the tenant rules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

from gpudra.api.config import (
    BoundConfig,
    ConfigError,
    ConfigIssue,
    DeviceType,
    bound_configs,
    join_path,
)
from gpudra.api.deviceclasses import mig_profile_selector
from gpudra.api.sharing import Sharing, is_memory_slice, resolve_sharing
from gpudra.api.tenants import MAX_DEVICES_PER_CLAIM
from gpudra.webhook.convert import ConversionPolicy
from gpudra.webhook.tenant_rules import TenantRules
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

__all__ = [
    "ClaimVerdict",
    "ClassConfigs",
    "class_configs",
    "driver_classes",
    "validate_claim_object",
]

# The one selector form that pins a MIG request to a profile, as the conversion writes it.
_PROFILE_SELECTOR: Final = re.compile(
    r'\s*device\.attributes\["(?P<driver>[^"]+)"\]\.profile\s*==\s*"(?P<profile>[^"]+)"\s*'
)


@dataclass
class ClaimVerdict:
    """Problems found: `invalid` (malformed objects or configs) and `forbidden` (tenant
    rules); `name` is the object's metadata.name, for the denial message."""

    invalid: list[str] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)
    name: str = ""

    @property
    def allowed(self) -> bool:
        return not self.invalid and not self.forbidden

    @property
    def message(self) -> str:
        return "; ".join([*self.invalid, *self.forbidden])


def driver_classes(policy: ConversionPolicy, extra: Sequence[str] = ()) -> frozenset[str]:
    """The DeviceClasses that are the driver's: the policy's three, its per-profile MIG
    classes, plus `extra`."""
    return frozenset(
        {policy.gpu_class, policy.mig_class, policy.shared_class, *policy.profile_classes, *extra}
    )


@dataclass(frozen=True, slots=True)
class ClassConfigs:
    """A DeviceClass's opaque configs for the driver, or why they cannot be parsed.

    The allocation copies them into every claim of the class, and prepare applies them
    before the claim's own; a claim of a class whose configs are invalid cannot be
    prepared.
    """

    configs: tuple[BoundConfig, ...] = ()
    error: ConfigError | None = None


def class_configs(device_class: Mapping[str, Any], driver: str) -> ClassConfigs:
    """The driver's configs in a DeviceClass object (as the API server returns it)."""
    metadata = device_class.get("metadata")
    name = metadata.get("name", "") if isinstance(metadata, Mapping) else ""
    spec = device_class.get("spec")
    entries = spec.get("config") if isinstance(spec, Mapping) else None
    if not isinstance(entries, list):
        return ClassConfigs()
    try:
        parsed = _parse(_ConfigList, {"config": entries}, f"DeviceClass {name} spec")
        configs = bound_configs(
            [e.wire() for e in parsed.config or ()],
            driver=driver,
            prefix=f"DeviceClass {name} spec.config",
        )
    except _Invalid as exc:
        return ClassConfigs(error=ConfigError([ConfigIssue("", issue) for issue in exc.issues]))
    except ConfigError as exc:
        return ClassConfigs(error=exc)
    return ClassConfigs(tuple(configs))


# --- typed claim objects ------------------------------------------------------------------
# Only the fields validation reads; the API server checks the rest of the schema. Strict:
# a string where a number belongs is an error, as in the API server's decoder.


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="ignore", frozen=True, strict=True, alias_generator=to_camel, validate_by_alias=True
    )


class _Cel(_Model):
    expression: str = ""


class _Selector(_Model):
    cel: _Cel | None = None


class _Capacity(_Model):
    requests: dict[str, str | int | float] | None = None


class _Exact(_Model):
    device_class_name: str = ""
    allocation_mode: Literal["ExactCount", "All"] | None = None
    count: int | None = None
    selectors: list[_Selector] | None = None
    admin_access: bool | None = None
    capacity: _Capacity | None = None


class _Sub(_Exact):
    name: str = ""


class _RequestSpec(_Model):
    name: str = ""
    exactly: _Exact | None = None
    first_available: list[_Sub] | None = None


class _Opaque(_Model):
    driver: str = ""
    parameters: Any = None


class _ConfigEntry(_Model):
    requests: list[str] | None = None
    opaque: _Opaque | None = None

    def wire(self) -> dict[str, Any]:
        """The entry as `bound_configs` reads it."""
        entry: dict[str, Any] = {"requests": list(self.requests or ())}
        if self.opaque is not None:
            entry["opaque"] = {"driver": self.opaque.driver, "parameters": self.opaque.parameters}
        return entry


class _ConfigList(_Model):
    config: list[_ConfigEntry] | None = None


class _Devices(_ConfigList):
    requests: list[_RequestSpec] | None = None


class _ClaimSpec(_Model):
    devices: _Devices | None = None


class _Metadata(_Model):
    name: str = ""


class _Claim(_Model):
    metadata: _Metadata | None = None
    spec: _ClaimSpec | None = None


class _TemplateSpec(_Model):
    spec: _ClaimSpec | None = None


class _Template(_Model):
    metadata: _Metadata | None = None
    spec: _TemplateSpec | None = None


_M = TypeVar("_M", bound=_Model)


class _Invalid(Exception):
    def __init__(self, issues: list[str]) -> None:
        super().__init__("; ".join(issues))
        self.issues = issues


def _parse(model: type[_M], obj: object, prefix: str) -> _M:
    """`obj` as `model`; raises _Invalid with one line per field of the wrong type."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        issues = []
        for error in exc.errors(include_url=False):
            path = prefix
            for part in error["loc"]:
                path = join_path(path, f"[{part}]" if isinstance(part, int) else str(part))
            issues.append(f"{path or '(object)'}: {error['msg']} (got {error['input']!r:.60})")
        raise _Invalid(issues) from None


@dataclass(frozen=True)
class _Request:
    path: str  # spec.devices.requests[0].exactly or ...firstAvailable[1]
    name: str  # "req" or "req/sub" (configs bind to the parent name)
    device_class: str
    count: int
    selectors: tuple[str, ...]
    memory_slice: bool  # capacity requests other than shares: part of a GPU's memory
    admin: bool


def validate_claim_object(
    obj: Mapping[str, Any],
    *,
    template: bool,
    policy: ConversionPolicy,
    classes: frozenset[str],
    rules: TenantRules | None,
    denial: str = "",
    device_classes: Mapping[str, ClassConfigs] | None = None,
) -> ClaimVerdict:
    """Check one ResourceClaim (or, with `template`, ResourceClaimTemplate) object.

    `denial` is a namespace-wide reason (tenant conflict, rules not loaded) that forbids
    any claim for the driver's classes; `device_classes` holds the configs of the
    DeviceClasses by name (a class not in it has none).
    """
    verdict = ClaimVerdict()
    try:
        if template:
            parsed_template = _parse(_Template, obj, "")
            metadata = parsed_template.metadata
            spec = parsed_template.spec.spec if parsed_template.spec else None
        else:
            parsed_claim = _parse(_Claim, obj, "")
            metadata, spec = parsed_claim.metadata, parsed_claim.spec
    except _Invalid as exc:
        verdict.invalid.extend(exc.issues)
        return verdict
    verdict.name = metadata.name if metadata is not None else ""
    devices = spec.devices if spec is not None else None
    if devices is None:
        return verdict
    base = f"{'spec.spec' if template else 'spec'}.devices"
    configs: list[BoundConfig] = []
    try:
        configs = bound_configs(
            [entry.wire() for entry in devices.config or ()],
            driver=policy.driver,
            prefix=f"{base}.config",
        )
    except ConfigError as exc:
        verdict.invalid.extend(str(issue) for issue in exc.issues)
    requests = _requests(devices.requests or (), base)
    ours = [r for r in requests if r.device_class in classes]
    if ours and denial:
        verdict.forbidden.append(denial)
        return verdict
    # Resolution needs every config parsed; what failed to parse is reported already.
    resolved = (
        {} if verdict.invalid else _resolve(ours, configs, policy, device_classes or {}, verdict)
    )
    if rules is not None:
        _check_rules(ours, resolved, policy, rules, verdict)
    return verdict


def _requests(raw: Sequence[_RequestSpec], base: str) -> list[_Request]:
    result: list[_Request] = []
    for index, request in enumerate(raw):
        if request.exactly is not None:
            result.append(_one(request.exactly, f"{base}.requests[{index}].exactly", request.name))
        for sub_index, sub in enumerate(request.first_available or ()):
            path = f"{base}.requests[{index}].firstAvailable[{sub_index}]"
            result.append(_one(sub, path, f"{request.name}/{sub.name}"))
    return result


def _one(raw: _Exact, path: str, name: str) -> _Request:
    count = raw.count if raw.count is not None else 1
    devices = MAX_DEVICES_PER_CLAIM if raw.allocation_mode == "All" else count
    selectors = tuple(s.cel.expression for s in raw.selectors or () if s.cel is not None)
    capacity = raw.capacity.requests if raw.capacity is not None else None
    return _Request(
        path,
        name,
        raw.device_class_name,
        devices,
        selectors,
        memory_slice=is_memory_slice(capacity or {}),
        admin=raw.admin_access is True,
    )


def _device_type(request: _Request, policy: ConversionPolicy) -> DeviceType:
    mig = request.device_class == policy.mig_class or request.device_class in policy.profile_classes
    return "mig" if mig else "gpu"


def _resolve(
    requests: Sequence[_Request],
    configs: Sequence[BoundConfig],
    policy: ConversionPolicy,
    device_classes: Mapping[str, ClassConfigs],
    verdict: ClaimVerdict,
) -> dict[str, Sharing]:
    """Each request's sharing as prepare will resolve it; prepare's refusals are invalid."""
    resolved: dict[str, Sharing] = {}
    for request in requests:
        found = device_classes.get(request.device_class, ClassConfigs())
        if found.error is not None:
            verdict.invalid.extend(
                f"{request.path}.deviceClassName: {issue}; the cluster admin must fix the "
                "DeviceClass"
                for issue in found.error.issues
            )
            continue
        try:
            resolved[request.path] = resolve_sharing(
                _device_type(request, policy),
                found.configs,
                configs,
                request.name,
                memory_slice=request.memory_slice and not request.admin,
                where=f"{request.path} (capacity.requests)",
            )
        except ConfigError as exc:
            verdict.invalid.extend(str(issue) for issue in exc.issues)
    return resolved


def _sharing_source(request: _Request, sharing: Sharing) -> str:
    """The field that sets `request`'s sharing mode, for a denial to name."""
    if request.memory_slice and not request.admin and sharing.config.sharing is None:
        return f"{request.path}.capacity.requests (a memory slice of a shared GPU runs under MPS)"
    if sharing.path:
        return join_path(sharing.path, "sharing.strategy")
    return f"{request.path} (no sharing config: Exclusive)"


def _check_rules(
    requests: Sequence[_Request],
    resolved: Mapping[str, Sharing],
    policy: ConversionPolicy,
    rules: TenantRules,
    verdict: ClaimVerdict,
) -> None:
    spec = rules.tenant.spec
    label = rules.label
    # firstAvailable alternatives: the largest one counts against the limit.
    largest: dict[str, int] = {}
    for request in requests:
        parent = request.name.split("/", 1)[0]
        largest[parent] = max(largest.get(parent, 0), request.count)
        if not spec.allows_class(request.device_class):
            verdict.forbidden.append(
                f"{request.path}.deviceClassName: {label} does not allow device class "
                f"{request.device_class}; accepted values: "
                f"{', '.join(spec.allowed_device_classes or ()) or 'none'}"
            )
        if _device_type(request, policy) == "mig" and spec.allowed_mig_profiles is not None:
            _check_profile(request, policy, rules, verdict)
        sharing = resolved.get(request.path)
        if sharing is None:
            continue  # reported as invalid already
        if not spec.allows_sharing(sharing.mode):
            verdict.forbidden.append(
                f"{_sharing_source(request, sharing)}: {label} does not allow sharing mode "
                f"{sharing.mode}; accepted values: "
                f"{', '.join(spec.allowed_sharing or ()) or 'none'}"
            )
    total = sum(largest.values())
    limit = spec.max_devices_per_pod
    if limit is not None and total > limit:
        counts = ", ".join(f"{r.path}.count={r.count}" for r in requests)
        verdict.forbidden.append(
            f"{label}: maxDevicesPerPod is {limit}, this claim asks for {total} devices ({counts})"
        )


def _check_profile(
    request: _Request, policy: ConversionPolicy, rules: TenantRules, verdict: ClaimVerdict
) -> None:
    """MIG requests must pin an allowed profile: with a per-profile class, or with the
    selector form the conversion uses. A per-profile class pins its profile whatever the
    selectors say, so it is checked first: a selector naming an allowed profile on the
    class of another must not pass."""
    allowed = rules.tenant.spec.allowed_mig_profiles or []
    pinned = policy.profile_classes.get(request.device_class)
    if pinned is not None:
        if pinned not in allowed:
            verdict.forbidden.append(
                f"{request.path}.deviceClassName: {rules.label} does not allow MIG profile "
                f"{pinned} (device class {request.device_class}); accepted values: "
                f"{', '.join(allowed) or 'none'}"
            )
        return
    for selector in request.selectors:
        match = _PROFILE_SELECTOR.fullmatch(selector)
        if match and match["driver"] == policy.driver:
            if match["profile"] in allowed:
                return
            verdict.forbidden.append(
                f"{request.path}.selectors: {rules.label} does not allow MIG profile "
                f"{match['profile']}; accepted values: {', '.join(allowed) or 'none'}"
            )
            return
    example = mig_profile_selector(policy.driver, allowed[0] if allowed else "1g.10gb")
    verdict.forbidden.append(
        f"{request.path}.selectors: {rules.label} allows only MIG profiles "
        f"{', '.join(allowed) or 'none'}, so a {request.device_class} request must select one "
        f"with a CEL selector of the form {example}"
    )
