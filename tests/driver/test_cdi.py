"""CDI specs: content, minimum cdiVersion, atomic files, safe names, toolkit lookup."""

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from gpudra.driver.cdi import (
    DEFAULT_KIND,
    LIBRARY_MOUNT_OPTIONS,
    CdiDevice,
    CdiError,
    CdiSpecStore,
    ContainerEdits,
    ConvertedEdits,
    DeviceNode,
    Hook,
    Mount,
    build_spec,
    cdi_device_name,
    convert_edits,
    driver_common_edits,
    find_driver_files,
    find_toolkit_spec,
    minimum_cdi_version,
    qualified_id,
    toolkit_device_ids,
    validate_claim_uid,
)
from gpudra.driver.nvml.standin import install_driver_root

from e2e.debian_driver import LIBRARY_DIR, debian_layout

UID = "0b7e4a2c-1d3f-4e5a-8b6c-7d8e9f0a1b2c"  # starts with a digit
UID_LETTER = "ab7e4a2c-1d3f-4e5a-8b6c-7d8e9f0a1b2c"
GPU_UUID = "GPU-4a2e1b5c-8a3d-4f61-9e0e-000000000001"
MIG_UUID = "MIG-5b3f2c6d-9b4e-5a72-8f1f-000000000002"


def _gpu_device(name: str = "gpu-0", minor: int = 0) -> CdiDevice:
    return CdiDevice(
        name=name,
        edits=ContainerEdits(
            env={"NVIDIA_VISIBLE_DEVICES": "void"},
            device_nodes=(DeviceNode(path=f"/dev/nvidia{minor}"),),
        ),
    )


