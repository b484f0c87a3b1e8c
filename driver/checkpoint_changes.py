"""The checkpoint's changes file: claim records appended after the whole file.

Why it exists: the checkpoint file is replaced whole, by rename, and its content is
synced before every rename so that a power loss never leaves it torn. That sync (and
the worker thread that waits for it) was the largest cost of a whole-GPU prepare after
the API server read, for changes that may be lost with the power anyway: a prepare's
end and a claim's removal once its devices are undone (`Checkpoint._save` says why
losing them is harmless). Such changes are appended here instead, one line per write,
with no sync: the write reaches the page cache before the kubelet gets its answer, so
a restarted process reads it, and a power loss can take only changes that were never
promised to survive one.

The format, one line per write:

    <crc32 of the JSON, 8 hex digits> <JSON>\\n
    JSON: {"base": <base>, "n": <0, 1, 2, ...>, "claims": {<uid>: <record or null>}}

`base` names the checkpoint file the line extends: the first 16 hex digits of the
SHA-256 of its bytes, each of which holds a fresh random `writeId`, so no two files
written share one. `n` counts the lines written on that base. A record is the claim's
JSON as the checkpoint file holds it; null removes the claim.

A reader (`replay`) applies the lines in order while each is whole (its checksum, its
newline), names the file it read as its base and has the next `n`, and ignores the rest:
a line torn by a power loss, lines of an older checkpoint file (the file was replaced
and this one emptied, but the emptying was lost with the power), or lines after a gap.
What it applies is always the state of some earlier moment, never a mix, and never older
than the checkpoint file.

Whenever the checkpoint file is replaced, this file is made anew, empty (`empty` says
why it is removed rather than emptied in place), and each change that
must survive a power loss replaces the checkpoint file (synced) rather than being
appended. The agent also replaces it when it stops, so that a release that reads the
checkpoint file alone (those before this file existed) finds every change in it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpudra.common.files import write_all

__all__ = [
    "CHANGES_SUFFIX",
    "ChangedError",
    "ChangesFile",
    "Replayed",
    "base_of",
    "encode_line",
    "replay",
]

CHANGES_SUFFIX: Final = ".changes"
"""Appended to the checkpoint file's name: `checkpoint.json.changes`."""


def base_of(checkpoint_bytes: bytes) -> str:
    """The name of a checkpoint file's content that its changes lines carry."""
    return hashlib.sha256(checkpoint_bytes).hexdigest()[:16]


def encode_line(base: str, n: int, claims: Iterable[bytes]) -> bytes:
    """One line: `claims` are `"<uid>":<record JSON or null>` fragments."""
    body = b'{"base":"%s","n":%d,"claims":{%s}}' % (base.encode(), n, b",".join(claims))
    return b"%08x " % zlib.crc32(body) + body + b"\n"


@dataclass(frozen=True, slots=True)
class Replayed:
    """What `replay` applied: `lines` lines, ending `size` bytes into the file;
    `ignored` bytes after them were not applied (torn, stale or out of order)."""

    lines: int
    size: int
    ignored: int


def _line(raw: bytes, base: str, n: int) -> dict[str, Any] | None:
    """The claims of one whole line with this base and number; None for any other."""
    if len(raw) < 10 or raw[8:9] != b" ":
        return None
    body = raw[9:]
    try:
        if int(raw[:8], 16) != zlib.crc32(body):
            return None
        # The standard codec, as for the checkpoint file: records keep what another
        # release wrote exactly (an integer past 64 bits stays one).
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("base") != base or doc.get("n") != n:
        return None
    claims = doc.get("claims")
    return claims if isinstance(claims, dict) else None


def replay(claims: dict[str, Any], data: bytes, base: str) -> Replayed:
    """Apply to `claims` (uid -> record JSON, changed in place) the lines of `data` that
    extend the checkpoint file named `base`, in order, up to the first that does not."""
    applied = size = 0
    while size < len(data):
        end = data.find(b"\n", size)
        if end < 0:
            break  # a torn last line
        changes = _line(data[size:end], base, applied)
        if changes is None:
            break
        for uid, record in changes.items():
            if record is None:
                claims.pop(uid, None)
            else:
                claims[uid] = record
        applied += 1
        size = end + 1
    return Replayed(applied, size, len(data) - size)


class ChangedError(Exception):
    """The changes file was written by another process since this one's last line."""


class ChangesFile:
    """The open changes file of one checkpoint: appends, and emptying.

    Opened on first use and kept open; the checkpoint serialises the calls."""

    def __init__(self, checkpoint_path: Path) -> None:
        self.path = checkpoint_path.with_name(checkpoint_path.name + CHANGES_SUFFIX)
        self._fd: int | None = None

    def read(self) -> bytes:
        """The file's bytes; empty when it does not exist."""
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return b""

    def _open(self) -> int:
        if self._fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
            self._fd = os.open(self.path, flags, 0o600)
        return self._fd

    @property
    def opened(self) -> bool:
        """Whether this process holds the file open (from its first line, or since it
        emptied it): then `check` needs no look at the folder."""
        return self._fd is not None

    def check(self, size: int | None) -> bool:
        """Whether the file holds `size` bytes (None: unknown, after a failed append),
        the lines this process appended and nothing else; False when it was removed
        (the next `empty` makes a new one). Raises ChangedError where another process
        wrote to it."""
        if self._fd is not None:
            st = os.fstat(self._fd)
            if st.st_nlink == 0:  # removed, by another process's `empty` too
                self.close()
                return False
            actual = st.st_size
        else:
            try:
                actual = self.path.stat().st_size
            except FileNotFoundError:
                if size == 0:  # none yet: made now, and held open from here on
                    self._open()
                return size == 0
        if size is not None and actual != size:
            raise ChangedError(f"{self.path} holds {actual} bytes, not the {size} written here")
        if size is not None and self._fd is None:
            self._open()
        return size is not None

    def append(self, line: bytes) -> None:
        """Append `line` (not synced). A failure may leave part of it behind: the caller
        must empty the file (by replacing the checkpoint file) before appending again."""
        write_all(self._open(), line)

    def empty(self) -> None:
        """Drop every line (their checkpoint file was replaced) by removing the file and
        making a new one, held open. Removed rather than emptied in place, so that
        another process holding the old one open (the agent a take-over replaced)
        sees it removed before it adds a line no reader would get to."""
        self.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._open()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
