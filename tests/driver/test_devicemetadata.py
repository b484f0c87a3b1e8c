"""Device metadata files: their content, paths and removal, and what Kubernetes' own
readers (k8s.io/dynamic-resource-allocation's `devicemetadata`, of 1.37 and of 1.36)
make of them."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from gpudra.driver import publish
from gpudra.driver.cdi import CdiError, CdiSpecStore, claim_kind
from gpudra.driver.devicemetadata import (
    API_VERSIONS,
    DeviceMetadataStore,
    MetadataDevice,
    MetadataError,
    MetadataRequest,
    container_path,
    metadata_stream,
    mounted,
)
from gpudra.driver.devices import NUMA_NODE_ATTRIBUTE, MigStrategy, discover
from gpudra.driver.nvml import NvmlEmulator

from e2e.gobuild import GoBuildError
from e2e.tools import metadataread

DRIVER = "gpu.nvidia.com"


def objects(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects of a stream, as a streaming decoder reads them."""
    decoder, text, out, at = json.JSONDecoder(), data.decode(), [], 0
    while at < len(text):
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            break
        value, at = decoder.raw_decode(text, at)
        out.append(value)
    return out


def devices(
    profile: str, strategy: MigStrategy = MigStrategy.STATIC, *, lists: bool = False
) -> list[MetadataDevice]:
    """An emulated node's devices with the attributes its slices publish (`lists`: the
    NUMA node as a list, `--numa-node-list`)."""
    return [
        MetadataDevice(
            pool="node-a", name=d.name, attributes=publish.device_attributes(d, lists=lists)
        )
        for d in discover(NvmlEmulator.from_builtin(profile)).devices(strategy)
    ]


def test_a_stream_holds_the_same_object_once_per_version_newest_first() -> None:
    [gpu, *_] = devices("h100-80gb-hbm3-x8")
    request = MetadataRequest(name="gpu/large", devices=(gpu,))
    uid = str(uuid.uuid4())

    stream = metadata_stream(
        driver=DRIVER,
        namespace="team-a",
        claim_name="train-gpu-x7k2p",
        claim_uid=uid,
        pod_claim_name="gpu",
        request=request,
    )

    assert stream.endswith(b"\n") and stream.count(b"\n") == len(API_VERSIONS)
    found = objects(stream)
    assert [o["apiVersion"] for o in found] == [
        "metadata.resource.k8s.io/v1beta1",
        "metadata.resource.k8s.io/v1alpha1",
    ]
    for obj in found:
        assert obj["kind"] == "DeviceMetadata"
        assert obj["metadata"] == {
            "name": "train-gpu-x7k2p",
            "namespace": "team-a",
            "uid": uid,
            "generation": 1,
        }
        assert obj["podClaimName"] == "gpu"
        [req] = obj["requests"]
        assert req["name"] == "gpu/large"  # the subrequest stays in the content
        [dev] = req["devices"]
        assert dev == {
            "driver": DRIVER,
            "pool": "node-a",
            "name": gpu.name,
            "attributes": gpu.attributes,
        }
        assert dev["attributes"]["uuid"]["string"].startswith("GPU-")


def test_container_paths_follow_the_upstream_layout() -> None:
    base = "/var/run/kubernetes.io/dra-device-attributes"
    assert (
        container_path(DRIVER, "shared-gpus", None, "gpu")
        == f"{base}/resourceclaims/shared-gpus/gpu/gpu.nvidia.com-metadata.json"
    )
    # A claim made from a template: under the pod's name for it, not its generated name.
    assert (
        container_path(DRIVER, "trainer-0-gpu-x7k2p", "gpu", "gpu")
        == f"{base}/resourceclaimtemplates/gpu/gpu/gpu.nvidia.com-metadata.json"
    )


