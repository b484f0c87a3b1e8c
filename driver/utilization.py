"""A whole GPU's utilization over the sampling interval, from NVML's sample buffer.

`nvmlDeviceGetUtilizationRates` answers the percent of time one or more kernels ran
"over the past sample period", a period "between 1 second and 1/6 second depending on
the product" (nvml.h). Read once per sampling interval, it would decide a whole interval
busy or idle from its last second or less: a job that computes 95 % of the time but is
between kernels at each reading is billed idle, and one that times a burst to each
reading is not. The driver keeps those per-period figures, each with its CPU timestamp
in microseconds, in a buffer that `nvmlDeviceGetSamples` reads (Kepler and newer):
`NVML_GPU_UTILIZATION_SAMPLES` and `NVML_MEMORY_UTILIZATION_SAMPLES` give the same two
figures as the rates call. `GpuUtilization` keeps, per GPU and figure, the newest
timestamp it has seen and the samples taken since the previous pass, and each pass
averages them.

The buffer is short: nvml.h leaves its size open, and an H200 on R580 held 71 samples
200 ms apart, 14 s, on every read (docs/gpus.md). A pass that read it only once per
`--sample-interval` of 30 s would average the interval's last 14 s and lose the rest:
work at the start of each interval billed as idle, a burst at its end hiding an idle
GPU. So between passes the sampler reads the buffer again every `TOP_UP_EVERY_S`
(`top_up`), well within what it holds, and the pass averages everything read since the
previous pass: its figure is the same as if the buffer had held the whole interval,
whatever the interval. At the default 10 s interval no read is added.

The plain mean of those samples is the time-weighted mean: the driver takes them one
sample period apart, each covering the period before it. Where the buffer lost samples
all the same (a read late by more than the buffer holds), weighting by the gap to the
previous seen sample would give the oldest survivor the weight of the time lost; the
figure then covers the part of the interval the buffer still held.

Where there is nothing to average, the figure is the rates call's, as before: on the
first pass for a GPU (the buffer then holds time from before this sampler, which no
interval of its own covers), when no sample is newer than the last seen
(NVML_ERROR_NOT_FOUND), and where the samples call is not there (NOT_SUPPORTED,
FUNCTION_NOT_FOUND). A MIG-enabled GPU supports neither call for these figures
(nvml.h), and a MIG device's own utilization comes from GPM (`gpudra.driver.gpm`).

The timestamps are the node's wall clock, which can step back (an NTP step, a clock
fixed by hand): the newest timestamp seen is then in the future, no sample is newer
for as long as the step, and every pass would take the rates call. A newest seen
timestamp more than `AHEAD_MARGIN_S` ahead of the wall clock is therefore dropped,
once, with a warning: that read starts afresh as a first pass does, and samples
stamped in the future (taken before the step) are not averaged.

Not thread-safe: the sampler calls it from one pass or read at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import pynvml
from gpudra.driver.nvml import NvmlLibrary

__all__ = ["AHEAD_MARGIN_S", "TOP_UP_EVERY_S", "GpuUtilization", "utilization_rates"]

log = logging.getLogger(__name__)

# Seconds between reads of a GPU's sample buffer where the sampling interval is longer:
# within the 14 s an H200's buffer held, with 4 s of room for a slow read. A product
# sampling at nvml.h's shortest period, 1/6 s, into a buffer as long would hold 11.8 s.
TOP_UP_EVERY_S: Final = 10.0
# How far a sample timestamp may be ahead of the wall clock before the clock is taken
# to have stepped back (a sample is taken before it is read, so never ahead at all).
AHEAD_MARGIN_S: Final = 2.0

# Answers that mean "no samples to average here", not "no figure".
_NO_SAMPLES: Final = frozenset(
    {
        pynvml.NVML_ERROR_NOT_FOUND,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    }
)
_KINDS: Final = (pynvml.NVML_GPU_UTILIZATION_SAMPLES, pynvml.NVML_MEMORY_UTILIZATION_SAMPLES)


def utilization_rates(nvml: NvmlLibrary, handle: Any) -> tuple[float, float]:
    """(utilization, memory utilization) in percent over the GPU's last sample period."""
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    return float(rates.gpu), float(rates.memory)


@dataclass(slots=True)
class _Window:
    """One GPU's samples of one figure since the previous pass: the newest timestamp
    seen (microseconds), and the sum and count of the values read since the pass."""

    last: int
    total: float = 0.0
    count: int = 0


