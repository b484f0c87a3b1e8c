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
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal, TypeVar

from gpudra.api.config import (
    BoundConfig,
    ConfigError,
    ConfigIssue,
    DeviceConfig,
    DeviceType,
    MpsConfig,
    bound_configs,
    join_path,
    loc_path,
    parse_opaque_config,
)
from gpudra.api.deviceclasses import mig_profile_selector
from gpudra.api.names import base_request
from gpudra.api.sharing import (
    SHARES_CAPACITY,
    Sharing,
    driver_capacities,
    is_memory_slice,
    mps_daemon_settings,
    mps_setting_conflict,
    resolve_sharing,
)
from gpudra.api.tenants import MAX_DEVICES_PER_CLAIM
from gpudra.webhook.convert import ConversionPolicy
from gpudra.webhook.tenant_rules import TenantRules
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

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


MAX_PROBLEMS: Final = 20
"""At most this many problems are named in one denial."""
MAX_MESSAGE: Final = 8192
"""And at most this many characters of them."""


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
        """The problems, the first `MAX_PROBLEMS` of them: a claim with thousands of bad
        fields gets a denial a user can read, not megabytes."""
        problems = [*self.invalid, *self.forbidden]
        shown = "; ".join(problems[:MAX_PROBLEMS])
        if len(shown) > MAX_MESSAGE:
            shown = shown[:MAX_MESSAGE] + "..."
        if len(problems) > MAX_PROBLEMS:
            shown += f"; and {len(problems) - MAX_PROBLEMS} more problems"
        return shown


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
    kinds: tuple[DeviceType, ...] | None = None
    """The one kind of device its selectors pin (`device.attributes["<driver>"].type ==
    "gpu"` or `"mig"`, as the chart's classes do); None where they do not say."""
    extended_resource_name: str | None = None
    """Its ``spec.extendedResourceName`` as stored: the API server drops the field while
    its DRAExtendedResource gate is off, and then the scheduler serves no pod by that
    name, so the webhook leaves a resource to the scheduler only where it is stored
    (`Admission`)."""


_TYPE_SELECTOR: Final = re.compile(
    r'\s*(?P<open>\()?\s*device\.attributes\["(?P<driver>[^"]+)"\]\.type\s*==\s*'
    r'"(?P<kind>gpu|mig)"\s*(?(open)\))\s*'
)


def _conjuncts(expression: str) -> list[str] | None:
    """The terms a CEL expression joins with `&&` at its top level, outside parentheses,
    brackets and string literals; None where a string is not closed.

    Split anywhere else, a term could sit under an operator that turns it round
    (`false == (false && T)`) or inside a triple-quoted string compared with itself,
    and a class that selects every device would read as pinning one kind. The caller
    has refused the characters of the forms this does not follow (`'` strings,
    escapes).
    """
    terms: list[str] = []
    depth = start = i = 0
    while i < len(expression):
        if expression.startswith('"""', i):
            end = expression.find('"""', i + 3)
            if end < 0:
                return None
            i = end + 3
            continue
        char = expression[i]
        if char == '"':
            end = expression.find('"', i + 1)
            if end < 0:
                return None
            i = end + 1
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0 and expression.startswith("&&", i):
            terms.append(expression[start:i])
            start = i + 2
            i += 2
            continue
        i += 1
    terms.append(expression[start:])
    return terms


def _pinned_kind(spec: Mapping[str, Any], driver: str) -> tuple[DeviceType, ...] | None:
    """The device kind a class's selectors pin: a selector (all must hold) that is a plain
    conjunction with the type's equality as one of its top-level terms. Anything else
    (an `||`, a negation, a choice, the equality under another operator or inside a
    string) is taken to pin nothing."""
    selectors = spec.get("selectors")
    for selector in selectors if isinstance(selectors, list) else ():
        cel = selector.get("cel") if isinstance(selector, Mapping) else None
        expression = cel.get("expression") if isinstance(cel, Mapping) else None
        if not isinstance(expression, str) or any(c in expression for c in "|!?'\\"):
            continue
        for term in _conjuncts(expression) or ():
            match = _TYPE_SELECTOR.fullmatch(term)
            if match and match["driver"] == driver:
                return ("gpu",) if match["kind"] == "gpu" else ("mig",)
    return None


