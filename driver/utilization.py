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
timestamp it has seen, and each pass averages the samples taken since.

The plain mean of those samples is the time-weighted mean: the driver takes them one
sample period apart, each covering the period before it. It also holds when the
buffer lost samples between two passes (an interval longer than the buffer holds),
where weighting by the gap to the previous seen sample would give the oldest survivor
the weight of the time lost; the figure then covers the part of the interval the
buffer still held.

Where there is nothing to average, the figure is the rates call's, as before: on the
first pass for a GPU (the buffer then holds time from before this sampler, which no
interval of its own covers), when no sample is newer than the last seen
(NVML_ERROR_NOT_FOUND), and where the samples call is not there (NOT_SUPPORTED,
FUNCTION_NOT_FOUND). A MIG-enabled GPU supports neither call for these figures
(nvml.h), and a MIG device's own utilization comes from GPM (`gpudra.driver.gpm`).
Not thread-safe: the sampler calls it from one pass at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import pynvml
from gpudra.driver.nvml import NvmlLibrary

__all__ = ["GpuUtilization", "utilization_rates"]

# Answers that mean "no samples to average here", not "no figure".
_NO_SAMPLES: Final = frozenset(
    {
        pynvml.NVML_ERROR_NOT_FOUND,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    }
)


def utilization_rates(nvml: NvmlLibrary, handle: Any) -> tuple[float, float]:
    """(utilization, memory utilization) in percent over the GPU's last sample period."""
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    return float(rates.gpu), float(rates.memory)


class GpuUtilization:
    """The newest sample timestamp seen of each GPU's utilization figures."""

    def __init__(self) -> None:
        self._last_seen: dict[tuple[str, int], int] = {}

    def read(self, nvml: NvmlLibrary, handle: Any, gpu_uuid: str) -> tuple[float, float]:
        """(utilization, memory utilization) in percent: each the mean of the GPU's
        samples since the previous `read` of it, else the rates call's figure.

        Raises pynvml's NVMLError where neither call gives a figure.
        """
        gpu = self._average(nvml, handle, gpu_uuid, pynvml.NVML_GPU_UTILIZATION_SAMPLES)
        memory = self._average(nvml, handle, gpu_uuid, pynvml.NVML_MEMORY_UTILIZATION_SAMPLES)
        if gpu is not None and memory is not None:
            return gpu, memory
        rates = utilization_rates(nvml, handle)
        return (
            rates[0] if gpu is None else gpu,
            rates[1] if memory is None else memory,
        )

    def _average(self, nvml: NvmlLibrary, handle: Any, gpu_uuid: str, kind: int) -> float | None:
        key = (gpu_uuid, kind)
        last = self._last_seen.get(key)
        try:
            # nvml.h: utilization samples are unsigned ints (`uiVal`).
            _value_type, samples = nvml.nvmlDeviceGetSamples(handle, kind, last or 0)
        except pynvml.NVMLError as err:
            if err.value in _NO_SAMPLES:
                return None
            raise
        if not samples:  # NOT_FOUND is how NVML says so; an empty answer means the same
            return None
        self._last_seen[key] = max(s.timeStamp for s in samples)
        if last is None:
            return None
        return sum(float(s.sampleValue.uiVal) for s in samples) / len(samples)

    def retain(self, gpu_uuids: Iterable[str]) -> None:
        """Forget the GPUs not in `gpu_uuids` (gone, or no longer sampled)."""
        keep = set(gpu_uuids)
        for key in [k for k in self._last_seen if k[0] not in keep]:
            del self._last_seen[key]