def _no_temp_files(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


# --- spec content ---


def test_a_store_converts_the_same_common_edits_once(
    tmp_path: Path, conversions: list[ContainerEdits]
) -> None:
    """The node's control nodes and driver files are one object for every prepare:
    checked and converted for the first spec, reused after; other edits afresh."""
    converted = conversions
    store = CdiSpecStore(tmp_path)
    common = ContainerEdits(
        device_nodes=(DeviceNode("/dev/nvidiactl"),),
        mounts=(Mount("/usr/lib/libcuda.so.1", "/usr/lib/libcuda.so.1", ("ro", "rbind")),),
    )
    first = store.build(UID, [_gpu_device("gpu-0", 0)], common_edits=common)
    second = store.build(UID_LETTER, [_gpu_device("gpu-1", 1)], common_edits=common)
    assert converted.count(common) == 1 and len(converted) == 3  # + each spec's device
    assert first == build_spec(UID, [_gpu_device("gpu-0", 0)], common_edits=common)
    assert second["containerEdits"] == first["containerEdits"]
    other = ContainerEdits(device_nodes=(DeviceNode("/dev/nvidia-uvm"),))
    third = store.build(UID, [_gpu_device()], common_edits=other)
    assert third["containerEdits"] == {"deviceNodes": [{"path": "/dev/nvidia-uvm"}]}
    bad = ContainerEdits(env={"BAD=KEY": "x"})
    for _ in range(2):  # a bad one is refused every time, never kept
        with pytest.raises(CdiError, match="BAD=KEY"):
            store.build(UID, [_gpu_device()], common_edits=bad)


def test_converted_edits_are_kept_by_object_and_the_oldest_go_first() -> None:
    """Kept by identity: an equal but distinct object is converted on its own, a bad
    one is never kept, and beyond the limit the oldest is converted again."""
    converted = ConvertedEdits(limit=2)
    a, b, c = (_gpu_device(f"gpu-{i}", i).edits for i in range(3))
    first = converted(a)
    assert converted(a)[0] is first[0] and first == convert_edits(a)
    twin = _gpu_device("gpu-0", 0).edits
    assert twin == a and converted(twin)[0] is not first[0]  # its own
    converted(b)  # a's, the oldest, goes
    assert converted(b)[0] is converted(b)[0]
    assert converted(a)[0] is not first[0]  # converted again
    converted(c)
    bad = ContainerEdits(env={"BAD=KEY": "x"})
    for _ in range(2):
        with pytest.raises(CdiError, match="BAD=KEY"):
            converted(bad)
    hooked = ContainerEdits(additional_gids=(44,))
    assert converted(hooked) == ({"additionalGids": [44]}, 4)  # what 0.7.0 brings


def test_spec_has_one_device_per_prepared_device_and_common_edits_on_top() -> None:
    common = ContainerEdits(
        device_nodes=(DeviceNode("/dev/nvidiactl"), DeviceNode("/dev/nvidia-uvm")),
        mounts=(Mount("/usr/lib/libcuda.so.1", "/usr/lib/libcuda.so.1", ("ro", "rbind")),),
    )
    spec = build_spec(
        UID_LETTER, [_gpu_device("gpu-0", 0), _gpu_device("gpu-1", 1)], common_edits=common
    )
    assert spec["kind"] == DEFAULT_KIND == "k8s.gpu.nvidia.com/claim"
    assert [d["name"] for d in spec["devices"]] == [f"{UID_LETTER}-gpu-0", f"{UID_LETTER}-gpu-1"]
    assert spec["devices"][1]["containerEdits"] == {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [{"path": "/dev/nvidia1"}],
    }
    assert spec["containerEdits"] == {
        "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}],
        "mounts": [
            {
                "hostPath": "/usr/lib/libcuda.so.1",
                "containerPath": "/usr/lib/libcuda.so.1",
                "options": ["ro", "rbind"],
            }
        ],
    }
    assert spec["cdiVersion"] == "0.3.0"


def test_all_container_edit_fields_are_written_with_cdi_names() -> None:
    edits = ContainerEdits(
        device_nodes=(
            DeviceNode(
                "/dev/nvidia0",
                host_path="/host/dev/nvidia0",
                type="c",
                major=195,
                minor=0,
                file_mode=0o666,
                permissions="rw",
                uid=0,
                gid=44,
            ),
        ),
        mounts=(Mount("/a", "/b", ("ro",), "bind"),),
        hooks=(Hook("createContainer", "/usr/bin/hook", ("hook", "x"), ("A=1",), 5),),
        additional_gids=(44,),
    )
    spec = build_spec(UID, [CdiDevice("gpu-0", edits, annotations={"a.b/c": "d"})])
    device = spec["devices"][0]
    assert device["annotations"] == {"a.b/c": "d"}
    assert device["containerEdits"] == {
        "deviceNodes": [
            {
                "path": "/dev/nvidia0",
                "hostPath": "/host/dev/nvidia0",
                "type": "c",
                "permissions": "rw",
                "major": 195,
                "minor": 0,
                "fileMode": 0o666,
                "uid": 0,
                "gid": 44,
            }
        ],
        "mounts": [{"hostPath": "/a", "containerPath": "/b", "options": ["ro"], "type": "bind"}],
        "hooks": [
            {
                "hookName": "createContainer",
                "path": "/usr/bin/hook",
                "args": ["hook", "x"],
                "env": ["A=1"],
                "timeout": 5,
            }
        ],
        "additionalGids": [44],
    }
    assert spec["cdiVersion"] == "0.7.0"


@pytest.mark.parametrize(
    ("uid", "edits", "annotations", "expected"),
    [
        (UID_LETTER, ContainerEdits(env={"A": "1"}), None, "0.3.0"),
        (UID_LETTER, ContainerEdits(mounts=(Mount("/a", "/a", (), "bind"),)), None, "0.4.0"),
        (UID, ContainerEdits(env={"A": "1"}), None, "0.5.0"),  # name starts with a digit
        (
            UID_LETTER,
            ContainerEdits(device_nodes=(DeviceNode("/dev/x", host_path="/h/dev/x"),)),
            None,
            "0.5.0",
        ),
        (UID_LETTER, ContainerEdits(env={"A": "1"}), {"k": "v"}, "0.6.0"),
        (UID_LETTER, ContainerEdits(additional_gids=(5,)), None, "0.7.0"),
        (UID, ContainerEdits(additional_gids=(5,)), {"k": "v"}, "0.7.0"),
    ],
)
def test_cdi_version_is_the_lowest_the_fields_need(
    uid: str, edits: ContainerEdits, annotations: dict[str, str] | None, expected: str
) -> None:
    spec = build_spec(uid, [CdiDevice("gpu-0", edits)], annotations=annotations)
    assert spec["cdiVersion"] == expected


def test_cdi_version_counts_top_level_edits_and_dotted_class() -> None:
    top_gids = build_spec(
        UID_LETTER,
        [CdiDevice("d", ContainerEdits(env={"A": "1"}))],
        common_edits=ContainerEdits(additional_gids=(1,)),
    )
    assert top_gids["cdiVersion"] == "0.7.0"
    dotted = build_spec(
        UID_LETTER, [CdiDevice("d", ContainerEdits(env={"A": "1"}))], kind="v.example/a.b"
    )
    assert dotted["cdiVersion"] == "0.6.0"
    assert minimum_cdi_version({"kind": "a/b", "devices": [{"name": "x"}]}) == "0.3.0"


def test_toolkit_device_without_edits_gets_a_marker_so_the_spec_stays_valid() -> None:
    device = CdiDevice("gpu-0", toolkit_ids=(f"nvidia.com/gpu={GPU_UUID}",))
    spec = build_spec(UID, [device])
    assert spec["devices"][0]["containerEdits"] == {"env": ["GPUDRA_DEVICE_GPU_0=gpu-0"]}
    assert "containerEdits" not in spec


@pytest.mark.parametrize(
    "device",
    [
        CdiDevice("gpu 0", ContainerEdits(env={"A": "1"})),
        CdiDevice("gpu/0", ContainerEdits(env={"A": "1"})),
        CdiDevice("gpu-", ContainerEdits(env={"A": "1"})),
        CdiDevice("gpu-0", ContainerEdits(device_nodes=(DeviceNode("dev/nvidia0"),))),
        CdiDevice("gpu-0", ContainerEdits(mounts=(Mount("/a", "relative"),))),
        CdiDevice("gpu-0", ContainerEdits(env={"A=B": "1"})),
        CdiDevice("gpu-0", ContainerEdits(hooks=(Hook("preStart", "/bin/x"),))),  # type: ignore[arg-type]
        CdiDevice("gpu-0", ContainerEdits(device_nodes=(DeviceNode("/d", type="x"),))),  # type: ignore[arg-type]
        CdiDevice("gpu-0", ContainerEdits(device_nodes=(DeviceNode("/d", permissions="rx"),))),
        CdiDevice("gpu-0", ContainerEdits(env={"A": "1"}), annotations={"bad key!": "v"}),
        # What the CDI library (v1.1.1, vendored by containerd) refuses to load.
        CdiDevice("gpu-0", ContainerEdits(hooks=(Hook("createContainer", "/x", env=("A",)),))),
        CdiDevice("gpu-0", ContainerEdits(hooks=(Hook("createContainer", "/x", env=("=1",)),))),
        CdiDevice("gpu-0", ContainerEdits(device_nodes=(DeviceNode("/d", uid=2**32),))),
        CdiDevice("gpu-0", ContainerEdits(device_nodes=(DeviceNode("/d", gid=2**32),))),
        CdiDevice("gpu-0", ContainerEdits(device_nodes=(DeviceNode("/d", file_mode=2**32),))),
        CdiDevice("gpu-0", ContainerEdits(device_nodes=(DeviceNode("/d", major=2**63),))),
        CdiDevice("gpu-0", ContainerEdits(device_nodes=(DeviceNode("/d", minor=-1),))),
        CdiDevice("gpu-0", ContainerEdits(additional_gids=(2**32,))),
    ],
)
def test_invalid_device_input_is_rejected(device: CdiDevice) -> None:
    with pytest.raises(CdiError):
        build_spec(UID, [device])


def test_the_widest_numbers_the_library_loads_are_written() -> None:
    node = DeviceNode("/d", major=2**63 - 1, minor=0, file_mode=2**32 - 1, uid=2**32 - 1, gid=0)
    edits = ContainerEdits(
        device_nodes=(node,),
        hooks=(Hook("createContainer", "/x", env=("A=", "B=c=d")),),
        additional_gids=(2**32 - 1,),
    )
    spec = build_spec(UID, [CdiDevice("gpu-0", edits)])
    (device,) = spec["devices"]
    got = device["containerEdits"]
    assert got["deviceNodes"][0]["uid"] == 2**32 - 1
    assert got["hooks"][0]["env"] == ["A=", "B=c=d"]
    assert got["additionalGids"] == [2**32 - 1]


def test_spec_needs_a_device_and_unique_names() -> None:
    with pytest.raises(CdiError, match="at least one device"):
        build_spec(UID, [])
    with pytest.raises(CdiError, match="twice"):
        build_spec(UID, [_gpu_device(), _gpu_device()])


@pytest.mark.parametrize("kind", ["nvidia.com", "/claim", "vendor/", "a/b/c", "1abc/claim", "a/b-"])
def test_invalid_kind_rejected(kind: str) -> None:
    with pytest.raises(CdiError, match="vendor/class"):
        build_spec(UID, [_gpu_device()], kind=kind)


def test_qualified_ids() -> None:
    name = cdi_device_name(UID, "gpu-0")
    assert name == f"{UID}-gpu-0"
    assert qualified_id(name) == f"k8s.gpu.nvidia.com/claim={UID}-gpu-0"
    assert qualified_id("x", "v.example/c") == "v.example/c=x"
    store = CdiSpecStore(Path("/nonexistent"))
    device = CdiDevice("gpu-0", toolkit_ids=(f"nvidia.com/gpu={GPU_UUID}",))
    assert store.device_ids(UID, device) == [
        f"k8s.gpu.nvidia.com/claim={UID}-gpu-0",
        f"nvidia.com/gpu={GPU_UUID}",
    ]
    with pytest.raises(CdiError):
        qualified_id("-bad")


# --- claim UIDs never reach the file system unchecked ---

MALICIOUS_UIDS = [
    "../../etc/passwd",
    "../" + UID,
    UID + "/../x",
    "a/b",
    "",
    ".",
    "..",
    UID.upper(),
    UID + "\n",
    UID + "\x00",
    UID[:-1] + "/",
    "0b7e4a2c1d3f4e5a8b6c7d8e9f0a1b2c",
]


@pytest.mark.parametrize("uid", MALICIOUS_UIDS)
def test_malicious_claim_uids_are_rejected_everywhere(tmp_path: Path, uid: str) -> None:
    store = CdiSpecStore(tmp_path / "cdi")
    with pytest.raises(CdiError, match="Kubernetes UID"):
        validate_claim_uid(uid)
    with pytest.raises(CdiError):
        store.spec_path(uid)
    with pytest.raises(CdiError):
        store.write_claim(uid, [_gpu_device()])
    with pytest.raises(CdiError):
        store.remove(uid)
    assert not (tmp_path / "cdi").exists() or not list((tmp_path / "cdi").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["cdi"])


# --- files ---


def test_write_is_complete_json_with_no_temp_file_left(tmp_path: Path) -> None:
    root = tmp_path / "run" / "cdi"
    store = CdiSpecStore(root)
    store.write_claim(UID, [_gpu_device()])
    path = store.spec_path(UID)
    assert path == root / f"k8s.gpu.nvidia.com-claim_{UID}.json"
    spec = json.loads(path.read_text())
    assert spec["devices"][0]["name"] == f"{UID}-gpu-0"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert _no_temp_files(root)


def test_spec_mode_is_exact_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o077)
    try:
        store = CdiSpecStore(tmp_path)
        store.write_claim(UID, [_gpu_device()])
        path = store.spec_path(UID)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_write_recreates_a_removed_cdi_folder(tmp_path: Path) -> None:
    root = tmp_path / "cdi"
    store = CdiSpecStore(root)
    store.write_claim(UID, [_gpu_device()])
    store.remove(UID)
    root.rmdir()  # e.g. a tmpfs remounted under a running agent
    store.write_claim(UID, [_gpu_device()])
    path = store.spec_path(UID)
    assert json.loads(path.read_text())["devices"][0]["name"] == f"{UID}-gpu-0"
    assert stat.S_IMODE(root.stat().st_mode) == 0o755