def class_configs(device_class: Mapping[str, Any], driver: str) -> ClassConfigs:
    """The driver's configs in a DeviceClass object (as the API server returns it), the
    device kind its selectors pin and its extendedResourceName."""
    metadata = device_class.get("metadata")
    name = metadata.get("name", "") if isinstance(metadata, Mapping) else ""
    spec = device_class.get("spec")
    if not isinstance(spec, Mapping):
        return ClassConfigs()
    kinds = _pinned_kind(spec, driver)
    mapped = spec.get("extendedResourceName")
    extended = mapped if isinstance(mapped, str) and mapped else None
    entries = spec.get("config")
    if not isinstance(entries, list):
        return ClassConfigs(kinds=kinds, extended_resource_name=extended)
    try:
        parsed = _parse(_CONFIG_LIST, {"config": entries}, f"DeviceClass {name} spec")
        configs = bound_configs(
            parsed.get("config") or (),
            driver=driver,
            prefix=f"DeviceClass {name} spec.config",
        )
    except _Invalid as exc:
        issues = [ConfigIssue("", issue) for issue in exc.issues]
        return ClassConfigs(error=ConfigError(issues), kinds=kinds, extended_resource_name=extended)
    except ConfigError as exc:
        return ClassConfigs(error=exc, kinds=kinds, extended_resource_name=extended)
    return ClassConfigs(tuple(configs), kinds=kinds, extended_resource_name=extended)


# --- typed claim objects ------------------------------------------------------------------
# Only the fields validation reads; the API server checks the rest of the schema. Strict:
# a string where a number belongs is an error, as in the API server's decoder. TypedDicts,
# not models: pydantic checks the types and hands back plain dicts of the fields named
# here, with no object built per field (the webhook parses every claim it admits), and
# its errors say "a valid dictionary", not the name of a class of ours. The config of the
# three roots (`_Claim`, `_Template`, `_ConfigList`) holds for every TypedDict inside them.

_STRICT: Final = ConfigDict(strict=True, extra="ignore")


class _Cel(TypedDict, total=False):
    expression: str


class _Selector(TypedDict, total=False):
    cel: _Cel | None


class _Capacity(TypedDict, total=False):
    requests: dict[str, str | int | float] | None


class _Toleration(TypedDict, total=False):
    key: str | None


class _Exact(TypedDict, total=False):
    deviceClassName: str
    allocationMode: Literal["ExactCount", "All"] | None
    count: int | None
    selectors: list[_Selector] | None
    adminAccess: bool | None
    capacity: _Capacity | None
    # Unbounded like the API server's (its "at most 16" is not enforced up to 1.36): a
    # body's size bounds them.
    tolerations: list[_Toleration] | None


class _Sub(_Exact, total=False):
    name: str


# The API server's limits (resource.k8s.io validation), so that a review sent straight
# to the port, which no API server checked, costs what a real claim at most costs.
_MAX_REQUESTS: Final = 32
_MAX_SUBREQUESTS: Final = 8
_MAX_CONFIGS: Final = 32


class _RequestSpec(TypedDict, total=False):
    name: str
    exactly: _Exact | None
    firstAvailable: Annotated[list[_Sub], Field(max_length=_MAX_SUBREQUESTS)] | None


class _Opaque(TypedDict, total=False):
    driver: str
    parameters: Any


class _ConfigEntry(TypedDict, total=False):
    """A `config[]` entry, in the form `bound_configs` reads."""

    requests: Annotated[list[str], Field(max_length=_MAX_REQUESTS)] | None
    opaque: _Opaque | None


@with_config(_STRICT)
class _ConfigList(TypedDict, total=False):
    config: Annotated[list[_ConfigEntry], Field(max_length=_MAX_CONFIGS)] | None


class _Devices(_ConfigList, total=False):
    requests: Annotated[list[_RequestSpec], Field(max_length=_MAX_REQUESTS)] | None


class _ClaimSpec(TypedDict, total=False):
    devices: _Devices | None


class _Metadata(TypedDict, total=False):
    name: str


@with_config(_STRICT)
class _Claim(TypedDict, total=False):
    metadata: _Metadata | None
    spec: _ClaimSpec | None


