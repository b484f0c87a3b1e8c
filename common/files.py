"""Crash-safe file replacement, shared by the checkpoint, CDI specs and certificates."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace `path` with `data` so that readers see the old or the new content only.

    On any failure the temp file is removed and the old file is left untouched.
    `durable` also makes the new content survive a power loss (fsync of the file and
    its folder); without it the replacement is still atomic for every reader and
    survives a crash of this process, which is all that files rebuilt after a
    reboot need.
    The temp name does not end in `.json`/`.yaml`, so CDI loaders watching the
    directory never pick up a file that is still being written.
    """
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            if durable:
                os.fsync(handle.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