@pytest.mark.parametrize("annotation", ["../../../etc", "a/b", "GPU", "-x", "x" * 64, ".."])
def test_a_pod_claim_name_that_is_no_dns_label_is_refused_before_any_file(
    tmp_path: Path, annotation: str
) -> None:
    """The annotation is the claim writer's: it never becomes a path outside the
    metadata folder, in the container or on the host."""
    store = DeviceMetadataStore(tmp_path / "device-metadata", driver=DRIVER)
    [gpu, *_] = devices("h100-80gb-hbm3-x8")

    with pytest.raises(MetadataError) as caught:
        store.write(
            namespace="team-a",
            claim_name="c",
            claim_uid=str(uuid.uuid4()),
            pod_claim_name=annotation,
            requests=[MetadataRequest("gpu", (gpu,))],
        )

    message = str(caught.value)
    assert "annotation resource.kubernetes.io/pod-claim-name" in message
    assert "DNS label" in message and "remove or fix the annotation" in message
    assert not (tmp_path / "device-metadata").exists()


def test_files_are_written_per_request_mounted_read_only_and_removed(tmp_path: Path) -> None:
    root = tmp_path / "device-metadata"
    store = DeviceMetadataStore(root, driver=DRIVER)
    first, second, third, *_ = devices("h100-80gb-hbm3-x8")
    uid = str(uuid.uuid4())

    mounts = store.write(
        namespace="team-a",
        claim_name="pair",
        claim_uid=uid,
        pod_claim_name=None,
        requests=[
            MetadataRequest("gpu", (first,)),
            MetadataRequest("pair", (second, third)),
        ],
    )

    assert sorted(mounts) == ["gpu", "pair"]
    for request, names in (("gpu", [first.name]), ("pair", [second.name, third.name])):
        host = root / f"{uid}.{request}.json"
        assert oct(host.stat().st_mode & 0o777) == "0o644"
        [v1beta1, _] = objects(host.read_bytes())
        assert [d["name"] for d in v1beta1["requests"][0]["devices"]] == names
        device = mounts[request]
        assert device.name == f"metadata_{request}"
        [mount] = device.edits.mounts
        assert mount.host_path == str(host)
        assert mount.container_path == container_path(DRIVER, "pair", None, request)
        assert mount.options == ("ro", "bind")
    # The claim's spec takes them as devices of its own.
    cdi = CdiSpecStore(tmp_path / "cdi", kind=claim_kind(DRIVER))
    spec = cdi.build(uid, list(mounts.values()))
    assert [d["name"] for d in spec["devices"]] == [f"{uid}-metadata_gpu", f"{uid}-metadata_pair"]
    ids = [i for d in mounts.values() for i in cdi.device_ids(uid, d)]
    assert mounted(ids)
    assert not mounted([f"k8s.gpu.nvidia.com/claim={uid}-gpu-0", "nvidia.com/gpu=GPU-1"])

    # Side by side in one folder: no folder per claim or request to make and remove.
    assert sorted(p.name for p in root.iterdir()) == [f"{uid}.gpu.json", f"{uid}.pair.json"]
    assert store.claim_uids() == [uid]
    store.remove(uid, ["pair", "gpu", "gpu"])
    assert list(root.iterdir()) == []
    store.remove(uid, ["gpu", "pair"])  # again: nothing to do


def test_the_sweep_removes_all_a_claim_left_and_only_that(tmp_path: Path) -> None:
    """The start-up sweep knows a claim by its UID alone: its files, a temp file a
    crash left and a folder named for it go; another claim's files and names that hold
    no claim UID stay."""
    root = tmp_path / "device-metadata"
    store = DeviceMetadataStore(root, driver=DRIVER)
    [gpu, *_] = devices("h100-80gb-hbm3-x8")
    uid, other = str(uuid.uuid4()), str(uuid.uuid4())
    for claim in (uid, other):
        store.write(
            namespace="n",
            claim_name="c",
            claim_uid=claim,
            pod_claim_name=None,
            requests=[MetadataRequest("gpu", (gpu,))],
        )
    (root / f".{uid}.pair.json.0a1b2c.tmp").write_bytes(b"{")
    (root / uid / "gpu").mkdir(parents=True)
    (root / "lost+found").mkdir()
    assert store.claim_uids() == sorted([uid, other])

    store.remove_claim(uid)

    assert sorted(p.name for p in root.iterdir()) == [f"{other}.gpu.json", "lost+found"]
    store.remove_claim(uid)  # again: nothing to do
    DeviceMetadataStore(tmp_path / "never-written", driver=None).remove_claim(uid)


