"""Integer GPU shares: which GPUs `--gpu-shares` publishes with how many shares, the
refusal when a named GPU serves other claims, the published capacities, the shares a
claim consumed, and the command line."""

from __future__ import annotations

import logging
from typing import cast

import pytest
from gpudra.cli.main import build_parser
from gpudra.cli.node import _agent_config
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.claims import ClaimError, ClaimRef, checked_claim
from gpudra.driver.devices import Inventory, MigStrategy, SharedGpus, discover
from gpudra.driver.gpushares import GpuShares, GpuSharesError, parse_node_override
from gpudra.driver.nvml import load_nvml
from gpudra.driver.publish import pool_content, shares_capacity

H100 = "emulated:h100-80gb-hbm3-x8"
H100_MIG = "emulated:h100-80gb-hbm3-x8-mig"
DRIVER = "gpu.nvidia.com"


def inventory(profile: str = H100) -> Inventory:
    return discover(load_nvml(profile))


def every(count: int) -> dict[str, int]:
    return {f"gpu-{i}": count for i in range(8)}


def test_shares_go_to_every_gpu_with_a_per_node_override() -> None:
    shares = GpuShares(default=4, by_node={"big": 8, "off": 0})
    inv = inventory()
    assert shares.resolve(inv, "n1", frozenset()) == (every(4), ())
    assert shares.resolve(inv, "big", frozenset()) == (every(8), ())
    assert shares.resolve(inv, "off", frozenset()) == ({}, ())
    assert GpuShares().resolve(inv, "n1", frozenset()) == ({}, ())


def test_all_leaves_out_gpus_that_serve_memory_slices_or_mig() -> None:
    shares = GpuShares(default=2)
    inv = inventory()
    got, problems = shares.resolve(inv, "n1", frozenset({"gpu-7"}))
    assert problems == ()
    assert got == {name: 2 for name in every(2) if name != "gpu-7"}
    mig = inventory(H100_MIG)
    got, problems = shares.resolve(mig, "n1", frozenset())
    assert problems == ()
    assert "gpu-0" not in got  # MIG mode: its MIG devices are served, not shares


def test_naming_a_gpu_that_serves_other_claims_is_one_line_naming_it() -> None:
    inv = inventory()
    shares = GpuShares(default=4, gpus=SharedGpus.parse("6,7"))
    got, problems = shares.resolve(inv, "n1", frozenset({"gpu-7"}))
    assert got == {"gpu-6": 4}
    assert problems == (
        f"GPU index 7 ({inv.gpus[7].uuid}) is in --shared-gpus (memory slices) and cannot "
        "also have integer shares: leave it out of one of --shared-gpus and "
        "--gpu-shares-gpus; --gpu-shares-gpus 6,7 with --gpu-shares 4",
    )
    mig = inventory(H100_MIG)
    by_node = GpuShares(default=0, by_node={"n1": 3}, gpus=SharedGpus.parse("0"))
    ((problem,),) = [by_node.resolve(mig, "n1", frozenset())[1]]
    assert problem.startswith(f"GPU index 0 ({mig.gpus[0].uuid}) has MIG mode enabled")
    assert problem.endswith("--gpu-shares-gpus 0 with --gpu-shares-node n1=3")
    absent = GpuShares(default=2, gpus=SharedGpus.parse("9")).resolve(inv, "n1", frozenset())
    assert absent == (
        {},
        (
            "--gpu-shares-gpus 9: GPU index 9 does not exist on this node "
            "(it has 8 GPUs: indices 0-7)",
        ),
    )


