"""Scriptable telemetry of emulated GPUs: utilization, memory, temperature, power, clock, ECC.

Monitoring and accounting read these values through the very NVML calls they make on a
real node (`nvmlDeviceGetUtilizationRates`, `nvmlDeviceGetMemoryInfo`, ...), so every
metric and alert is tested through the production code path. Each GPU's values come from
three places, the later winning:

1. the profile: a GPU's `telemetry` field (`TelemetrySpec`), where each value is a
   number or a list of `[seconds, value]` steps counted from the emulator's start;
2. `Telemetry.script`: a test in the same process sets values (by GPU index, GPU UUID
   or MIG device UUID);
3. a script file (`--nvml-script`): a JSON object mapping those same keys to values,
   re-read whenever it changes, so a test can script an agent running in another
   process (an idle GPU held by a pod, a hot one).

What NVML does not answer for a device is answered the NVML way, so the caller's
handling of it is tested too: a MIG device has its own memory figures but no
utilization, temperature, power or clock of its own (NOT_SUPPORTED, never the parent's
numbers), and `unsupported` makes a GPU refuse a call as older GPUs do. A MIG device's
own SM utilization comes only through GPM on Hopper and newer, as on real GPUs.

A GPU's utilization figures are also kept as NVML's driver keeps them for
`nvmlDeviceGetSamples`: one sample every `SAMPLE_PERIOD_US`, the newest `SAMPLE_RING` of
them (`Telemetry.samples`), so a profile's steps within a sampling interval show in
what the agent averages over it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Final, Literal, TypeAlias

import pynvml
from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "SAMPLE_PERIOD_US",
    "SAMPLE_RING",
    "SCRIPTABLE",
    "ScriptError",
    "Telemetry",
    "TelemetrySpec",
]

Quantity: TypeAlias = Annotated[float, Field(ge=0)]
Step: TypeAlias = tuple[Annotated[float, Field(ge=0)], Quantity]
Signal: TypeAlias = Quantity | tuple[Step, ...]
# What a test or the profile may set; the NVML call each value answers is in its comment.
Scriptable: TypeAlias = Literal[
    "utilization",  # nvmlDeviceGetUtilizationRates().gpu, GPU_UTILIZATION samples; percent
    "memoryUtilization",  # ...().memory, MEMORY_UTILIZATION samples; percent
    "memoryUsed",  # nvmlDeviceGetMemoryInfo().used, bytes
    "temperature",  # nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU), degrees C
    "power",  # nvmlDeviceGetPowerUsage(), watts (NVML answers milliwatts)
    "smClock",  # nvmlDeviceGetClockInfo(NVML_CLOCK_SM), MHz
    "eccCorrected",  # nvmlDeviceGetTotalEccErrors(CORRECTED, VOLATILE)
    "eccUncorrected",  # nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE)
]
SCRIPTABLE: Final[tuple[str, ...]] = (
    "utilization",
    "memoryUtilization",
    "memoryUsed",
    "temperature",
    "power",
    "smClock",
    "eccCorrected",
    "eccUncorrected",
)
_PERCENT: Final = frozenset({"utilization", "memoryUtilization"})
# What a MIG device answers itself; every other value is the parent GPU's alone.
_PER_MIG: Final = frozenset({"memoryUsed"})
# What a MIG device may be scripted with besides: its SM utilization, which NVML gives
# only through GPM (`nvmlGpmMigSampleGet`, Hopper and newer), never the plain call.
_GPM_PER_MIG: Final = frozenset({"utilization"})
# nvml.h: the driver samples utilization once per sample period, "between 1 second and
# 1/6 second depending on the product", and leaves the size of the buffer open. Emulated
# GPUs all keep what a real H200 on R580 held (e2e/gpu_node_check.py, `sample_buffer`):
# 71 samples 200 ms apart, 14 s, on every read, idle or busy, for the GPU's and the
# memory's utilization alike.
SAMPLE_PERIOD_US: Final = 200_000
SAMPLE_RING: Final = 71


class TelemetrySpec(BaseModel):
    """One GPU's telemetry in a profile: a number each, or `[seconds, value]` steps.

    Steps hold from their time (seconds since the emulator started) until the next
    one; the last holds for ever. `memoryUsed` unset: the product's `memoryUsed`.
    `unsupported` lists values whose NVML call answers NOT_SUPPORTED on this GPU.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    utilization: Signal = 0.0
    memoryUtilization: Signal = 0.0
    memoryUsed: Signal | None = None
    temperature: Signal = 35.0
    power: Signal = 60.0
    smClock: Signal = 1410.0
    eccCorrected: Annotated[int, Field(ge=0)] = 0
    eccUncorrected: Annotated[int, Field(ge=0)] = 0
    unsupported: tuple[Scriptable, ...] = ()

    @field_validator("utilization", "memoryUtilization")
    @classmethod
    def _percent(cls, value: Signal) -> Signal:
        values = [value] if isinstance(value, float | int) else [v for _t, v in value]
        if any(v > 100 for v in values):
            msg = "a utilization is a percentage: 0 to 100"
            raise ValueError(msg)
        return value

    @field_validator(
        "utilization", "memoryUtilization", "memoryUsed", "temperature", "power", "smClock"
    )
    @classmethod
    def _steps_in_order(cls, value: Signal | None) -> Signal | None:
        if isinstance(value, tuple):
            if not value:
                msg = "give a number or at least one [seconds, value] step"
                raise ValueError(msg)
            times = [t for t, _v in value]
            if times != sorted(times) or len(set(times)) != len(times):
                msg = f"step times must increase, got {times}"
                raise ValueError(msg)
        return value


