"""NVML's unrepairable-memory flag, read the same way whichever layout the library uses.

`nvmlDeviceGetUnrepairableMemoryFlag_v1` (R590 and later, Hopper and newer: "whether or
not there is unrepairable memory", NVML change log) fills a struct that NVIDIA publishes
in two shapes. Every `nvml.h` since NVML 13.1 (R590), the one the library is built from,
declares `nvmlUnrepairableMemoryStatus_v1_t` as a single `unsigned int
bUnrepairableMemory`, with no version field and no version macro. NVIDIA's own Python
binding (nvidia-ml-py 13.590.44 to 13.615.71) declares it as `version` followed by the
flag, sets the version to `nvmlUnrepairableMemory_v1` (0x1000008: version 1, 8 bytes), and
returns the second word. Were the library to write the header's struct, pynvml's wrapper
would hand back the zero it started with, on every GPU: a GPU whose memory cannot be
repaired would read as sound, silently.

So gpudra calls the library's symbol itself, on two words laid out as pynvml lays them
out, and reads what the library wrote:
- the first word still holds the version passed: the library took the versioned struct,
  and the flag is the second word;
- the first word changed: the library wrote the header's struct over the version, and
  the flag is the first word (0 or 1 never equals the version).
Either way the buffer is large enough for what the library writes. No GPU of R590 or
later has been run here (docs/gpus.md), so which of the two a driver writes is not
known yet; `python -m e2e.gpu_node_check` records the two words on a GPU node.
"""

from __future__ import annotations

import ctypes
from typing import Any, Final, Protocol

import pynvml
from gpudra.driver.nvml.branches import UNREPAIRABLE_MEMORY_ENTRY

__all__ = [
    "StatusWords",
    "WithLibrary",
    "read_status_words",
    "read_unrepairable_memory",
    "unrepairable",
]

StatusWords: Final = ctypes.c_uint * 2
"""The struct as nvidia-ml-py lays it out: the version, then the flag."""


class WithLibrary(Protocol):
    """What the read needs of an `NvmlLibrary`: libnvidia-ml itself."""

    @property
    def nvmlLib(self) -> Any: ...


def read_status_words(nvml: WithLibrary, handle: Any) -> tuple[int, int]:
    """The two words after the library's call, the first primed with the version.

    Raises pynvml's `NVMLError` for the library's answer (NOT_SUPPORTED before Hopper,
    GPU_IS_LOST, ...), and FUNCTION_NOT_FOUND where the library has no such symbol (a
    driver before R590), as pynvml's own lookup does.
    """
    try:
        entry = getattr(nvml.nvmlLib, UNREPAIRABLE_MEMORY_ENTRY)
    except AttributeError:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND) from None
    words = StatusWords(pynvml.nvmlUnrepairableMemory_v1, 0)
    code = int(entry(handle, ctypes.byref(words)))
    if code != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(code)
    return int(words[0]), int(words[1])


def unrepairable(words: tuple[int, int]) -> bool:
    """Whether the two words say the GPU has unrepairable memory (module docstring)."""
    first, second = words
    if first == pynvml.nvmlUnrepairableMemory_v1:
        return second != 0
    return first != 0


def read_unrepairable_memory(nvml: WithLibrary, handle: Any) -> bool:
    """Whether NVML says GPU `handle` has unrepairable memory; errors as
    `read_status_words`."""
    return unrepairable(read_status_words(nvml, handle))
