"""Opaque device configs: upstream compatibility, error paths, and precedence."""

import json
from typing import Any

import pytest
from gpudra.api.config import (
    MAX_PARAMETERS_BYTES,
    BoundConfig,
    ConfigError,
    GpuConfig,
    MigDeviceConfig,
    bound_configs,
    default_config,
    format_errors,
    interval_value,
    parse_opaque_config,
    resolve_config,
)

API = "resource.nvidia.com/v1beta1"
PREFIX = "spec.devices.config[0].opaque.parameters"

# The `parameters` of the upstream driver's demo specs, as the API server stores them.
UPSTREAM_EXAMPLES: list[dict[str, Any]] = [
    {"apiVersion": API, "kind": "GpuConfig"},
    {
        "apiVersion": API,
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
    },
    {"apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}},
    {
        "apiVersion": API,
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultActiveThreadPercentage": 50,
                "defaultPinnedDeviceMemoryLimit": "10Gi",
            },
        },
    },
    {
        "apiVersion": API,
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultActiveThreadPercentage": 50,
                "defaultPinnedDeviceMemoryLimit": "10Gi",
                "defaultPerDevicePinnedMemoryLimit": {
                    "0": "5Gi",
                    "GPU-4a2e1b5c-8a3d-4f61-9e0e-000000000001": "2Gi",
                },
            },
        },
    },
    {"apiVersion": API, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}},
    {"apiVersion": API, "kind": "MigDeviceConfig", "sharing": {"strategy": "TimeSlicing"}},
    {
        "apiVersion": API,
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 25}},
    },
    # Its MPS guide's multi-user example (multiUser since its May 2026 releases).
    {
        "apiVersion": API,
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"multiUser": True}},
    },
]


def _gpu(sharing: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "GpuConfig", "sharing": sharing}


def _errors(raw: Any, prefix: str = PREFIX) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_opaque_config(raw)
    return format_errors(prefix, info.value)


# --- upstream compatibility ---


@pytest.mark.parametrize("raw", UPSTREAM_EXAMPLES)
def test_upstream_examples_parse_and_round_trip_unchanged(raw: dict[str, Any]) -> None:
    config = parse_opaque_config(raw)
    assert config.to_wire() == raw
    assert parse_opaque_config(json.dumps(raw).encode()).to_wire() == raw


@pytest.mark.parametrize(
    "kind", ["VfioDeviceConfig", "ComputeDomainChannelConfig", "ComputeDomainDaemonConfig"]
)
def test_upstreams_kinds_gpudra_does_not_serve_say_so(kind: str) -> None:
    """A claim written for upstream's GPU passthrough or ComputeDomains is refused
    saying what the kind is for and that gpudra does not do it, not as a typo."""
    (line,) = _errors({"apiVersion": API, "kind": kind})
    assert line.startswith(f"{PREFIX}.kind: {kind!r} is upstream's config for ")
    assert line.endswith(", which gpudra does not do; accepted: GpuConfig, MigDeviceConfig")
    (line,) = _errors({"apiVersion": API, "kind": "GpuConfigs"})
    assert line == f"{PREFIX}.kind: unknown 'GpuConfigs'; accepted: GpuConfig, MigDeviceConfig"


def test_parsed_values_are_typed() -> None:
    config = parse_opaque_config(UPSTREAM_EXAMPLES[4])
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None
    mps = config.sharing.mps_config
    assert mps is not None
    assert mps.default_active_thread_percentage == 50
    assert mps.default_pinned_device_memory_limit is not None
    assert mps.default_pinned_device_memory_limit.value() == 10 * 1024**3
    assert config.sharing.effective_interval() is None


def test_time_slicing_defaults_to_default_interval() -> None:
    config = parse_opaque_config(UPSTREAM_EXAMPLES[2])
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None
    assert config.sharing.effective_interval() == "Default"
    assert [interval_value(i) for i in ("Default", "Short", "Medium", "Long")] == [0, 1, 2, 3]