@pytest.mark.parametrize(
    ("shares", "message"),
    [
        ({"default": -1}, "--gpu-shares is -1; give 0 (no shares) to 1024"),
        ({"default": 1025}, "--gpu-shares is 1025"),
        ({"by_node": {"n1": 2000}}, "--gpu-shares-node n1=2000 is 2000"),
    ],
)
def test_out_of_range_counts_name_the_flag(shares: dict[str, object], message: str) -> None:
    with pytest.raises(GpuSharesError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GpuShares(**shares)  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", ["n1", "=3", "n1=", "n1=x", "n1=-1"])
def test_node_override_needs_node_equals_count(raw: str) -> None:
    with pytest.raises(GpuSharesError, match="give NODE=N"):
        parse_node_override(raw)
    assert parse_node_override(" n1 =3") == ("n1", 3)


def test_published_gpu_has_upstreams_share_and_memory_capacities() -> None:
    inv = inventory()
    memory = inv.gpus[0].device.capacity["memory"]
    content = pool_content(inv, MigStrategy.DYNAMIC, shares={"gpu-0": 4})
    devices = {d["name"]: d for d in content.devices}
    gpu = devices["gpu-0"]
    assert gpu["allowMultipleAllocations"] is True
    top = str(memory // 1024**2 * 1024**2)
    assert gpu["capacity"] == {
        "memory": {
            "value": top,
            "requestPolicy": {
                "default": "0",
                "validRange": {"min": "0", "max": top, "step": "1Mi"},
            },
        },
        # No shares asked: all of them, so a whole-GPU claim keeps every share off it.
        "shares": {
            "value": "4",
            "requestPolicy": {"default": "4", "validRange": {"min": "1", "max": "4", "step": "1"}},
        },
    }
    assert "allowMultipleAllocations" not in devices["gpu-1"]
    with pytest.raises(ValueError, match="at least 1"):
        shares_capacity(memory, 0)


REF = ClaimRef("ns", "0b6c7a52-1f0e-4f57-9a55-4c7e7c1e0b01", "c")


def claim(consumed: dict[str, str]) -> dict[str, object]:
    result = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": "n1",
        "device": "gpu-0",
        "shareID": "7e2d3c4b-0000-4000-8000-000000000001",
        "consumedCapacity": consumed,
    }
    return {
        "metadata": {"name": REF.name, "namespace": REF.namespace, "uid": REF.uid},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def test_a_claims_consumed_shares_are_read_and_its_memory_is_no_slice() -> None:
    parsed = checked_claim(REF, claim({"shares": "1", "memory": "0"}), driver=DRIVER, pool="n1")
    (device,) = parsed.devices
    assert device.consumed_shares == 1
    assert device.consumed_memory is None  # not a memory slice: nothing to pin
    with pytest.raises(ClaimError, match=r"consumedCapacity.shares is 1500m; a GPU's shares"):
        checked_claim(REF, claim({"shares": "1500m"}), driver=DRIVER, pool="n1")
    # Either spelling of the driver's capacity: the status names a capacity as the slice
    # does, and a claim of another spelling is still a share, never a memory slice.
    qualified = {f"{DRIVER}/shares": "2", f"{DRIVER}/memory": "0"}
    (device,) = checked_claim(REF, claim(qualified), driver=DRIVER, pool="n1").devices
    assert (device.consumed_shares, device.consumed_memory) == (2, None)


@pytest.mark.anyio
async def test_agent_refuses_a_first_inventory_it_cannot_share_and_warns_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = AgentConfig(
        node_name="n1",
        health_events=False,
        shared_gpus=SharedGpus.parse("7"),
        gpu_shares=GpuShares(default=2, gpus=SharedGpus.parse("7")),
    )
    a = NodeAgent(config, cast(Kube, object()), load_nvml(H100))
    with pytest.raises(GpuSharesError, match=r"^GPU index 7 \(GPU-"):
        await a.scan()
    ok = AgentConfig(node_name="n1", health_events=False, gpu_shares=GpuShares(default=2))
    a = NodeAgent(ok, cast(Kube, object()), load_nvml(H100))
    await a.scan()
    assert a.shares == every(2)
    assert {d["name"] for d in a._content().devices if d.get("allowMultipleAllocations")} == set(
        every(2)
    )
    with caplog.at_level(logging.INFO, logger="gpudra.driver.agent"):
        a.nvml = load_nvml(H100_MIG)  # a GPU went into MIG mode: logged, left out
        await a.scan()
    assert "gpu-0" not in a.shares


def test_command_line_reaches_the_agent() -> None:
    args = build_parser().parse_args(
        [
            "node",
            "--node-name=n1",
            "--gpu-shares=4",
            "--gpu-shares-node=big=8",
            "--gpu-shares-gpus=0,3",
        ]
    )
    shares = _agent_config(args).gpu_shares
    assert shares == GpuShares(default=4, by_node={"big": 8}, gpus=SharedGpus.parse("0,3"))
    bad = build_parser().parse_args(["node", "--node-name=n1", "--gpu-shares-gpus=some"])
    with pytest.raises(SystemExit, match="--gpu-shares-gpus 'some': 'some' is neither"):
        _agent_config(bad)