@pytest.mark.parametrize("request_name", ["../checkpoint", "a/b", ".hidden"])
def test_a_request_name_from_a_record_never_names_a_file_outside_the_folder(
    tmp_path: Path, request_name: str
) -> None:
    """Whatever a checkpoint record says, a removal stays in the store's folder."""
    (tmp_path / "checkpoint.json").write_text("{}")
    store = DeviceMetadataStore(tmp_path / "device-metadata", driver=DRIVER)

    with pytest.raises(MetadataError, match="cannot name a file"):
        store.remove(str(uuid.uuid4()), [request_name])

    assert (tmp_path / "checkpoint.json").exists()


def test_a_store_that_writes_nothing_still_removes_and_names_only_claim_files(
    tmp_path: Path,
) -> None:
    root = tmp_path / "device-metadata"
    uid = str(uuid.uuid4())
    DeviceMetadataStore(root, driver=DRIVER).write(
        namespace="n",
        claim_name="c",
        claim_uid=uid,
        pod_claim_name=None,
        requests=[MetadataRequest("gpu", devices("h100-80gb-hbm3-x8")[:1])],
    )
    off = DeviceMetadataStore(root, driver=None)
    assert not off.writes
    with pytest.raises(MetadataError, match="writes no device metadata"):
        off.write(namespace="n", claim_name="c", claim_uid=uid, pod_claim_name=None, requests=[])
    with pytest.raises(CdiError):
        off.remove("../checkpoint.json", ["gpu"])

    off.remove(uid, ["gpu"])

    assert off.claim_uids() == []


# --- what Kubernetes' own readers make of the files ------------------------------------------


def read_with(version: str, path: Path) -> dict[str, Any]:
    """`path` decoded by upstream's reader of Kubernetes `version`, as a workload would."""
    try:
        return metadataread.read(version, path)
    except GoBuildError as exc:
        pytest.skip(f"the upstream reader cannot be built here: {exc}")


@pytest.mark.parametrize(
    ("profile", "strategy", "lists"),
    [
        ("h100-80gb-hbm3-x8", MigStrategy.STATIC, False),
        ("a100-40gb-mig-mixed", MigStrategy.STATIC, False),
        ("h100-80gb-hbm3-x8", MigStrategy.STATIC, True),
    ],
)
def test_kubernetes_readers_of_1_37_and_1_36_decode_the_files_and_1_37_validates_them(
    tmp_path: Path, profile: str, strategy: MigStrategy, lists: bool
) -> None:
    """Every device of a node, MIG devices included, in one request: the 1.37 reader
    takes v1beta1 and its validation finds nothing; the 1.36 reader, which knows only
    v1alpha1, skips the newer object and reads the same content. The NUMA node as a
    list too (`--numa-node-list`)."""
    store = DeviceMetadataStore(tmp_path, driver=DRIVER)
    listed = devices(profile, strategy, lists=lists)
    assert any(("ints" in d.attributes.get(NUMA_NODE_ATTRIBUTE, {})) is lists for d in listed)
    uid = str(uuid.uuid4())
    store.write(
        namespace="team-a",
        claim_name="trainer-0-gpu-x7k2p",
        claim_uid=uid,
        pod_claim_name="gpu",
        requests=[MetadataRequest("gpu", tuple(listed))],
    )
    path = tmp_path / f"{uid}.gpu.json"

    newest = read_with("1.37", path)
    oldest = read_with("1.36", path)

    assert newest["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
    assert newest["validation"] == ""
    for decoded in (newest["object"], oldest["object"]):
        assert (decoded["name"], decoded["namespace"], decoded["uid"]) == (
            "trainer-0-gpu-x7k2p",
            "team-a",
            uid,
        )
        assert decoded["PodClaimName"] == "gpu"
        [request] = decoded["Requests"]
        assert request["Name"] == "gpu"
        assert [
            (d["Driver"], d["Pool"], d["Name"], d["Attributes"]) for d in request["Devices"]
        ] == [(DRIVER, d.pool, d.name, d.attributes) for d in listed]
