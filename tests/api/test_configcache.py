"""The webhook's cache of parsed opaque configs: what it returns is what the parser
returns, a config seen before is not parsed again, and a tenant sending new configs
cannot grow it."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from gpudra.api.config import API_VERSION, ConfigError, parse_opaque_config
from gpudra.api.configcache import ConfigCache


def gpu_config(interval: str = "Long", **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}},
        **extra,
    }


def test_an_equal_config_is_parsed_once() -> None:
    cache = ConfigCache()
    first = cache.parse(gpu_config())
    assert first == parse_opaque_config(gpu_config())
    # Another object with the same JSON, its keys in another order: the same parse.
    reordered = dict(reversed(list(gpu_config().items())))
    assert cache.parse(reordered) is first
    assert len(cache) == 1
    assert cache.parse(gpu_config("Short")) is not first
    assert len(cache) == 2


def test_values_of_other_json_types_are_other_configs() -> None:
    """Strict parsing tells 1 from 1.0 and "1": so must the key."""
    cache = ConfigCache()
    mps = {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}
    for value in (50, 50.0, "50"):
        raw = copy.deepcopy(mps)
        raw["sharing"]["mpsConfig"] = {"defaultActiveThreadPercentage": value}
        try:
            expected: object = parse_opaque_config(raw)
        except ConfigError as exc:
            expected = str(exc)
        try:
            got: object = cache.parse(raw)
        except ConfigError as exc:
            got = str(exc)
        assert got == expected, value


def test_the_least_recently_used_config_is_evicted_at_the_bound() -> None:
    cache = ConfigCache(size=2)
    long_, short = cache.parse(gpu_config("Long")), cache.parse(gpu_config("Short"))
    assert cache.parse(gpu_config("Long")) is long_  # now the most recent
    cache.parse(gpu_config("Medium"))  # evicts Short, the least recent
    assert len(cache) == 2
    assert cache.parse(gpu_config("Long")) is long_
    assert cache.parse(gpu_config("Short")) is not short


def test_a_bad_config_is_reported_afresh_and_not_kept() -> None:
    cache = ConfigCache()
    bad = gpu_config("Forever")
    with pytest.raises(ConfigError) as expected:
        parse_opaque_config(bad)
    for _ in range(2):
        with pytest.raises(ConfigError) as got:
            cache.parse(bad)
        assert str(got.value) == str(expected.value)
    assert len(cache) == 0


def test_long_and_unencodable_configs_are_parsed_and_not_kept() -> None:
    plain = {"apiVersion": API_VERSION, "kind": "GpuConfig"}  # 59 bytes of JSON
    cache = ConfigCache(max_key_bytes=100)
    assert cache.parse(gpu_config()) == parse_opaque_config(gpu_config())  # 140 bytes
    assert len(cache) == 0
    assert cache.parse(plain) is cache.parse(plain)
    assert len(cache) == 1
    unencodable = gpu_config()
    unencodable["sharing"]["timeSlicingConfig"] = {3: "Long"}  # orjson refuses the key
    with pytest.raises(ConfigError) as expected:
        parse_opaque_config(unencodable)
    with pytest.raises(ConfigError) as got:
        cache.parse(unencodable)
    assert str(got.value) == str(expected.value)
    text = json.dumps(plain)  # JSON text: parsed, not kept
    assert cache.parse(text) == parse_opaque_config(text)
    assert len(cache) == 1


def test_the_size_must_hold_a_config() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ConfigCache(size=0)
