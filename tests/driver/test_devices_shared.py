"""GPUs published for memory slices: parsing `--shared-gpus`, resolving it against the
node's GPUs, and the ResourceSlice JSON of a shared GPU."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, cast

import pytest
from gpudra.common.kube import Kube
from gpudra.driver.agent import AgentConfig, NodeAgent
from gpudra.driver.devices import (
    MEMORY_SLICE_MIN,
    Inventory,
    MigStrategy,
    SharedGpus,
    SharedGpusError,
    discover,
)
from gpudra.driver.nvml import load_nvml
from gpudra.driver.nvml.emulator import load_builtin_profile
from gpudra.driver.publish import memory_request_policy, pool_content
from gpudra.driver.slices import PoolError, SliceLimits, plan_slices, validate_device
from gpudra.driver.slices import unshared_by_server as dropped

H100 = "emulated:h100-80gb-hbm3-x8"
H100_MIG = "emulated:h100-80gb-hbm3-x8-mig"
DRIVER = "gpu.nvidia.com"
UUID = "GPU-86737bf0-609a-5b5b-b9e7-de8873112c51"


def inventory(profile: str = H100) -> Inventory:
    return discover(load_nvml(profile))


# --- parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "parsed"),
    [
        ("none", SharedGpus()),
        (" NONE ", SharedGpus()),
        ("all", SharedGpus(every=True)),
        ("3", SharedGpus(indices=frozenset({3}))),
        ("0, 3,3", SharedGpus(indices=frozenset({0, 3}))),
        (UUID.upper().replace("GPU", "gpu"), SharedGpus(uuids=frozenset({UUID.lower()}))),
        (f"1,{UUID}", SharedGpus(indices=frozenset({1}), uuids=frozenset({UUID.lower()}))),
    ],
)
def test_parse_accepts_none_all_indices_and_uuids(raw: str, parsed: SharedGpus) -> None:
    assert SharedGpus.parse(raw) == parsed
    assert SharedGpus.parse(str(parsed)) == parsed  # str() gives the flag's form back


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("", "empty entry"),
        ("0,,1", "empty entry"),
        ("some", "'some' is neither a GPU index nor a GPU UUID; give none, all, or a"),
        ("-1", "'-1' is neither a GPU index nor a GPU UUID"),
        ("GPU-1234", "'GPU-1234' is neither a GPU index nor a GPU UUID"),
        ("all,0", "'all' cannot be combined with other entries"),
        (f"M{UUID[1:].replace('PU', 'IG')}", "is a MIG device; only whole GPUs"),
    ],
)
def test_parse_rejects_other_forms_saying_which(raw: str, message: str) -> None:
    with pytest.raises(SharedGpusError, match=re.escape(message)):
        SharedGpus.parse(raw)


# --- resolution against the node's GPUs --------------------------------------------------


def test_resolve_by_index_and_uuid() -> None:
    inv = inventory()
    gpu5 = inv.gpus[5]
    names, problems = SharedGpus(indices=frozenset({2}), uuids=frozenset({gpu5.uuid})).resolve(inv)
    assert problems == ()
    assert names == {inv.gpus[2].device.name, gpu5.device.name}
    assert SharedGpus().resolve(inv) == (frozenset(), ())
    assert SharedGpus(every=True).resolve(inv) == ({g.device.name for g in inv.gpus}, ())


def test_resolve_names_gpus_the_node_lacks() -> None:
    missing = "gpu-00000000-0000-0000-0000-000000000000"
    _, problems = SharedGpus(indices=frozenset({1, 9}), uuids=frozenset({missing})).resolve(
        inventory()
    )
    assert problems == (
        "GPU index 9 does not exist on this node (it has 8 GPUs: indices 0-7)",
        f"no GPU with UUID {missing} on this node",
    )


def test_mig_enabled_gpus_are_not_shareable() -> None:
    """A MIG-enabled GPU is only ever offered as MIG devices or placements."""
    inv = inventory(H100_MIG)
    names, problems = SharedGpus(indices=frozenset({0})).resolve(inv)
    assert names == frozenset()
    assert len(problems) == 1
    assert problems[0].startswith(f"GPU index 0 ({inv.gpus[0].uuid}) has MIG mode enabled")
    # `all` shares what can be shared and leaves MIG GPUs to their MIG view.
    assert SharedGpus(every=True).resolve(inv) == (frozenset(), ())
    content = pool_content(inv, MigStrategy.DYNAMIC, shared=frozenset({"gpu-0"}), driver=DRIVER)
    assert not any(d.get("allowMultipleAllocations") for d in content.devices)


# --- what is published -------------------------------------------------------------------


def test_shared_gpu_json_allows_multiple_allocations_with_a_memory_policy() -> None:
    inv = inventory()
    memory = inv.gpus[3].device.capacity["memory"]
    content = pool_content(inv, MigStrategy.DYNAMIC, shared=frozenset({"gpu-3"}), driver=DRIVER)
    by_name = {d["name"]: d for d in content.devices}
    shared = by_name.pop("gpu-3")
    assert shared["allowMultipleAllocations"] is True
    # Qualified: the scheduler matches capacity request names literally, and claims
    # ask for `<driver>/memory`.
    assert shared["capacity"] == {
        f"{DRIVER}/memory": {
            "value": str(memory),
            "requestPolicy": {
                "default": str(memory),
                "validRange": {"min": "1Gi", "max": str(memory)},
            },
        }
    }
    assert MEMORY_SLICE_MIN == 1024**3
    # Nothing else about the device changes: same attributes as unshared.
    plain = {d["name"]: d for d in pool_content(inv, MigStrategy.DYNAMIC).devices}["gpu-3"]
    assert shared["attributes"] == plain["attributes"]
    assert plain["capacity"] == {"memory": {"value": str(memory)}}
    for other in by_name.values():
        assert "allowMultipleAllocations" not in other
        assert set(other["capacity"]) == {"memory"}
        assert "requestPolicy" not in other["capacity"]["memory"]


def test_shared_devices_need_the_driver_name() -> None:
    with pytest.raises(ValueError, match="driver name"):
        pool_content(inventory(), MigStrategy.DYNAMIC, shared=frozenset({"gpu-3"}))


def test_request_policy_default_is_the_whole_gpu() -> None:
    """A claim naming no memory amount consumes everything: a whole GPU, never a 1Gi share."""
    assert memory_request_policy(85520809984)["default"] == "85520809984"


@pytest.mark.parametrize("server", [34, 36])
def test_a_shared_gpu_never_shares_a_slice_with_an_exclusive_device(
    server: int, tmp_path: Path
) -> None:
    """The 1.34 scheduler never allocates a shareable device listed after an exclusive one
    in its slice; alone in a slice it is. The real node's mix: whole GPUs, one of them
    shared, beside MIG GPUs whose placements consume counters."""
    profile = load_builtin_profile("h100-80gb-hbm3-x8-mig").model_dump(mode="json")
    for gpu in profile["gpus"][:4]:
        gpu["migEnabled"] = False
        gpu.pop("migPendingEnabled", None)
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(profile))
    inv = inventory(f"emulated:{path}")
    content = pool_content(inv, MigStrategy.DYNAMIC, shared=frozenset({"gpu-3"}), driver=DRIVER)
    bodies = plan_slices(content, SliceLimits.for_server(server))
    holding = [b for b in bodies if any(d["name"] == "gpu-3" for d in b.get("devices", []))]
    assert [[d["name"] for d in b["devices"]] for b in holding] == [["gpu-3"]]
    # After the exclusive GPUs: the scheduler takes the first device that fits, and a
    # whole-GPU claim on the shared one would take all its memory.
    order = [d["name"] for b in bodies for d in b.get("devices", [])]
    assert max(order.index(f"gpu-{i}") for i in range(3)) < order.index("gpu-3")
    assert sum(len(b.get("devices", [])) for b in bodies) == len(content.devices)


def test_shared_pool_passes_the_api_limits() -> None:
    content = pool_content(
        inventory(), MigStrategy.DYNAMIC, shared=frozenset({"gpu-0", "gpu-7"}), driver=DRIVER
    )
    for limits in (SliceLimits.for_server(34), SliceLimits.for_server(36)):
        bodies = plan_slices(content, limits)
        assert sum(len(b.get("devices", [])) for b in bodies) == 8


def test_request_policy_without_multiple_allocations_is_refused() -> None:
    dev: dict[str, Any] = {
        "name": "gpu-0",
        "capacity": {"memory": {"value": "80Gi", "requestPolicy": {"default": "1Gi"}}},
    }
    with pytest.raises(PoolError, match=r"requestPolicy.*allowMultipleAllocations"):
        validate_device(dev, SliceLimits())
    dev["allowMultipleAllocations"] = True
    validate_device(dev, SliceLimits())


def test_devices_the_server_stored_unshared_are_named() -> None:
    sent = {
        "devices": [
            {"name": "gpu-0", "allowMultipleAllocations": True},
            {"name": "gpu-1"},
        ]
    }
    assert dropped(sent, {"devices": [{"name": "gpu-0"}, {"name": "gpu-1"}]}) == ["gpu-0"]
    assert dropped(sent, sent) == []
    assert dropped({"sharedCounters": []}, {"sharedCounters": []}) == []


# --- the agent ---------------------------------------------------------------------------


def agent(shared: str, profile: str = H100) -> NodeAgent:
    config = AgentConfig(node_name="n1", shared_gpus=SharedGpus.parse(shared), health_events=False)
    return NodeAgent(config, cast(Kube, object()), load_nvml(profile))


@pytest.mark.anyio
async def test_agent_publishes_the_chosen_gpu_shared() -> None:
    a = agent("6")
    await a.scan()
    assert a.shared == {"gpu-6"}
    devices = {d["name"]: d for d in a._content().devices}
    assert devices["gpu-6"]["allowMultipleAllocations"] is True
    assert set(devices["gpu-6"]["capacity"]) == {"gpu.nvidia.com/memory"}
    assert "allowMultipleAllocations" not in devices["gpu-5"]


@pytest.mark.anyio
async def test_agent_refuses_a_first_inventory_without_the_named_gpu() -> None:
    a = agent("9")
    with pytest.raises(SharedGpusError, match="GPU index 9 does not exist on this node"):
        await a.scan()
    assert a.inventory is None  # nothing to publish from


@pytest.mark.anyio
async def test_agent_only_warns_when_a_shared_gpu_disappears_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a = agent("7")
    await a.scan()
    assert a.shared == {"gpu-7"}
    a.nvml = load_nvml("emulated:l4")  # the node now has one GPU
    with caplog.at_level(logging.ERROR, logger="gpudra.driver.agent"):
        inv = await a.scan()
    assert len(inv.gpus) == 1
    assert a.shared == frozenset()
    assert "cannot share" in caplog.text
    assert not any(d.get("allowMultipleAllocations") for d in a._content().devices)
