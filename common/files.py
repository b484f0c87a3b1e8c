"""Crash-safe file replacement, shared by the checkpoint, CDI specs and certificates, and
the removal of folders that untrusted processes write in."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import select
import subprocess
from pathlib import Path

_RM_TIMEOUT_S = 120.0
_RM_ERROR_LINES = 3


def atomic_write(
    path: str | Path,
    data: bytes,
    *,
    mode: int = 0o644,
    durable: bool = True,
    sync_folder: bool = True,
    folder_mode: int | None = None,
) -> None:
    """Replace `path` with `data` so that readers see the old or the new content only.

    On any failure the temp file is removed and the old file is left untouched.
    `durable` also makes the new content survive a power loss (fsync of the file and
    its folder); without it the replacement is still atomic for every reader and
    survives a crash of this process, which is all that files rebuilt after a
    reboot need. `durable` without `sync_folder` syncs the new content before the
    rename but not the rename itself: after a power loss the file is whole, with this
    content or what an earlier write left (and the temp file may be left beside it,
    for the writer's start-up sweep), and the rename reaches the disk with the
    folder's next sync (the file system's own commit, or the next `durable` write
    there). That spares one of the two syncs, for a writer whose latest content may be
    lost with the power but whose file must never be torn.
    The temp name does not end in `.json`/`.yaml`, so CDI loaders watching the
    directory never pick up a file that is still being written.
    With `folder_mode`, a missing folder is created (with that mode) when the first
    open fails, rather than checked before every write.
    """
    # Plain os calls and strings: on the prepare path this runs on every claim, and
    # mkstemp, a buffered file object and Path methods cost more than the writes.
    directory, name = os.path.split(path)
    directory = directory or "."
    tmp = f"{directory}/.{name}.{secrets.token_hex(6)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileNotFoundError:
        if folder_mode is None:
            raise
        Path(directory).mkdir(mode=folder_mode, parents=True, exist_ok=True)
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
    if durable and sync_folder:
        fsync_dir(directory)


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd`: a write may take less than it is given. A full pipe
    whose descriptor is non-blocking (another process may have made a shared stderr so)
    is waited on, not given up on half way, which would leave part of a line for the
    next to be glued to."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            waiting = select.poll()
            waiting.register(fd, select.POLLOUT)
            waiting.poll()


def fsync_dir(directory: str | Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path, *, timeout_s: float = _RM_TIMEOUT_S) -> None:
    """Remove `path` and everything below it, where untrusted processes may write.

    A claim's containers write, as root, in its MPS pipe folder and its /dev/shm, which
    the agent removes at unprepare. `shutil.rmtree` cannot be trusted with them: on
    Python 3.11 it recurses once per level, so a tree a thousand folders deep raises
    RecursionError, and with ``ignore_errors`` a folder refilled while it is being
    removed is left behind without a word. GNU rm walks any depth (openat, no
    recursion), never follows a symlink, stays on the file system of `path`
    (``--one-file-system``: a mount inside is not entered) and says what it could not
    remove. Anything left is an OSError naming it, so that the caller keeps its record
    and tries again; a missing `path` is nothing to do.
    """
    if not os.path.lexists(path):
        return
    try:
        done = subprocess.run(
            ["rm", "-rf", "--one-file-system", "--", str(path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise OSError(f"removing {path}: not done within {timeout_s:g} s") from None
    if done.returncode != 0 or os.path.lexists(path):
        lines = done.stderr.strip().splitlines()[:_RM_ERROR_LINES]
        why = "; ".join(lines) or f"rm exited with {done.returncode}"
        raise OSError(f"removing {path}: {why}")


class ProcessLock:
    """An exclusive advisory lock (flock) on `path`, between processes; within one
    holder it nests, and one thread at a time may use it (the holder serialises).

    For files two processes may write at once, such as a node agent's checkpoint while
    a rolling update runs the new agent beside the old one. The lock file is created
    (with its folder, `folder_mode`) on first use and kept open until `close`.
    """

    def __init__(self, path: Path, *, folder_mode: int = 0o700) -> None:
        self.path = path
        self._folder_mode = folder_mode
        self._fd: int | None = None
        self._depth = 0

    def _open(self) -> int:
        if self._fd is None:
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
            try:
                self._fd = os.open(self.path, flags, 0o600)
            except FileNotFoundError:
                self.path.parent.mkdir(mode=self._folder_mode, parents=True, exist_ok=True)
                self._fd = os.open(self.path, flags, 0o600)
        return self._fd

    def __enter__(self) -> None:
        if self._depth == 0:
            fcntl.flock(self._open(), fcntl.LOCK_EX)
        self._depth += 1

    def __exit__(self, *_exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None and self._depth == 0:
            os.close(self._fd)  # releases the lock too
            self._fd = None
