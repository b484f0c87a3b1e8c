"""The wire JSON codec: compact UTF-8 out, whatever the standard encoder took; Go's
JSON in."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

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


@pytest.mark.parametrize("text", [b"{", b"NaN", b'{"a": Infinity}', b'"\xff"'])
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