class _TemplateSpec(TypedDict, total=False):
    spec: _ClaimSpec | None


@with_config(_STRICT)
class _Template(TypedDict, total=False):
    metadata: _Metadata | None
    spec: _TemplateSpec | None


# Built once: a TypeAdapter compiles its validator when it is made.
_CLAIM: Final = TypeAdapter(_Claim)
_TEMPLATE: Final = TypeAdapter(_Template)
_CONFIG_LIST: Final = TypeAdapter(_ConfigList)

_T = TypeVar("_T")


class _Invalid(Exception):
    def __init__(self, issues: list[str]) -> None:
        super().__init__("; ".join(issues))
        self.issues = issues


def _parse(adapter: TypeAdapter[_T], obj: object, prefix: str) -> _T:
    """`obj` checked by `adapter`; raises _Invalid with one line per field of the wrong
    type."""
    try:
        return adapter.validate_python(obj)
    except ValidationError as exc:
        issues = []
        for error in exc.errors(include_url=False):
            path = loc_path(prefix, error["loc"])
            # reprlib: a value nested a thousand deep is shown, not a RecursionError.
            shown = reprlib.repr(error["input"])[:60]
            issues.append(f"{path or '(object)'}: {error['msg']} (got {shown})")
        raise _Invalid(issues) from None


@dataclass(frozen=True)
class _Request:
    path: str  # spec.devices.requests[0].exactly or ...firstAvailable[1]
    name: str  # "req" or "req/sub" (configs bind to the parent name)
    device_class: str
    count: int  # the most devices it may get (allocationMode All: a claim's most)
    selectors: tuple[str, ...]
    memory_slice: bool  # capacity requests other than shares: part of a GPU's memory
    admin: bool
    shares: bool = False  # a shares request: some of a GPU's integer shares, or all
    fewest: int = 1  # the fewest devices it gets when allocated (All: at least one)
    tolerations: tuple[str, ...] = ()  # the taint key of each toleration ("": every taint)


def validate_claim_object(
    obj: Mapping[str, Any],
    *,
    template: bool,
    policy: ConversionPolicy,
    classes: frozenset[str],
    rules: TenantRules | None,
    denial: str = "",
    device_classes: Mapping[str, ClassConfigs] | None = None,
    parse_config: Callable[[object], DeviceConfig] = parse_opaque_config,
) -> ClaimVerdict:
    """Check one ResourceClaim (or, with `template`, ResourceClaimTemplate) object.

    `denial` is a namespace-wide reason (tenant conflict, rules not loaded) that forbids
    any claim for the driver's classes; `device_classes` holds the configs of the
    DeviceClasses by name (a class not in it has none); `parse_config` parses one
    opaque config (the webhook passes its `ConfigCache.parse`).
    """
    verdict = ClaimVerdict()
    try:
        if template:
            parsed_template = _parse(_TEMPLATE, obj, "")
            metadata = parsed_template.get("metadata")
            spec = (parsed_template.get("spec") or {}).get("spec")
        else:
            parsed_claim = _parse(_CLAIM, obj, "")
            metadata, spec = parsed_claim.get("metadata"), parsed_claim.get("spec")
    except _Invalid as exc:
        verdict.invalid.extend(exc.issues)
        return verdict
    verdict.name = (metadata or {}).get("name", "")
    devices = (spec or {}).get("devices")
    if devices is None:
        return verdict
    base = f"{'spec.spec' if template else 'spec'}.devices"
    configs: list[BoundConfig] = []
    try:
        configs = bound_configs(
            devices.get("config") or (),
            driver=policy.driver,
            prefix=f"{base}.config",
            parse=parse_config,
        )
    except ConfigError as exc:
        verdict.invalid.extend(str(issue) for issue in exc.issues)
    requests = _requests(devices.get("requests") or (), base, policy.driver)
    ours = [r for r in requests if r.device_class in classes]
    if ours and denial:
        verdict.forbidden.append(denial)
        return verdict
    # Resolution needs every config parsed; what failed to parse is reported already.
    resolved = (
        {} if verdict.invalid else _resolve(ours, configs, policy, device_classes or {}, verdict)
    )
    _check_mps(ours, resolved, verdict)
    if rules is not None:
        _check_rules(ours, resolved, policy, rules, verdict, device_classes or {})
    return verdict


