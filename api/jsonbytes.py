"""JSON to and from bytes, the one codec for what crosses the wire: AdmissionReviews,
opaque configs, API requests and responses, watch events.

orjson does the work: a node's slices are hundreds of KiB of JSON and every admission
decodes a review, and the standard library's codec took several times its CPU for
both. Encoding falls back to the standard encoder for the values orjson refuses (a
non-string key, an int past 64 bits), so whatever the standard encoder took still goes
out, as the same JSON value. Decoding is orjson's alone: it takes UTF-8 JSON, as the
API server and Go write it, refuses what Go's decoder refuses too (NaN, Infinity,
invalid UTF-8), and reads an integer past 64 bits as a float, as Go does into an
interface.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["DecodeError", "canonical", "copy", "dumps", "loads"]

DecodeError = orjson.JSONDecodeError
"""What `loads` raises for text that is not JSON (a ValueError)."""


def dumps(value: Any, *, default: Callable[[Any], Any] | None = None) -> bytes:
    """`value` as compact UTF-8 JSON. `default` turns a value neither codec knows into
    one they do (as the standard encoder's `default`); without it such a value raises
    TypeError."""
    try:
        return orjson.dumps(value, default=default)
    except orjson.JSONEncodeError:
        return json.dumps(
            value, separators=(",", ":"), ensure_ascii=False, default=default
        ).encode()


def copy(value: Any) -> Any:
    """A copy of `value` made of fresh JSON values (dicts, lists, strings, numbers),
    sharing nothing with it: what a reader of `dumps(value)` gets back. An int past 64
    bits stays an int, as the standard codec writes and reads it. Raises TypeError or
    ValueError for a value that is not JSON."""
    try:
        return orjson.loads(orjson.dumps(value))
    except orjson.JSONEncodeError:
        return json.loads(json.dumps(value, ensure_ascii=False))


def canonical(value: Any) -> bytes | None:
    """`value` as compact JSON with every object's keys sorted: the same bytes for the
    same decoded JSON value, to key it by. None for a value orjson refuses (a
    non-string key, an int past 64 bits), which then has no key."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return None


def loads(data: bytes | str) -> Any:
    """The value of a JSON text; raises `DecodeError`."""
    return orjson.loads(data)
