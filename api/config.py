"""Opaque device configs of the `resource.nvidia.com/v1beta1` API.

Claims written for the upstream NVIDIA DRA driver must work here unchanged, so
the wire format (camelCase names, kinds, enum values) is upstream's and unknown
fields are rejected like upstream's strict decoder does. The same code validates
in the admission webhook and in the kubelet plugin, so a config the webhook lets
through is never refused later at prepare time for a reason it could have seen.

Deliberate differences from upstream, all stricter and all reported at admission
rather than at prepare time:
- a sharing config that does not belong to the strategy (`mpsConfig` with
  `TimeSlicing`, `timeSlicingConfig` with `MPS`) is an error; upstream errors at
  prepare for GPUs and silently ignores it for MIG devices;
- pinned memory limits below 1Mi are an error (upstream fails at prepare: the
  MPS daemon takes whole MiB);
- `defaultPerDevicePinnedMemoryLimit` keys must look like a GPU index or a
  GPU/MIG UUID.
`MigDeviceSharing` has no `timeSlicingConfig` (there is none upstream): MIG
devices accept `strategy: TimeSlicing`, which changes nothing because a MIG
device has no time-slice setting.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import UnionType
from typing import (
    Annotated,
    Any,
    ClassVar,
    Final,
    Literal,
    Self,
    TypeAlias,
    Union,
    get_args,
    get_origin,
    overload,
)

from gpudra.api import jsonbytes
from gpudra.api.names import base_request
from gpudra.api.quantity import ACCEPTED_FORMS, Quantity, QuantityError, parse_quantity
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "ACCEPTED_API_VERSIONS",
    "ACCEPTED_KINDS",
    "API_VERSION",
    "GPU_CONFIG_KIND",
    "INTERVALS",
    "MAX_PARAMETERS_BYTES",
    "MIG_DEVICE_CONFIG_KIND",
    "STRATEGIES",
    "BoundConfig",
    "ConfigError",
    "ConfigIssue",
    "DeviceConfig",
    "DeviceType",
    "GpuConfig",
    "GpuSharing",
    "MigDeviceConfig",
    "MigDeviceSharing",
    "MpsConfig",
    "TimeSlicingConfig",
    "bound_configs",
    "default_config",
    "format_errors",
    "interval_value",
    "join_path",
    "loc_path",
    "parse_opaque_config",
    "resolve_bound",
    "resolve_config",
]

API_VERSION: Final = "resource.nvidia.com/v1beta1"
GPU_CONFIG_KIND: Final = "GpuConfig"
MIG_DEVICE_CONFIG_KIND: Final = "MigDeviceConfig"
ACCEPTED_API_VERSIONS: Final = (API_VERSION,)
ACCEPTED_KINDS: Final = (GPU_CONFIG_KIND, MIG_DEVICE_CONFIG_KIND)
# ResourceClaim `opaque.parameters` limit enforced by the API server.
MAX_PARAMETERS_BYTES: Final = 10 * 1024

Strategy: TypeAlias = Literal["TimeSlicing", "MPS"]
TimeSliceInterval: TypeAlias = Literal["Default", "Short", "Medium", "Long"]
DeviceType: TypeAlias = Literal["gpu", "mig"]
STRATEGIES: Final[tuple[Strategy, ...]] = get_args(Strategy)
# Order matters: the index is the value `nvidia-smi compute-policy --set-timeslice` takes.
INTERVALS: Final[tuple[TimeSliceInterval, ...]] = get_args(TimeSliceInterval)

_MIB: Final = 1024 * 1024
_MAX_PINNED_LIMIT: Final = 1024**5
"""1Pi: the most a pinned device memory limit may be, far above any GPU's memory; a
larger value would reach the MPS daemon as a number of up to a hundred digits. The
node refuses a limit above the memory of the very device it is given
(`gpudra.driver.planning.mps_limits`)."""
_DEVICE_SELECTOR_RE: Final = re.compile(
    r"[0-9]{1,4}|GPU-[0-9a-fA-F-]+|MIG-[0-9a-fA-F-]+|MIG-GPU-[0-9a-fA-F-]+/[0-9]+/[0-9]+"
)
_DEVICE_SELECTOR_FORMS: Final = ("<index>", "GPU-<uuid>", "MIG-<uuid>")


def interval_value(interval: TimeSliceInterval) -> int:
    """Numeric time-slice setting (Default=0 ... Long=3) used by nvidia-smi."""
    return INTERVALS.index(interval)


# --- errors -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """One problem: where (path relative to the parameters), what, and what is accepted."""

    path: str
    message: str
    accepted: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(ValueError):
    """Invalid opaque config; carries every issue found, not just the first."""

    def __init__(self, issues: Sequence[ConfigIssue]) -> None:
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        super().__init__("; ".join(str(issue) for issue in self.issues))

    def with_prefix(self, prefix: str) -> ConfigError:
        """The same issues with paths anchored at `prefix` (where the caller found them)."""
        return ConfigError(
            [ConfigIssue(join_path(prefix, i.path), i.message, i.accepted) for i in self.issues]
        )


def join_path(prefix: str, path: str) -> str:
    """Join field paths the way Kubernetes prints them (`a.b`, `a[0]`, `a[key]`)."""
    if not prefix:
        return path
    if not path:
        return prefix
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


def loc_path(prefix: str, loc: Iterable[str | int]) -> str:
    """A pydantic error's location as a field path under `prefix` (`a.b[0]`)."""
    path = prefix
    for part in loc:
        path = join_path(path, f"[{part}]" if isinstance(part, int) else str(part))
    return path


