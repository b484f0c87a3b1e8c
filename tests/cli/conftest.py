"""Shared by the CLI tests: a node agent's real metrics endpoint over emulated GPUs."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
from gpudra.common.metricsserver import serve_metrics
from gpudra.driver.accounting import Accounting
from gpudra.driver.checkpoint import ClaimRecord, ClaimState, DeviceRecord
from gpudra.driver.devices import discover
from gpudra.driver.metrics import DeviceMetrics
from gpudra.driver.nvml.emulator import NvmlEmulator, load_builtin_profile
from gpudra.driver.records import DeviceDetails
from gpudra.driver.sampling import Sampler
from prometheus_client import CollectorRegistry


@pytest.fixture(scope="session")
def endpoint() -> Iterator[str]:
    """An agent with two GPUs: gpu-0 held by team-a/trainer and idle 20 minutes,
    gpu-1 free and busy."""
    nvml = NvmlEmulator(load_builtin_profile("h100-80gb-hbm3-x8"))
    inventory = discover(nvml)
    nvml.telemetry.script(0, utilization=1)
    nvml.telemetry.script(1, utilization=90)
    uuid = inventory.gpus[0].uuid
    held = ClaimRecord(
        uid="u1",
        namespace="team-a",
        name="train",
        state=ClaimState.PREPARE_COMPLETED,
        devices=(
            DeviceRecord(
                pool="node-a",
                device="gpu-0",
                request_names=("gpu",),
                details=DeviceDetails(type="gpu", gpu_uuid=uuid, uuid=uuid, pod="trainer"),
            ),
        ),
    )
    now = [0.0]
    accounting = Accounting()
    sampler = Sampler(
        nvml,
        pool="node-a",
        inventory=lambda: inventory,
        prepared=lambda: (held,),
        on_sample=(accounting.observe,),
        clock=lambda: now[0],
        interval_s=1200,  # sampled 20 minutes apart: no stall between the two
    )

    async def two_samples() -> None:
        await sampler.sample_once()
        now[0] += 1200
        await sampler.sample_once()

    anyio.run(two_samples)
    registry = CollectorRegistry()
    registry.register(DeviceMetrics(sampler, accounting))
    server, thread = serve_metrics("127.0.0.1", 0, registry)  # as the agent serves
    try:
        yield f"node-a=http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        thread.join()