def test_quantity_as_bare_json_number_is_accepted_like_go() -> None:
    raw = _gpu({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": 1073741824}})
    config = parse_opaque_config(raw)
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None and config.sharing.mps_config is not None
    limit = config.sharing.mps_config.default_pinned_device_memory_limit
    assert limit is not None and limit.value() == 1024**3


def test_pinned_limits_resolve_index_and_uuid_keys() -> None:
    config = parse_opaque_config(UPSTREAM_EXAMPLES[4])
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None and config.sharing.mps_config is not None
    # Index 0 is the first UUID in sorted order, as upstream counts, not the first given.
    uuids = ["GPU-4a2e1b5c-8a3d-4f61-9e0e-000000000001", "GPU-0aaa"]
    limits = config.sharing.mps_config.pinned_memory_limits(uuids)
    assert limits == {"GPU-0aaa": 5 * 1024**3, uuids[0]: 2 * 1024**3}


def test_an_index_counts_the_devices_in_the_order_of_their_uuids_as_upstream() -> None:
    """Upstream's MPS daemon resolves an index into its devices' UUIDs sorted
    (`AllocatableDevices.UUIDs`), whatever order the scheduler allocated them in: a
    claim written for it limits the same GPUs here."""
    limits = {"defaultPerDevicePinnedMemoryLimit": {"0": "10Gi", "1": "20Gi"}}
    config = parse_opaque_config(_gpu({"strategy": "MPS", "mpsConfig": limits}))
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None and config.sharing.mps_config is not None
    gib = 1024**3
    for allocated in (["GPU-d6", "GPU-1e"], ["GPU-1e", "GPU-d6"]):
        assert config.sharing.mps_config.pinned_memory_limits(allocated) == {
            "GPU-1e": 10 * gib,
            "GPU-d6": 20 * gib,
        }


def test_two_keys_naming_one_device_are_refused_naming_both() -> None:
    """Upstream applies such keys in Go's random map order, so the limit a GPU got would
    depend on chance: an index spelt twice is refused as the config is read, an index
    and a UUID naming the same device once the devices are known."""
    assert _errors(
        _gpu(
            {
                "strategy": "MPS",
                "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"1": "1Gi", "01": "2Gi"}},
            }
        )
    ) == [
        PREFIX + ".sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[01]: key '01' names "
        "the same device as key '1'; keep one of the two"
    ]
    both = {"defaultPerDevicePinnedMemoryLimit": {"0": "1Gi", "GPU-b": "2Gi"}}
    config = parse_opaque_config(_gpu({"strategy": "MPS", "mpsConfig": both}))
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None and config.sharing.mps_config is not None
    mps = config.sharing.mps_config
    assert mps.pinned_memory_limits(["GPU-b", "GPU-a"]) == {"GPU-a": 1 << 30, "GPU-b": 2 << 30}
    with pytest.raises(ConfigError) as info:
        mps.pinned_memory_limits(["GPU-c", "GPU-a"])
    assert "GPU-b" in str(info.value)  # names no device
    with pytest.raises(ConfigError) as info:
        mps.pinned_memory_limits(["GPU-z", "GPU-b"])
    (line,) = format_errors(PREFIX + ".sharing.mpsConfig", info.value)
    assert line == (
        PREFIX + ".sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[GPU-b]: names the same "
        "device as key '0' (GPU-b); keep one of the two"
    )


def test_an_index_among_devices_not_made_yet_must_fit_each_of_them() -> None:
    """A MIG device made at prepare has no UUID until then, so which device an index
    names is not known while the claim is planned: its limit must fit the smallest of
    them, or the claim would fail halfway through its prepare. A limit for all devices,
    or one that fits each, is taken."""
    gib = 1024**3
    devices = [("gpu-0-mig-1g10gb", 10 * gib), ("gpu-0-mig-3g40gb", 40 * gib)]
    stand_ins = ["<gpu-0-mig-1g10gb>", "<gpu-0-mig-3g40gb>"]
    limits = {"defaultPerDevicePinnedMemoryLimit": {"1": "20Gi"}}
    config = parse_opaque_config(_gpu({"strategy": "MPS", "mpsConfig": limits}))
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None and config.sharing.mps_config is not None
    mps = config.sharing.mps_config
    # Known UUIDs: index 1 is the 40 GB device's, which holds 20 GiB.
    assert mps.pinned_memory_limits(["MIG-a", "MIG-b"], devices) == {"MIG-b": 20 * gib}
    with pytest.raises(ConfigError) as info:
        mps.pinned_memory_limits(stand_ins, devices, unordered=True)
    (line,) = format_errors(PREFIX + ".sharing.mpsConfig", info.value)
    assert line.startswith(
        PREFIX + ".sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[1]: asks for 20480 "
        "MiB, more than the 10240 MiB of memory of device gpu-0-mig-1g10gb, which this "
        "index may name"
    ), line
    fits = {
        "defaultPerDevicePinnedMemoryLimit": {"1": "8Gi"},
        "defaultPinnedDeviceMemoryLimit": "30Gi",
    }
    config = parse_opaque_config(_gpu({"strategy": "MPS", "mpsConfig": fits}))
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None and config.sharing.mps_config is not None
    with pytest.raises(ConfigError) as info:  # the limit for all must fit each too
        config.sharing.mps_config.pinned_memory_limits(stand_ins, devices, unordered=True)
    assert "defaultPinnedDeviceMemoryLimit: asks for 30720 MiB" in str(info.value)
    # Beside a device whose UUID is known, an index may turn out to name that device.
    mixed = {"defaultPerDevicePinnedMemoryLimit": {"0": "1Gi", "MIG-a": "2Gi"}}
    config = parse_opaque_config(_gpu({"strategy": "MPS", "mpsConfig": mixed}))
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None and config.sharing.mps_config is not None
    with pytest.raises(ConfigError) as info:
        config.sharing.mps_config.pinned_memory_limits(
            ["MIG-a", stand_ins[0]], devices, unordered=True
        )
    (line,) = format_errors(PREFIX + ".sharing.mpsConfig", info.value)
    assert line.startswith(
        PREFIX + ".sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[0]: may name the same "
        "device as key 'MIG-a'"
    ), line
    assert line.endswith("key these limits all by index or all by UUID"), line
    # Once every UUID is known, the index names one device, here not MIG-a.
    known = config.sharing.mps_config.pinned_memory_limits(["MIG-a", "MIG-0"], devices)
    assert known == {"MIG-0": 1 << 30, "MIG-a": 2 << 30}


def test_a_pinned_limit_above_a_devices_memory_names_the_key_that_set_it() -> None:
    """Whatever spelling of a device's index set the limit ("01" counts as 1), the
    refusal names that key, and a limit the device's memory holds is taken."""
    limits: dict[str, Any] = {
        "defaultPinnedDeviceMemoryLimit": "1Gi",
        "defaultPerDevicePinnedMemoryLimit": {"01": "100Gi"},
    }
    config = parse_opaque_config(_gpu({"strategy": "MPS", "mpsConfig": limits}))
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None and config.sharing.mps_config is not None
    mps = config.sharing.mps_config
    gib = 1024**3
    devices = [("gpu-0", 80 * gib), ("gpu-1", 80 * gib)]
    with pytest.raises(ConfigError) as info:
        mps.pinned_memory_limits(["GPU-a", "GPU-b"], devices)
    (line,) = format_errors(PREFIX + ".sharing.mpsConfig", info.value)
    assert line.startswith(
        PREFIX + ".sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[01]: asks for 102400 "
        "MiB, more than the 81920 MiB of memory of device gpu-1"
    ), line
    bigger = [("gpu-0", 80 * gib), ("gpu-1", 120 * gib)]
    assert mps.pinned_memory_limits(["GPU-a", "GPU-b"], bigger) == {
        "GPU-a": gib,
        "GPU-b": 100 * gib,
    }


def test_pinned_limit_naming_a_device_outside_the_claim_is_an_error() -> None:
    raw = _gpu(
        {"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"3": "1Gi"}}}
    )
    config = parse_opaque_config(raw)
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None and config.sharing.mps_config is not None
    with pytest.raises(ConfigError) as info:
        config.sharing.mps_config.pinned_memory_limits(["GPU-a"])
    (line,) = format_errors(PREFIX + ".sharing.mpsConfig", info.value)
    assert line.startswith(PREFIX + ".sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[3]: ")
    assert "GPU-a" in line and "0" in line


# --- bad input: every error names the full field path and what is accepted ---


def test_percentage_out_of_range_names_the_full_path() -> None:
    raw = _gpu({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 150}})
    assert _errors(raw) == [
        "spec.devices.config[0].opaque.parameters.sharing.mpsConfig."
        "defaultActiveThreadPercentage: must be between 0 and 100 (got 150)"
    ]


@pytest.mark.parametrize("value", [-1, 101])
def test_percentage_bounds(value: int) -> None:
    raw = _gpu({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": value}})
    (line,) = _errors(raw)
    assert "between 0 and 100" in line


@pytest.mark.parametrize("value", [50.5, 50.0, "50", True])
def test_percentage_must_be_an_integer(value: Any) -> None:
    raw = _gpu({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": value}})
    (line,) = _errors(raw)
    assert line.startswith(f"{PREFIX}.sharing.mpsConfig.defaultActiveThreadPercentage: ")
    assert "integer between 0 and 100" in line


@pytest.mark.parametrize(
    ("raw", "path", "accepted"),
    [
        (_gpu({"strategy": "Fabric"}), "sharing.strategy", ["TimeSlicing", "MPS"]),
        (_gpu({}), "sharing.strategy", ["TimeSlicing", "MPS"]),
        (
            _gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Huge"}}),
            "sharing.timeSlicingConfig.interval",
            ["Default", "Short", "Medium", "Long"],
        ),
        (
            _gpu({"strategy": "TimeSlicing", "replicas": 4}),
            "sharing.replicas",
            ["strategy", "timeSlicingConfig", "mpsConfig"],
        ),
        (
            {"apiVersion": API, "kind": "GpuConfig", "metadata": {"name": "x"}},
            "metadata",
            ["apiVersion", "kind", "sharing"],
        ),
        (
            _gpu({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercent": 5}}),
            "sharing.mpsConfig.defaultActiveThreadPercent",
            ["defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit"],
        ),
        (_gpu("MPS"), "sharing", ["strategy"]),
        (
            _gpu({"strategy": "TimeSlicing", "mpsConfig": {}}),
            "sharing.mpsConfig",
            ["timeSlicingConfig"],
        ),
        (
            _gpu({"strategy": "MPS", "timeSlicingConfig": {"interval": "Long"}}),
            "sharing.timeSlicingConfig",
            ["mpsConfig"],
        ),
        (
            {
                "apiVersion": API,
                "kind": "MigDeviceConfig",
                "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
            },
            "sharing.timeSlicingConfig",
            ["strategy", "mpsConfig"],
        ),
        (
            {
                "apiVersion": API,
                "kind": "MigDeviceConfig",
                "sharing": {"strategy": "TimeSlicing", "mpsConfig": {}},
            },
            "sharing.mpsConfig",
            ["MPS"],
        ),
        (
            _gpu({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "10GB"}}),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
            ["Gi"],
        ),
        (
            _gpu({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "-1Gi"}}),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
            ["negative"],
        ),
        (
            _gpu({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "512Ki"}}),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
            ["1Mi"],
        ),
        (
            _gpu(
                {
                    "strategy": "MPS",
                    "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"first": "1Gi"}},
                }
            ),
            "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[first]",
            ["GPU-<uuid>", "MIG-<uuid>", "<index>"],
        ),
        (
            _gpu(
                {"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "x"}}}
            ),
            "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[0]",
            ["Ki Mi Gi"],
        ),
    ],
)
def test_bad_input_names_path_and_accepted_values(
    raw: dict[str, Any], path: str, accepted: list[str]
) -> None:
    lines = _errors(raw)
    matching = [line for line in lines if line.startswith(f"{PREFIX}.{path}: ")]
    assert matching, lines
    for value in accepted:
        assert value in matching[0], (value, matching[0])


def test_every_unknown_field_is_reported() -> None:
    lines = _errors(_gpu({"strategy": "MPS", "foo": 1, "bar": 2}))
    assert [line.split(":")[0] for line in lines] == [
        f"{PREFIX}.sharing.foo",
        f"{PREFIX}.sharing.bar",
    ]


def test_errors_in_sibling_fields_are_all_reported() -> None:
    raw = _gpu(
        {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultActiveThreadPercentage": 500,
                "defaultPinnedDeviceMemoryLimit": "lots",
            },
        }
    )
    assert len(_errors(raw)) == 2


def test_structured_issues_carry_accepted_values() -> None:
    with pytest.raises(ConfigError) as info:
        parse_opaque_config(_gpu({"strategy": "Fabric"}))
    (issue,) = info.value.issues
    assert issue.path == "sharing.strategy"
    assert issue.accepted == ("TimeSlicing", "MPS")
    assert str(info.value).startswith("sharing.strategy: unknown value 'Fabric'")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"}, ["apiVersion"]),
        ({"apiVersion": API, "kind": "ComputeDomainChannelConfig"}, ["kind"]),
        ({"kind": "GpuConfig"}, ["apiVersion"]),
        ({"apiVersion": API}, ["kind"]),
        ({}, ["apiVersion", "kind"]),
    ],
)
def test_unknown_api_version_or_kind_lists_accepted(
    raw: dict[str, Any], expected: list[str]
) -> None:
    lines = _errors(raw)
    assert [line.split(": ")[0] for line in lines] == [f"{PREFIX}.{f}" for f in expected]
    text = "\n".join(lines)
    if "apiVersion" in expected:
        assert API in text
    if "kind" in expected:
        assert "GpuConfig" in text and "MigDeviceConfig" in text


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", "null", 42, None, ["a"]])
def test_non_object_parameters(raw: Any) -> None:
    (line,) = _errors(raw)
    assert line.startswith(f"{PREFIX}: ")
    assert "object" in line


def test_parameters_over_10_kib_are_rejected() -> None:
    padding = {"x" * 10: "y" * (MAX_PARAMETERS_BYTES)}
    raw = {"apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "MPS"}, **padding}
    (line,) = _errors(raw)
    assert "10240" in line and "10 KiB" in line
    (line,) = _errors(json.dumps(raw).encode())
    assert "10240" in line


def test_parameters_just_under_the_limit_are_measured_not_rejected() -> None:
    raw = {"apiVersion": API, "kind": "GpuConfig"}
    assert len(json.dumps(raw).encode()) < MAX_PARAMETERS_BYTES
    parse_opaque_config(raw)


def test_null_strategy_names_the_accepted_values() -> None:
    assert _errors(_gpu({"strategy": None})) == [
        f"{PREFIX}.sharing.strategy: unknown value None; accepted values: TimeSlicing, MPS"
    ]


def test_an_object_with_unknown_fields_is_reported_once_not_what_is_inside() -> None:
    """A misspelt or misplaced field means the object is not what the user thinks: its
    unknown fields are named and the guesses inside it are not; siblings still count."""
    raw = {
        "apiVersion": API,
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "Fabric",
            "timeSlicingConfig": {"interval": "Huge", "replicas": 2},
            "mpsConfig": {"defaultActiveThreadPercentage": 500},
        },
    }
    assert _errors(raw, prefix="") == [
        "sharing.strategy: unknown value 'Fabric'; accepted values: TimeSlicing, MPS",
        "sharing.timeSlicingConfig.replicas: unknown field; accepted fields: interval",
        "sharing.mpsConfig.defaultActiveThreadPercentage: must be between 0 and 100 (got 500)",
    ]
    raw["metadata"] = {}
    assert _errors(raw, prefix="") == [
        "metadata: unknown field; accepted fields: apiVersion, kind, sharing"
    ]


def test_shape_problems_are_named_in_our_words() -> None:
    """Not an object, a missing field, a key that is not a string (YAML's unquoted
    numbers): each says what is accepted, never pydantic's own wording."""
    assert _errors(_gpu({"strategy": "TimeSlicing", "timeSlicingConfig": "Long"}), "") == [
        "sharing.timeSlicingConfig: must be an object with the fields interval (got 'Long')"
    ]
    assert _errors(_gpu({"mpsConfig": {}}), "") == [
        "sharing.strategy: required field is missing; accepted values: TimeSlicing, MPS"
    ]
    assert _errors(_gpu({"strategy": "MPS", "mpsConfig": {3: "1Gi"}}), "") == [
        "sharing.mpsConfig.3: unknown field; accepted fields: defaultActiveThreadPercentage, "
        "defaultPinnedDeviceMemoryLimit, defaultPerDevicePinnedMemoryLimit, multiUser"
    ]
    mig = {"apiVersion": API, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}
    mig["sharing"]["timeSlicingConfig"] = {}
    assert _errors(mig, "") == [
        "sharing.timeSlicingConfig: unknown field (MIG devices have no time-slice setting; use "
        "strategy TimeSlicing without a config); accepted fields: strategy, mpsConfig"
    ]


def test_snake_case_names_are_not_accepted_on_the_wire() -> None:
    lines = _errors(_gpu({"strategy": "MPS", "mps_config": {}}))
    assert lines[0].startswith(f"{PREFIX}.sharing.mps_config: unknown field")


def test_format_errors_without_prefix_and_with_prefix() -> None:
    with pytest.raises(ConfigError) as info:
        parse_opaque_config(_gpu({"strategy": "X"}))
    assert format_errors("", info.value) == [str(info.value.issues[0])]
    assert format_errors("a[1]", info.value)[0].startswith("a[1].sharing.strategy: ")


# --- bound configs from Kubernetes objects ---


def test_bound_configs_parses_own_driver_entries_and_anchors_errors() -> None:
    entries: list[dict[str, Any]] = [
        {"requests": ["a"], "opaque": {"driver": "other.example.com", "parameters": {"x": 1}}},
        {"opaque": {"driver": "gpu.nvidia.com", "parameters": UPSTREAM_EXAMPLES[1]}},
        {
            "requests": ["b/sub"],
            "opaque": {"driver": "gpu.nvidia.com", "parameters": UPSTREAM_EXAMPLES[5]},
        },
    ]
    bound = bound_configs(entries, driver="gpu.nvidia.com", prefix="spec.devices.config")
    assert [(b.requests, b.path) for b in bound] == [
        ((), "spec.devices.config[1].opaque.parameters"),
        (("b/sub",), "spec.devices.config[2].opaque.parameters"),
    ]
    bad: list[dict[str, Any]] = [
        *entries,
        {"opaque": {"driver": "gpu.nvidia.com", "parameters": _gpu({"strategy": "no"})}},
        {"opaque": {"driver": "gpu.nvidia.com"}},
    ]
    with pytest.raises(ConfigError) as info:
        bound_configs(bad, driver="gpu.nvidia.com", prefix="spec.devices.config")
    paths = [str(i).split(": ")[0] for i in info.value.issues]
    assert paths == [
        "spec.devices.config[3].opaque.parameters.sharing.strategy",
        "spec.devices.config[4].opaque.parameters",
    ]


def test_bound_configs_filters_allocation_source() -> None:
    entries: list[dict[str, Any]] = [
        {"source": "FromClass", "opaque": {"driver": "d", "parameters": UPSTREAM_EXAMPLES[1]}},
        {"source": "FromClaim", "opaque": {"driver": "d", "parameters": UPSTREAM_EXAMPLES[3]}},
    ]
    prefix = "status.allocation.devices.config"
    (from_class,) = bound_configs(entries, driver="d", prefix=prefix, source="FromClass")
    (from_claim,) = bound_configs(entries, driver="d", prefix=prefix, source="FromClaim")
    assert from_class.path.startswith(f"{prefix}[0]")
    assert from_claim.path.startswith(f"{prefix}[1]")


# --- precedence ---


def _bound(sharing: Any, requests: tuple[str, ...] = (), kind: str = "GpuConfig") -> BoundConfig:
    raw = {"apiVersion": API, "kind": kind, "sharing": sharing}
    return BoundConfig(parse_opaque_config(raw), requests, f"cfg-{kind}-{requests}")


TS = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}
TS_LONG = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
MPS = {"strategy": "MPS"}


def test_defaults_when_nothing_is_configured() -> None:
    assert resolve_config("gpu", [], [], "req") == GpuConfig()
    assert resolve_config("mig", [], [], "req") == MigDeviceConfig()
    assert default_config("gpu").sharing is None


def test_claim_overrides_class() -> None:
    klass, claim = _bound(TS), _bound(MPS)
    assert resolve_config("gpu", [klass], [claim], "req") is claim.config
    assert resolve_config("gpu", [klass], [], "req") is klass.config


def test_class_config_never_overrides_claim_config_even_if_bound() -> None:
    klass, claim = _bound(TS, ("req",)), _bound(MPS)
    assert resolve_config("gpu", [klass], [claim], "req") is claim.config


def test_last_matching_wins() -> None:
    first, second = _bound(TS), _bound(TS_LONG)
    assert resolve_config("gpu", [], [first, second], "req") is second.config


def test_bound_config_applies_only_to_its_requests() -> None:
    unbound, bound_other = _bound(TS), _bound(MPS, ("other",))
    assert resolve_config("gpu", [], [unbound, bound_other], "req") is unbound.config
    assert resolve_config("gpu", [], [unbound, bound_other], "other") is bound_other.config


def test_request_binding_matches_subrequests() -> None:
    parent, exact = _bound(TS, ("req",)), _bound(MPS, ("req/b",))
    assert resolve_config("gpu", [], [parent], "req/a") is parent.config
    assert resolve_config("gpu", [], [parent, exact], "req/b") is exact.config
    assert resolve_config("gpu", [], [exact], "req/a") == GpuConfig()
    assert resolve_config("gpu", [], [exact], "req") == GpuConfig()


def test_unbound_config_of_other_kind_is_skipped() -> None:
    gpu, mig = _bound(TS), _bound(MPS, kind="MigDeviceConfig")
    assert resolve_config("gpu", [], [gpu, mig], "req") is gpu.config
    assert resolve_config("mig", [], [gpu, mig], "req") is mig.config
    assert resolve_config("mig", [], [gpu], "req") == MigDeviceConfig()


def test_bound_config_of_wrong_kind_is_an_error() -> None:
    gpu_bound = _bound(TS, ("req",))
    with pytest.raises(ConfigError) as info:
        resolve_config("mig", [], [gpu_bound], "req/sub")
    (issue,) = info.value.issues
    assert issue.path == f"{gpu_bound.path}.kind"
    assert issue.accepted == ("MigDeviceConfig",)
    assert "GpuConfig cannot configure the MIG device" in issue.message


def test_wrong_kind_bound_to_another_request_is_not_an_error() -> None:
    mig_other = _bound(MPS, ("other",), kind="MigDeviceConfig")
    assert resolve_config("gpu", [], [mig_other], "req") == GpuConfig()


def test_unknown_device_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="'gpu' or 'mig'"):
        resolve_config("tpu", [], [], "req")  # type: ignore[call-overload]