def _requests(raw: Sequence[_RequestSpec], base: str, driver: str) -> list[_Request]:
    result: list[_Request] = []
    for index, request in enumerate(raw):
        name = request.get("name", "")
        exactly = request.get("exactly")
        if exactly is not None:
            result.append(_one(exactly, f"{base}.requests[{index}].exactly", name, driver))
        for sub_index, sub in enumerate(request.get("firstAvailable") or ()):
            path = f"{base}.requests[{index}].firstAvailable[{sub_index}]"
            result.append(_one(sub, path, f"{name}/{sub.get('name', '')}", driver))
    return result


def _one(raw: _Exact, path: str, name: str, driver: str) -> _Request:
    count = raw.get("count")
    if count is None:
        count = 1
    devices = MAX_DEVICES_PER_CLAIM if raw.get("allocationMode") == "All" else count
    selectors = tuple(
        cel.get("expression", "")
        for selector in raw.get("selectors") or ()
        if (cel := selector.get("cel")) is not None
    )
    capacity = driver_capacities((raw.get("capacity") or {}).get("requests") or {}, driver)
    return _Request(
        path,
        name,
        raw.get("deviceClassName", ""),
        devices,
        selectors,
        memory_slice=is_memory_slice(capacity),
        admin=raw.get("adminAccess") is True,
        shares=SHARES_CAPACITY in capacity,
        fewest=1 if raw.get("allocationMode") == "All" else count,
        tolerations=tuple(t.get("key") or "" for t in raw.get("tolerations") or ()),
    )


def _device_types(
    request: _Request, policy: ConversionPolicy, device_classes: Mapping[str, ClassConfigs]
) -> tuple[DeviceType, ...]:
    """What the request's class may give: the driver's own classes one kind each; any
    other (an admin's class named with --device-class) the kind its selectors pin, else
    a whole GPU or a MIG device, so its requests are judged as both."""
    if request.device_class == policy.mig_class or request.device_class in policy.profile_classes:
        return ("mig",)
    if request.device_class in (policy.gpu_class, policy.shared_class):
        return ("gpu",)
    found = device_classes.get(request.device_class)
    return (found.kinds if found is not None else None) or ("gpu", "mig")


def _resolve(
    requests: Sequence[_Request],
    configs: Sequence[BoundConfig],
    policy: ConversionPolicy,
    device_classes: Mapping[str, ClassConfigs],
    verdict: ClaimVerdict,
) -> dict[str, list[tuple[bool, Sharing]]]:
    """Each request's sharing as prepare may resolve it, by whether its device is a memory
    slice; prepare's refusals are invalid.

    A request with capacity requests other than shares becomes a slice of a shared GPU
    when the scheduler gives it one, but a capacity request only filters a device that
    is not shared, and one asking for a shared GPU's whole memory leaves nothing to share:
    either way it gets a whole device, which prepare runs as its config says. Which one
    is the scheduler's choice, so such a request is resolved both ways. So is a request
    for integer shares: some of a GPU's shares (time-sliced with the claims holding the
    others, never Exclusive) or, asking for as many as the GPU has, the whole GPU.
    """
    resolved: dict[str, list[tuple[bool, Sharing]]] = {}
    for request in requests:
        found = device_classes.get(request.device_class, ClassConfigs())
        if found.error is not None:
            verdict.invalid.extend(
                f"{request.path}.deviceClassName: {issue}; the cluster admin must fix the "
                "DeviceClass"
                for issue in found.error.issues
            )
            continue
        outcomes = resolved[request.path] = []
        ways = [(False, False)]  # (a memory slice, some integer shares)
        if request.memory_slice and not request.admin:
            ways.insert(0, (True, False))
        elif request.shares and not request.admin:
            ways.insert(0, (False, True))
        try:
            for device_type in _device_types(request, policy, device_classes):
                for sliced, share in ways if device_type == "gpu" else [(False, False)]:
                    sharing = resolve_sharing(
                        device_type,
                        found.configs,
                        configs,
                        request.name,
                        memory_slice=sliced,
                        where=f"{request.path} (capacity.requests)",
                        integer_share=share,
                    )
                    if all(
                        (sharing.mode, sharing.path) != (known.mode, known.path)
                        for _, known in outcomes
                    ):
                        outcomes.append((sliced, sharing))
        except ConfigError as exc:
            verdict.invalid.extend(str(issue) for issue in exc.issues)
            del resolved[request.path]
    return resolved