def test_failed_rename_leaves_previous_spec_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CdiSpecStore(tmp_path)
    store.write_claim(UID, [_gpu_device("gpu-0")])
    path = store.spec_path(UID)
    before = path.read_bytes()

    def broken_replace(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space"):
        store.write_claim(UID, [_gpu_device("gpu-1", 1)])
    assert path.read_bytes() == before
    assert _no_temp_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_failed_first_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CdiSpecStore(tmp_path, durable=True)

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="Input/output"):
        store.write_claim(UID, [_gpu_device()])
    assert list(tmp_path.iterdir()) == []
    assert store.list_claim_uids() == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_leaves_nothing(tmp_path: Path) -> None:
    store = CdiSpecStore(tmp_path)
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            store.write_claim(UID, [_gpu_device()])
    finally:
        tmp_path.chmod(0o755)
    assert list(tmp_path.iterdir()) == []


def test_rewrite_replaces_whole_spec(tmp_path: Path) -> None:
    store = CdiSpecStore(tmp_path)
    store.write_claim(UID, [_gpu_device("gpu-0"), _gpu_device("gpu-1", 1)])
    store.write_claim(UID, [_gpu_device("gpu-2", 2)])
    path = store.spec_path(UID)
    assert [d["name"] for d in json.loads(path.read_text())["devices"]] == [f"{UID}-gpu-2"]


