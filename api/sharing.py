"""How one request's devices are shared: the effective config and sharing mode.

The kubelet plugin (`gpudra.driver.planning`) decides this for each allocated device,
and the validating webhook (`gpudra.webhook.validate`) for each request of a claim
before it is created. Both call `resolve_sharing`, so the webhook cannot admit a claim
that prepare would refuse, nor count a tenant's sharing mode differently from what the
node will set up:

1. the config: the DeviceClass's configs, then the claim's, last match wins
   (`resolve_bound`);
2. a memory slice (a request with capacity requests, none of them integer shares:
   the scheduler gives it part of a shared GPU's memory) always runs under an MPS
   daemon, which limits its memory for the clients that go through it (a container
   that leaves MPS is not held: see docs/sharing.md); a time-slice, a setting of the
   whole GPU that
   other claims share, cannot apply to it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias, TypeVar, get_args

from gpudra.api.config import (
    BoundConfig,
    ConfigError,
    ConfigIssue,
    DeviceConfig,
    DeviceType,
    GpuConfig,
    MpsConfig,
    default_config,
    interval_value,
    join_path,
    resolve_bound,
)

__all__ = [
    "MPS_DAEMON_SETTINGS",
    "SHARES_CAPACITY",
    "SHARING_MODES",
    "Sharing",
    "SharingMode",
    "driver_capacities",
    "is_memory_slice",
    "mps_daemon_settings",
    "mps_setting_conflict",
    "resolve_sharing",
    "sharing_of",
]

V = TypeVar("V")
SharingMode: TypeAlias = Literal["Exclusive", "TimeSlicing", "MPS"]
SHARING_MODES: Final[tuple[SharingMode, ...]] = get_args(SharingMode)
SHARES_CAPACITY: Final = "shares"
"""The capacity of a GPU published with integer shares (the upstream driver's name)."""


def driver_capacities(named: Mapping[str, V], driver: str) -> dict[str, V]:
    """`named` (a request's `capacity.requests`, a result's `consumedCapacity`) keyed by
    each capacity's name within `driver`'s domain: `<driver>/shares` becomes `shares`.

    Why: a capacity name without a domain means the driver's own, and from Kubernetes
    1.38 the scheduler resolves a request's names that way (kubernetes#142202): a request
    for `<driver>/shares` is given one of the integer shares a GPU publishes as `shares`,
    and `memory` a slice of the memory a shared GPU publishes as `<driver>/memory`. So a
    rule that reads a name must read both spellings, or a tenant asks under the one it
    does not read. Before 1.38 the scheduler matched names literally, and the spelling
    that differs from the slice's was never given a device. Names of other domains stay
    as they are. A request naming both spellings is refused by the 1.38 scheduler; here
    the last one wins, since only the names matter to the rules.
    """
    prefix = f"{driver}/"
    return {name.removeprefix(prefix): value for name, value in named.items()}


def is_memory_slice(capacity_requests: Collection[str]) -> bool:
    """A request with these capacity names is a memory slice of a shared GPU.

    A request for integer shares is not, whatever memory it names: the GPU is
    time-sliced (or runs MPS) between the claims holding its shares, and the memory
    they name is the scheduler's bookkeeping only.
    """
    return bool(capacity_requests) and SHARES_CAPACITY not in capacity_requests


@dataclass(frozen=True, slots=True)
class Sharing:
    """The resolved config of one request's device and what it makes prepare do.

    `path` is where the config was found (empty: the driver default), so errors and
    denials can name the field to change.
    """

    config: DeviceConfig
    path: str
    mode: SharingMode
    time_slice: int | None = None

    @property
    def mps(self) -> bool:
        """The device joins the claim's MPS daemon."""
        return self.mode == "MPS"

    @property
    def mps_config(self) -> MpsConfig | None:
        return sharing_of(self.config)[2]


def sharing_of(config: DeviceConfig) -> tuple[bool, int | None, MpsConfig | None]:
    """(uses MPS, time-slice value or None, MPS settings) of a resolved config."""
    sharing = config.sharing
    if sharing is None:
        return False, None, None
    if sharing.strategy == "MPS":
        return True, None, sharing.mps_config
    if isinstance(config, GpuConfig) and config.sharing is not None:
        interval = config.sharing.effective_interval()
        return False, None if interval is None else interval_value(interval), None
    return False, None, None  # MIG devices have no time-slice setting


MPS_DAEMON_SETTINGS: Final[Mapping[str, tuple[str, str]]] = {
    "defaultActiveThreadPercentage": (
        "default_active_thread_percentage",
        "active thread percentages",
    ),
    "multiUser": ("multi_user", "multi-user modes"),
}
"""The `mpsConfig` settings that are the daemon's, not a device's: by wire name, the
`MpsConfig` field and what a conflict calls their values. A claim has one MPS daemon,
so its configs must agree on each (`mps_setting_conflict`)."""


def mps_daemon_settings(mps: MpsConfig) -> dict[str, int | bool]:
    """The daemon settings `mps` sets (`MPS_DAEMON_SETTINGS`), by wire name."""
    values = {wire: getattr(mps, field) for wire, (field, _) in MPS_DAEMON_SETTINGS.items()}
    return {wire: value for wire, value in values.items() if value is not None}


def mps_setting_conflict(setting: str, asked: Mapping[int | bool, str]) -> str | None:
    """Why one claim's MPS daemon cannot serve configs asking for these values of the
    daemon setting `setting` (each value with the path of a config asking for it), or
    None.

    A claim has one MPS daemon, and the setting is the daemon's: prepare refuses a
    claim whose configs disagree, and admission refuses it first.
    """
    if len(asked) <= 1:
        return None
    where = ", ".join(
        f"{join_path(path, f'sharing.mpsConfig.{setting}')}={_wire(value)}"
        for value, path in asked.items()
    )
    return (
        f"one MPS daemon serves the claim, but its configs ask for different "
        f"{MPS_DAEMON_SETTINGS[setting][1]} ({where}); use one value"
    )


def _wire(value: int | bool) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def resolve_sharing(
    device_type: DeviceType,
    class_configs: Sequence[BoundConfig],
    claim_configs: Sequence[BoundConfig],
    request_name: str,
    *,
    memory_slice: bool,
    where: str,
    integer_share: bool = False,
) -> Sharing:
    """The effective config and sharing mode of the device `request_name` gets.

    `request_name` is the full "req/sub" name (a config may be bound to the
    subrequest); `memory_slice` says the device is part of a shared GPU's memory;
    `integer_share` that it is some, not all, of the integer shares of a GPU published
    with them, which the claims holding its other shares use too: such a device is never
    Exclusive, whatever its config says; without MPS it is time-sliced (Default
    interval unless its config names one), as the device plugin's replicas were.
    `where` names the request or result in errors. Raises ConfigError, with paths
    anchored where the configs were found.
    """
    bound = resolve_bound(device_type, class_configs, claim_configs, request_name)
    config = bound.config if bound is not None else default_config(device_type)
    path = bound.path if bound is not None else ""
    uses_mps, time_slice, _ = sharing_of(config)
    if memory_slice and time_slice is not None:
        raise ConfigError(
            [
                ConfigIssue(
                    join_path(path, "sharing.strategy"),
                    f"TimeSlicing cannot apply to {where}: it is a memory slice of a shared "
                    "GPU, and the time-slice is a setting of the whole GPU, which other "
                    "claims share; use strategy MPS or no sharing config",
                    ("MPS",),
                )
            ]
        )
    if uses_mps or memory_slice:
        # A slice of a shared GPU always gets an MPS daemon: it limits the memory of
        # the clients that go through it.
        return Sharing(config, path, "MPS")
    if config.sharing is not None and config.sharing.strategy == "TimeSlicing":
        return Sharing(config, path, "TimeSlicing", time_slice)
    if integer_share:
        return Sharing(config, path, "TimeSlicing", interval_value("Default"))
    return Sharing(config, path, "Exclusive")
