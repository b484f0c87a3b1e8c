"""The checkpoint's changes file format: which lines a reader applies."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import pytest
from gpudra.driver.checkpoint_changes import (
    ChangedError,
    ChangesFile,
    base_of,
    encode_line,
    replay,
)

BASE = base_of(b'{"claims":{}}\n')


def _fragment(uid: str, record: dict[str, Any] | None) -> bytes:
    return json.dumps(uid).encode() + b":" + json.dumps(record).encode()


def _lines(*changes: dict[str, dict[str, Any] | None], base: str = BASE, first: int = 0) -> bytes:
    return b"".join(
        encode_line(base, first + n, [_fragment(uid, rec) for uid, rec in change.items()])
        for n, change in enumerate(changes)
    )


def test_lines_are_applied_in_order_and_null_removes() -> None:
    claims: dict[str, Any] = {"a": {"state": "PrepareStarted"}}
    data = _lines({"a": {"state": "PrepareCompleted"}, "b": {"state": "x"}}, {"a": None})
    done = replay(claims, data, BASE)
    assert claims == {"b": {"state": "x"}}
    assert (done.lines, done.size, done.ignored) == (2, len(data), 0)


def test_a_torn_last_line_is_ignored() -> None:
    whole = _lines({"a": {"n": 1}})
    torn = _lines({"b": {"n": 2}}, first=1)
    for cut in range(len(torn)):  # every way the last line can be cut short
        claims: dict[str, Any] = {}
        done = replay(claims, whole + torn[:cut], BASE)
        assert claims == {"a": {"n": 1}}, cut
        assert (done.lines, done.size, done.ignored) == (1, len(whole), cut)


def test_a_damaged_line_stops_the_reader() -> None:
    """A flipped byte (its checksum), zeros where a power loss left no data, a line of
    another checkpoint file or out of order: that line and every one after it are not
    applied, so what is applied is always an earlier state."""
    first = _lines({"a": {"n": 1}})
    second = _lines({"b": {"n": 2}}, first=1)
    third = _lines({"c": {"n": 3}}, first=2)
    flipped = bytearray(second)
    flipped[20] ^= 0x01
    cases = {
        "checksum": bytes(flipped),
        "zeros": b"\0" * len(second),
        "another file's": _lines({"b": {"n": 2}}, base=base_of(b"other"), first=1),
        "a gap": _lines({"b": {"n": 2}}, first=2),
        "a repeat": _lines({"b": {"n": 2}}, first=0),
        "no separator": second.replace(b" ", b"-", 1),
    }
    for name, bad in cases.items():
        claims: dict[str, Any] = {}
        done = replay(claims, first + bad + third, BASE)
        assert claims == {"a": {"n": 1}}, name
        assert done.lines == 1 and done.ignored == len(bad) + len(third), name


def test_a_line_is_its_checksum_then_the_json() -> None:
    line = encode_line(BASE, 0, [_fragment("a", None)])
    crc, body = line.rstrip(b"\n").split(b" ", 1)
    assert int(crc, 16) == zlib.crc32(body)
    assert json.loads(body) == {"base": BASE, "n": 0, "claims": {"a": None}}


def test_the_file_sits_beside_the_checkpoint_and_empties(tmp_path: Path) -> None:
    changes = ChangesFile(tmp_path / "checkpoint.json")
    assert changes.path == tmp_path / "checkpoint.json.changes"
    assert changes.read() == b""
    assert changes.check(0) and changes.opened  # made, and held open from then on
    changes.append(b"one\n")
    changes.append(b"two\n")
    assert changes.read() == b"one\ntwo\n"
    assert changes.check(8)
    with changes.path.open("rb") as held:
        changes.empty()  # a new, empty file: whoever held the old one sees it removed
        assert os.fstat(held.fileno()).st_nlink == 0
    assert changes.read() == b""
    changes.append(b"three\n")
    assert changes.read() == b"three\n"
    assert changes.path.stat().st_mode & 0o777 == 0o600


def test_a_removed_or_foreign_written_file_is_told_apart(tmp_path: Path) -> None:
    mine = ChangesFile(tmp_path / "checkpoint.json")
    mine.empty()
    mine.append(b"one\n")
    other = ChangesFile(tmp_path / "checkpoint.json")
    assert other.check(4)  # read as it is, opened
    other.append(b"two\n")
    with pytest.raises(ChangedError, match="holds 8 bytes, not the 4"):
        mine.check(4)
    other.empty()  # as a take-over does
    assert not mine.check(8) and not mine.opened  # removed under it
    assert not mine.check(None)  # unknown after a failed line: replace the file
    mine.close()
    other.close()