def test_write_refuses_spec_of_another_kind(tmp_path: Path) -> None:
    store = CdiSpecStore(tmp_path)
    spec = build_spec(UID, [_gpu_device()], kind="nvidia.com/gpu")
    with pytest.raises(CdiError, match="kind"):
        store.write(UID, spec)


def test_remove_is_idempotent(tmp_path: Path) -> None:
    store = CdiSpecStore(tmp_path)
    store.write_claim(UID, [_gpu_device()])
    path = store.spec_path(UID)
    assert store.remove(UID) is True
    assert not path.exists()
    assert store.remove(UID) is False
    assert CdiSpecStore(tmp_path / "missing").remove(UID) is False


def test_list_returns_only_our_specs(tmp_path: Path) -> None:
    store = CdiSpecStore(tmp_path)
    store.write_claim(UID, [_gpu_device()])
    store.write_claim(UID_LETTER, [_gpu_device()])
    CdiSpecStore(tmp_path, kind="example.com/other").write_claim(
        "11111111-2222-3333-4444-555555555555", [_gpu_device()]
    )
    (tmp_path / "nvidia.yaml").write_text("kind: nvidia.com/gpu\n")
    (tmp_path / "k8s.gpu.nvidia.com-claim_not-a-uid.json").write_text("{}")
    (tmp_path / f"k8s.gpu.nvidia.com-claim_{UID}.yaml").write_text("{}")
    (tmp_path / f".k8s.gpu.nvidia.com-claim_{UID}.json.abc.tmp").write_text("{")
    assert store.list_claim_uids() == sorted([UID, UID_LETTER])
    assert CdiSpecStore(tmp_path / "missing").list_claim_uids() == []


