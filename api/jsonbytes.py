"""JSON to and from bytes, the one codec for what crosses the wire: AdmissionReviews,
opaque configs, API requests and responses, watch events.

orjson does the work: a node's slices are hundreds of KiB of JSON and every admission
decodes a review, and the standard library's codec took several times its CPU for
both. Encoding falls back to the standard encoder for the values orjson refuses (a
non-string key, an int past 64 bits), so whatever the standard encoder took still goes
out, as the same JSON value.

Decoding reads what Go's encoding/json reads, because the API server is Go and keeps
some fields (a claim's opaque parameters, any RawExtension) as the bytes a client
sent, checked only by Go's decoder, and serves them back unchanged in every GET, LIST
and WATCH. orjson refuses three things Go takes: an unpaired UTF-16 surrogate escape
("\\ud800"), invalid UTF-8 inside a string, and nesting deeper than 1024 levels. Any
tenant can store one in a claim for another driver's class, where no gpudra webhook
looks, and a decoder that refused it would fail every listing of claims that holds
it. So a text orjson refuses is decoded again by the standard library's decoder, the
way Go does: each unpaired surrogate and each invalid byte becomes U+FFFD, nesting is
taken to Go's limit of 10000 levels and refused past it, and NaN, Infinity, a number
past a 64-bit float and anything else that is not JSON are refused, as Go refuses
them. Either way an integer past 64 bits reads as a float, as Go reads it into an
interface.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import re
import sys
from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["GO_MAX_DEPTH", "DecodeError", "canonical", "copy", "dumps", "loads"]

GO_MAX_DEPTH = 10_000
"""The deepest nesting Go's encoding/json reads (its maxNestingDepth): `loads` reads
this deep and refuses deeper, as the API server does."""

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


def loads(data: bytes | str, *, as_go: bool = True) -> Any:
    """The value of a JSON text, as Go's encoding/json reads it into an interface
    (see the module's docstring); raises `DecodeError`.

    `as_go=False` refuses what orjson refuses instead of reading it again the slower
    way, which costs about ten times orjson's CPU: for text anyone may send (an
    admission review on the webhook's port), where a text made to fail orjson at its
    end would buy that CPU for its mere size."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        if not as_go:
            raise
        # Rare (a text orjson refuses): the slower reading that takes what Go takes.
    return _loads_as_go(data)


def _loads_as_go(data: bytes | str) -> Any:
    """`data` read as Go reads it, by the standard library's decoder with its
    pure-Python scanner.

    That scanner, unlike orjson and the standard C scanner, nests in Python frames
    only, which since Python 3.11 take no C stack: the recursion limit is raised for
    the call to make room for GO_MAX_DEPTH levels (three frames each) and lowered by as
    much after it, so calls that overlap in two threads each keep their room and the
    limit ends where it was. The nesting itself is counted, so past GO_MAX_DEPTH the
    text is refused by its depth, as Go refuses it, and not by the frames left.
    Invalid UTF-8 is decoded with surrogateescape, so each invalid byte becomes a lone
    surrogate, and every lone surrogate then becomes U+FFFD, as in Go."""
    text = data if isinstance(data, str) else bytes(data).decode("utf-8", "surrogateescape")
    decoder = _GoDecoder()
    room = 3 * (GO_MAX_DEPTH + 1) + 100
    sys.setrecursionlimit(sys.getrecursionlimit() + room)
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as exc:
        raise DecodeError(exc.msg, exc.doc, exc.pos) from None
    except _Refused as exc:  # a number or constant, refused where it first stands
        raise DecodeError(str(exc), text, max(text.find(exc.literal), 0)) from None
    finally:
        sys.setrecursionlimit(sys.getrecursionlimit() - room)


def _go_string(value: str) -> str:
    """`value` with every lone surrogate (an unpaired escape, an invalid UTF-8 byte)
    replaced by U+FFFD, as Go decodes both, and as orjson can encode again."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return re.sub(r"[\ud800-\udfff]", "\ufffd", value)
    return value


class _Refused(ValueError):
    """A literal the scanner matched that Go refuses; the decoder places it."""

    def __init__(self, message: str, literal: str) -> None:
        super().__init__(message)
        self.literal = literal


def _go_float(text: str) -> float:
    if not text.isascii():  # the scanner's pattern takes any Unicode digit
        raise _Refused(f"invalid number {text[:40]!r}", text)
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"number {text[:40]} is out of the range of a 64-bit float", text)
    return value


def _go_int(text: str) -> int | float:
    """An integer as orjson reads it: an int within 64 bits, a float past them."""
    if len(text) <= 20 and text.isascii():
        value = int(text)
        if -(2**63) <= value < 2**64:
            return value
    return _go_float(text)


def _refuse_constant(name: str) -> Any:
    raise _Refused(f"{name} is not JSON", name)


class _GoDecoder(json.JSONDecoder):
    """The standard decoder with the pure-Python scanner, Go's nesting limit, and
    strings and numbers read as Go reads them. One per text: it counts its nesting."""

    def __init__(self) -> None:
        super().__init__(
            object_pairs_hook=lambda pairs: {_go_string(k): v for k, v in pairs},
            parse_float=_go_float,
            parse_int=_go_int,
            parse_constant=_refuse_constant,
        )
        self.depth = 0
        self.parse_object = self._nested(json.decoder.JSONObject)  # type: ignore[attr-defined]
        self.parse_array = self._nested(json.decoder.JSONArray)  # type: ignore[attr-defined]
        self.parse_string = self._string
        self.scan_once = json.scanner.py_make_scanner(self)  # type: ignore[attr-defined]

    @staticmethod
    def _string(text: str, end: int, strict: bool) -> tuple[str, int]:
        value, end = json.decoder.scanstring(text, end, strict)  # type: ignore[attr-defined]
        return _go_string(value), end

    def _nested(self, parse: Callable[..., Any]) -> Callable[..., Any]:
        def parse_nested(text_and_end: tuple[str, int], *args: Any) -> Any:
            self.depth += 1
            try:
                if self.depth > GO_MAX_DEPTH:
                    text, end = text_and_end
                    raise json.JSONDecodeError(
                        f"exceeded max depth: nesting deeper than {GO_MAX_DEPTH} levels, "
                        "the most Go's encoding/json reads",
                        text,
                        end - 1,
                    )
                return parse(text_and_end, *args)
            finally:
                self.depth -= 1

        return parse_nested