@dataclass(slots=True)
class _Ring:
    """One GPU's samples of one figure: (timestamp in microseconds, value), oldest
    first, and the number of sample periods since the start it has been taken up to."""

    samples: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=SAMPLE_RING))
    taken: int = 0


class ScriptError(ValueError):
    """A script (call or file) that cannot be applied; the message names the key and value."""


def _at(signal: Signal, elapsed: float) -> float:
    if not isinstance(signal, tuple):
        return float(signal)
    current = signal[0][1]
    for when, value in signal:
        if when > elapsed:
            break
        current = value
    return float(current)


def _not_supported() -> Exception:
    err: Exception = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return err


class Telemetry:
    """The live telemetry of one emulated node; the emulator answers NVML from it.

    Thread-safe on its own lock, so the emulator's NVML calls and a test's `script`
    may come from any thread.
    """

    def __init__(
        self,
        gpus: Mapping[str, TelemetrySpec],
        *,
        index: Mapping[int, str] | None = None,
        product_memory_used: Mapping[str, int] | None = None,
        script_path: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`gpus` maps each GPU UUID to its spec; `index` GPU index -> UUID, so scripts
        may name GPUs by index. `clock` (seconds) is the wall clock by default, the
        clock of a real GPU's sample timestamps."""
        self._specs = dict(gpus)
        self._index = dict(index or {})
        self._product_used = dict(product_memory_used or {})
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()
        self._scripted: dict[str, dict[str, float]] = {}
        self._ecc_events: dict[str, dict[str, int]] = {}
        self._script_path = script_path
        self._file_stamp: tuple[int, int] | None = None
        self._from_file: dict[str, dict[str, float]] = {}
        self._rings: dict[tuple[str, str], _Ring] = {}

    # --- controls -----------------------------------------------------------------------

    def script(self, key: int | str, **values: float) -> None:
        """Set values of the GPU at index `key`, or the GPU or MIG device with UUID `key`.

        Names are those of `TelemetrySpec` (`SCRIPTABLE`); a MIG device takes
        `memoryUsed`, which NVML answers for it, and `utilization`, which only GPM
        measures of it (Hopper and newer).
        """
        checked = self._checked(key, values, where="script")
        with self._lock:
            self._scripted.setdefault(checked[0], {}).update(checked[1])

    def count_ecc(self, gpu_uuid: str, *, uncorrected: bool) -> None:
        """An ECC error happened on the GPU (the emulator's `inject_ecc`)."""
        name = "eccUncorrected" if uncorrected else "eccCorrected"
        with self._lock:
            counts = self._ecc_events.setdefault(gpu_uuid, {})
            counts[name] = counts.get(name, 0) + 1

    def _checked(
        self, key: int | str, values: Mapping[str, object], *, where: str
    ) -> tuple[str, dict[str, float]]:
        uuid = self._index.get(key) if isinstance(key, int) else key
        if uuid is None:
            msg = f"{where}: no GPU at index {key}; this node has {len(self._index)}"
            raise ScriptError(msg)
        is_mig = uuid.startswith("MIG-")
        if not is_mig and uuid not in self._specs:
            msg = f"{where}: {uuid!r} is no GPU of this node (give an index, GPU or MIG UUID)"
            raise ScriptError(msg)
        out: dict[str, float] = {}
        for name, raw in values.items():
            if name not in SCRIPTABLE:
                msg = f"{where}: {uuid}: unknown value {name!r}; known: {', '.join(SCRIPTABLE)}"
                raise ScriptError(msg)
            if is_mig and name not in _PER_MIG | _GPM_PER_MIG:
                msg = f"{where}: {uuid}: a MIG device has no {name} of its own; script its GPU"
                raise ScriptError(msg)
            if isinstance(raw, bool) or not isinstance(raw, int | float) or raw < 0:
                msg = f"{where}: {uuid}.{name}: {raw!r} is not a non-negative number"
                raise ScriptError(msg)
            if name in _PERCENT and raw > 100:
                msg = f"{where}: {uuid}.{name}: {raw} is not a percentage (0 to 100)"
                raise ScriptError(msg)
            out[name] = float(raw)
        return uuid, out

    def _reload(self) -> None:
        """Re-read the script file when it changed; a bad file keeps the last good one."""
        if self._script_path is None:
            return
        try:
            stat = self._script_path.stat()
        except FileNotFoundError:
            self._from_file, self._file_stamp = {}, None
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._file_stamp:
            return
        self._file_stamp = stamp
        try:
            doc = json.loads(self._script_path.read_text(encoding="utf-8"))
            if not isinstance(doc, dict):
                msg = f"{self._script_path}: want an object of GPU index or UUID -> values"
                raise ScriptError(msg)
            parsed: dict[str, dict[str, float]] = {}
            for key, values in doc.items():
                if not isinstance(values, dict):
                    msg = f"{self._script_path}: {key}: want an object of values"
                    raise ScriptError(msg)
                target: int | str = int(key) if key.isdigit() else key
                uuid, checked = self._checked(target, values, where=str(self._script_path))
                parsed.setdefault(uuid, {}).update(checked)
        except (OSError, ValueError) as err:  # ScriptError and JSON errors are ValueErrors
            raise ScriptError(str(err)) from None
        self._from_file = parsed

    # --- what NVML answers --------------------------------------------------------------

    def value(self, gpu_uuid: str, name: str, mig_uuid: str | None = None) -> float:
        """The current value of `name` for a GPU or one of its MIG devices.

        Raises pynvml's NOT_SUPPORTED where NVML would: a value the GPU lists as
        unsupported, or one a MIG device has no figure of its own for.
        """
        spec = self._specs.get(gpu_uuid, TelemetrySpec())
        if name in spec.unsupported or (mig_uuid is not None and name not in _PER_MIG):
            raise _not_supported()
        with self._lock:
            # A bad file keeps the last good script: the agent must not fail on a typo.
            with contextlib.suppress(ScriptError):
                self._reload()
            scripted = self._scripted_value(mig_uuid or gpu_uuid, name)
            events = self._ecc_events.get(gpu_uuid, {}).get(name, 0)
        if scripted is not None:
            return scripted + events
        if mig_uuid is not None:
            return 0.0
        if name in ("eccCorrected", "eccUncorrected"):
            return float(getattr(spec, name) + events)
        signal: Signal | None = getattr(spec, name)
        if signal is None:
            return float(self._product_used.get(gpu_uuid, 0))
        return _at(signal, self._clock() - self._start)

    def samples(self, gpu_uuid: str, name: str, after_us: int) -> list[tuple[int, float]]:
        """The GPU's samples of `name` (`utilization` or `memoryUtilization`) newer than
        `after_us`, oldest first, as (timestamp in microseconds, value); at most the
        newest `SAMPLE_RING`. Timestamps are the clock's, counted in microseconds.

        Samples are taken when asked for: each sample time since the last ask gets the
        profile's value at that time, or the value scripted now. A script has no time
        of its own, so it answers the whole stretch since the GPU's samples were last
        asked for: a test scripts what the coming sampling interval is, and a profile's
        steps change a value within one. Timestamps are the CPU's wall clock on a real
        GPU: a clock that steps back leaves the samples taken before the step in the
        buffer, stamped in the future, and the new ones follow at the new times. Raises
        pynvml's NOT_SUPPORTED where the GPU lists the value as unsupported.
        """
        spec = self._specs.get(gpu_uuid, TelemetrySpec())
        if name not in _PERCENT or name in spec.unsupported:
            raise _not_supported()
        signal: Signal = getattr(spec, name)
        start_us = round(self._start * 1_000_000)
        with self._lock:
            with contextlib.suppress(ScriptError):
                self._reload()
            scripted = self._scripted_value(gpu_uuid, name)
            ring = self._rings.setdefault((gpu_uuid, name), _Ring())
            now = (round(self._clock() * 1_000_000) - start_us) // SAMPLE_PERIOD_US
            if now < ring.taken:  # the clock stepped back: the driver samples on from now
                ring.taken = now - 1
            for period in range(max(ring.taken + 1, now - SAMPLE_RING + 1), now + 1):
                at_us = period * SAMPLE_PERIOD_US
                value = _at(signal, at_us / 1_000_000) if scripted is None else scripted
                ring.samples.append((start_us + at_us, value))
            ring.taken = max(ring.taken, now)
            return [s for s in ring.samples if s[0] > after_us]

    def mig_sm_utilization(self, gpu_uuid: str, mig_uuids: Iterable[str]) -> float:
        """What GPM measures of a GPU instance's SMs: the utilization scripted for one of
        its MIG devices, else its GPU's."""
        with self._lock:
            with contextlib.suppress(ScriptError):
                self._reload()
            for mig_uuid in mig_uuids:
                scripted = self._scripted_value(mig_uuid, "utilization")
                if scripted is not None:
                    return scripted
        return self.value(gpu_uuid, "utilization")

    def _scripted_value(self, key: str, name: str) -> float | None:
        """A value the script file or a test set for GPU or MIG device `key` (the file
        first); call with the lock held."""
        for source in (self._from_file, self._scripted):
            if name in source.get(key, {}):
                return source[key][name]
        return None

    def check_file(self) -> None:
        """Raise `ScriptError` if the script file cannot be applied (for a clear start-up
        error; later changes that fail are ignored until fixed)."""
        with self._lock:
            self._file_stamp = None
            self._reload()