def test_remove_temp_files_only_touches_ours(tmp_path: Path) -> None:
    store = CdiSpecStore(tmp_path)
    ours = tmp_path / f".k8s.gpu.nvidia.com-claim_{UID}.json.abc.tmp"
    theirs = tmp_path / ".nvidia.yaml.tmp"
    ours.write_text("{")
    theirs.write_text("x")
    assert store.remove_temp_files() == 1
    assert not ours.exists() and theirs.exists()


# --- common edits from the driver installation ---


def _host(tmp_path: Path, *files: str) -> Path:
    """`files` under `tmp_path`, those in a `bin` folder executable."""
    for name in files:
        path = tmp_path / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        if path.parent.name in ("bin", "sbin"):
            path.chmod(0o755)
    return tmp_path


def test_driver_common_edits_skip_missing_nodes_and_libraries(tmp_path: Path) -> None:
    host = _host(
        tmp_path,
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/run/nvidia/driver/usr/lib64/libcuda.so.580.1",
    )
    edits = driver_common_edits(
        driver_root=Path("/run/nvidia/driver"),
        libraries=["/usr/lib64/libcuda.so.580.1", "/usr/lib64/libnvidia-ml.so.580.1"],
        host_view=host,
    )
    assert [n.path for n in edits.device_nodes] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert all(n.host_path is None for n in edits.device_nodes)
    assert edits.mounts == (
        Mount(
            "/run/nvidia/driver/usr/lib64/libcuda.so.580.1",
            "/usr/lib64/libcuda.so.580.1",
            LIBRARY_MOUNT_OPTIONS,
        ),
    )


