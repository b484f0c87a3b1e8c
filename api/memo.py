"""A bounded memo of values keyed by the JSON they were made from.

The webhook meets the same JSON again and again: every claim a ResourceClaimTemplate
makes carries the template's spec and configs, and a cluster's templates share a few.
What it makes of such JSON (a parsed config, a spec found allowed) is a function of
those bytes, so it is kept by them and handed back the next time, with no new work.

A hostile tenant can send only new JSON: a memo holds at most `size` values, the least
recently used evicted, and JSON longer than `max_key_bytes` is not kept at all, so its
memory is bounded whatever it is sent.

Not for concurrent use (the webhook's event loop is its one thread).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from gpudra.api.jsonbytes import canonical

__all__ = ["Memo"]

_T = TypeVar("_T")


class Memo(Generic[_T]):
    """Values by the sorted JSON of what they were made from, least recently used
    evicted."""

    def __init__(self, size: int, max_key_bytes: int) -> None:
        if size < 1:
            raise ValueError(f"a memo holds at least one value, not {size}")
        self._size = size
        self._max_key_bytes = max_key_bytes
        self._kept: dict[bytes, _T] = {}  # oldest use first

    def __len__(self) -> int:
        return len(self._kept)

    def key(self, raw: object) -> bytes | None:
        """`raw`'s key: its JSON with every object's keys sorted, the same for the same
        decoded value. None where it is not kept: longer than the bound, or not
        something orjson encodes."""
        key = canonical(raw)
        return key if key is not None and len(key) <= self._max_key_bytes else None

    def get(self, key: bytes) -> _T | None:
        """The value kept for `key`, now the most recently used; None if none is."""
        value = self._kept.pop(key, None)
        if value is not None:
            self._kept[key] = value
        return value

    def put(self, key: bytes, value: _T) -> None:
        """Keep `value` for `key`, evicting the least recently used at the bound."""
        kept = self._kept
        if key not in kept and len(kept) >= self._size:
            del kept[next(iter(kept))]
        kept.pop(key, None)
        kept[key] = value
