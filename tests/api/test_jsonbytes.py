"""The wire JSON codec: compact UTF-8 out, whatever the standard encoder took; Go's
JSON in, as Go reads it: what the API server keeps unchecked comes back to us."""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Iterator, Mapping

import orjson
import pytest
from gpudra.api import jsonbytes


class Labels(Mapping[str, str]):
    """A mapping that is not a dict: neither encoder takes it."""

    def __getitem__(self, key: str) -> str:
        return {"team": "é"}[key]

    def __iter__(self) -> Iterator[str]:
        return iter(["team"])

    def __len__(self) -> int:
        return 1


@pytest.mark.parametrize(
    "value",
    [
        {"kind": "GpuConfig", "sharing": {"strategy": "MPS"}, "n": [1, 2.5, None, True]},
        {"big": 2**70},
        {1: "int-key"},
        "naïve-ünicode",
    ],
)
def test_dumps_is_compact_json_of_the_same_value(value: object) -> None:
    encoded = jsonbytes.dumps(value)
    assert b" " not in encoded
    assert json.loads(encoded) == json.loads(json.dumps(value))
    assert "\\u" not in encoded.decode()  # UTF-8, not escapes


def test_dumps_refuses_what_is_not_json_data_as_the_standard_encoder_does() -> None:
    for value in ({"labels": Labels()}, {"when": object()}):
        with pytest.raises(TypeError):
            json.dumps(value)
        with pytest.raises(TypeError):
            jsonbytes.dumps(value)


@pytest.mark.parametrize(
    "text",
    [
        b"{",
        b"NaN",
        b'{"a": Infinity}',
        b'{"a": 1e400}',
        b'["\\ud800", ]',  # a surrogate does not make the reading lenient elsewhere
        b'["\\ud800" 1]',
        b'["\x01"]',  # a control character in a string
        b"\xef\xbb\xbf[]",  # a byte order mark
        "[1\u0661]".encode(),  # an Arabic-Indic digit
        b"[1] [2]",
    ],
)
def test_loads_refuses_what_go_refuses(text: bytes) -> None:
    with pytest.raises(jsonbytes.DecodeError):
        jsonbytes.loads(text)
    with pytest.raises(ValueError):
        jsonbytes.loads(text)


def test_an_integer_past_64_bits_reads_as_a_float_as_in_go() -> None:
    assert jsonbytes.loads(b'{"a": 18446744073709551616}') == {"a": 2.0**64}


def test_loads_takes_bytes_and_text() -> None:
    assert jsonbytes.loads(b'{"a":[1,"x"]}') == jsonbytes.loads('{"a":[1,"x"]}') == {"a": [1, "x"]}


def test_default_turns_what_neither_codec_knows_into_json() -> None:
    for value in ({"path": Labels()}, {"path": Labels(), "big": 2**70}):
        decoded = json.loads(jsonbytes.dumps(value, default=repr))
        assert decoded["path"].startswith("<") and decoded.get("big", 2**70) == 2**70


def test_copy_is_fresh_json_data_and_keeps_big_integers() -> None:
    value = {"devices": [{"minor": 3, "extra": {"é": [1, 2]}}], "big": 2**70}
    copied = jsonbytes.copy(value)
    assert copied == value
    assert copied["devices"][0]["extra"] is not value["devices"][0]["extra"]
    assert isinstance(copied["big"], int)
    with pytest.raises(TypeError):
        jsonbytes.copy({"when": object()})


def _nested(depth: int) -> bytes:
    """An object holding arrays, `depth` levels in all."""
    return b'{"x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        # Go decodes an unpaired surrogate escape to U+FFFD; orjson refuses it.
        (b'{"x":"\\ud800"}', {"x": "\ufffd"}),
        (b'{"x":"\\udc00 a"}', {"x": "\ufffd a"}),
        (b'["\\ud800\\ud800x"]', ["\ufffd\ufffdx"]),
        (b'["\\udc00\\ud83d\\ude00"]', ["\ufffd\U0001f600"]),  # a pair after it still pairs
        (b'{"\\ud800":1}', {"\ufffd": 1}),  # in a key too
        # Invalid UTF-8 in a string: one U+FFFD per byte, as Go writes it.
        (b'["a\xffb"]', ["a\ufffdb"]),
        (b'["\xed\xa0\x80"]', ["\ufffd\ufffd\ufffd"]),  # a surrogate encoded in UTF-8
        # The rest of such a text reads as orjson reads it.
        (
            b'{"s":"\\ud800","n":[18446744073709551615,18446744073709551616,-1,1.5,null,true]}',
            {"s": "\ufffd", "n": [2**64 - 1, 2.0**64, -1, 1.5, None, True]},
        ),
        ('["\\ud800", "\ud800"]', ["\ufffd", "\ufffd"]),  # text with a lone surrogate
    ],
)
def test_loads_reads_what_go_reads_and_orjson_refuses(text: bytes | str, value: object) -> None:
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(text)
    decoded = jsonbytes.loads(text)
    assert decoded == value
    assert jsonbytes.loads(jsonbytes.dumps(decoded)) == value  # and orjson writes it again


@pytest.mark.parametrize("depth", [1025, 5000, jsonbytes.GO_MAX_DEPTH])
def test_loads_reads_nesting_to_go_s_limit(depth: int) -> None:
    value = jsonbytes.loads(_nested(depth))["x"]
    for _ in range(depth - 2):
        (value,) = value
    assert value == []
    objects = b'{"a":' * depth + b'"\\ud800"' + b"}" * depth
    value = jsonbytes.loads(objects)
    for _ in range(depth):
        value = value["a"]
    assert value == "\ufffd"


@pytest.mark.parametrize(
    ("text", "where"),
    [(b'["\\ud800", 1e400]', "(char 11)"), (b'["\\ud800", [NaN]]', "(char 12)")],
)
def test_a_refused_literal_is_placed(text: bytes, where: str) -> None:
    with pytest.raises(jsonbytes.DecodeError, match=re.escape(where)):
        jsonbytes.loads(text)


def test_loads_refuses_nesting_past_go_s_limit_and_leaves_the_recursion_limit() -> None:
    limit = sys.getrecursionlimit()
    for text in (_nested(jsonbytes.GO_MAX_DEPTH + 1), b"[" * 100_000):
        with pytest.raises(jsonbytes.DecodeError, match="exceeded max depth"):
            jsonbytes.loads(text)
    assert sys.getrecursionlimit() == limit


def test_nesting_is_read_in_threads_at_once() -> None:
    """Each reading raises the recursion limit by its own room and lowers it by as
    much, so readings that overlap keep theirs and the limit ends where it was."""
    limit = sys.getrecursionlimit()
    results: list[object] = []

    def read() -> None:
        for _ in range(5):
            results.append(jsonbytes.loads(_nested(jsonbytes.GO_MAX_DEPTH)))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 20 and all(isinstance(r, dict) for r in results)
    assert sys.getrecursionlimit() == limit
