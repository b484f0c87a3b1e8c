"""The emulated NVML of a built-in profile, as the tests of this folder load it."""

from __future__ import annotations

from collections.abc import Sequence

from gpudra.driver.nvml import NvmlEmulator, load_nvml
from gpudra.driver.nvml.emulator import load_builtin_profile, parse_profile


def emulated(name: str) -> NvmlEmulator:
    """`load_nvml("emulated:<name>")`, typed as the emulator it is."""
    nvml = load_nvml(f"emulated:{name}")
    assert isinstance(nvml, NvmlEmulator)
    return nvml


def with_gpu_answers(name: str, field: str, values: Sequence[int]) -> NvmlEmulator:
    """Built-in profile `name` whose GPUs' `field` (a `GpuSpec` field: what NVML answers
    for that GPU) is `values`, GPU by GPU."""
    document = load_builtin_profile(name).model_dump(mode="json")
    for gpu, value in zip(document["gpus"], values, strict=True):
        gpu[field] = value
    return NvmlEmulator(parse_profile(document), source=f"{name}, {field} {list(values)}")


def with_nvml_numa_nodes(name: str, nodes: Sequence[int]) -> NvmlEmulator:
    """Built-in profile `name` whose NVML answers nvmlDeviceGetNumaNodeId with `nodes`,
    GPU by GPU: as on Grace (GH200, GB200), where NVML names each GPU's own HBM NUMA
    node, not the node of the CPU the GPU hangs off."""
    return with_gpu_answers(name, "numaNode", nodes)