def test_driver_files_are_found_under_the_driver_root(tmp_path: Path) -> None:
    host = _host(
        tmp_path,
        "/run/nvidia/driver/usr/lib64/libcuda.so.580.65.06",
        "/run/nvidia/driver/usr/lib64/libnvidia-ml.so.580.65.06",
        "/run/nvidia/driver/usr/lib64/libfoo.so.1",
        "/run/nvidia/driver/usr/bin/nvidia-smi",
        "/run/nvidia/driver/bin/nvidia-smi",
        "/run/nvidia/driver/usr/bin/bash",
    )
    lib64 = host / "run/nvidia/driver/usr/lib64"
    (lib64 / "libcuda.so.1").symlink_to("libcuda.so.580.65.06")
    root = Path("/run/nvidia/driver")

    files = find_driver_files(root, host_view=host)

    assert files == (
        "/usr/lib64/libcuda.so.1",
        "/usr/lib64/libcuda.so.580.65.06",
        "/usr/lib64/libnvidia-ml.so.580.65.06",
        "/usr/bin/nvidia-smi",
    )
    edits = driver_common_edits(driver_root=root, libraries=files, host_view=host)
    assert [m.container_path for m in edits.mounts] == list(files)
    # The soname link is mounted from the file it names inside the root.
    assert edits.mounts[0].host_path == "/run/nvidia/driver/usr/lib64/libcuda.so.580.65.06"
    assert edits.env == {
        "LD_LIBRARY_PATH": "/usr/lib64:/usr/local/nvidia/lib:/usr/local/nvidia/lib64"
    }
    assert find_driver_files(Path("/opt/none"), host_view=host) == ()


def test_driver_common_edits_with_separate_dev_root_use_host_path(tmp_path: Path) -> None:
    host = _host(tmp_path, "/run/nvidia/driver/dev/nvidiactl")
    edits = driver_common_edits(dev_root=Path("/run/nvidia/driver"), host_view=host)
    assert edits.device_nodes == (
        DeviceNode("/dev/nvidiactl", host_path="/run/nvidia/driver/dev/nvidiactl"),
    )
    spec = build_spec(UID_LETTER, [_gpu_device()], common_edits=edits)
    assert spec["cdiVersion"] == "0.5.0"


def test_driver_common_edits_reject_escaping_library_paths() -> None:
    with pytest.raises(CdiError):
        driver_common_edits(libraries=["/usr/lib/../../etc/shadow"], host_view=None)
    with pytest.raises(CdiError):
        driver_common_edits(libraries=["usr/lib/libcuda.so"], host_view=None)


def test_driver_common_edits_without_checks() -> None:
    edits = driver_common_edits(libraries=["/usr/lib/libcuda.so.1"], host_view=None)
    assert len(edits.device_nodes) == 3
    assert edits.mounts[0].host_path == "/usr/lib/libcuda.so.1"


# --- the NVIDIA container toolkit's spec ---