def _check_mps(
    requests: Sequence[_Request],
    resolved: Mapping[str, Sequence[tuple[bool, Sharing]]],
    verdict: ClaimVerdict,
) -> None:
    """What prepare refuses across a claim's MPS devices, refused here first: one daemon
    serves them all, so one value of each of its settings (`MPS_DAEMON_SETTINGS`: the
    active thread percentage, multi-user mode); and a per-device pinned-memory
    index counts into the devices its config is given, so it must be below their number.

    Of a request's ``firstAvailable`` alternatives one is allocated: their settings
    never meet, and an index must name a device whichever of them using the config is
    allocated, so the fewest devices among those count (for ``allocationMode: All``,
    one: a node may have only one). The ways one request may resolve (a whole GPU or a
    MIG device, for a class that does not pin the kind) meet where it may get several
    devices: the scheduler may give it some of each. Admin-access devices join no daemon.
    """
    # daemon setting -> parent request -> value -> config path
    asked: dict[str, dict[str, dict[int | bool, str]]] = {}
    settings: dict[str, MpsConfig] = {}
    # request path -> the MPS config path of each way it may resolve (None: not MPS)
    uses: dict[str, set[str | None]] = {}
    for request in requests:
        if request.admin:
            continue
        parent = base_request(request.name)
        paths = uses[request.path] = set()
        own: dict[str, dict[int | bool, str]] = {}  # this request's ways, by setting
        for _, sharing in resolved.get(request.path, ()):
            mps = sharing.mps_config if sharing.mps else None
            paths.add(None if mps is None else sharing.path)
            if mps is None:
                continue
            for setting, value in mps_daemon_settings(mps).items():
                asked.setdefault(setting, {}).setdefault(parent, {}).setdefault(value, sharing.path)
                own.setdefault(setting, {}).setdefault(value, sharing.path)
            settings[sharing.path] = mps
        for setting, values in own.items():
            conflict = mps_setting_conflict(setting, values) if request.count > 1 else None
            if conflict is not None:
                verdict.invalid.append(
                    f"{request.path}: may be given several devices, whole GPUs and MIG "
                    f"devices together (device class {request.device_class} does not pin "
                    f"the kind), and {conflict}"
                )
    for setting, by_parent in asked.items():
        merged: dict[int | bool, str] = {}
        for values in by_parent.values():
            for value, path in values.items():
                merged.setdefault(value, path)
        conflict = mps_setting_conflict(setting, merged) if len(by_parent) > 1 else None
        if conflict is not None:
            verdict.invalid.append(conflict)
    for path, mps in settings.items():
        indexes = [k for k in mps.default_per_device_pinned_memory_limit or {} if k.isdigit()]
        if not indexes:
            continue
        # Whichever alternative of each request is allocated: a config is sure of an
        # alternative's devices only where every way it may resolve (slice or whole,
        # GPU or MIG device) uses the config; one that does not gives it none.
        fewest_of: dict[str, int] = {}
        for request in requests:
            if request.path not in uses:
                continue
            parent = base_request(request.name)
            sure = request.fewest if uses[request.path] == {path} else 0
            fewest_of[parent] = min(fewest_of.get(parent, sure), sure)
        fewest = sum(fewest_of.values())
        for key in indexes:
            if int(key) >= fewest:
                field = join_path(path, "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit")
                verdict.invalid.append(
                    f"{field}[{key}]: names no device this config is sure to be given: it "
                    f"may be given as few as {fewest} device(s), indexed from 0; use a lower "
                    "index"
                )


