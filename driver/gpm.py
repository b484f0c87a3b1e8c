"""A MIG device's own SM utilization, through GPM (GPU performance metrics).

NVML's plain utilization call answers NOT_SUPPORTED for a MIG device, and the parent
GPU's figure says nothing about one instance. On Hopper and newer GPUs, GPM measures
each GPU instance: two samples taken some time apart give the share of the instance's
SMs that were busy in between. `MigUtilization` keeps each MIG device's last sample,
so every sampling pass yields the utilization over the whole interval since the
previous pass, the same span the whole-GPU figure averages NVML's utilization samples
over (`gpudra.driver.utilization`); the first pass after a MIG device appears has
nothing to compare with yet. Where GPM is not supported (Ampere and older) the NVML
error goes to the caller, which reports the value as unavailable with that reason.

The span is the same, the figure is not. The whole-GPU figure is the percent of time
one or more kernels ran (`nvmlUtilization_t.gpu`), however few SMs they used; this one
is `NVML_GPM_METRIC_SM_UTIL`, the percent of the instance's SMs that were busy, so one
small kernel running all the time reads near 100 % on a whole GPU and its SMs' share
here. GPM's `NVML_GPM_METRIC_GRAPHICS_UTIL` ("percentage of time any compute/graphics
app was active") would match the whole-GPU definition, but NVML documents
`nvmlGpmMigSampleGet` without saying which metrics a GPU instance's samples give, so
the agent keeps the SM figure it has always read rather than switch on a promise NVML
does not make. The idle threshold, one for both, therefore reads a MIG device's light
but steady work as idle sooner than a whole GPU's (docs/monitoring.md says so).

Samples are NVML allocations: each is freed once compared, and those of devices no
longer sampled at the end of a pass (`retain`). Not thread-safe: the sampler calls it
from one pass at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pynvml
from gpudra.driver.nvml import NvmlLibrary

__all__ = ["MigUtilization"]


class MigUtilization:
    """The GPM samples of the MIG devices sampled so far, by MIG device UUID."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}

    def read(self, nvml: NvmlLibrary, mig_handle: Any, mig_uuid: str) -> float | None:
        """SM utilization (percent) of the MIG device since the previous `read` of it;
        None on the first. Raises pynvml's NVMLError (NOT_SUPPORTED without GPM)."""
        parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig_handle)
        if not nvml.nvmlGpmQueryDeviceSupport(parent).isSupportedDevice:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        instance = nvml.nvmlDeviceGetGpuInstanceId(mig_handle)
        sample = nvml.nvmlGpmSampleAlloc()
        try:
            nvml.nvmlGpmMigSampleGet(parent, instance, sample)
        except pynvml.NVMLError:
            nvml.nvmlGpmSampleFree(sample)
            raise
        previous = self._last.pop(mig_uuid, None)
        self._last[mig_uuid] = sample
        if previous is None:
            return None
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1 = previous
        request.sample2 = sample
        request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
        try:
            nvml.nvmlGpmMetricsGet(request)
        finally:
            nvml.nvmlGpmSampleFree(previous)
        metric = request.metrics[0]
        if metric.nvmlReturn != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(metric.nvmlReturn)
        return float(metric.value)

    def retain(self, nvml: NvmlLibrary, mig_uuids: Iterable[str]) -> None:
        """Free the samples of MIG devices not in `mig_uuids` (destroyed, or no longer
        sampled)."""
        keep = set(mig_uuids)
        for uuid in [u for u in self._last if u not in keep]:
            nvml.nvmlGpmSampleFree(self._last.pop(uuid))
