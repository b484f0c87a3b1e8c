"""Parsed opaque configs, kept by their JSON, so a config seen before is not validated
again.

Claims repeat their configs: every claim a ResourceClaimTemplate makes carries the
template's, and a cluster's templates share a few. The webhook checks every config of
every claim it admits, and at the rate a real cluster creates claims each admission
meets the validator's code and data gone cold: measured in one process with the caches
flushed before each claim, the configs' validation was 100 of a claim's 220 µs, where
a warm loop takes 2 to 3 µs a config. A config's parse is a function of its JSON alone
and the parsed models are frozen, so the parse of a config seen before is handed back
as it is.

A hostile tenant can send only new configs: the cache is a bounded `Memo`, so its memory
is bounded; such a tenant costs each admission the sorted encoding of its configs on top
of their parse. Only configs that parse are kept: a bad one is parsed afresh each time,
so what it is told never depends on what came before.

For decoded JSON (dicts, lists, strings, numbers, booleans, None), as every caller
passes; not for concurrent use (the webhook's event loop is its one thread).
"""

from __future__ import annotations

from gpudra.api.config import DeviceConfig, parse_opaque_config
from gpudra.api.memo import Memo

__all__ = ["ConfigCache"]


class ConfigCache:
    """`parse_opaque_config`, remembering the configs that parsed."""

    def __init__(self, size: int = 256, max_key_bytes: int = 4096) -> None:
        if size < 1:
            raise ValueError(f"a config cache holds at least one config, not {size}")
        self._parsed: Memo[DeviceConfig] = Memo(size, max_key_bytes)

    def __len__(self) -> int:
        return len(self._parsed)

    def parse(self, raw: object) -> DeviceConfig:
        """What `parse_opaque_config(raw)` returns, or the ConfigError it raises."""
        # JSON text, and anything orjson cannot encode, is parsed and not kept.
        key = self._parsed.key(raw) if isinstance(raw, dict) else None
        if key is None:
            return parse_opaque_config(raw)
        config = self._parsed.get(key)  # now the most recently used
        if config is None:
            config = parse_opaque_config(raw)
            self._parsed.put(key, config)
        return config