TOOLKIT_YAML = f"""---
cdiVersion: 0.5.0
containerEdits:
  deviceNodes:
  - path: /dev/nvidiactl
devices:
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: "0"
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: {GPU_UUID}
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia-caps/nvidia-cap21
  name: "0:1"
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia-caps/nvidia-cap21
  name: {MIG_UUID}
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: all
kind: nvidia.com/gpu
"""


def test_toolkit_yaml_spec_maps_uuids_to_its_ids(tmp_path: Path) -> None:
    spec_path = tmp_path / "etc" / "cdi" / "nvidia.yaml"
    spec_path.parent.mkdir(parents=True)
    spec_path.write_text(TOOLKIT_YAML)
    paths = [spec_path, tmp_path / "etc" / "cdi" / "nvidia.json"]
    spec = find_toolkit_spec(paths)
    assert spec is not None and spec.path == spec_path
    assert spec.device_ids(GPU_UUID) == [f"nvidia.com/gpu={GPU_UUID}"]
    assert spec.device_ids(MIG_UUID) == [f"nvidia.com/gpu={MIG_UUID}"]
    assert spec.device_ids("GPU-unknown") == []
    assert spec.device_ids("GPU-unknown", index="0:1") == ["nvidia.com/gpu=0:1"]
    assert toolkit_device_ids(GPU_UUID, paths=paths) == [f"nvidia.com/gpu={GPU_UUID}"]


def test_toolkit_json_spec_with_index_names_only(tmp_path: Path) -> None:
    spec_path = tmp_path / "nvidia.json"
    doc = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}],
    }
    spec_path.write_text(json.dumps(doc))
    assert toolkit_device_ids(GPU_UUID, paths=[spec_path]) == []
    assert toolkit_device_ids(GPU_UUID, index="0", paths=[spec_path]) == ["nvidia.com/gpu=0"]


def test_missing_broken_or_foreign_toolkit_specs_are_ignored(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: [unclosed\n")
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"kind": "example.com/dev", "devices": [{"name": GPU_UUID}]}))
    paths = [tmp_path / "absent.yaml", broken, foreign]
    assert find_toolkit_spec(paths) is None
    assert toolkit_device_ids(GPU_UUID, paths=paths) == []
    good = tmp_path / "nvidia.yaml"
    good.write_text(TOOLKIT_YAML)
    assert toolkit_device_ids(GPU_UUID, paths=[*paths, good]) == [f"nvidia.com/gpu={GPU_UUID}"]


def test_numbered_nodes_are_listed_without_host_nodes(tmp_path: Path) -> None:
    """Emulated GPUs: the host has no /dev/nvidia*, so the spec carries each node's
    type and numbers and the runtime makes the node itself."""
    host = _host(tmp_path)  # nothing under /dev
    numbers = {"/dev/nvidiactl": (195, 255), "/dev/nvidia-uvm": (510, 0)}
    edits = driver_common_edits(host_view=host, device_numbers=numbers.get)
    assert edits.device_nodes == (
        DeviceNode("/dev/nvidiactl", type="c", major=195, minor=255),
        DeviceNode("/dev/nvidia-uvm", type="c", major=510, minor=0),
    )
    spec = build_spec(UID_LETTER, [_gpu_device()], common_edits=edits)
    assert spec["containerEdits"]["deviceNodes"][0] == {
        "path": "/dev/nvidiactl",
        "type": "c",
        "major": 195,
        "minor": 255,
    }
    # Without numbers, missing nodes are still left out.
    assert driver_common_edits(host_view=host).device_nodes == ()


