"""Validation of hand-written ResourceClaims and ResourceClaimTemplates.

Claims that bypass the pod conversion are held to the same rules: the namespace's
GpuTenant (device classes, MIG profiles, sharing modes, devices per claim) and the
strict opaque-config parser the kubelet plugin uses (`gpudra.api.config`), so a config
that would fail at prepare time is refused at creation, with its field path and the
accepted values. Opaque configs addressed to other drivers are not ours to judge and are
skipped; so are requests for DeviceClasses that are not the driver's.

Pure functions, no I/O: the admission server passes the object and the tenant rules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gpudra.api.config import (
    BoundConfig,
    ConfigError,
    DeviceConfig,
    DeviceType,
    bound_configs,
    resolve_config,
)
from gpudra.api.tenants import MAX_DEVICES_PER_CLAIM
from gpudra.webhook.convert import ConversionPolicy
from gpudra.webhook.tenant_rules import TenantRules

__all__ = ["ClaimVerdict", "driver_classes", "validate_claim_object"]

# The one selector form that pins a MIG request to a profile, as the conversion writes it.
_PROFILE_SELECTOR: Final = re.compile(
    r'\s*device\.attributes\["(?P<driver>[^"]+)"\]\.profile\s*==\s*"(?P<profile>[^"]+)"\s*'
)


@dataclass
class ClaimVerdict:
    """Problems found: `invalid` (malformed configs) and `forbidden` (tenant rules)."""

    invalid: list[str] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.invalid and not self.forbidden

    @property
    def message(self) -> str:
        return "; ".join([*self.invalid, *self.forbidden])


def driver_classes(policy: ConversionPolicy, extra: Sequence[str] = ()) -> frozenset[str]:
    """The DeviceClasses that are the driver's: the policy's three plus `extra`."""
    return frozenset({policy.gpu_class, policy.mig_class, policy.shared_class, *extra})


@dataclass(frozen=True)
class _Request:
    path: str  # spec.devices.requests[0].exactly or ...firstAvailable[1]
    name: str  # "req" or "req/sub" (configs bind to the parent name)
    device_class: str
    count: int
    selectors: tuple[str, ...]


def validate_claim_object(
    obj: Mapping[str, Any],
    *,
    template: bool,
    policy: ConversionPolicy,
    classes: frozenset[str],
    rules: TenantRules | None,
    denial: str = "",
) -> ClaimVerdict:
    """Check one ResourceClaim (or, with `template`, ResourceClaimTemplate) object.

    `denial` is a namespace-wide reason (tenant conflict, rules not loaded) that forbids
    any claim for the driver's classes.
    """
    verdict = ClaimVerdict()
    prefix = "spec.spec" if template else "spec"
    spec = obj.get("spec")
    if template and isinstance(spec, Mapping):
        spec = spec.get("spec")
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    if not isinstance(devices, Mapping):
        return verdict
    base = f"{prefix}.devices"
    entries = devices.get("config") or []
    configs: list[BoundConfig] = []
    if isinstance(entries, list):
        try:
            configs = bound_configs(entries, driver=policy.driver, prefix=f"{base}.config")
        except ConfigError as exc:
            verdict.invalid.extend(str(issue) for issue in exc.issues)
    requests = _requests(devices.get("requests"), base)
    ours = [r for r in requests if r.device_class in classes]
    if ours and denial:
        verdict.forbidden.append(denial)
        return verdict
    if not verdict.invalid:
        _check_config_kinds(ours, configs, policy, verdict)
    if rules is not None:
        _check_rules(ours, configs, policy, rules, verdict)
    return verdict


def _requests(raw: object, base: str) -> list[_Request]:
    result: list[_Request] = []
    if not isinstance(raw, list):
        return result
    for index, request in enumerate(raw):
        if not isinstance(request, Mapping):
            continue
        name = str(request.get("name", ""))
        exactly = request.get("exactly")
        if isinstance(exactly, Mapping):
            result.append(_one(exactly, f"{base}.requests[{index}].exactly", name))
        subs = request.get("firstAvailable")
        if isinstance(subs, list):
            for sub_index, sub in enumerate(subs):
                if isinstance(sub, Mapping):
                    path = f"{base}.requests[{index}].firstAvailable[{sub_index}]"
                    result.append(_one(sub, path, f"{name}/{sub.get('name', '')}"))
    return result


def _one(raw: Mapping[str, Any], path: str, name: str) -> _Request:
    mode = raw.get("allocationMode", "ExactCount")
    count = raw.get("count", 1)
    devices = MAX_DEVICES_PER_CLAIM if mode == "All" else count if isinstance(count, int) else 1
    selectors = tuple(
        str((s.get("cel") or {}).get("expression", ""))
        for s in raw.get("selectors") or ()
        if isinstance(s, Mapping)
    )
    return _Request(path, name, str(raw.get("deviceClassName", "")), devices, selectors)


def _device_type(request: _Request, policy: ConversionPolicy) -> DeviceType:
    return "mig" if request.device_class == policy.mig_class else "gpu"


def _check_config_kinds(
    requests: Sequence[_Request],
    configs: Sequence[BoundConfig],
    policy: ConversionPolicy,
    verdict: ClaimVerdict,
) -> None:
    """A config bound to a request by name must fit its device type (as at prepare)."""
    for request in requests:
        try:
            resolve_config(_device_type(request, policy), (), configs, request.name)
        except ConfigError as exc:
            verdict.invalid.extend(str(issue) for issue in exc.issues)


def _sharing(config: DeviceConfig) -> str:
    return config.sharing.strategy if config.sharing is not None else "Exclusive"


def _check_rules(
    requests: Sequence[_Request],
    configs: Sequence[BoundConfig],
    policy: ConversionPolicy,
    rules: TenantRules,
    verdict: ClaimVerdict,
) -> None:
    spec = rules.tenant.spec
    label = rules.label
    total = 0
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
        device_type = _device_type(request, policy)
        if device_type == "mig" and spec.allowed_mig_profiles is not None:
            _check_profile(request, policy, rules, verdict)
        try:
            config = resolve_config(device_type, (), configs, request.name)
        except ConfigError:
            continue  # reported as invalid already
        mode = _sharing(config)
        if not spec.allows_sharing(mode):
            where = next(
                (f"{b.path}.sharing.strategy" for b in reversed(configs) if b.config is config),
                f"{request.path} (no sharing config: Exclusive)",
            )
            verdict.forbidden.append(
                f"{where}: {label} does not allow sharing mode {mode}; accepted values: "
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
    """MIG requests must pin an allowed profile with the selector form the conversion uses."""
    allowed = rules.tenant.spec.allowed_mig_profiles or []
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
    example = (
        f'device.attributes["{policy.driver}"].profile == "{allowed[0] if allowed else "1g.10gb"}"'
    )
    verdict.forbidden.append(
        f"{request.path}.selectors: {rules.label} allows only MIG profiles "
        f"{', '.join(allowed) or 'none'}, so a {request.device_class} request must select one "
        f"with a CEL selector of the form {example}"
    )
