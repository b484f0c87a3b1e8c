"""Sharing a GPU between the containers of one claim: time-slicing and MPS.

Neither goes through NVML: NVML has no call for the time-slice length, and MPS is a
daemon, not an API. So, like the upstream NVIDIA DRA driver, the backend runs
NVIDIA's own tools:

- time-slicing: `nvidia-smi -i <uuid> -c DEFAULT`, then `nvidia-smi compute-policy
  -i <uuid> --set-timeslice <0-3>` (Default/Short/Medium/Long), reset to 0 when the
  claim is unprepared. `compute-policy` needs an Ampere or newer GPU and a recent
  driver; on older GPUs (Turing and before) nvidia-smi refuses it, and the error
  says so rather than leaving the GPU silently unchanged.
- MPS: one control daemon per claim, `nvidia-cuda-mps-control -d` with its own
  `CUDA_MPS_PIPE_DIRECTORY`/`CUDA_MPS_LOG_DIRECTORY`, so claims never share a
  daemon; defaults (`set_default_active_thread_percentage`,
  `set_default_device_pinned_mem_limit`) are sent through its control pipe, and
  `quit` stops it.

Every call blocks (it runs a process) and is meant for a worker thread. Nothing here
knows about claims beyond the names it is given, nor about Kubernetes or gRPC.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

__all__ = [
    "MPS_CONTROL",
    "NVIDIA_SMI",
    "TOOL_DIRS",
    "MpsDaemon",
    "NvidiaSharing",
    "SharingBackend",
    "SharingError",
    "find_tool",
]

log = logging.getLogger(__name__)

NVIDIA_SMI: Final = "nvidia-smi"
MPS_CONTROL: Final = "nvidia-cuda-mps-control"
# Where a driver installation keeps its tools, relative to the driver root.
TOOL_DIRS: Final = ("usr/bin", "usr/local/bin", "bin", "usr/sbin", "sbin")
# nvidia-smi compute-policy --set-timeslice takes 0 (Default) to 3 (Long).
MAX_TIME_SLICE: Final = 3
_MIB: Final = 1024 * 1024
# The control daemon creates this named pipe in its pipe directory once it listens.
_CONTROL_PIPE: Final = "control"
_PID_FILE: Final = "nvidia-cuda-mps-control.pid"
_OUTPUT_TAIL: Final = 500


class SharingError(RuntimeError):
    """A sharing setting could not be applied or undone; the message names the GPU."""


@dataclass(frozen=True, slots=True)
class MpsDaemon:
    """One MPS control daemon: everything needed to start it and, later, to stop it.

    `pinned_memory_limits` are bytes per device UUID; MPS takes whole MiB, so they
    are rounded down (the config layer refuses limits below 1 MiB).
    """

    name: str
    pipe_dir: Path
    log_dir: Path
    device_uuids: tuple[str, ...]
    active_thread_percentage: int | None = None
    pinned_memory_limits: Mapping[str, int] = field(default_factory=dict)


class SharingBackend(Protocol):
    """What the device layer needs to share a GPU. All calls block; all undo calls are
    idempotent, because rollback and unprepare retry them after crashes."""

    def set_time_slice(self, gpu_uuid: str, interval: int) -> None:
        """Apply time-slice `interval` (0 Default, 1 Short, 2 Medium, 3 Long)."""
        ...

    def reset_time_slice(self, gpu_uuid: str) -> None:
        """Put the GPU back to the default time-slice."""
        ...

    def start_mps(self, daemon: MpsDaemon) -> None:
        """Start the daemon (or adopt one already running in its pipe dir) and apply
        its defaults."""
        ...

    def stop_mps(self, daemon: MpsDaemon) -> None:
        """Stop the daemon if it runs and remove its directories."""
        ...


def find_tool(name: str, driver_root: Path = Path("/")) -> Path | None:
    """`name` in the driver root's tool folders first, then on PATH.

    The driver root comes first because with a containerised driver
    (`/run/nvidia/driver`) the tools on PATH, if any, may not match the running
    kernel module.
    """
    for folder in TOOL_DIRS:
        candidate = driver_root / folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def _tail(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _OUTPUT_TAIL else "..." + text[-_OUTPUT_TAIL:]


class NvidiaSharing:
    """`SharingBackend` that runs nvidia-smi and nvidia-cuda-mps-control.

    Paths given explicitly win; otherwise each tool is looked up on first use (see
    `find_tool`), so a node without MPS tools still serves claims that do not ask
    for MPS, and the error appears only on a claim that needs the missing tool.
    `env` is added to every tool's environment.
    """

    def __init__(
        self,
        *,
        driver_root: Path = Path("/"),
        nvidia_smi: Path | None = None,
        mps_control: Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
        ready_timeout_s: float = 10.0,
    ) -> None:
        self._driver_root = driver_root
        self._env = dict(env or {})
        self._paths: dict[str, Path | None] = {NVIDIA_SMI: nvidia_smi, MPS_CONTROL: mps_control}
        self._timeout_s = timeout_s
        self._ready_timeout_s = ready_timeout_s

    # --- plumbing ---

    def _tool(self, name: str, purpose: str) -> Path:
        path = self._paths.get(name) or find_tool(name, self._driver_root)
        if path is None:
            dirs = ", ".join(str(self._driver_root / d) for d in TOOL_DIRS)
            raise SharingError(
                f"{purpose}: {name} not found in {dirs} or on PATH; install the NVIDIA "
                f"driver utilities on the node, or pass the path of {name} explicitly"
            )
        return path

    def _run(
        self,
        argv: Sequence[str],
        purpose: str,
        *,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
    ) -> str:
        full_env = {**os.environ, **self._env, **(env or {})}
        try:
            done = subprocess.run(
                list(argv),
                input=stdin,
                capture_output=True,
                text=True,
                env=full_env,
                timeout=self._timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise SharingError(
                f"{purpose}: {' '.join(argv)} did not finish within {self._timeout_s:.0f}s"
            ) from None
        except OSError as exc:
            raise SharingError(f"{purpose}: cannot run {argv[0]}: {exc}") from None
        if done.returncode != 0:
            output = _tail(done.stderr or done.stdout or "")
            raise SharingError(
                f"{purpose}: {' '.join(argv)} exited with status {done.returncode}"
                + (f": {output}" if output else "")
            )
        return done.stdout

    # --- time-slicing ---

    def set_time_slice(self, gpu_uuid: str, interval: int) -> None:
        if not 0 <= interval <= MAX_TIME_SLICE:
            raise SharingError(
                f"time-slice interval {interval} for GPU {gpu_uuid} is not between 0 and "
                f"{MAX_TIME_SLICE}"
            )
        smi = str(self._tool(NVIDIA_SMI, f"time-slicing GPU {gpu_uuid}"))
        self._run(
            [smi, "-i", gpu_uuid, "-c", "DEFAULT"],
            f"setting compute mode DEFAULT on GPU {gpu_uuid} for time-slicing",
        )
        try:
            self._run(
                [smi, "compute-policy", "-i", gpu_uuid, "--set-timeslice", str(interval)],
                f"setting time-slice {interval} on GPU {gpu_uuid}",
            )
        except SharingError as exc:
            raise SharingError(
                f"{exc}; time-slice intervals need an Ampere or newer GPU and a driver "
                "with `nvidia-smi compute-policy` (older GPUs cannot change it): remove "
                "the timeSlicingConfig interval for this GPU"
            ) from None
        log.info("time-slice set", extra={"fields": {"gpu": gpu_uuid, "interval": interval}})

    def reset_time_slice(self, gpu_uuid: str) -> None:
        smi = str(self._tool(NVIDIA_SMI, f"resetting the time-slice of GPU {gpu_uuid}"))
        self._run(
            [smi, "compute-policy", "-i", gpu_uuid, "--set-timeslice", "0"],
            f"resetting the time-slice of GPU {gpu_uuid}",
        )

    # --- MPS ---

    @staticmethod
    def _mps_env(daemon: MpsDaemon) -> dict[str, str]:
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(daemon.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(daemon.log_dir),
            "CUDA_VISIBLE_DEVICES": ",".join(daemon.device_uuids),
        }

    def _control(self, daemon: MpsDaemon, command: str, purpose: str) -> str:
        tool = str(self._tool(MPS_CONTROL, purpose))
        return self._run([tool], purpose, env=self._mps_env(daemon), stdin=command + "\n")

    @staticmethod
    def _alive(daemon: MpsDaemon) -> bool | None:
        """Whether the daemon's recorded process exists (None: no PID file to tell)."""
        try:
            pid = int((daemon.pipe_dir / _PID_FILE).read_text(encoding="ascii").strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _running(self, daemon: MpsDaemon) -> bool:
        """A control pipe whose daemon has not died (a crash or reboot leaves stale pipes)."""
        return (daemon.pipe_dir / _CONTROL_PIPE).exists() and self._alive(daemon) is not False

    def start_mps(self, daemon: MpsDaemon) -> None:
        gpus = ", ".join(daemon.device_uuids)
        purpose = f"starting the MPS control daemon {daemon.name} for {gpus}"
        tool = str(self._tool(MPS_CONTROL, purpose))
        for folder in (daemon.pipe_dir, daemon.log_dir):
            folder.mkdir(mode=0o755, parents=True, exist_ok=True)
        if self._running(daemon):
            # A retry after a crash: the daemon from the first attempt still listens.
            log.info("adopting running MPS daemon", extra={"fields": {"daemon": daemon.name}})
        else:
            for stale in (_CONTROL_PIPE, _PID_FILE):
                (daemon.pipe_dir / stale).unlink(missing_ok=True)
            self._run([tool, "-d"], purpose, env=self._mps_env(daemon))
            self._wait_for_pipe(daemon, purpose)
        try:
            if daemon.active_thread_percentage is not None:
                self._control(
                    daemon,
                    f"set_default_active_thread_percentage {daemon.active_thread_percentage}",
                    f"setting the MPS active thread percentage for {gpus}",
                )
            for uuid, limit in daemon.pinned_memory_limits.items():
                self._control(
                    daemon,
                    f"set_default_device_pinned_mem_limit {uuid} {limit // _MIB}M",
                    f"setting the MPS pinned memory limit of {uuid}",
                )
        except SharingError:
            self._quit_quietly(daemon)
            raise
        log.info(
            "MPS daemon started",
            extra={"fields": {"daemon": daemon.name, "pipeDir": str(daemon.pipe_dir)}},
        )

    def _wait_for_pipe(self, daemon: MpsDaemon, purpose: str) -> None:
        """`-d` returns once the daemon forked; it listens a moment later."""
        deadline = time.monotonic() + self._ready_timeout_s
        while not (daemon.pipe_dir / _CONTROL_PIPE).exists():
            if time.monotonic() >= deadline:
                raise SharingError(
                    f"{purpose}: the daemon did not create its control pipe "
                    f"{daemon.pipe_dir / _CONTROL_PIPE} within {self._ready_timeout_s:.0f}s; "
                    f"see the logs in {daemon.log_dir}"
                )
            time.sleep(0.02)

    def _quit_quietly(self, daemon: MpsDaemon) -> None:
        try:
            self._control(daemon, "quit", f"stopping MPS daemon {daemon.name}")
        except SharingError as exc:
            log.warning(
                "could not stop MPS daemon after a failed start",
                extra={"fields": {"daemon": daemon.name, "error": str(exc)}},
            )

    def stop_mps(self, daemon: MpsDaemon) -> None:
        purpose = f"stopping the MPS control daemon {daemon.name}"
        if self._running(daemon):
            try:
                self._control(daemon, "quit", purpose)
            except SharingError:
                if self._alive(daemon):
                    raise
                # Nothing answers and no live process is recorded: it died already.
                log.warning(
                    "MPS daemon did not answer and is not running; removing its files",
                    extra={"fields": {"daemon": daemon.name}},
                )
        for folder in (daemon.pipe_dir, daemon.log_dir):
            shutil.rmtree(folder, ignore_errors=True)
        log.info("MPS daemon stopped", extra={"fields": {"daemon": daemon.name}})
