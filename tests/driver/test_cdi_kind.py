"""Each driver name has its own CDI kind, `k8s.<driver name>/claim`.

The runtime drops a device that two specs of one priority define, and an agent sweeps
the claim specs of its kind that its checkpoint does not name. With one kind for every
driver name, a claim given devices by two drivers on one node (gpudra under another
name beside NVIDIA's driver, or two releases) lost them all, and two agents sharing a
CDI folder removed each other's specs. A release before wrote every name's specs under
`k8s.gpu.nvidia.com/claim`; the claims it prepared are unprepared by the next one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest
from gpudra.common.kube import Kube
from gpudra.driver.cdi import DEFAULT_KIND, CdiDevice, CdiSpecStore, claim_kind
from gpudra.driver.claims import Claim, ClaimRef, checked_claim

from tests.driver.test_prepare import (
    NODE,
    Node,
    h100,
    node,  # noqa: F401  (the fixture)
    node_preparer,
)
from tests.driver.test_take_over import node_service

pytestmark = pytest.mark.anyio

OTHER = "gpu.example.com"
OTHER_KIND = "k8s.gpu.example.com/claim"
UID = "00000000-0000-4000-8000-000000000001"


def claim(driver: str, device: str, uid: str = UID) -> Claim:
    """A claim allocated `device` of `driver` on this node, checked as the plugin does."""
    ref = ClaimRef("team-a", uid, "train")
    result = {"driver": driver, "pool": NODE, "device": device, "request": "gpu"}
    obj = {
        "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
        "status": {
            "allocation": {"devices": {"results": [result], "config": []}},
            "reservedFor": [{"resource": "pods", "name": "pod", "uid": "x"}],
        },
    }
    return checked_claim(ref, obj, driver=driver, pool=NODE)


def spec_file(folders: Node, kind: str, uid: str = UID) -> Path:
    return folders.cdi_dir / f"{kind.replace('/', '-')}_{uid}.json"


def test_the_kind_is_named_after_the_driver() -> None:
    assert claim_kind("gpu.nvidia.com") == DEFAULT_KIND == "k8s.gpu.nvidia.com/claim"
    assert claim_kind(OTHER) == OTHER_KIND


async def test_an_agent_under_another_driver_name_writes_and_names_specs_of_its_kind(
    node: Node,  # noqa: F811
) -> None:
    """`gpudra node --driver-name gpu.example.com`, as the chart's `driverName` runs it:
    the kubelet gets IDs of the driver's kind, and the spec defines them."""
    service = node_service(node, cast(Kube, object()), h100(), driver_name=OTHER)
    await service.agent.scan()
    assert service.preparer is not None
    await service.preparer.recover()
    gpu = claim(OTHER, "gpu-1")
    prepared = (await service.preparer.prepare([gpu]))[UID]
    assert prepared.error is None
    assert [d.cdi_device_ids for d in prepared.devices] == [[f"{OTHER_KIND}={UID}-gpu-1"]]
    spec = json.loads(spec_file(node, OTHER_KIND).read_text())
    assert spec["kind"] == OTHER_KIND
    assert [d["name"] for d in spec["devices"]] == [f"{UID}-gpu-1"]
    assert not spec_file(node, DEFAULT_KIND).exists()
    assert await service.preparer.unprepare([gpu.ref]) == {UID: None}
    assert not spec_file(node, OTHER_KIND).exists()


async def test_two_drivers_on_one_folder_keep_each_others_specs(
    node: Node,  # noqa: F811
) -> None:
    """One claim given a GPU by each of two agents sharing the CDI folder, each with its
    own checkpoint: both specs stand, and one agent's start (its sweep of specs its
    checkpoint does not name) and its unprepare leave the other's spec."""
    ours = node_preparer(node, h100())
    theirs = node_preparer(
        node, h100(), checkpoint=node.root / "theirs" / "checkpoint.json", cdi_kind=OTHER_KIND
    )
    await ours.recover()
    await theirs.recover()
    assert (await ours.prepare([claim("gpu.nvidia.com", "gpu-1")]))[UID].error is None
    assert (await theirs.prepare([claim(OTHER, "gpu-2")]))[UID].error is None
    await theirs.recover()  # as after a restart: their sweep
    assert spec_file(node, DEFAULT_KIND).exists()
    assert await theirs.unprepare([claim(OTHER, "gpu-2").ref]) == {UID: None}
    assert spec_file(node, DEFAULT_KIND).exists()
    assert not spec_file(node, OTHER_KIND).exists()


async def test_a_claim_prepared_under_the_old_kind_is_unprepared_whole(
    node: Node,  # noqa: F811
) -> None:
    """An agent named `gpu.example.com` of the release before wrote its claim's spec
    under the default kind. The next release, on the same checkpoint, answers the
    kubelet's repeat prepare with the IDs it handed out and removes that spec at the
    unprepare: left, it would hand the GPU to anyone asking the runtime for it."""
    before = node_preparer(node, h100())  # one kind for every driver name
    gpu = claim(OTHER, "gpu-1")
    first = (await before.prepare([gpu]))[UID]
    assert first.error is None
    assert spec_file(node, DEFAULT_KIND).exists()

    after = node_preparer(node, h100(), cdi_kind=OTHER_KIND)
    await after.recover()
    assert spec_file(node, DEFAULT_KIND).exists()  # a prepared claim's, not an orphan
    again = (await after.prepare([gpu]))[UID]
    assert again.error is None
    assert [d.cdi_device_ids for d in again.devices] == [[f"{DEFAULT_KIND}={UID}-gpu-1"]]
    assert await after.unprepare([gpu.ref]) == {UID: None}
    assert not spec_file(node, DEFAULT_KIND).exists()
    assert not list(node.cdi_dir.iterdir())


def test_remove_takes_only_claim_specs_of_the_kinds_the_ids_name(tmp_path: Path) -> None:
    """The IDs name the toolkit's devices too (`nvidia.com/gpu`): its files, and other
    claims' specs, stay."""
    gpu = CdiDevice("gpu-0", toolkit_ids=("nvidia.com/gpu=GPU-1",))
    CdiSpecStore(tmp_path).write_claim(UID, [gpu])
    other_uid = "00000000-0000-4000-8000-000000000002"
    CdiSpecStore(tmp_path).write_claim(other_uid, [gpu])
    toolkit_like = tmp_path / f"nvidia.com-gpu_{UID}.json"
    toolkit_like.write_text("{}")
    store = CdiSpecStore(tmp_path, kind=OTHER_KIND)
    ids = [f"{DEFAULT_KIND}={UID}-gpu-0", "nvidia.com/gpu=GPU-1", "not a kind=x"]
    assert store.remove(UID, device_ids=ids) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"k8s.gpu.nvidia.com-claim_{other_uid}.json", toolkit_like.name]
    )
    assert store.remove(UID, device_ids=ids) is False