def _sharing_source(request: _Request, sliced: bool, sharing: Sharing) -> str:
    """The field that sets `request`'s sharing mode, for a denial to name."""
    if sliced and sharing.config.sharing is None:
        return f"{request.path}.capacity.requests (a memory slice of a shared GPU runs under MPS)"
    if sharing.mode == "TimeSlicing" and not sharing.path:
        return (
            f"{request.path}.capacity.requests.shares (some of a GPU's integer shares are "
            "time-sliced with the claims holding its other shares)"
        )
    if sharing.path:
        return join_path(sharing.path, "sharing.strategy")
    if request.shares and not request.admin:
        return (
            f"{request.path}.capacity.requests.shares (as many shares as the GPU has give "
            "the whole GPU, which runs as its config says; with no sharing config: Exclusive)"
        )
    if request.memory_slice and not request.admin:
        return (
            f"{request.path}.capacity.requests (the scheduler may give this request a whole "
            "device, which runs as its config says; with no sharing config: Exclusive)"
        )
    return f"{request.path} (no sharing config: Exclusive)"


def _check_rules(
    requests: Sequence[_Request],
    resolved: Mapping[str, Sequence[tuple[bool, Sharing]]],
    policy: ConversionPolicy,
    rules: TenantRules,
    verdict: ClaimVerdict,
    device_classes: Mapping[str, ClassConfigs],
) -> None:
    spec = rules.tenant.spec
    label = rules.label
    # firstAvailable alternatives: the largest one counts against the limit.
    largest: dict[str, int] = {}
    for request in requests:
        parent = base_request(request.name)
        largest[parent] = max(largest.get(parent, 0), request.count)
        if not spec.allows_class(request.device_class):
            verdict.forbidden.append(
                f"{request.path}.deviceClassName: {label} does not allow device class "
                f"{request.device_class}; accepted values: "
                f"{', '.join(spec.allowed_device_classes or ()) or 'none'}"
            )
        refused = [
            (i, k) for i, k in enumerate(request.tolerations) if not spec.allows_toleration(k)
        ]
        if refused:
            # One line per request, however many tolerations it has (the API server does
            # not bound them): the first refused one, and how many more.
            index, key = refused[0]
            what = f"device taint {key}" if key else "every device taint (no key)"
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            verdict.forbidden.append(
                f"{request.path}.tolerations[{index}]: {label} does not allow tolerating "
                f"{what}{more}; accepted keys: "
                f"{', '.join(spec.allowed_taint_tolerations or ()) or 'none'} "
                "(allowedTaintTolerations)"
            )
        kinds = _device_types(request, policy, device_classes)
        if "mig" in kinds and spec.allowed_mig_profiles is not None:
            _check_profile(request, policy, rules, verdict, either=len(kinds) > 1)
        # Not in `resolved`: reported as invalid already.
        for sliced, sharing in resolved.get(request.path, ()):
            if not spec.allows_sharing(sharing.mode):
                verdict.forbidden.append(
                    f"{_sharing_source(request, sliced, sharing)}: {label} does not allow "
                    f"sharing mode {sharing.mode}; accepted values: "
                    f"{', '.join(spec.allowed_sharing or ()) or 'none'}"
                )
            mps = sharing.mps_config if sharing.mps else None
            if mps is not None and mps.multi_user and not spec.allow_mps_multi_user:
                message = (
                    f"{join_path(sharing.path, 'sharing.mpsConfig.multiUser')}: {label} does "
                    "not allow multi-user MPS (allowMpsMultiUser is false): remove multiUser "
                    "and run the claim's containers as one user"
                )
                if message not in verdict.forbidden:  # one config, several ways to resolve
                    verdict.forbidden.append(message)
    total = sum(largest.values())
    limit = spec.max_devices_per_pod
    if limit is not None and total > limit:
        counts = ", ".join(f"{r.path}.count={r.count}" for r in requests)
        verdict.forbidden.append(
            f"{label}: maxDevicesPerPod is {limit}, this claim asks for {total} devices ({counts})"
        )


def _check_profile(
    request: _Request,
    policy: ConversionPolicy,
    rules: TenantRules,
    verdict: ClaimVerdict,
    *,
    either: bool = False,
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
    why = (
        f" (device class {request.device_class} may give MIG devices: its selectors do not "
        f'pin device.attributes["{policy.driver}"].type; the cluster admin can pin it)'
        if either
        else ""
    )
    verdict.forbidden.append(
        f"{request.path}.selectors: {rules.label} allows only MIG profiles "
        f"{', '.join(allowed) or 'none'}, so a {request.device_class} request must select one "
        f"with a CEL selector of the form {example}{why}"
    )