class GpuUtilization:
    """The samples of each GPU's utilization figures read since the previous pass.

    `wall_clock` is the clock of NVML's sample timestamps: the node's wall clock.
    """

    def __init__(self, *, wall_clock: Callable[[], float] = time.time) -> None:
        self._windows: dict[tuple[str, int], _Window] = {}
        self._wall_clock = wall_clock

    def read(self, nvml: NvmlLibrary, handle: Any, gpu_uuid: str) -> tuple[float, float]:
        """(utilization, memory utilization) in percent: each the mean of the GPU's
        samples since the previous `read` of it (with those `top_up` read meanwhile),
        else the rates call's figure.

        Raises pynvml's NVMLError where neither call gives a figure.
        """
        restarted = self._check_clock(gpu_uuid)
        gpu, memory = (self._mean(nvml, handle, gpu_uuid, kind, restarted) for kind in _KINDS)
        if gpu is not None and memory is not None:
            return gpu, memory
        rates = utilization_rates(nvml, handle)
        return (
            rates[0] if gpu is None else gpu,
            rates[1] if memory is None else memory,
        )

    def top_up(self, nvml: NvmlLibrary, handle: Any, gpu_uuid: str) -> None:
        """Take the GPU's samples since the last seen into the coming pass's mean,
        before the buffer drops them. Only for a GPU a pass has read (the first pass
        starts its window); an NVML error is left for the pass to read and report."""
        restarted = self._check_clock(gpu_uuid)
        for kind in _KINDS:
            if (gpu_uuid, kind) in self._windows:
                try:
                    self._take(nvml, handle, gpu_uuid, kind, restarted)
                except pynvml.NVMLError:
                    continue

    def gpus(self) -> frozenset[str]:
        """The GPUs a pass has read and not forgotten: those `top_up` reads."""
        return frozenset(uuid for uuid, _kind in self._windows)

    def retain(self, gpu_uuids: Iterable[str]) -> None:
        """Forget the GPUs not in `gpu_uuids` (gone, or no longer sampled)."""
        keep = set(gpu_uuids)
        for key in [k for k in self._windows if k[0] not in keep]:
            del self._windows[key]

    def _now_us(self) -> int:
        return round(self._wall_clock() * 1_000_000)

    def _check_clock(self, gpu_uuid: str) -> bool:
        """Drop the GPU's windows whose newest timestamp is ahead of the wall clock (it
        stepped back), with a warning; whether any was."""
        now_us = self._now_us()
        ahead = [
            (key, window.last)
            for key, window in self._windows.items()
            if key[0] == gpu_uuid and window.last > now_us + AHEAD_MARGIN_S * 1_000_000
        ]
        if not ahead:
            return False
        newest = max(last for _key, last in ahead)
        log.warning(
            "the newest utilization sample seen of a GPU is ahead of the wall clock, which "
            "must have stepped back: averaging its samples afresh from now",
            extra={
                "fields": {
                    "gpu": gpu_uuid,
                    "last_sample_us": newest,
                    "wall_clock_us": now_us,
                    "ahead_s": (newest - now_us) / 1_000_000,
                }
            },
        )
        for key, _last in ahead:
            del self._windows[key]
        return True

    def _take(
        self, nvml: NvmlLibrary, handle: Any, gpu_uuid: str, kind: int, restarted: bool
    ) -> _Window | None:
        """The GPU's window of `kind` with the samples since the newest seen added; None
        where it had none (the first read, or the first since the clock stepped back),
        which starts one from the newest sample (or from now, after a step back)."""
        key = (gpu_uuid, kind)
        window = self._windows.get(key)
        now_us = self._now_us()
        try:
            # nvml.h: utilization samples are unsigned ints (`uiVal`).
            _value_type, answered = nvml.nvmlDeviceGetSamples(
                handle, kind, window.last if window is not None else 0
            )
        except pynvml.NVMLError as err:
            if err.value not in _NO_SAMPLES:
                raise
            answered = []  # NOT_FOUND is how NVML says none is newer
        # A sample stamped in the future was taken before the wall clock stepped back.
        samples = [s for s in answered if s.timeStamp <= now_us + AHEAD_MARGIN_S * 1_000_000]
        if window is None:
            if samples or restarted:
                newest = max((int(s.timeStamp) for s in samples), default=now_us)
                self._windows[key] = _Window(newest)
            return None
        if samples:
            window.last = max(window.last, *(int(s.timeStamp) for s in samples))
            window.total += sum(float(s.sampleValue.uiVal) for s in samples)
            window.count += len(samples)
        return window

    def _mean(
        self, nvml: NvmlLibrary, handle: Any, gpu_uuid: str, kind: int, restarted: bool
    ) -> float | None:
        """The mean of the window's samples, which starts again empty; None where it has
        none. On an NVML error the window starts again empty too: its samples belong to
        an interval that gets no figure."""
        try:
            window = self._take(nvml, handle, gpu_uuid, kind, restarted)
        except pynvml.NVMLError:
            self._empty(gpu_uuid, kind)
            raise
        if window is None or not window.count:
            return None
        mean = window.total / window.count
        self._empty(gpu_uuid, kind)
        return mean

    def _empty(self, gpu_uuid: str, kind: int) -> None:
        window = self._windows.get((gpu_uuid, kind))
        if window is not None:
            window.total, window.count = 0.0, 0
