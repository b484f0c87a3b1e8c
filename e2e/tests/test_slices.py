"""The ResourceSlice controller against the real API server."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from gpudra.common.kube import Kube
from gpudra.driver.slices import SLICES, PoolContent, SliceController, SliceLimits

from e2e.cluster.harness import Cluster
from e2e.proxy import Proxy

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
NODE = "worker-2"


def gpus(n: int, product: str = "NVIDIA H100 80GB HBM3") -> list[dict[str, Any]]:
    return [
        {
            "name": f"gpu-{i}",
            "attributes": {"type": {"string": "gpu"}, "productName": {"string": product}},
            "capacity": {"memory": {"value": "80Gi"}},
        }
        for i in range(n)
    ]


def partitioned(n_gpus: int, per_gpu: int) -> PoolContent:
    sets, devs = [], []
    for g in range(n_gpus):
        sets.append(
            {
                "name": f"gpu-{g}-cs",
                "counters": {f"slice-{s}": {"value": "1"} for s in range(per_gpu)},
            }
        )
        devs += [
            {
                "name": f"gpu-{g}-part-{s}",
                "attributes": {"type": {"string": "mig"}},
                "consumesCounters": [
                    {"counterSet": f"gpu-{g}-cs", "counters": {f"slice-{s}": {"value": "1"}}}
                ],
            }
            for s in range(per_gpu)
        ]
    return PoolContent(devices=devs, counter_sets=sets)


async def slices_of(k: Kube, driver: str) -> list[dict[str, Any]]:
    out = await k.request(
        "GET",
        "/apis/resource.k8s.io/v1/resourceslices",
        query={"fieldSelector": f"spec.driver={driver}"},
    )
    return sorted(out["items"], key=lambda o: o["metadata"]["name"])


async def eventually(what: str, probe: Any, limit_s: float = 30.0) -> Any:
    with anyio.fail_after(limit_s):
        while True:
            value = await probe()
            if value:
                return value
            await anyio.sleep(0.05)


def whole_pool(items: list[dict[str, Any]], n_devices: int) -> bool:
    if not items:
        return False
    gens = {o["spec"]["pool"]["generation"] for o in items}
    count = {o["spec"]["pool"]["resourceSliceCount"] for o in items}
    devs = sum(len(o["spec"].get("devices", [])) for o in items)
    return len(gens) == 1 and count == {len(items)} and devs == n_devices


class Pool:
    def __init__(self, content: PoolContent) -> None:
        self.content = content
        self.fail: Exception | None = None

    def __call__(self) -> PoolContent:
        if self.fail:
            raise self.fail
        return self.content


async def test_publish_restore_and_no_idle_writes(akube: Kube) -> None:
    driver = f"t{secrets.token_hex(3)}.gpudra.dev"
    pool = Pool(PoolContent(devices=gpus(200)))
    ctl = SliceController(akube, driver=driver, node=NODE, source=pool)
    async with anyio.create_task_group() as tg:
        await tg.start(ctl.run)
        await eventually("publish", lambda: _ok(akube, driver, 200))
        items = await slices_of(akube, driver)
        assert len(items) == 2  # 128 + 72: split within the per-slice device limit
        assert all(o["spec"]["nodeName"] == NODE for o in items)
        assert items[0]["metadata"]["ownerReferences"][0]["kind"] == "Node"
        gen = items[0]["spec"]["pool"]["generation"]

        # Nothing changed: repeated triggers write nothing.
        writes = ctl.writes
        for _ in range(5):
            ctl.trigger()
            await anyio.sleep(0.1)
        assert ctl.writes == writes

        # Someone deletes a slice: it comes back, same pool generation.
        name = items[1]["metadata"]["name"]
        await akube.request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{name}")
        await eventually("restore", lambda: _ok(akube, driver, 200))
        assert {o["spec"]["pool"]["generation"] for o in await slices_of(akube, driver)} == {gen}

        # Someone edits a slice: the edit is reverted.
        edited = (await slices_of(akube, driver))[0]
        edited["spec"]["devices"] = edited["spec"]["devices"][:1]
        await akube.request(
            "PUT", f"/apis/resource.k8s.io/v1/resourceslices/{edited['metadata']['name']}", edited
        )
        await eventually("revert edit", lambda: _ok(akube, driver, 200))

        # The inventory changes: new generation everywhere, the stale slice is deleted.
        pool.content = PoolContent(devices=gpus(8, product="NVIDIA L4"))
        ctl.trigger()
        await eventually("shrink", lambda: _ok(akube, driver, 8))
        items = await slices_of(akube, driver)
        assert len(items) == 1
        assert items[0]["spec"]["pool"]["generation"] == gen + 1
        assert items[0]["spec"]["devices"][0]["attributes"]["productName"]["string"] == "NVIDIA L4"
        tg.cancel_scope.cancel()
    await _cleanup(akube, driver)


async def test_partitionable_pool_splits_counters_from_devices(akube: Kube) -> None:
    driver = f"t{secrets.token_hex(3)}.gpudra.dev"
    content = partitioned(n_gpus=8, per_gpu=25)
    ctl = SliceController(akube, driver=driver, node=NODE, source=Pool(content))
    async with anyio.create_task_group() as tg:
        await tg.start(ctl.run)
        await eventually("publish", lambda: _ok(akube, driver, 200))
        items = await slices_of(akube, driver)
        counters = [o for o in items if o["spec"].get("sharedCounters")]
        assert len(counters) == 1 and len(counters[0]["spec"]["sharedCounters"]) == 8
        assert all(len(o["spec"].get("devices", [])) <= 64 for o in items)
        tg.cancel_scope.cancel()
    await _cleanup(akube, driver)


async def test_bad_inventory_keeps_the_published_pool(akube: Kube) -> None:
    driver = f"t{secrets.token_hex(3)}.gpudra.dev"
    pool = Pool(PoolContent(devices=gpus(4)))
    ctl = SliceController(akube, driver=driver, node=NODE, source=pool)
    async with anyio.create_task_group() as tg:
        await tg.start(ctl.run)
        await eventually("publish", lambda: _ok(akube, driver, 4))
        before = await slices_of(akube, driver)
        # A discovery failure mid-scan: nothing partial is published.
        pool.fail = RuntimeError("NVML failed mid-scan at GPU 2")
        ctl.trigger()
        await eventually("error seen", lambda: _true(ctl.last_error))
        # An attribute over the API limit: rejected before any write, naming the field.
        pool.fail = None
        bad = gpus(4)
        bad[2]["attributes"]["productName"] = {"string": "x" * 65}
        pool.content = PoolContent(devices=bad)
        ctl.trigger()
        await eventually(
            "pool error",
            lambda: _true(
                ctl.last_error
                and "device gpu-2: attribute productName is 65 characters" in ctl.last_error
            ),
        )
        after = await slices_of(akube, driver)
        assert [o["metadata"]["resourceVersion"] for o in after] == [
            o["metadata"]["resourceVersion"] for o in before
        ]
        tg.cancel_scope.cancel()
    await _cleanup(akube, driver)


async def test_a_newer_generation_written_by_someone_else_is_superseded(akube: Kube) -> None:
    driver = f"t{secrets.token_hex(3)}.gpudra.dev"
    ctl = SliceController(akube, driver=driver, node=NODE, source=Pool(PoolContent(gpus(200))))
    async with anyio.create_task_group() as tg:
        await tg.start(ctl.run)
        await eventually("publish", lambda: _ok(akube, driver, 200))
        first, _second = await slices_of(akube, driver)
        gen = first["spec"]["pool"]["generation"]
        # Another writer claims the pool with a later generation in one slice: the
        # controller republishes the whole pool above it, so no slice of ours is stale.
        first["spec"]["pool"]["generation"] = gen + 5
        await akube.request("PUT", f"{SLICES}/{first['metadata']['name']}", first)
        await eventually("superseded", lambda: _at_generation(akube, driver, 200, gen + 6))
        tg.cancel_scope.cancel()
    await _cleanup(akube, driver)


async def test_rides_out_an_api_server_outage(cluster: Cluster, tmp_path: Path) -> None:
    driver = f"t{secrets.token_hex(3)}.gpudra.dev"
    # The API server's port on this machine, from the kubeconfig: kind maps it there too.
    cfg = yaml.safe_load(cluster.layout.admin_kubeconfig.read_text())
    server = cfg["clusters"][0]["cluster"]["server"]
    async with anyio.create_task_group() as tg:
        proxy = Proxy(target_port=int(server.rpartition(":")[2]))
        await proxy.start(tg)
        cfg["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
        (tmp_path / "kc").write_text(json.dumps(cfg))
        k = await Kube.connect(str(tmp_path / "kc"))
        direct = await Kube.connect(str(cluster.layout.admin_kubeconfig))
        pool = Pool(PoolContent(devices=gpus(2)))
        ctl = SliceController(
            k, driver=driver, node=NODE, source=pool, backoff_max_s=1.0, limits=SliceLimits()
        )
        await tg.start(ctl.run)
        await eventually("publish", lambda: _ok(direct, driver, 2))
        await proxy.cut()
        pool.content = PoolContent(devices=gpus(3))
        ctl.trigger()
        await eventually("failure noticed", lambda: _true(ctl.last_error))
        await anyio.sleep(1.5)  # several capped retries against a dead endpoint
        await proxy.restore(tg)
        await eventually("recover", lambda: _ok(direct, driver, 3), limit_s=60)
        tg.cancel_scope.cancel()
    await _cleanup(direct, driver)
    await k.close()
    await direct.close()


async def _at_generation(k: Kube, driver: str, n: int, generation: int) -> bool:
    items = await slices_of(k, driver)
    return whole_pool(items, n) and items[0]["spec"]["pool"]["generation"] == generation


async def _true(v: Any) -> Any:
    return v


async def _ok(k: Kube, driver: str, n: int) -> bool:
    return whole_pool(await slices_of(k, driver), n)


async def _cleanup(k: Kube, driver: str) -> None:
    for o in await slices_of(k, driver):
        await k.request(
            "DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{o['metadata']['name']}"
        )