def format_errors(prefix: str, err: ConfigError) -> list[str]:
    """One line per issue naming the full field path, for webhook and event messages."""
    return [str(issue) for issue in err.with_prefix(prefix).issues]


UPSTREAM_ONLY_KINDS: Final[Mapping[str, str]] = {
    "VfioDeviceConfig": "for a GPU passed through to a virtual machine (vfio-pci)",
    "ComputeDomainChannelConfig": "for the IMEX channels of a ComputeDomain (multi-node NVLink)",
    "ComputeDomainDaemonConfig": "for the IMEX daemon of a ComputeDomain (multi-node NVLink)",
}
"""Kinds of upstream's `resource.nvidia.com/v1beta1` that gpudra does not serve, with
what they are for: a claim written for upstream with one is refused saying so, not as
an unknown kind."""


# --- field validators ------------------------------------------------------------------------


def _percentage(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise PydanticCustomError(
            "gpudra_int",
            "must be an integer between 0 and 100 (got {value})",
            {"value": repr(value), "accepted": ("0-100",)},
        )
    if not 0 <= value <= 100:
        raise PydanticCustomError(
            "gpudra_range",
            "must be between 0 and 100 (got {value})",
            {"value": value, "accepted": ("0-100",)},
        )
    return value


def _flag(value: Any) -> Any:
    """A JSON boolean, as upstream's `*bool` takes it: no string, no number."""
    if value is None or isinstance(value, bool):
        return value
    raise PydanticCustomError(
        "gpudra_bool",
        "must be true or false (got {value})",
        {"value": repr(value), "accepted": ("true", "false")},
    )


def _quantity_error(reason: str) -> PydanticCustomError:
    return PydanticCustomError(
        "gpudra_quantity", "{reason}", {"reason": reason, "accepted": (ACCEPTED_FORMS,)}
    )


def _pinned_limit(value: Any) -> Quantity:
    """A pinned device memory limit: a quantity from 1Mi to 1Pi (`_MAX_PINNED_LIMIT`)."""
    if isinstance(value, Quantity):
        return value
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise _quantity_error(f"must be a quantity such as '10Gi' (got {value!r})")
    if isinstance(value, float) and not math.isfinite(value):
        raise _quantity_error(f"must be a finite quantity (got {value!r})")
    # Go's Quantity.UnmarshalJSON accepts bare JSON numbers and trims whitespace.
    text = value.strip() if isinstance(value, str) else str(value)
    try:
        quantity = parse_quantity(text)
    except QuantityError as exc:
        raise _quantity_error(str(exc)) from None
    if quantity.value() < _MIB:
        raise PydanticCustomError(
            "gpudra_range",
            "must be at least 1Mi because MPS takes limits in whole MiB (got {value})",
            {"value": repr(text), "accepted": (">= 1Mi",)},
        )
    if quantity.value() > _MAX_PINNED_LIMIT:
        raise PydanticCustomError(
            "gpudra_range",
            "must be at most 1Pi, more memory than any GPU has (got {value}); use at most "
            "the memory of the device the config is given",
            {"value": repr(text), "accepted": ("<= 1Pi",)},
        )
    return quantity


def _per_device_limits(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise PydanticCustomError(
            "gpudra_object",
            "must be a map of GPU index or UUID to quantity (got {value})",
            {"value": repr(value), "accepted": _DEVICE_SELECTOR_FORMS},
        )
    limits: dict[str, Quantity] = {}
    for key, limit in value.items():
        # YAML turns an unquoted index into an int; the JSON the API server stores does not.
        name = str(key) if isinstance(key, int) and not isinstance(key, bool) else key
        if not isinstance(name, str) or not _DEVICE_SELECTOR_RE.fullmatch(name):
            raise PydanticCustomError(
                "gpudra_key",
                "key {key} is neither a GPU index nor a GPU/MIG UUID; accepted: {forms}",
                {
                    "key": repr(key),
                    "forms": ", ".join(_DEVICE_SELECTOR_FORMS),
                    "field": f"[{key}]",
                    "accepted": _DEVICE_SELECTOR_FORMS,
                },
            )
        same = [
            k
            for k in limits
            if k == name or (k.isdigit() and name.isdigit() and int(k) == int(name))
        ]
        if same:
            # Upstream's driver applies such keys in Go's random map order.
            raise PydanticCustomError(
                "gpudra_key",
                "key {key} names the same device as key {other}; keep one of the two",
                {"key": repr(key), "other": repr(same[0]), "field": f"[{name}]"},
            )
        try:
            limits[name] = _pinned_limit(limit)
        except PydanticCustomError as exc:
            ctx = dict(exc.context or {})
            ctx["field"] = f"[{name}]"
            raise PydanticCustomError(exc.type, exc.message_template, ctx) from None
    return limits


PinnedLimit: TypeAlias = Annotated[
    Quantity, PlainValidator(_pinned_limit), PlainSerializer(str, return_type=str)
]


# --- models -------------------------------------------------------------------------------


class _Strict(BaseModel):
    """Base for wire models: camelCase aliases only, unknown fields rejected by name.

    Pydantic's own checks (forbidden extra fields, required fields, literal values) do
    the validation, with no Python called back for a valid object: the webhook checks
    every opaque config of every claim it admits, and prepare every config it applies.
    Only when validation fails does `_issues_from` turn pydantic's errors into ours,
    reading the shape problems of each object from the data with `_shape_issues`.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        arbitrary_types_allowed=True,
        validate_by_alias=True,
        validate_by_name=False,
        serialize_by_alias=True,
    )

    # Extra guidance for fields that exist in a sibling type but not in this one.
    unknown_field_hints: ClassVar[Mapping[str, str]] = {}
    # Per class, from its fields, by wire name: all of them, the nested wire models
    # (to find the model an error is in) and the values of each Literal field.
    _wire_names: ClassVar[tuple[str, ...]] = ()
    _nested: ClassVar[Mapping[str, type[_Strict]]] = {}
    _choices: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        fields = [(info.alias or name, info.annotation) for name, info in cls.model_fields.items()]
        cls._wire_names = tuple(wire for wire, _ in fields)
        cls._nested = {
            wire: arg
            for wire, annotation in fields
            for arg in _union_args(annotation)
            if isinstance(arg, type) and issubclass(arg, _Strict)
        }
        cls._choices = {
            wire: tuple(str(value) for value in get_args(arg))
            for wire, annotation in fields
            for arg in _union_args(annotation)
            if get_origin(arg) is Literal
        }

    @classmethod
    def _shape_issues(cls, data: Any) -> list[ConfigIssue]:
        """What is wrong with `data` as a whole object of this type, paths relative to
        it: not an object; else every unknown field; else the first missing one. Errors
        inside an object with such a problem are not reported: they would only guess at
        what was meant."""
        accepted = cls._wire_names
        if not isinstance(data, Mapping):
            return [
                ConfigIssue(
                    "",
                    f"must be an object with the fields {', '.join(accepted)} (got {data!r})",
                    accepted,
                )
            ]
        unknown = [str(key) for key in data if key not in accepted]
        if unknown:
            hints = [cls.unknown_field_hints[k] for k in unknown if k in cls.unknown_field_hints]
            hint = f" ({hints[0]})" if hints else ""
            message = f"unknown field{hint}; accepted fields: {', '.join(accepted)}"
            return [ConfigIssue(name, message, accepted) for name in unknown]
        for name, info in cls.model_fields.items():
            wire = info.alias or name
            if info.is_required() and wire not in data:
                values = cls._choices.get(wire, ())
                choices = f"; accepted values: {', '.join(values)}" if values else ""
                return [ConfigIssue(wire, f"required field is missing{choices}", values)]
        return []

    def to_wire(self) -> dict[str, Any]:
        """The JSON form, as a claim would carry it."""
        return self.model_dump(mode="json", exclude_none=True)


def _union_args(annotation: Any) -> tuple[Any, ...]:
    """The members of `X | None` (or of any union), else the annotation itself."""
    return get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)


class TimeSlicingConfig(_Strict):
    """Time-slice length for CUDA contexts sharing a full GPU."""

    interval: TimeSliceInterval | None = None

    def effective_interval(self) -> TimeSliceInterval:
        return self.interval or "Default"


class MpsConfig(_Strict):
    """Settings for the per-claim MPS control daemon."""

    default_active_thread_percentage: Annotated[int | None, BeforeValidator(_percentage)] = Field(
        default=None, alias="defaultActiveThreadPercentage"
    )
    default_pinned_device_memory_limit: PinnedLimit | None = Field(
        default=None, alias="defaultPinnedDeviceMemoryLimit"
    )
    default_per_device_pinned_memory_limit: Annotated[
        dict[str, PinnedLimit] | None, BeforeValidator(_per_device_limits)
    ] = Field(default=None, alias="defaultPerDevicePinnedMemoryLimit")
    # Upstream's field (since May 2026): the control daemon in multi-user mode
    # (`nvidia-cuda-mps-control -M`), so the claim's containers need not all run as
    # one user. NVIDIA's MPS guide: clients of every user then connect to one MPS
    # server run as root, and isolation between users is disregarded; Volta or newer
    # (`gpudra.driver.planning`), and a GpuTenant allows it (`allowMpsMultiUser`).
    multi_user: Annotated[bool | None, BeforeValidator(_flag)] = Field(
        default=None, alias="multiUser"
    )

    def pinned_memory_limits(
        self,
        uuids: Sequence[str],
        devices: Sequence[tuple[str, int | None]] = (),
        *,
        unordered: bool = False,
    ) -> dict[str, int]:
        """Limit in bytes per allocated device UUID.

        An index key counts the devices in the order of their UUIDs, not in the order
        they were allocated: upstream's driver counts them so (its MPS daemon's devices
        are a sorted list of UUIDs), and a claim written for it must limit the same GPU
        here. Two keys naming one device (an index and a UUID, or "1" and "01") are
        refused: upstream applies them in Go's random map order.

        `devices`, by the position of each UUID in `uuids`: the device's name and its
        memory in bytes (None: not known). A limit above a device's memory is refused,
        naming the field that set it: MPS would take it as it is, and a limit no device
        can reach is a typo more likely than a wish. `unordered`: some of `uuids` stand
        for devices not made yet (a MIG device gets its UUID when it is made), so which
        device an index key names is not known: its limit must fit each of them, and no
        UUID key may stand beside it.

        Issue paths are relative to this `mpsConfig`.
        """
        limits: dict[str, int] = {}
        fields: dict[str, str] = {}  # UUID -> the field its limit comes from
        if self.default_pinned_device_memory_limit is not None:
            limits = dict.fromkeys(uuids, self.default_pinned_device_memory_limit.value())
            fields = dict.fromkeys(uuids, "defaultPinnedDeviceMemoryLimit")
        by_uuid = sorted(uuids)
        keys: dict[str, str] = {}  # UUID -> the key that named it
        named = self.default_per_device_pinned_memory_limit or {}
        if unordered:
            by_index = [k for k in named if k.isdigit()]
            by_name = [k for k in named if not k.isdigit()]
            if by_index and by_name:
                raise ConfigError(
                    [
                        ConfigIssue(
                            f"defaultPerDevicePinnedMemoryLimit[{by_index[0]}]",
                            f"may name the same device as key {by_name[0]!r}: an index "
                            "counts the devices in the order of their UUIDs, and a MIG "
                            "device made at prepare has none yet; key these limits all by "
                            "index or all by UUID",
                        )
                    ]
                )
        for key, limit in named.items():
            if key in uuids:
                uuid = key
            elif key.isdigit() and int(key) < len(by_uuid):
                uuid = by_uuid[int(key)]
            else:
                accepted = (*uuids, *(str(i) for i in range(len(uuids))))
                raise ConfigError(
                    [
                        ConfigIssue(
                            f"defaultPerDevicePinnedMemoryLimit[{key}]",
                            f"names no device allocated to this claim; accepted: "
                            f"{', '.join(accepted) or 'none'}",
                            accepted,
                        )
                    ]
                )
            if uuid in keys:
                raise ConfigError(
                    [
                        ConfigIssue(
                            f"defaultPerDevicePinnedMemoryLimit[{key}]",
                            f"names the same device as key {keys[uuid]!r} ({uuid}); "
                            "keep one of the two",
                        )
                    ]
                )
            keys[uuid] = key
            limits[uuid] = limit.value()
            fields[uuid] = f"defaultPerDevicePinnedMemoryLimit[{key}]"
        sized = [(total, name) for name, total in devices if total is not None]
        smallest = min(sized) if unordered and sized else None
        for uuid, (own_name, own_total) in zip(uuids, devices, strict=False):
            asked = limits.get(uuid)
            total, name, why = own_total, own_name, ""
            if smallest is not None and keys.get(uuid, "").isdigit():
                # Any of the devices may turn out to be the one this index names.
                total, name = smallest
                why = (
                    ", which this index may name: it counts the devices in the order of "
                    "their UUIDs, and a MIG device made at prepare has none yet"
                )
            if total is not None and asked is not None and asked > total:
                raise ConfigError(
                    [
                        ConfigIssue(
                            fields[uuid],
                            f"asks for {-(-asked // _MIB)} MiB, more than the "
                            f"{total // _MIB} MiB of memory of device {name}{why}; use at "
                            "most the device's memory",
                            (f"<= {total // _MIB}Mi",),
                        )
                    ]
                )
        return limits


class GpuSharing(_Strict):
    """How a full GPU is shared between the containers of one claim."""

    strategy: Strategy
    time_slicing_config: TimeSlicingConfig | None = Field(default=None, alias="timeSlicingConfig")
    mps_config: MpsConfig | None = Field(default=None, alias="mpsConfig")

    @model_validator(mode="after")
    def _config_matches_strategy(self) -> Self:
        if self.strategy == "TimeSlicing" and self.mps_config is not None:
            raise _mismatch("mpsConfig", "TimeSlicing", "timeSlicingConfig")
        if self.strategy == "MPS" and self.time_slicing_config is not None:
            raise _mismatch("timeSlicingConfig", "MPS", "mpsConfig")
        return self

    def effective_interval(self) -> TimeSliceInterval | None:
        """The time-slice to apply, or None when the strategy is not time-slicing."""
        if self.strategy != "TimeSlicing":
            return None
        return (self.time_slicing_config or TimeSlicingConfig()).effective_interval()


class MigDeviceSharing(_Strict):
    """How a MIG device is shared; MIG has no time-slice setting, only MPS settings."""

    unknown_field_hints: ClassVar[Mapping[str, str]] = {
        "timeSlicingConfig": "MIG devices have no time-slice setting; use strategy TimeSlicing "
        "without a config"
    }

    strategy: Strategy
    mps_config: MpsConfig | None = Field(default=None, alias="mpsConfig")

    @model_validator(mode="after")
    def _config_matches_strategy(self) -> Self:
        if self.strategy == "TimeSlicing" and self.mps_config is not None:
            raise PydanticCustomError(
                "gpudra_conflict",
                "cannot be used with strategy TimeSlicing; remove it or set strategy: MPS",
                {"field": "mpsConfig", "accepted": ("MPS",)},
            )
        return self


def _mismatch(field: str, strategy: str, expected: str) -> PydanticCustomError:
    other = "MPS" if strategy == "TimeSlicing" else "TimeSlicing"
    return PydanticCustomError(
        "gpudra_conflict",
        "cannot be used with strategy {strategy} (which takes {expected}); remove it or set "
        "strategy: {other}",
        {
            "field": field,
            "strategy": strategy,
            "expected": expected,
            "other": other,
            "accepted": (expected,),
        },
    )


class GpuConfig(_Strict):
    """Config for a full GPU (`kind: GpuConfig`); no sharing means exclusive use."""

    api_version: Literal["resource.nvidia.com/v1beta1"] = Field(
        default=API_VERSION, alias="apiVersion"
    )
    kind: Literal["GpuConfig"] = GPU_CONFIG_KIND
    sharing: GpuSharing | None = None


class MigDeviceConfig(_Strict):
    """Config for a MIG device (`kind: MigDeviceConfig`)."""

    api_version: Literal["resource.nvidia.com/v1beta1"] = Field(
        default=API_VERSION, alias="apiVersion"
    )
    kind: Literal["MigDeviceConfig"] = MIG_DEVICE_CONFIG_KIND
    sharing: MigDeviceSharing | None = None


DeviceConfig: TypeAlias = GpuConfig | MigDeviceConfig


# --- parsing ------------------------------------------------------------------------------


# Pydantic's errors that say an object has the wrong shape, each with how many parts at
# the end of its location name a field of that object rather than the object.
_SHAPE_ERRORS: Final = {"model_type": 0, "extra_forbidden": 1, "invalid_key": 1, "missing": 1}


def _issues_from(model: type[_Strict], data: Any, exc: ValidationError) -> list[ConfigIssue]:
    """Our issues for pydantic's errors validating `data` as `model`, in pydantic's order.

    An object with a shape problem (not an object, an unknown field, a missing one) is
    reported once, as `_shape_issues` reads it from the data, in place of every error
    inside it; so is only the outermost of such objects.
    """
    errors = exc.errors(include_url=False)
    broken: set[tuple[str | int, ...]] = set()
    for error in errors:
        if error["type"] in _SHAPE_ERRORS:
            loc = tuple(error["loc"])
            broken.add(loc[: len(loc) - _SHAPE_ERRORS[error["type"]]])
    # Found by prefix lookups, not by comparing every pair: a config may carry
    # thousands of unknown fields, and a quadratic pass would hold the webhook.
    outermost = {loc for loc in broken if _outer(loc, broken, proper=True) is None}
    reported: set[tuple[str | int, ...]] = set()
    issues: list[ConfigIssue] = []
    for error in errors:
        loc = tuple(error["loc"])
        outer = _outer(loc, outermost, proper=False)
        if outer is not None:
            if outer not in reported:
                reported.add(outer)
                cls, value = _locate(model, data, outer)
                base = loc_path("", outer)
                issues.extend(
                    ConfigIssue(join_path(base, issue.path), issue.message, issue.accepted)
                    for issue in cls._shape_issues(value)
                )
            continue
        path = loc_path("", loc)
        if error["type"] == "literal_error":
            values = _locate(model, data, loc[:-1])[0]._choices[str(loc[-1])]
            message = f"unknown value {error['input']!r}; accepted values: {', '.join(values)}"
            issues.append(ConfigIssue(path, message, values))
            continue
        ctx: Mapping[str, Any] = error.get("ctx") or {}
        if "field" in ctx:
            path = join_path(path, str(ctx["field"]))
        accepted = tuple(str(a) for a in ctx.get("accepted", ()))
        issues.append(ConfigIssue(path, error["msg"], accepted))
    return issues


def _outer(
    loc: tuple[str | int, ...], among: set[tuple[str | int, ...]], *, proper: bool
) -> tuple[str | int, ...] | None:
    """The shortest of `among` that `loc` lies within (itself too, unless `proper`)."""
    for end in range(len(loc) + (0 if proper else 1)):
        if loc[:end] in among:
            return loc[:end]
    return None


def _locate(
    model: type[_Strict], data: Any, loc: tuple[str | int, ...]
) -> tuple[type[_Strict], Any]:
    """The wire model at `loc` under `model`, and the part of `data` it was given."""
    for part in loc:
        model, data = model._nested[str(part)], data[part]
    return model, data


def _decode(raw: object) -> Any:
    if isinstance(raw, bytes | bytearray | str):
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        size = len(data)
        if size > MAX_PARAMETERS_BYTES:
            raise _too_large(size)
        try:
            return jsonbytes.loads(data)
        except (ValueError, RecursionError) as exc:  # nesting deeper than the decoder goes
            raise ConfigError(
                [ConfigIssue("", f"must be a JSON object: {exc}", ACCEPTED_KINDS)]
            ) from None
    if isinstance(raw, Mapping):
        try:
            size = len(jsonbytes.dumps(raw))
        except (TypeError, ValueError, RecursionError) as exc:
            raise ConfigError([ConfigIssue("", f"must be plain JSON data: {exc}")]) from None
        if size > MAX_PARAMETERS_BYTES:
            raise _too_large(size)
        return raw
    raise ConfigError(
        [
            ConfigIssue(
                "",
                f"must be an object with apiVersion {API_VERSION} and kind "
                f"{' or '.join(ACCEPTED_KINDS)} (got {type(raw).__name__})",
                ACCEPTED_KINDS,
            )
        ]
    )


def _too_large(size: int) -> ConfigError:
    return ConfigError(
        [
            ConfigIssue(
                "",
                f"parameters are {size} bytes; the limit is {MAX_PARAMETERS_BYTES} bytes (10 KiB)",
            )
        ]
    )


def parse_opaque_config(raw: object) -> DeviceConfig:
    """Decode and validate one `opaque.parameters` object, dispatching on apiVersion/kind.

    `raw` is the decoded JSON object or its JSON text (bytes or str); anything else
    is reported as a ConfigError, so callers can pass what they found unchecked.

    Raises ConfigError with paths relative to the parameters; use `format_errors`
    or `ConfigError.with_prefix` to anchor them where the config was found.
    """
    data = _decode(raw)
    if not isinstance(data, Mapping):
        raise ConfigError(
            [ConfigIssue("", f"must be a JSON object (got {type(data).__name__})", ACCEPTED_KINDS)]
        )
    issues: list[ConfigIssue] = []
    api_version = data.get("apiVersion")
    if api_version not in ACCEPTED_API_VERSIONS:
        what = "required field is missing" if api_version is None else f"unknown {api_version!r}"
        issues.append(
            ConfigIssue(
                "apiVersion",
                f"{what}; accepted: {', '.join(ACCEPTED_API_VERSIONS)}",
                ACCEPTED_API_VERSIONS,
            )
        )
    kind = data.get("kind")
    if kind not in ACCEPTED_KINDS:
        what = "required field is missing" if kind is None else f"unknown {kind!r}"
        if isinstance(kind, str) and kind in UPSTREAM_ONLY_KINDS:
            what = (
                f"{kind!r} is upstream's config {UPSTREAM_ONLY_KINDS[kind]}, which gpudra "
                "does not do"
            )
        issues.append(
            ConfigIssue("kind", f"{what}; accepted: {', '.join(ACCEPTED_KINDS)}", ACCEPTED_KINDS)
        )
    if issues:
        raise ConfigError(issues)
    model: type[GpuConfig] | type[MigDeviceConfig] = (
        GpuConfig if kind == GPU_CONFIG_KIND else MigDeviceConfig
    )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_issues_from(model, data, exc)) from None


# --- precedence ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BoundConfig:
    """A parsed config and the requests it is bound to (empty: all requests).

    `path` is where the parameters were found, so a precedence error can name it.
    """

    config: DeviceConfig
    requests: tuple[str, ...] = ()
    path: str = ""

    def applies_to(self, request_name: str) -> bool:
        """Bound to the request itself, or to its parent for a "req/sub" result."""
        if not self.requests:
            return True
        return request_name in self.requests or base_request(request_name) in self.requests


def default_config(device_type: DeviceType) -> DeviceConfig:
    """Driver defaults: no sharing set up, the device is used as it is. The models are
    frozen, so one instance of each serves every claim without a config (most of
    them), built once rather than validated again on every prepare."""
    if device_type == "gpu":
        return _DEFAULT_GPU_CONFIG
    if device_type == "mig":
        return _DEFAULT_MIG_CONFIG
    return _config_type(device_type)()  # raises, naming the type


_DEFAULT_GPU_CONFIG: Final = GpuConfig()
_DEFAULT_MIG_CONFIG: Final = MigDeviceConfig()


def _config_type(device_type: DeviceType) -> type[GpuConfig] | type[MigDeviceConfig]:
    if device_type == "gpu":
        return GpuConfig
    if device_type == "mig":
        return MigDeviceConfig
    raise ValueError(f"device type must be 'gpu' or 'mig', got {device_type!r}")


def bound_configs(
    entries: Sequence[object],
    *,
    driver: str,
    prefix: str,
    source: str | None = None,
    parse: Callable[[object], DeviceConfig] = parse_opaque_config,
) -> list[BoundConfig]:
    """Parse the `config[]` entries addressed to `driver`, in order.

    `entries` is the JSON form of a claim's `spec.devices.config`, a DeviceClass's
    `spec.config` or an allocation's `status.allocation.devices.config`; `prefix`
    is that field's path; `source` (FromClass/FromClaim) filters allocation
    entries; `parse` parses one entry's parameters (the webhook passes its
    `ConfigCache.parse`). Every bad entry is reported in one ConfigError.
    """
    result: list[BoundConfig] = []
    issues: list[ConfigIssue] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            # Not ours to skip: without an object no driver is named, so say so.
            issues.append(
                ConfigIssue(
                    f"{prefix}[{index}]",
                    f"must be an object with opaque.driver and opaque.parameters "
                    f"(got {type(entry).__name__})",
                )
            )
            continue
        if source is not None and entry.get("source") != source:
            continue
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        path = f"{prefix}[{index}].opaque.parameters"
        requests = entry.get("requests") or []
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            issues.append(
                ConfigIssue(
                    f"{prefix}[{index}].requests",
                    f"must be a list of request names, not {requests!r}",
                )
            )
            continue
        try:
            config = parse(opaque.get("parameters"))
        except ConfigError as exc:
            issues.extend(exc.with_prefix(path).issues)
            continue
        result.append(BoundConfig(config, tuple(requests), path))
    if issues:
        raise ConfigError(issues)
    return result


@overload
def resolve_config(
    device_type: Literal["gpu"],
    class_configs: Sequence[BoundConfig],
    claim_configs: Sequence[BoundConfig],
    request_name: str,
) -> GpuConfig: ...
@overload
def resolve_config(
    device_type: Literal["mig"],
    class_configs: Sequence[BoundConfig],
    claim_configs: Sequence[BoundConfig],
    request_name: str,
) -> MigDeviceConfig: ...
@overload
def resolve_config(
    device_type: DeviceType,
    class_configs: Sequence[BoundConfig],
    claim_configs: Sequence[BoundConfig],
    request_name: str,
) -> DeviceConfig: ...
def resolve_config(
    device_type: DeviceType,
    class_configs: Sequence[BoundConfig],
    claim_configs: Sequence[BoundConfig],
    request_name: str,
) -> DeviceConfig:
    """The config for one allocated device: defaults < class < claim, last match wins
    (`resolve_bound`, or the driver default where no config applies)."""
    bound = resolve_bound(device_type, class_configs, claim_configs, request_name)
    return bound.config if bound is not None else default_config(device_type)


def resolve_bound(
    device_type: DeviceType,
    class_configs: Sequence[BoundConfig],
    claim_configs: Sequence[BoundConfig],
    request_name: str,
) -> BoundConfig | None:
    """The config that applies to one allocated device, with where it was found: the
    last match of the claim's configs, else of the class's; None for the driver default.

    A claim's config bound to this request by name must be of the device's kind:
    the user asked for it on this device, so silently skipping it would hide a
    mistake. An unbound config of the other kind is skipped, because it is meant
    for the claim's other devices (a claim may hold GPUs and MIG devices). So is a
    class's config of the other kind: the allocator binds every config of a class to
    each request of that class, which no one asked for, and a class that gives both
    kinds carries a config for each.
    """
    wanted = _config_type(device_type)
    for from_class, configs in ((False, claim_configs), (True, class_configs)):
        for bound in reversed(configs):
            if bound.requests:
                if not bound.applies_to(request_name):
                    continue
                if not isinstance(bound.config, wanted) and from_class:
                    continue
                if not isinstance(bound.config, wanted):
                    kind = wanted().kind  # an error: building the default costs nothing here
                    raise ConfigError(
                        [
                            ConfigIssue(
                                join_path(bound.path, "kind"),
                                f"{bound.config.kind} cannot configure the "
                                f"{device_type.upper()} device allocated for request "
                                f"{request_name!r}; accepted kind: {kind}",
                                (kind,),
                            )
                        ]
                    )
                return bound
            if isinstance(bound.config, wanted):
                return bound
    return None
