"""Progress lines for the long first-run steps written in Python, and a runner for the
build scripts that lets their progress through.

Why: a cold `make demo` builds Kubernetes, containerd and images for many minutes;
without a word the user cannot tell work from a hang. A step prints what it does, why
and roughly how long the first run takes, then a line at least every
GPUDRA_PROGRESS_INTERVAL seconds (default 30) while it runs, then its time: the same
lines e2e/progress.sh prints for the bash build scripts. Everything goes to stderr,
because callers read results from stdout.

Standard library only: e2e/bootstrap_venv.py uses it before the venv exists.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TextIO

DEFAULT_INTERVAL = 30.0
INTERVAL_ENV = "GPUDRA_PROGRESS_INTERVAL"


class BuildFailed(Exception):
    """A build exited non-zero; the message is its own last error line, or where to look."""


def interval() -> float:
    """Seconds between heartbeat lines: GPUDRA_PROGRESS_INTERVAL when it is a positive
    whole number (tests set a short one), else 30."""
    raw = os.environ.get(INTERVAL_ENV, "")
    return float(raw) if raw.isdigit() and int(raw) > 0 else DEFAULT_INTERVAL


def duration(seconds: float) -> str:
    """75 -> `1m15s`, as e2e/progress.sh writes it."""
    s = int(seconds)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s"


@contextlib.contextmanager
def step(what: str, why: str, eta: str, out: TextIO | None = None) -> Iterator[None]:
    """Prints `what` with `why` and the first run's `eta`, a heartbeat while the body runs,
    and `done in`/`failed after` with the time it took."""
    stream = out or sys.stderr

    def say(line: str) -> None:
        print(line, file=stream, flush=True)

    start = time.monotonic()
    say(f"{what}: {why} (first run: {eta})")
    stop = threading.Event()

    def beat() -> None:
        every = interval()
        while not stop.wait(every):
            say(f"  still {what} ({duration(time.monotonic() - start)})")

    ticker = threading.Thread(target=beat, name="progress", daemon=True)
    ticker.start()
    try:
        yield
    except BaseException:
        stop.set()
        ticker.join()
        say(f"{what}: failed after {duration(time.monotonic() - start)}")
        raise
    stop.set()
    ticker.join()
    say(f"{what}: done in {duration(time.monotonic() - start)}")


def run_build(
    argv: list[str],
    *,
    prefix: str,
    what: str,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> str:
    """Runs a build (a script of e2e/) and returns its stdout; its stderr, the build's
    progress, goes on to ours as it comes. On failure, BuildFailed carries the build's
    last `<prefix>: ...` line without the prefix, or says to look above."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=dict(env) if env is not None else None,
    )
    errors: list[str] = []
    mark = f"{prefix}:"

    def forward() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.startswith(mark):
                errors.append(line.removeprefix(mark).strip())

    relay = threading.Thread(target=forward, name="build-stderr", daemon=True)
    relay.start()
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        proc.kill()

    timer = threading.Timer(timeout, kill) if timeout is not None else None
    if timer is not None:
        timer.start()
    try:
        assert proc.stdout is not None
        stdout = proc.stdout.read()
        proc.wait()
        relay.join()
    finally:
        if timer is not None:
            timer.cancel()
    if killed.is_set():
        raise BuildFailed(f"{what} took longer than {timeout}s (see above)")
    if proc.returncode != 0:
        raise BuildFailed(errors[-1] if errors else f"{what} failed (see above)")
    return stdout


def build_script(
    script: Path, *, prefix: str, what: str, env: Mapping[str, str] | None = None
) -> Path:
    """The path a build script of e2e/ prints last on stdout (a bin dir or a binary)."""
    out = run_build(["bash", str(script)], prefix=prefix, what=what, env=env)
    lines = out.strip().splitlines()
    if not lines:
        raise BuildFailed(f"{script.name} printed no path on stdout")
    return Path(lines[-1])