def test_a_debian_packaged_driver_is_mounted_through_its_alternatives_links(
    tmp_path: Path,
) -> None:
    """Debian links the libraries and nvidia-smi through /etc/alternatives, with
    absolute links. Seen under /host (the chart's agent), they name the agent's own
    files, and the runtime on the host would follow them outside a driver container's
    root: the spec mounts the file each resolves to inside the root, under its name."""
    host = tmp_path / "host"
    root = Path("/run/nvidia/driver")
    install_driver_root(host / str(root).lstrip("/"), "535.261.03")
    debian_layout(host / str(root).lstrip("/"))
    # Debian's nvidia-cuda-mps package puts the MPS server in /usr/sbin.
    _host(host, f"{root}/usr/sbin/nvidia-cuda-mps-server")

    files = find_driver_files(root, host_view=host)

    assert files == (
        f"/{LIBRARY_DIR}/libcuda.so.1",
        f"/{LIBRARY_DIR}/libnvidia-ml.so.1",
        "/usr/bin/nvidia-smi",
        "/usr/bin/nvidia-cuda-mps-control",
        "/usr/sbin/nvidia-cuda-mps-server",
    )
    edits = driver_common_edits(driver_root=root, libraries=files, host_view=host)
    assert {m.container_path: m.host_path for m in edits.mounts} == {
        f"/{LIBRARY_DIR}/libcuda.so.1": (
            f"{root}/{LIBRARY_DIR}/nvidia/current/libcuda.so.535.261.03"
        ),
        f"/{LIBRARY_DIR}/libnvidia-ml.so.1": (
            f"{root}/{LIBRARY_DIR}/nvidia/current/libnvidia-ml.so.535.261.03"
        ),
        "/usr/bin/nvidia-smi": f"{root}/usr/lib/nvidia/current/nvidia-smi",
        "/usr/bin/nvidia-cuda-mps-control": f"{root}/usr/bin/nvidia-cuda-mps-control",
        "/usr/sbin/nvidia-cuda-mps-server": f"{root}/usr/sbin/nvidia-cuda-mps-server",
    }
    assert edits.env["LD_LIBRARY_PATH"].startswith(f"/{LIBRARY_DIR}:")


def test_names_that_are_no_regular_file_are_neither_listed_nor_mounted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder named like a library (upstream's driver mounted such a folder until it
    checked) and a soname link left dangling by a removed driver: neither is mounted,
    so neither fails the container's start, and the file in the next folder is found."""
    host = _host(tmp_path, "/usr/lib64/libnvidia-ml.so.580.1")
    (host / LIBRARY_DIR / "libnvidia-ml.so.1").mkdir(parents=True)
    (host / LIBRARY_DIR / "libcuda.so.1").symlink_to("libcuda.so.550.1")
    (host / "usr/lib64/libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.1")

    with caplog.at_level(logging.INFO, logger="gpudra.driver.driverroot"):
        files = find_driver_files(Path("/"), host_view=host)

    assert files == ("/usr/lib64/libnvidia-ml.so.1", "/usr/lib64/libnvidia-ml.so.580.1")
    skipped = {
        r.fields["path"]  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage().startswith("driver file skipped")
    }
    assert skipped == {f"/{LIBRARY_DIR}/libnvidia-ml.so.1", f"/{LIBRARY_DIR}/libcuda.so.1"}
    # Named explicitly (`--driver-library`), they are left out of the spec too.
    named = (f"/{LIBRARY_DIR}/libnvidia-ml.so.1", f"/{LIBRARY_DIR}/libcuda.so.1", *files)
    edits = driver_common_edits(libraries=named, host_view=host)
    assert [m.container_path for m in edits.mounts] == list(files)


def test_a_utility_is_mounted_from_the_first_folder_where_it_is_a_program(
    tmp_path: Path,
) -> None:
    """The container toolkit's folders, `usr/bin` first; a file there that no one may
    run (or a folder of the name) is passed over for the next folder's program."""
    host = _host(
        tmp_path,
        "/usr/sbin/nvidia-smi",
        "/usr/local/bin/nvidia-debugdump",
        "/sbin/nvidia-persistenced",
    )
    (host / "usr/bin").mkdir(parents=True, exist_ok=True)
    (host / "usr/bin/nvidia-smi").write_text("")  # not executable
    (host / "usr/bin/nvidia-debugdump").mkdir()

    files = find_driver_files(Path("/"), host_view=host)

    assert files == (
        "/usr/sbin/nvidia-smi",
        "/usr/local/bin/nvidia-debugdump",
        "/sbin/nvidia-persistenced",
    )
