"""Owner files: whether the agent that took the node's checkpoint over still runs.

A rolling update with a surge pod runs the new agent beside the old one; the new one's
start takes the checkpoint over (`gpudra.driver.checkpoint`), and from then on the old
one changes no device and publishes no slice. Should the new one go away while the old
one runs on (the surge pod fails or is deleted, a `helm rollback` makes the old pod
current again), the old one would refuse every prepare for good, and its liveness
probe, which prepares nothing, would never tell. It needs a sign of life of the agent
that took the file over, to stop when there is none: its restart takes the file over
again.

Design choices, and why:
- Each agent that takes the checkpoint over holds, for the life of its process, an
  exclusive flock on a file of its own in a folder beside the checkpoint
  (`.checkpoint.json.owners/<order>-<token>`). The kernel releases a flock when the
  process ends, however it ends (SIGKILL and the OOM killer included), and a flock is
  on the host's file, so agents in two containers sharing the state folder see each
  other's. A process ID in a file would mean nothing across PID namespaces, and a new
  process may reuse it.
- A file appears under its name already locked (made under a hidden temporary name,
  locked, then renamed), so nobody sees it there and unlocked while its agent runs.
- Files are named in the order their agents took the checkpoint over: registered under
  the checkpoint's lock, just before the take-over, each with an order past every file
  there and at least the wall clock in nanoseconds (so the order keeps growing once old
  files are removed). An agent taken over looks only at the files registered after its
  own: an older one, dead or alive, never took the file from it.
- An agent that learns it was taken over removes its own file (`resign`): a lock held
  means "owns the checkpoint, or has not learnt otherwise yet", so two agents taken over
  never keep each other waiting. An agent that stops while it owns the file leaves the
  file, unlocked: that is how the agents it took the file from learn it is gone.
- Only a registration removes dead files (unlocked, each while holding its lock, so a
  live agent's file is never removed). An agent taken over that removed the dead file
  of the agent it watches would hide it from any other agent taken over and watching
  it too; it stops anyway, and its restart registers.
- No file registered after this agent's (`Successor.UNKNOWN`): whoever took the file
  over registers none. That is a release from before the owner files (a downgrade with a
  surge pod), or someone edited the file. Nothing tells whether it runs, so the agent
  stands down on as before, said once, rather than take the file back from an agent
  that may be running: that agent would then change nothing on the node for good.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import time
import weakref
from enum import StrEnum
from pathlib import Path
from typing import Final

__all__ = ["OwnerFile", "Successor", "owners_folder"]

log = logging.getLogger(__name__)

_FOLDER_MODE: Final = 0o700


class Successor(StrEnum):
    """What became of the agents that took the checkpoint over after this one."""

    RUNNING = "running"  # one of them holds its lock
    GONE = "gone"  # each left its file unlocked: stopped, or killed
    UNKNOWN = "unknown"  # none left a file: one that registers none took it over


def owners_folder(checkpoint: Path) -> Path:
    """The owner files' folder beside `checkpoint` (hidden: no checkpoint file itself)."""
    return checkpoint.with_name(f".{checkpoint.name}.owners")


class OwnerFile:
    """This process's owner file, locked from `register` until `resign` or `close`
    (or the process's end). Used by one thread at a time."""

    def __init__(self, path: Path, order: int, fd: int) -> None:
        self.path = path
        self.order = order
        # Closed once: by `close`, or when this object is collected (a test's agent
        # dropped without its stop); a descriptor number closed twice could be another
        # file's by then.
        self._release = weakref.finalize(self, os.close, fd)
        self._unknown_said = False

    @classmethod
    def register(cls, folder: Path) -> OwnerFile:
        """A new owner file in `folder`, locked, named after every file there. Call under
        the checkpoint's lock, before the take-over, so the order is the take-overs'."""
        folder.mkdir(mode=_FOLDER_MODE, parents=True, exist_ok=True)
        token = secrets.token_hex(8)
        temporary = folder / f".{token}.tmp"
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else has it open
            order = max([time.time_ns(), *(listed + 1 for listed, _path in _listed(folder))])
            path = folder / f"{order}-{token}"
            temporary.rename(path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        return cls(path, order, fd)

    def forget_dead(self) -> None:
        """Remove the files no agent holds any more but this one: for the agent that
        now owns the checkpoint, which no agent taken over watches for."""
        for _order, path in _listed(self.path.parent):
            if path == self.path:
                continue
            fd = _open(path)
            if fd is None:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                path.unlink(missing_ok=True)  # under its lock: no live agent's file
            except BlockingIOError:
                pass  # its agent runs
            finally:
                os.close(fd)

    def resign(self) -> None:
        """Taken over: remove this agent's file, then release it. Left there unlocked,
        it would tell the agents this one took the file from that their successor is
        gone, while the one that took it from this one runs."""
        if not self._release.alive:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            self.close()

    def successor(self) -> Successor:
        """What became of the agents registered after this one (see `Successor`). Each
        file's lock is tested shared, so two agents looking at once never see each
        other's test as a live agent."""
        running = dead = False
        for order, path in _listed(self.path.parent):
            if order <= self.order:
                continue
            fd = _open(path)
            if fd is None:
                continue  # removed since: resigned, or by a newer registration
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                running = True
            else:
                dead = True
            finally:
                os.close(fd)
        if running:
            return Successor.RUNNING
        return Successor.GONE if dead else Successor.UNKNOWN

    def successor_gone(self) -> str | None:
        """For an agent whose checkpoint was taken over: why it should stop (so that its
        restart takes the file over again), or None while the agent that took it over
        runs, or where that cannot be told (said once). Resigns first."""
        self.resign()
        successor = self.successor()
        if successor is Successor.GONE:
            return (
                f"the agents that took the checkpoint over from this one are gone (their "
                f"owner files in {self.path.parent} are unlocked): this agent stops, and "
                "its restart takes the checkpoint over again"
            )
        if successor is Successor.UNKNOWN and not self._unknown_said:
            self._unknown_said = True
            log.warning(
                "the agent that took the checkpoint over leaves no owner file (a release "
                "from before them, or the file was edited): should it stop, restart this "
                "agent by hand",
                extra={"fields": {"folder": str(self.path.parent)}},
            )
        return None

    def close(self) -> None:
        """Release the lock, leaving the file: an agent that stops while it owns the
        checkpoint tells the agents it took the file from that it is gone."""
        self._release()


def _listed(folder: Path) -> list[tuple[int, Path]]:
    """The owner files in `folder` with their order; temporary files are not listed."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    listed: list[tuple[int, Path]] = []
    for entry in entries:
        order, dash, token = entry.name.partition("-")
        if dash and order.isascii() and order.isdigit() and token:
            listed.append((int(order), Path(entry.path)))
    return listed


def _open(path: Path) -> int | None:
    """A descriptor of `path`, for its flock; None where it is gone."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
