"""Crash-safe file replacement, shared by the checkpoint, CDI specs and certificates."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def atomic_write(
    path: Path,
    data: bytes,
    *,
    mode: int = 0o644,
    durable: bool = True,
    folder_mode: int | None = None,
) -> None:
    """Replace `path` with `data` so that readers see the old or the new content only.

    On any failure the temp file is removed and the old file is left untouched.
    `durable` also makes the new content survive a power loss (fsync of the file and
    its folder); without it the replacement is still atomic for every reader and
    survives a crash of this process, which is all that files rebuilt after a
    reboot need.
    The temp name does not end in `.json`/`.yaml`, so CDI loaders watching the
    directory never pick up a file that is still being written.
    With `folder_mode`, a missing folder is created (with that mode) when the first
    open fails, rather than checked before every write.
    """
    directory = path.parent
    # Plain os calls: on the prepare path this runs on every claim, and mkstemp,
    # a buffered file object and Path methods cost more than the writes themselves.
    tmp = f"{directory}/.{path.name}.{secrets.token_hex(6)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileNotFoundError:
        if folder_mode is None:
            raise
        directory.mkdir(mode=folder_mode, parents=True, exist_ok=True)
        fd = os.open(tmp, flags, 0o600)
    try:
        try:
            write_all(fd, data)
            os.fchmod(fd, mode)  # exact, whatever the umask
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # noqa: PTH105 - see above
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # noqa: PTH108 - see above
        raise
    if durable:
        fsync_dir(directory)


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd`: a write may take less than it is given."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
