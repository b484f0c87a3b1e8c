"""The opaque-config parser under generated input: a config or a ConfigError naming the
field, nothing else; the same for a claim's `config[]` entries and their resolution."""

from __future__ import annotations

import json
from typing import Any

import pytest
from gpudra.api.config import (
    API_VERSION,
    BoundConfig,
    ConfigError,
    GpuConfig,
    MigDeviceConfig,
    bound_configs,
    parse_opaque_config,
    resolve_config,
)
from gpudra.api.configcache import ConfigCache
from hypothesis import example, given
from hypothesis import strategies as st

from tests.api.test_config import UPSTREAM_EXAMPLES
from tests.fuzz.strategies import JSON, mutated

DRIVER = "gpu.nvidia.com"

# The upstream driver's demo configs, as the API server stores them, are the seeds.
VALID_CONFIGS = UPSTREAM_EXAMPLES

# How pydantic's own messages begin: what `parse_opaque_config` must have translated.
PYDANTIC_WORDING = ("Input should", "Extra inputs", "Field required", "Keys should")

CONFIGS = st.sampled_from(VALID_CONFIGS).flatmap(lambda c: mutated(c, values=JSON))


def _gpu_sharing(sharing: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": sharing}


def _parsed(raw: Any) -> GpuConfig | MigDeviceConfig | None:
    try:
        config = parse_opaque_config(raw)
    except ConfigError as exc:
        assert exc.issues
        for issue in exc.issues:
            assert str(issue)
            # Every message is ours, naming what is accepted, never pydantic's wording.
            assert not issue.message.startswith(PYDANTIC_WORDING), issue
        return None
    # A config that parses serialises and parses again to the same thing.
    assert parse_opaque_config(config.to_wire()) == config
    return config


@given(CONFIGS)
@example(_gpu_sharing({"strategy": None}))
@example(_gpu_sharing({"strategy": "MPS", "mpsConfig": {3: "1Gi"}}))
def test_mutated_configs_parse_or_name_the_field(raw: dict[str, Any]) -> None:
    _parsed(raw)


def _outcome(parse: Any, raw: Any) -> object:
    try:
        return parse(raw)
    except ConfigError as exc:
        return ("error", str(exc))


@given(st.lists(CONFIGS | JSON, min_size=1, max_size=6))
def test_the_config_cache_answers_as_the_parser(raws: list[Any]) -> None:
    """Whatever came before it, the webhook's cache gives each config the parser's own
    answer: the same config, or the same error."""
    cache = ConfigCache(size=3)
    for raw in [*raws, *reversed(raws)]:
        assert _outcome(cache.parse, raw) == _outcome(parse_opaque_config, raw)


@given(CONFIGS.map(json.dumps) | st.text(max_size=200) | st.binary(max_size=200))
def test_config_text_parses_or_is_a_config_error(raw: str | bytes) -> None:
    _parsed(raw)


@given(JSON)
def test_any_json_value_parses_or_is_a_config_error(raw: Any) -> None:
    _parsed(raw)


@pytest.mark.parametrize("depth", [50, 5000, 100_000])
def test_deeply_nested_parameters_are_a_config_error(depth: int) -> None:
    """Nesting past the JSON decoder's recursion limit is bad input, not a crash."""
    raw = "[" * depth + "]" * depth
    with pytest.raises(ConfigError):
        parse_opaque_config(raw)
    nested: Any = {}
    for _ in range(min(depth, 5000)):
        nested = {"a": nested}
    with pytest.raises(ConfigError):
        parse_opaque_config({"apiVersion": API_VERSION, "kind": "GpuConfig", "x": nested})


ENTRY = st.fixed_dictionaries(
    {
        "requests": st.lists(st.sampled_from(("gpu", "mig", "a/b", "")), max_size=2),
        "opaque": st.fixed_dictionaries(
            {"driver": st.sampled_from((DRIVER, "other.example.com")), "parameters": CONFIGS}
        ),
    }
)
ENTRIES = st.lists(ENTRY, max_size=3).flatmap(lambda e: mutated(e, values=JSON, max_mutations=2))


@given(ENTRIES, st.sampled_from(("gpu", "mig")), st.sampled_from(("gpu", "mig", "a/b", "x")))
@example([None], "gpu", "gpu")
@example([{"requests": 5, "opaque": {"driver": DRIVER, "parameters": {}}}], "gpu", "gpu")
def test_config_entries_bind_and_resolve_or_name_the_field(
    entries: Any, device_type: Any, request: str
) -> None:
    """A claim's `config[]` as a user may write it (entries not objects, `requests` not a
    list): bound configs, or one ConfigError for every bad entry."""
    try:
        bound = bound_configs(entries, driver=DRIVER, prefix="spec.devices.config")
    except ConfigError as exc:
        assert all(str(issue).startswith("spec.devices.config") for issue in exc.issues)
        return
    assert all(isinstance(b, BoundConfig) for b in bound)
    try:
        resolve_config(device_type, (), bound, request)
    except ConfigError as exc:
        assert exc.issues
