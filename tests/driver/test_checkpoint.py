"""Checkpoint of prepared claims: persistence, compatibility, reboots, exclusivity."""

import asyncio
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from gpudra.common.files import atomic_write
from gpudra.driver import checkpoint as checkpoint_module
from gpudra.driver.checkpoint import (
    CHECKPOINT_MAJOR_VERSION,
    CHECKPOINT_VERSION,
    Checkpoint,
    CheckpointError,
    CheckpointTooNewError,
    ClaimRef,
    ClaimState,
    DeviceConflictError,
    DeviceKey,
    DeviceRecord,
    GroupCommit,
    document,
    load,
)
from gpudra.driver.checkpoint_changes import ChangesFile
from gpudra.driver.records import (
    CreatedMig,
    DeviceDetails,
    MpsStarted,
    TimeSliceSet,
    details_from_json,
    details_to_json,
)
from hypothesis import given, settings
from hypothesis import strategies as st

BOOT_A = "6c0ff6d4-1b2d-4a3e-9f00-00000000000a"
BOOT_B = "6c0ff6d4-1b2d-4a3e-9f00-00000000000b"
CLAIM_1 = ClaimRef(namespace="ns", uid="11111111-1111-1111-1111-111111111111", name="claim-1")
CLAIM_2 = ClaimRef(namespace="ns", uid="22222222-2222-2222-2222-222222222222", name="claim-2")
CLAIM_3 = ClaimRef(namespace="other", uid="33333333-3333-3333-3333-333333333333", name="claim-3")


@pytest.fixture
def boot(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text(BOOT_A + "\n")
    return path


@pytest.fixture
def cp_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "checkpoint.json"


def _load(cp_path: Path, boot: Path) -> Checkpoint:
    return load(cp_path, boot_id_path=boot)


def _gpu(device: str = "gpu-0", **kwargs: Any) -> DeviceRecord:
    defaults: dict[str, Any] = {
        "pool": "node-a",
        "device": device,
        "request_names": ("gpu",),
        "cdi_device_ids": (f"k8s.gpu.nvidia.com/claim=x-{device}",),
    }
    defaults.update(kwargs)
    return DeviceRecord(**defaults)


def _doc(cp_path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(cp_path.read_text())
    return doc


# --- basic lifecycle, persisted before each call returns ---


def test_missing_file_is_an_empty_checkpoint(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    assert checkpoint.claims() == []
    assert checkpoint.boot_id == BOOT_A
    assert not cp_path.exists()


def test_prepare_lifecycle_is_persisted_at_each_step(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    started = checkpoint.begin_prepare(CLAIM_1)
    assert started.state is ClaimState.PREPARE_STARTED
    assert _load(cp_path, boot).get(CLAIM_1.uid) == started

    mig = CreatedMig(profile_id=9, profile="3g.40gb", start=0, size=4, gi=3)
    partial = [_gpu(details=DeviceDetails(gpu_uuid="GPU-1", mig=mig))]
    checkpoint.record_progress(CLAIM_1.uid, partial)
    reread = _load(cp_path, boot).get(CLAIM_1.uid)
    assert reread is not None and reread.devices[0].details.mig == mig
    assert reread.state is ClaimState.PREPARE_STARTED

    done = checkpoint.complete_prepare(CLAIM_1.uid, [_gpu(share_id="s-1")])
    assert done.completed
    reread = _load(cp_path, boot).get(CLAIM_1.uid)
    assert reread == done
    assert reread.ref == CLAIM_1
    assert _doc(cp_path)["claims"][CLAIM_1.uid]["state"] == "PrepareCompleted"
    assert _doc(cp_path)["version"] == CHECKPOINT_VERSION
    assert _doc(cp_path)["bootId"] == BOOT_A

    assert checkpoint.remove(CLAIM_1.uid) is True
    assert _load(cp_path, boot).get(CLAIM_1.uid) is None
    assert checkpoint.remove(CLAIM_1.uid) is False


def test_begin_prepare_returns_existing_record_unchanged(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1)
    done = checkpoint.complete_prepare(CLAIM_1.uid, [_gpu()])
    mtime = cp_path.stat().st_mtime_ns
    assert checkpoint.begin_prepare(CLAIM_1, [_gpu("gpu-1")]) == done
    assert cp_path.stat().st_mtime_ns == mtime


def test_progress_and_completion_need_a_started_record(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    with pytest.raises(CheckpointError, match="begin_prepare"):
        checkpoint.complete_prepare(CLAIM_1.uid, [])
    checkpoint.begin_prepare(CLAIM_1)
    checkpoint.complete_prepare(CLAIM_1.uid, [_gpu()])
    with pytest.raises(CheckpointError, match="already prepared"):
        checkpoint.record_progress(CLAIM_1.uid, [])


def test_incomplete_prepares_are_reported_after_restart(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1, [_gpu("gpu-0")])
    checkpoint.begin_prepare(CLAIM_2, [_gpu("gpu-1")])
    checkpoint.complete_prepare(CLAIM_2.uid, [_gpu("gpu-1")])
    # "crash": a new process reads the file
    incomplete = _load(cp_path, boot).incomplete()
    assert [c.uid for c in incomplete] == [CLAIM_1.uid]
    assert incomplete[0].devices[0].device == "gpu-0"


# --- compatibility across releases ---


def _foreign_file(cp_path: Path, version: int) -> dict[str, Any]:
    doc = {
        "version": version,
        "bootId": BOOT_A,
        "futureTopLevel": {"nested": [1, 2]},
        "claims": {
            CLAIM_1.uid: {
                "uid": CLAIM_1.uid,
                "namespace": "ns",
                "name": "claim-1",
                "state": "PrepareCompleted",
                "futureClaimField": "keep me",
                "devices": [
                    {
                        "pool": "node-a",
                        "device": "gpu-0",
                        "requestNames": ["gpu"],
                        "cdiDeviceIds": ["k8s.gpu.nvidia.com/claim=x"],
                        "adminAccess": False,
                        "exclusive": True,
                        "details": {},
                        "futureDeviceField": {"a": 1},
                    }
                ],
            }
        },
    }
    cp_path.parent.mkdir(parents=True, exist_ok=True)
    cp_path.write_text(json.dumps(doc))
    return doc


@pytest.mark.parametrize("version", [CHECKPOINT_VERSION, CHECKPOINT_VERSION + 7])
def test_unknown_fields_survive_a_rewrite(cp_path: Path, boot: Path, version: int) -> None:
    _foreign_file(cp_path, version)
    checkpoint = _load(cp_path, boot)
    assert checkpoint.file_version == version
    record = checkpoint.get(CLAIM_1.uid)
    assert record is not None and record.completed
    assert record.devices[0].extra == {"futureDeviceField": {"a": 1}}

    checkpoint.begin_prepare(CLAIM_2)  # any rewrite

    doc = _doc(cp_path)
    assert doc["version"] == CHECKPOINT_VERSION
    assert doc["futureTopLevel"] == {"nested": [1, 2]}
    claim = doc["claims"][CLAIM_1.uid]
    assert claim["futureClaimField"] == "keep me"
    assert claim["devices"][0]["futureDeviceField"] == {"a": 1}
    assert CLAIM_2.uid in doc["claims"]


def test_a_future_major_version_is_refused_and_left_untouched(cp_path: Path, boot: Path) -> None:
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION + 1)
    doc["majorVersion"] = CHECKPOINT_MAJOR_VERSION + 1
    cp_path.write_text(json.dumps(doc))
    before = cp_path.read_bytes()
    with pytest.raises(CheckpointTooNewError) as refused:
        _load(cp_path, boot)
    line = str(refused.value)
    assert "\n" not in line
    assert f"has majorVersion {CHECKPOINT_MAJOR_VERSION + 1}, written by a newer" in line
    assert "run that release or a newer one on this node" in line
    assert cp_path.read_bytes() == before
    assert [p.name for p in cp_path.parent.iterdir()] == [cp_path.name]


@pytest.mark.parametrize("major", ["2", 0, True])
def test_a_malformed_major_version_is_refused(cp_path: Path, boot: Path, major: Any) -> None:
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION)
    doc["majorVersion"] = major
    cp_path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"majorVersion .* is not a positive whole number"):
        _load(cp_path, boot)


def test_the_current_major_version_is_read(cp_path: Path, boot: Path) -> None:
    """A file a killed agent left extended by its changes file is read with them; a
    write that no change will be appended to says it is whole again."""
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION)
    doc["majorVersion"] = CHECKPOINT_MAJOR_VERSION
    cp_path.write_text(json.dumps(doc))
    checkpoint = _load(cp_path, boot)
    assert checkpoint.get(CLAIM_1.uid) is not None
    checkpoint.begin_prepare(CLAIM_2)
    assert "majorVersion" not in _doc(cp_path)
    assert set(_file_claims(cp_path)) == {CLAIM_1.uid, CLAIM_2.uid}


def _read_alone(cp_path: Path) -> dict[str, Any] | None:
    """What a release from before the changes file reads: the file alone, refused
    (None) when its majorVersion is above 1."""
    return None if _doc(cp_path).get("majorVersion", 1) > 1 else _file_claims(cp_path)


@pytest.mark.anyio
async def test_a_release_that_reads_the_file_alone_never_misses_an_appended_change(
    cp_path: Path, boot: Path
) -> None:
    """The agent appends prepares' ends and removals beside the file and folds them in
    only when it stops. Killed before that, the file alone lacks them: a release from
    before the changes file (reading majorVersion 1 only) would roll back a prepare
    that ended, destroying a running pod's MIG instance, or keep a removed claim. So
    at every step the file alone is refused by such a release or holds every change."""
    commit = GroupCommit(load(cp_path, boot_id_path=boot, take_over=True))

    def check() -> None:
        alone = _read_alone(cp_path)
        assert alone is None or alone == document(cp_path)["claims"]

    check()
    steps: list[Callable[[Checkpoint], object]] = []
    for ref, device in ((CLAIM_1, "gpu-0"), (CLAIM_2, "gpu-1")):
        steps.append(lambda cp, r=ref, d=device: cp.begin_prepare(r, [_gpu(d)]))
        steps.append(lambda cp, r=ref, d=device: cp.complete_prepare(r.uid, [_gpu(d)]))
    steps.append(lambda cp: cp.remove(CLAIM_1.uid))
    for step in steps:
        await commit.apply(step)
        check()
    assert ChangesFile(cp_path).read() != b""  # the changes were appended
    assert _read_alone(cp_path) is None

    # Killed here: this release reads the file with its changes, and goes on.
    again = GroupCommit(load(cp_path, boot_id_path=boot, take_over=True))
    assert [c.uid for c in again.checkpoint.claims()] == [CLAIM_2.uid]
    await again.apply(lambda cp: cp.remove(CLAIM_2.uid))
    check()

    await again.compact()  # the stop: whole again, for any release
    assert _read_alone(cp_path) == {} == document(cp_path)["claims"]


def test_claim_level_unknown_fields_survive_completion(cp_path: Path, boot: Path) -> None:
    _foreign_file(cp_path, CHECKPOINT_VERSION + 1)
    doc = _doc(cp_path)
    doc["claims"][CLAIM_1.uid]["state"] = "PrepareStarted"
    cp_path.write_text(json.dumps(doc))
    checkpoint = _load(cp_path, boot)
    checkpoint.complete_prepare(CLAIM_1.uid, [_gpu()])
    assert _doc(cp_path)["claims"][CLAIM_1.uid]["futureClaimField"] == "keep me"


def test_old_file_without_version_or_boot_id_is_read(cp_path: Path, boot: Path) -> None:
    cp_path.parent.mkdir(parents=True)
    record = {"uid": CLAIM_1.uid, "state": "PrepareCompleted", "devices": []}
    cp_path.write_text(json.dumps({"claims": {CLAIM_1.uid: record}}))
    checkpoint = _load(cp_path, boot)
    assert checkpoint.file_version is None
    assert checkpoint.get(CLAIM_1.uid) is not None


def test_an_unknown_state_is_kept_and_reported_not_rolled_back(cp_path: Path, boot: Path) -> None:
    """A newer release's state may mean prepared and in use: rolling the claim back could
    take a running pod's devices, so the record is kept as it is and reported."""
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION + 1)
    doc["claims"][CLAIM_1.uid]["state"] = "UnprepareStarted"
    cp_path.write_text(json.dumps(doc))
    checkpoint = _load(cp_path, boot)
    assert checkpoint.incomplete() == []
    assert checkpoint.get(CLAIM_1.uid) is None
    assert checkpoint.unreadable()[CLAIM_1.uid]["state"] == "UnprepareStarted"
    problem = checkpoint.unreadable_problem(CLAIM_1.uid)
    assert problem is not None and "state 'UnprepareStarted' is not one this release" in problem
    checkpoint.begin_prepare(CLAIM_2)
    assert _doc(cp_path)["claims"][CLAIM_1.uid]["state"] == "UnprepareStarted"


def test_a_side_effect_of_an_unknown_kind_is_a_problem() -> None:
    """A newer release's side effect (an object under a key this one does not know)
    cannot be undone here; a descriptive value of its is kept and ignored."""
    details = details_from_json(
        {"type": "gpu", "powerLimit": {"uuid": "GPU-1", "previous": 300}, "note": "x"}
    )
    assert list(details.problems) == ["powerLimit"]
    assert "a side effect this release does not know" in details.problems["powerLimit"]
    assert details_to_json(details)["powerLimit"] == {"uuid": "GPU-1", "previous": 300}
    assert details_from_json({"type": "gpu", "note": "x"}).problems == {}


def test_unreadable_record_is_kept_and_reported(cp_path: Path, boot: Path) -> None:
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION + 1)
    weird = {"uid": CLAIM_3.uid, "state": "PrepareCompleted", "devices": {"as": "map"}}
    doc["claims"][CLAIM_3.uid] = weird
    cp_path.write_text(json.dumps(doc))
    checkpoint = _load(cp_path, boot)
    assert checkpoint.unreadable() == {CLAIM_3.uid: weird}
    assert checkpoint.get(CLAIM_3.uid) is None
    assert checkpoint.unreadable_problem(CLAIM_3.uid) == "devices must be a list"
    assert checkpoint.unreadable_problem(CLAIM_2.uid) is None
    checkpoint.begin_prepare(CLAIM_2)
    assert _doc(cp_path)["claims"][CLAIM_3.uid] == weird
    assert checkpoint.remove(CLAIM_3.uid) is True
    assert CLAIM_3.uid not in _doc(cp_path)["claims"]


def test_a_null_record_is_unreadable_with_its_reason(cp_path: Path, boot: Path) -> None:
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION)
    doc["claims"][CLAIM_3.uid] = None
    cp_path.write_text(json.dumps(doc))
    checkpoint = _load(cp_path, boot)
    assert checkpoint.unreadable_problem(CLAIM_3.uid) == "claim record must be an object"


def test_unknown_details_survive_a_rewrite_down_to_each_record(cp_path: Path, boot: Path) -> None:
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION + 1)
    details = {
        "type": "mig",
        "parentUuid": "GPU-1",
        "futureDetail": [1],
        "mig": {"profileId": 9, "start": 0, "size": 4, "created": True, "gi": 1, "slices": 4},
        "mps": {"pipeDir": "/s/mps/p", "uuids": ["GPU-1"], "futureSetting": True},
    }
    doc["claims"][CLAIM_1.uid]["devices"][0]["details"] = details
    cp_path.write_text(json.dumps(doc))
    checkpoint = _load(cp_path, boot)
    record = checkpoint.get(CLAIM_1.uid)
    assert record is not None
    read = record.devices[0].details
    assert read.mig == CreatedMig(9, "", start=0, size=4, gi=1, extra={"slices": 4})
    assert read.mps == MpsStarted(
        Path("/s/mps/p"), Path("/s/mps/p"), ("GPU-1",), extra={"futureSetting": True}
    )
    assert read.problems == {}

    checkpoint.begin_prepare(CLAIM_2)  # any rewrite

    written = _doc(cp_path)["claims"][CLAIM_1.uid]["devices"][0]["details"]
    assert written["futureDetail"] == [1]
    assert written["mig"]["slices"] == 4
    assert written["mps"]["futureSetting"] is True


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("computeMode", {"uuid": "GPU-1", "previous": None}, "previous must be an integer"),
        ("computeMode", {"uuid": "GPU-1", "previous": "abc"}, "previous must be an integer"),
        ("timeSlice", {"interval": 3}, "uuid must be a non-empty string"),
        (
            "timeSlice",
            {"uuid": "GPU-1", "interval": 3, "previousComputeMode": "EXCLUSIVE"},
            "previousComputeMode must be an integer",
        ),
        ("mps", ["not", "an", "object"], "must be an object"),
        ("mig", {"created": True, "start": 0}, "profileId must be an integer"),
    ],
)
def test_an_unreadable_side_effect_is_kept_verbatim_as_the_records_problem(
    cp_path: Path, boot: Path, key: str, value: Any, problem: str
) -> None:
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION)
    details = {"parentUuid": "GPU-1", "pod": 5, key: value}  # pod: merely descriptive
    doc["claims"][CLAIM_1.uid]["devices"][0]["details"] = details
    cp_path.write_text(json.dumps(doc))
    checkpoint = _load(cp_path, boot)
    record = checkpoint.get(CLAIM_1.uid)
    assert record is not None  # the claim still holds its device
    assert list(record.devices[0].details.problems) == [key]
    assert problem in record.devices[0].details.problems[key]
    assert checkpoint.holders(DeviceKey("node-a", "gpu-0")) == [(record, record.devices[0])]

    checkpoint.begin_prepare(CLAIM_2)  # any rewrite

    assert _doc(cp_path)["claims"][CLAIM_1.uid]["devices"][0]["details"] == details


def test_records_that_cannot_be_read_are_found_by_the_gpu_they_name(
    cp_path: Path, boot: Path
) -> None:
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION)
    # CLAIM_1: readable, but its time-slice step is not (a problem naming GPU-1).
    sliced = {"parentUuid": "GPU-1", "timeSlice": {"uuid": "GPU-1", "interval": "often"}}
    doc["claims"][CLAIM_1.uid]["devices"][0]["details"] = sliced
    # CLAIM_2: readable, no problem, on GPU-1 too; CLAIM_3: unreadable as a whole.
    readable = json.loads(json.dumps(doc["claims"][CLAIM_1.uid]))
    readable.update(uid=CLAIM_2.uid, name="claim-2")
    readable["devices"][0]["details"] = {"timeSlice": {"uuid": "GPU-1", "interval": 3}}
    doc["claims"][CLAIM_2.uid] = readable
    doc["claims"][CLAIM_3.uid] = {"uid": CLAIM_3.uid, "state": "Future", "devices": "GPU-1"}
    cp_path.write_text(json.dumps(doc))
    checkpoint = _load(cp_path, boot)

    assert sorted(checkpoint.unreadable_naming("GPU-1")) == sorted([CLAIM_1.uid, CLAIM_3.uid])
    assert checkpoint.unreadable_naming("GPU-1", excluding=CLAIM_3.uid) == [CLAIM_1.uid]
    assert checkpoint.unreadable_naming("GPU-2") == []


def test_a_record_that_cannot_be_read_names_a_gpu_by_its_device_too(
    cp_path: Path, boot: Path
) -> None:
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION)
    record = doc["claims"].pop(CLAIM_1.uid)
    record["state"] = "Future"  # a newer release's: unreadable, no UUID in it
    doc["claims"][CLAIM_1.uid] = record
    cp_path.write_text(json.dumps(doc))
    checkpoint = _load(cp_path, boot)

    assert checkpoint.unreadable_naming("GPU-1") == []
    named = checkpoint.unreadable_naming("GPU-1", devices=[DeviceKey("node-a", "gpu-0")])
    assert named == [CLAIM_1.uid]
    assert checkpoint.unreadable_naming("GPU-1", devices=[DeviceKey("node-a", "gpu-1")]) == []


def test_a_time_slice_record_keeps_the_compute_mode_it_replaced(cp_path: Path, boot: Path) -> None:
    """`previousComputeMode` is read and written back; a record without it (written
    before the field) reads as nothing to restore and is written back without it."""
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION)
    with_mode = {"uuid": "GPU-1", "interval": 2, "applied": True, "previousComputeMode": 3}
    without = {"uuid": "GPU-1", "interval": 2, "applied": True}
    doc["claims"][CLAIM_1.uid]["devices"][0]["details"] = {"timeSlice": with_mode}
    doc["claims"][CLAIM_1.uid]["devices"].append(
        {**doc["claims"][CLAIM_1.uid]["devices"][0], "details": {"timeSlice": without}}
    )
    cp_path.write_text(json.dumps(doc))
    record = _load(cp_path, boot).get(CLAIM_1.uid)
    assert record is not None
    read = [d.details.time_slice for d in record.devices]
    assert read == [
        TimeSliceSet("GPU-1", 2, applied=True, previous_compute_mode=3),
        TimeSliceSet("GPU-1", 2, applied=True, previous_compute_mode=None),
    ]

    _load(cp_path, boot).begin_prepare(CLAIM_2)  # any rewrite

    written = _doc(cp_path)["claims"][CLAIM_1.uid]["devices"]
    assert [d["details"]["timeSlice"] for d in written] == [with_mode, without]


def test_a_created_mig_instance_needs_its_gpu(cp_path: Path, boot: Path) -> None:
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION)
    mig = {"profileId": 9, "start": 0, "size": 4, "created": True, "gi": 1}
    doc["claims"][CLAIM_1.uid]["devices"][0]["details"] = {"mig": mig}
    cp_path.write_text(json.dumps(doc))
    record = _load(cp_path, boot).get(CLAIM_1.uid)
    assert record is not None
    assert (
        "details.parentUuid: must name the GPU" in record.devices[0].details.problems["parentUuid"]
    )


@pytest.mark.parametrize("content", ["{truncated", "[]", "", '"x"'])
def test_corrupt_file_is_an_error_and_left_alone(cp_path: Path, boot: Path, content: str) -> None:
    cp_path.parent.mkdir(parents=True)
    cp_path.write_text(content)
    with pytest.raises(CheckpointError, match=str(cp_path.name)):
        _load(cp_path, boot)
    assert cp_path.read_text() == content


# --- reboots ---


def test_reboot_discards_prepared_claims_but_reports_them(
    cp_path: Path, boot: Path, tmp_path: Path
) -> None:
    checkpoint = _load(cp_path, boot)
    mig = CreatedMig(profile_id=19, profile="1g.10gb", start=0, size=1, gi=3, ci=0)
    details = DeviceDetails(type="mig", gpu_uuid="GPU-1", mig=mig)
    checkpoint.begin_prepare(CLAIM_1)
    checkpoint.complete_prepare(CLAIM_1.uid, [_gpu("gpu-0-mig-1g10gb-19-0", details=details)])
    checkpoint.begin_prepare(CLAIM_2, [_gpu("gpu-1")])

    boot.write_text(BOOT_B + "\n")
    after = _load(cp_path, boot)
    assert after.claims() == [] and after.incomplete() == []
    assert after.holders(DeviceKey("node-a", "gpu-1")) == []
    previous = after.previous_boot()
    assert sorted(c.uid for c in previous) == sorted([CLAIM_1.uid, CLAIM_2.uid])
    migs = [d.details.mig for c in previous for d in c.devices if d.details.mig is not None]
    assert migs == [mig]

    # persisted at once: the new boot ID is on disk and the old claims are kept aside
    doc = _doc(cp_path)
    assert doc["bootId"] == BOOT_B and doc["claims"] == {}
    assert len(doc["previousBoot"]) == 2
    assert len(_load(cp_path, boot).previous_boot()) == 2

    after.forget_previous_boot(previous[:1])
    assert [c.uid for c in _load(cp_path, boot).previous_boot()] == [previous[1].uid]
    after.forget_previous_boot(previous)
    assert _load(cp_path, boot).previous_boot() == []
    assert "previousBoot" not in _doc(cp_path)


def _compact(value: Any) -> bytes:
    """`value` as compact JSON, as the checkpoint writes it."""
    return json.dumps(value, separators=(",", ":")).encode()


def _write_compact(cp_path: Path, doc: dict[str, Any]) -> None:
    cp_path.parent.mkdir(parents=True, exist_ok=True)
    cp_path.write_bytes(_compact(doc))


def _previous_record(uid: str, **fields: Any) -> dict[str, Any]:
    record = {"uid": uid, "namespace": "ns", "name": "old", "state": "PrepareCompleted"}
    record["devices"] = [
        {
            "pool": "node-a",
            "device": "gpu-0",
            "details": {"type": "gpu", "uuid": "GPU-1"},
        }
    ]
    record.update(fields)
    return record


# A newer release's previous-boot record: a state this release does not know, and a
# side effect it has never heard of; its clean-up is that release's to do.
_NEWER_PREVIOUS = _previous_record(
    CLAIM_3.uid, state="UnprepareStarted", futureField={"powerLimit": [300, 250]}
)


@pytest.mark.anyio
async def test_an_unreadable_previous_boot_record_is_kept_for_the_release_that_wrote_it(
    cp_path: Path, boot: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a downgrade, a previous-boot record only a newer release can read survives
    the take-over, appended changes, the readable records' forgetting and the agent's
    stop, as it was written: the newer release, back, still finds its clean-up to do."""
    readable = _previous_record(CLAIM_1.uid)
    _write_compact(
        cp_path,
        {
            "version": CHECKPOINT_VERSION + 1,
            "bootId": BOOT_A,
            "claims": {},
            "previousBoot": [readable, _NEWER_PREVIOUS],
        },
    )
    kept = _compact(_NEWER_PREVIOUS)

    def written_back(readable_uids: list[str]) -> None:
        records = document(cp_path)["previousBoot"]
        assert [r["uid"] for r in records[:-1]] == readable_uids
        assert records[-1] == _NEWER_PREVIOUS
        assert kept in cp_path.read_bytes()  # byte for byte

    with caplog.at_level("WARNING", logger=checkpoint_module.__name__):
        checkpoint = load(cp_path, boot_id_path=boot, take_over=True)
    logged = [r for r in caplog.records if "previous-boot record" in r.getMessage()]
    assert len(logged) == 1 and logged[0].__dict__["fields"]["record"] == _NEWER_PREVIOUS
    assert [r.uid for r in checkpoint.previous_boot()] == [CLAIM_1.uid]  # none to clean here
    written_back([CLAIM_1.uid])  # the take-over's write

    commit = GroupCommit(checkpoint)
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_2, [_gpu("gpu-1")], persist=False))
    await commit.apply(lambda cp: cp.complete_prepare(CLAIM_2.uid, [_gpu("gpu-1")]))
    assert ChangesFile(cp_path).read()  # appended
    written_back([CLAIM_1.uid])

    # The readable record cleaned up and forgotten; the other stays.
    cleaned = checkpoint.previous_boot()
    await commit.apply(lambda cp: cp.forget_previous_boot(cleaned))
    assert checkpoint.previous_boot() == []
    written_back([])
    await commit.apply(lambda cp: cp.remove(CLAIM_2.uid))
    await commit.compact()  # the agent's stop
    written_back([])
    assert _load(cp_path, boot).previous_boot() == []


def test_a_reboot_moves_unreadable_claims_to_the_previous_boot_as_they_are(
    cp_path: Path, boot: Path
) -> None:
    """A boot's claims are void after a reboot, those this release cannot read too: they
    no longer hold their devices, and go to `previousBoot` as they were written, for the
    release that can read them to clean up, as do the readable ones for this one. A
    record already there stays, however many reboots follow."""
    current = _previous_record(CLAIM_2.uid, state="UnprepareStarted", futureField=1)
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION + 1)
    doc["claims"][CLAIM_2.uid] = current
    doc["previousBoot"] = [_NEWER_PREVIOUS]
    _write_compact(cp_path, doc)
    before = _load(cp_path, boot)
    assert before.unreadable_holders(DeviceKey("node-a", "gpu-0")) == [CLAIM_2.uid]

    boot.write_text(BOOT_B + "\n")
    after = load(cp_path, boot_id_path=boot, take_over=True)
    assert after.claims() == [] and after.unreadable() == {}
    assert [r.uid for r in after.previous_boot()] == [CLAIM_1.uid]
    on_disk = document(cp_path)
    assert on_disk["claims"] == {}
    assert on_disk["previousBoot"][1:] == [_NEWER_PREVIOUS, current]
    assert _compact(current) in cp_path.read_bytes()
    after.begin_prepare(CLAIM_3, [_gpu("gpu-0")])  # its device is free again

    after.forget_previous_boot(after.previous_boot())
    after.remove(CLAIM_3.uid)
    boot.write_text(BOOT_A + "\n")  # another reboot
    again = load(cp_path, boot_id_path=boot, take_over=True)
    assert again.previous_boot() == []
    assert document(cp_path)["previousBoot"] == [_NEWER_PREVIOUS, current]


def test_unreadable_claims_a_reboot_could_not_record_as_moved_are_moved_at_the_next_write(
    cp_path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at the reboot's write: the claims, unreadable ones too, are moved in
    memory all the same, and the next write that succeeds records them so."""
    current = _previous_record(CLAIM_2.uid, state="UnprepareStarted")
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION)
    doc["claims"][CLAIM_2.uid] = current
    cp_path.write_text(json.dumps(doc))
    boot.write_text(BOOT_B + "\n")

    def full(path: Path, data: bytes, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "atomic_write", full)
    checkpoint = _load(cp_path, boot)
    assert checkpoint.unreadable() == {}
    monkeypatch.setattr(checkpoint_module, "atomic_write", atomic_write)
    checkpoint.begin_prepare(CLAIM_3, [_gpu("gpu-0")])
    on_disk = _doc(cp_path)
    assert list(on_disk["claims"]) == [CLAIM_3.uid]
    assert on_disk["previousBoot"][1:] == [current]


def test_same_boot_keeps_claims(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1)
    assert [c.uid for c in _load(cp_path, boot).claims()] == [CLAIM_1.uid]


def test_unreadable_boot_id_discards_nothing(cp_path: Path, boot: Path, tmp_path: Path) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1)
    after = load(cp_path, boot_id_path=tmp_path / "no-such-file")
    assert [c.uid for c in after.claims()] == [CLAIM_1.uid]
    assert after.boot_id == BOOT_A


# --- exclusivity ---


def test_exclusive_device_is_never_prepared_twice(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1, [_gpu("gpu-0")])
    before = cp_path.read_bytes()
    with pytest.raises(DeviceConflictError, match=r"node-a/gpu-0.*ns/claim-1"):
        checkpoint.begin_prepare(CLAIM_2, [_gpu("gpu-0")])
    assert cp_path.read_bytes() == before
    assert checkpoint.get(CLAIM_2.uid) is None
    # The error reaches the refused claim's pod events: another namespace's holder, maybe
    # another tenant's, is named by its UID only.
    with pytest.raises(DeviceConflictError) as refused:
        checkpoint.begin_prepare(CLAIM_3, [_gpu("gpu-0")])
    assert str(refused.value).endswith(f"for claim ({CLAIM_1.uid})")

    checkpoint.begin_prepare(CLAIM_2)
    with pytest.raises(DeviceConflictError):
        checkpoint.complete_prepare(CLAIM_2.uid, [_gpu("gpu-0", exclusive=False)])
    assert checkpoint.get(CLAIM_2.uid) is not None
    assert checkpoint.get(CLAIM_2.uid).devices == ()  # type: ignore[union-attr]


def test_shared_devices_may_be_held_by_several_claims(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1, [_gpu("gpu-0", exclusive=False, share_id="a")])
    checkpoint.begin_prepare(CLAIM_2, [_gpu("gpu-0", exclusive=False, share_id="b")])
    holders = checkpoint.holders(("node-a", "gpu-0"))
    assert sorted(c.uid for c, _ in holders) == [CLAIM_1.uid, CLAIM_2.uid]
    with pytest.raises(DeviceConflictError):
        checkpoint.begin_prepare(CLAIM_3, [_gpu("gpu-0")])


def test_admin_access_never_conflicts(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1, [_gpu("gpu-0")])
    checkpoint.begin_prepare(CLAIM_2, [_gpu("gpu-0", admin_access=True)])
    checkpoint.begin_prepare(CLAIM_3)
    checkpoint.complete_prepare(CLAIM_3.uid, [_gpu("gpu-1")])
    assert len(checkpoint.holders(DeviceKey("node-a", "gpu-0"))) == 2
    # an exclusive claim may join a device only an admin claim holds
    checkpoint.remove(CLAIM_1.uid)
    checkpoint.begin_prepare(CLAIM_1, [_gpu("gpu-0")])


def test_a_prepare_that_changes_how_it_holds_a_device_is_checked_again(
    cp_path: Path, boot: Path
) -> None:
    """A prepare's progress and end check their devices again, also where only the way
    they hold one changed (exclusive, admin access)."""
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1, [_gpu("gpu-0", exclusive=False, share_id="a")])
    checkpoint.begin_prepare(CLAIM_2, [_gpu("gpu-0", exclusive=False, share_id="b")])
    with pytest.raises(DeviceConflictError, match=r"gpu-0"):
        checkpoint.complete_prepare(CLAIM_2.uid, [_gpu("gpu-0", share_id="b")])
    checkpoint.complete_prepare(CLAIM_2.uid, [_gpu("gpu-0", exclusive=False, share_id="b")])

    admin = ClaimRef(namespace="ns", uid="44444444-4444-4444-4444-444444444444", name="admin")
    checkpoint.begin_prepare(CLAIM_3, [_gpu("gpu-1")])
    checkpoint.begin_prepare(admin, [_gpu("gpu-1", admin_access=True)])
    with pytest.raises(DeviceConflictError, match=r"gpu-1"):
        checkpoint.record_progress(admin.uid, [_gpu("gpu-1")])
    with pytest.raises(DeviceConflictError, match=r"gpu-1"):
        checkpoint.complete_prepare(admin.uid, [_gpu("gpu-0"), _gpu("gpu-1")])
    checkpoint.complete_prepare(admin.uid, [_gpu("gpu-1", admin_access=True)])


@pytest.mark.anyio
async def test_a_prepare_ends_checked_against_a_holder_a_failed_write_brought_back(
    cp_path: Path, boot: Path
) -> None:
    """A failed write undoes the changes it carried: a claim's removal undone puts its
    record back, holding its device again. A prepare that began on that device meanwhile
    (it was free then) is refused at its end rather than recorded beside it."""
    checkpoint = _load(cp_path, boot)
    commit = GroupCommit(checkpoint)
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu()]))
    await commit.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu()]))
    real = checkpoint._write
    started, go = threading.Event(), threading.Event()
    calls: list[int] = []

    def failing_once(snap: Any, *, durable: bool = True) -> None:
        calls.append(snap.seq)
        if len(calls) == 1:
            started.set()
            go.wait(5)
            raise CheckpointError("the disk is gone for a moment")
        real(snap, durable=durable)

    checkpoint._write = failing_once  # type: ignore[method-assign]
    failed: list[CheckpointError] = []

    async def remove_first() -> None:
        try:
            await commit.apply(lambda cp: cp.remove(CLAIM_1.uid, durable=True))
        except CheckpointError as exc:
            failed.append(exc)

    async def begin_second() -> None:
        await commit.apply(lambda cp: cp.begin_prepare(CLAIM_2, [_gpu()]))

    async with anyio.create_task_group() as group:
        group.start_soon(remove_first)
        while not started.is_set():
            await anyio.sleep(0.01)
        group.start_soon(begin_second)
        while checkpoint.get(CLAIM_2.uid) is None:
            await anyio.sleep(0.01)
        go.set()
    assert failed
    assert checkpoint.get(CLAIM_1.uid) is not None and checkpoint.get(CLAIM_2.uid) is not None
    with pytest.raises(DeviceConflictError, match=CLAIM_1.uid):
        await commit.apply(lambda cp: cp.complete_prepare(CLAIM_2.uid, [_gpu()]))


def test_same_claim_may_list_a_device_again(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1, [_gpu("gpu-0")])
    checkpoint.complete_prepare(CLAIM_1.uid, [_gpu("gpu-0")])


# --- atomic writes ---


def test_failed_write_changes_neither_disk_nor_memory(
    cp_path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1)
    before = cp_path.read_bytes()

    def broken_replace(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(CheckpointError, match="No space"):
        checkpoint.complete_prepare(CLAIM_1.uid, [_gpu()])
    with pytest.raises(CheckpointError):
        checkpoint.begin_prepare(CLAIM_2)
    assert cp_path.read_bytes() == before
    # No temp file left: the checkpoint, its (empty) changes file and the lock.
    assert sorted(p.name for p in cp_path.parent.iterdir()) == [
        f".{cp_path.name}.lock",
        cp_path.name,
        f"{cp_path.name}.changes",
    ]
    record = checkpoint.get(CLAIM_1.uid)
    assert record is not None and not record.completed
    assert checkpoint.get(CLAIM_2.uid) is None


def test_full_disk_gives_a_clear_error_and_keeps_the_old_checkpoint(
    small_fs: Path, fill_small_fs: Callable[[], None], boot: Path
) -> None:
    path = small_fs / "state" / "checkpoint.json"
    checkpoint = _load(path, boot)
    checkpoint.begin_prepare(CLAIM_1)
    checkpoint.complete_prepare(CLAIM_1.uid, [_gpu()])
    before = path.read_bytes()
    fill_small_fs()

    big = _gpu("gpu-1", details=DeviceDetails(pod="x" * 8192))
    with pytest.raises(CheckpointError) as error:
        checkpoint.begin_prepare(CLAIM_2, [big])
    assert str(path) in str(error.value)
    assert "No space left on device" in str(error.value)
    assert path.read_bytes() == before
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # none left
    assert checkpoint.get(CLAIM_2.uid) is None
    # Once there is room again, the next write succeeds.
    (small_fs / "filler").unlink()
    checkpoint.begin_prepare(CLAIM_2, [big])
    assert _load(path, boot).get(CLAIM_2.uid) is not None


def test_unserialisable_details_are_rejected_before_writing(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1)
    before = cp_path.read_bytes()
    with pytest.raises(CheckpointError, match="JSON"):
        checkpoint.complete_prepare(
            CLAIM_1.uid, [_gpu(details=DeviceDetails(extra={"x": object()}))]
        )
    assert cp_path.read_bytes() == before


def test_records_are_detached_from_caller_data(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    extra: dict[str, Any] = {"pid": 1}
    checkpoint.begin_prepare(CLAIM_1, [_gpu(details=DeviceDetails(extra=extra))])
    extra["pid"] = 2
    record = checkpoint.get(CLAIM_1.uid)
    assert record is not None and record.devices[0].details.extra == {"pid": 1}


def test_a_plain_record_is_kept_as_given_and_reads_back_the_same(cp_path: Path, boot: Path) -> None:
    """A planned whole GPU's record holds nothing that can change: kept without a copy
    (a prepare's bookkeeping, twice per claim), and what a restart reads is equal. One
    that holds something mutable, or a value of another type, is copied from its JSON."""
    checkpoint = _load(cp_path, boot)
    details = DeviceDetails(
        type="gpu", request="gpu", gpu_uuid="GPU-1", gpu_minor=1, uuid="GPU-1", pod="p"
    )
    plain = _gpu(details=details)
    started = checkpoint.begin_prepare(CLAIM_1, [plain])
    assert started.devices[0] is plain
    assert _load(cp_path, boot).get(CLAIM_1.uid) == started

    names = ["gpu"]
    listed = _gpu("gpu-1", request_names=names, details=details)
    minor_true = _gpu("gpu-2", details=replace(details, gpu_minor=True))
    second = checkpoint.begin_prepare(CLAIM_2, [listed, minor_true])
    names.append("other")
    assert second.devices[0] is not listed and second.devices[0].request_names == ("gpu",)
    assert second.devices[1] is not minor_true
    assert _load(cp_path, boot).get(CLAIM_2.uid) == second

    class Named(str):
        """A string that could carry more than its characters."""

    pod_subclass = _gpu("gpu-3", details=replace(details, pod=Named("p")))
    id_subclass = _gpu("gpu-4", cdi_device_ids=(Named("k8s.gpu.nvidia.com/claim=x"),))
    third = checkpoint.begin_prepare(CLAIM_3, [pod_subclass, id_subclass])
    assert type(third.devices[0].details.pod) is str
    assert type(third.devices[1].cdi_device_ids[0]) is str


def test_write_recreates_a_removed_state_folder(cp_path: Path, boot: Path) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1, [_gpu()])
    shutil.rmtree(cp_path.parent)
    checkpoint.complete_prepare(CLAIM_1.uid, [_gpu()])
    record = _load(cp_path, boot).get(CLAIM_1.uid)
    assert record is not None and record.completed


def test_atomic_write_replaces_content_and_sets_mode(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    atomic_write(target, b"one", mode=0o600)
    atomic_write(target, b"two", mode=0o600)
    assert target.read_bytes() == b"two"
    assert target.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_atomic_write_creates_a_missing_folder_only_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "f.json"
    with pytest.raises(FileNotFoundError):
        atomic_write(target, b"one")
    assert list(tmp_path.iterdir()) == []
    atomic_write(target, b"one", folder_mode=0o750)
    assert target.read_bytes() == b"one"
    assert (target.parent.stat().st_mode & 0o777) == 0o750 & ~_umask()


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


# --- group commit: concurrent changes share writes ---


def _claim(i: int) -> ClaimRef:
    return ClaimRef(namespace="ns", uid=f"{i:08d}-0000-4000-8000-000000000000", name=f"c-{i}")


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _count_writes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record every checkpoint write: each is one fsynced temp file and rename (the
    file's path), or one line appended to the changes file (its path)."""
    writes: list[Path] = []

    def counting(path: Path, data: bytes, **kwargs: Any) -> None:
        writes.append(path)
        atomic_write(path, data, **kwargs)

    real_append = ChangesFile.append

    def appending(self: ChangesFile, line: bytes) -> None:
        writes.append(self.path)
        real_append(self, line)

    monkeypatch.setattr(checkpoint_module, "atomic_write", counting)
    monkeypatch.setattr(ChangesFile, "append", appending)
    return writes


@pytest.mark.anyio
async def test_concurrent_changes_share_writes_and_are_durable_on_return(
    cp_path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = _count_writes(monkeypatch)
    commit = GroupCommit(_load(cp_path, boot))
    durable: list[str] = []

    async def prepare(i: int) -> None:
        ref = _claim(i)
        await commit.apply(lambda cp: cp.begin_prepare(ref, [_gpu(f"gpu-{i}")]))
        # On disk before the caller goes on, as with a direct call.
        assert _load(cp_path, boot).get(ref.uid) is not None
        await commit.apply(lambda cp: cp.complete_prepare(ref.uid, [_gpu(f"gpu-{i}")]))
        reread = _load(cp_path, boot).get(ref.uid)
        assert reread is not None and reread.completed
        durable.append(ref.uid)

    async with anyio.create_task_group() as group:
        for i in range(8):
            group.start_soon(prepare, i)

    assert len(durable) == 8
    # 16 changes; one write carries whatever queued up behind the one before it. The
    # starts (synced: other prepares change the node next) replace the file; the ends,
    # which a power loss may take, are appended to the changes file.
    replaced = [w for w in writes if w == cp_path]
    assert 1 <= len(replaced) < 8
    assert len(writes) < 16
    assert commit.writes == len(writes)
    assert sorted(c.uid for c in _load(cp_path, boot).claims()) == sorted(durable)


def _syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every fsync the writes make: of the new file's content ("file") or of
    the folder that makes its rename survive a power loss ("folder")."""
    synced: list[str] = []
    real = os.fsync

    def spying(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", spying)
    return synced


def test_only_changes_that_precede_a_side_effect_wait_for_the_folder_sync(
    cp_path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = _load(cp_path, boot)
    synced = _syncs(monkeypatch)

    # Before a MIG instance or an MPS daemon is made, its record survives a power loss.
    checkpoint.begin_prepare(CLAIM_1, [_gpu("gpu-0")])
    checkpoint.record_progress(CLAIM_1.uid, [_gpu("gpu-0")])
    assert synced == ["file", "folder", "file", "folder"]

    # A prepare's end and a removal come after the node's last step for the claim: the
    # content is whole on disk before the rename, but the rename is not waited for.
    synced.clear()
    checkpoint.complete_prepare(CLAIM_1.uid, [_gpu("gpu-0")])
    completed = _load(cp_path, boot).get(CLAIM_1.uid)
    assert completed is not None and completed.completed  # a restarted agent reads it
    checkpoint.remove(CLAIM_1.uid)
    assert _load(cp_path, boot).get(CLAIM_1.uid) is None
    assert synced == ["file", "file"]


@pytest.mark.parametrize("stored", ["none", "other boot", "unreadable boot ID"])
def test_every_write_syncs_its_rename_until_the_file_names_this_boot(
    cp_path: Path, boot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored: str
) -> None:
    """A rename lost with the power is harmless only because the boot ID tells the
    reboot; until the file on disk names this boot, which only a synced write makes
    sure of, every write is synced."""
    doc = _foreign_file(cp_path, CHECKPOINT_VERSION)
    if stored == "none":
        del doc["bootId"]
    else:
        doc["bootId"] = BOOT_B
    cp_path.write_text(json.dumps(doc))
    boot_path = tmp_path / "no-boot-id" if stored == "unreadable boot ID" else boot
    synced = _syncs(monkeypatch)
    checkpoint = load(cp_path, boot_id_path=boot_path)
    if stored == "other boot":  # the load moved the old boot's claims, synced
        assert synced == ["file", "folder"]
        synced.clear()
    assert synced == []

    for claim in (CLAIM_2, CLAIM_3):
        checkpoint.begin_prepare(claim, [_gpu(claim.name)], persist=False)
        checkpoint.complete_prepare(claim.uid, [_gpu(claim.name)])
    checkpoint.remove(CLAIM_2.uid)
    checkpoint.remove(CLAIM_3.uid, durable=True)  # the caller relies on it next

    light, durable = ["file"], ["file", "folder"]
    if stored == "unreadable boot ID":
        assert synced == durable * 4
    elif stored == "none":  # the first synced write puts this boot's ID on disk
        assert synced == durable + light + light + durable
    else:  # the load's synced write put it there
        assert synced == light + light + light + durable


@pytest.mark.anyio
@pytest.mark.parametrize("with_durable", [True, False])
async def test_a_shared_write_syncs_the_folder_when_any_change_it_carries_asks(
    cp_path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch, with_durable: bool
) -> None:
    checkpoint = _load(cp_path, boot)
    checkpoint.begin_prepare(CLAIM_1, [_gpu("gpu-0")])
    checkpoint.begin_prepare(CLAIM_2, [_gpu("gpu-1")])
    commit = GroupCommit(checkpoint)
    writes = _count_writes(monkeypatch)
    synced = _syncs(monkeypatch)

    async with anyio.create_task_group() as group:
        # The first change's write (synced: a prepare's start) starts at once; the two
        # after it share the next.
        group.start_soon(commit.apply, lambda cp: cp.begin_prepare(CLAIM_3, [_gpu("gpu-2")]))
        group.start_soon(commit.apply, lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu()]))
        if with_durable:
            group.start_soon(
                commit.apply, lambda cp: cp.record_progress(CLAIM_2.uid, [_gpu("gpu-1")])
            )
        else:
            group.start_soon(commit.apply, lambda cp: cp.remove(CLAIM_2.uid))

    assert len(writes) == 2
    # Without a change that must survive a power loss, the shared write is a line
    # appended to the changes file, which syncs nothing.
    synced_first = ["file", "folder"]
    assert synced == (synced_first * 2 if with_durable else synced_first)
    assert writes[1] == (cp_path if with_durable else ChangesFile(cp_path).path)
    on_disk = _load(cp_path, boot)
    assert on_disk.get(CLAIM_3.uid) is not None
    completed = on_disk.get(CLAIM_1.uid)
    assert completed is not None and completed.completed
    assert (on_disk.get(CLAIM_2.uid) is None) is not with_durable


@pytest.mark.anyio
async def test_conflicting_changes_in_one_batch_are_refused(cp_path: Path, boot: Path) -> None:
    commit = GroupCommit(_load(cp_path, boot))
    outcomes: dict[str, str] = {}

    async def reserve(ref: ClaimRef) -> None:
        try:
            await commit.apply(lambda cp: cp.begin_prepare(ref, [_gpu("gpu-0")]))
        except DeviceConflictError:
            outcomes[ref.uid] = "refused"
        else:
            outcomes[ref.uid] = "reserved"

    async with anyio.create_task_group() as group:
        for ref in (CLAIM_1, CLAIM_2, CLAIM_3):
            group.start_soon(reserve, ref)

    assert sorted(outcomes.values()) == ["refused", "refused", "reserved"]
    [holder] = [uid for uid, outcome in outcomes.items() if outcome == "reserved"]
    assert [c.uid for c in _load(cp_path, boot).claims()] == [holder]


@pytest.mark.anyio
async def test_failed_group_write_undoes_its_changes_and_fails_their_callers(
    small_fs: Path, fill_small_fs: Callable[[], None], boot: Path
) -> None:
    path = small_fs / "checkpoint.json"
    checkpoint = _load(path, boot)
    commit = GroupCommit(checkpoint)
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu("gpu-0")]))
    big = _gpu("gpu-1", details=DeviceDetails(pod="x" * 4096))
    fill_small_fs()
    errors: list[str] = []

    async def change(fn: Callable[[Checkpoint], object]) -> None:
        try:
            await commit.apply(fn)
        except CheckpointError as exc:
            errors.append(str(exc))

    async with anyio.create_task_group() as group:
        group.start_soon(change, lambda cp: cp.begin_prepare(CLAIM_2, [big]))
        group.start_soon(change, lambda cp: cp.remove(CLAIM_1.uid))

    assert len(errors) == 2 and all("cannot write checkpoint" in e for e in errors)
    # Memory is back to what is on disk: CLAIM_1 still holds its device, CLAIM_2 is gone.
    assert checkpoint.get(CLAIM_2.uid) is None
    assert checkpoint.get(CLAIM_1.uid) is not None
    assert [c.uid for c in _load(path, boot).claims()] == [CLAIM_1.uid]

    (small_fs / "filler").unlink()
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_2, [big]))
    assert sorted(c.uid for c in _load(path, boot).claims()) == sorted([CLAIM_1.uid, CLAIM_2.uid])


@pytest.mark.anyio
async def test_unchanged_claims_are_written_back_verbatim(cp_path: Path, boot: Path) -> None:
    commit = GroupCommit(_load(cp_path, boot))
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu("gpu-0")]))
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_2, [_gpu("gpu-1")]))
    first = _lines(cp_path)
    # (A change the file is replaced for: a prepare's end would be appended.)
    await commit.apply(lambda cp: cp.record_progress(CLAIM_2.uid, [_gpu("gpu-2")]))
    second = _lines(cp_path)
    # One claim per line: only CLAIM_2's line changed.
    assert [line for line in first if CLAIM_1.uid in line] == [
        line for line in second if CLAIM_1.uid in line
    ]
    assert [line for line in first if CLAIM_2.uid in line] != [
        line for line in second if CLAIM_2.uid in line
    ]
    assert _doc(cp_path)["claims"][CLAIM_2.uid]["devices"][0]["device"] == "gpu-2"


@pytest.mark.anyio
async def test_a_write_whose_caller_was_cancelled_never_puts_an_older_state_back(
    cp_path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc.aio cuts a call with a plain asyncio cancel, which the GroupCommit's shield
    does not stop: the write it started goes on in its thread while the next change is
    written. When the older write lands last, it must not replace the newer file."""
    commit = GroupCommit(_load(cp_path, boot))
    stall, stalled = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # a disk that stalls the first write it is asked for
        if stall.is_set() and threading.current_thread() is not threading.main_thread():
            stall.clear()
            stalled.set()
            time.sleep(1.0)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    stall.set()
    cut = asyncio.ensure_future(commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu()])))
    while not stalled.is_set():
        await anyio.sleep(0.01)
    cut.cancel()  # what grpc.aio does when the kubelet's deadline passes
    with pytest.raises(asyncio.CancelledError):
        await cut
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_2, [_gpu("gpu-1")]))
    assert sorted(c.uid for c in _load(cp_path, boot).claims()) == [CLAIM_1.uid, CLAIM_2.uid]
    await anyio.sleep(1.5)  # the cancelled call's write has long finished
    assert sorted(c.uid for c in _load(cp_path, boot).claims()) == [CLAIM_1.uid, CLAIM_2.uid]


# --- the changes file: a prepare's end and a removal, appended unsynced ---


def _bytes(path: Path) -> bytes:
    return path.read_bytes()


def _file_claims(cp_path: Path) -> dict[str, Any]:
    """The claims in the checkpoint file alone: what a release before the changes file
    reads."""
    claims: dict[str, Any] = _doc(cp_path)["claims"]
    return claims


@pytest.mark.anyio
async def test_a_prepares_end_and_a_removal_are_appended_unsynced_and_read_back(
    cp_path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit = GroupCommit(_load(cp_path, boot))
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu("gpu-0")]))
    before = _bytes(cp_path)
    synced = _syncs(monkeypatch)
    writes = _count_writes(monkeypatch)
    changes = ChangesFile(cp_path).path

    await commit.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu("gpu-0")]))
    completed = _load(cp_path, boot).get(CLAIM_1.uid)  # a restarted agent reads it
    assert completed is not None and completed.completed
    assert document(cp_path)["claims"][CLAIM_1.uid]["state"] == "PrepareCompleted"
    await commit.apply(lambda cp: cp.remove(CLAIM_1.uid))
    assert _load(cp_path, boot).get(CLAIM_1.uid) is None

    assert (writes, synced) == ([changes, changes], [])
    assert _bytes(cp_path) == before
    assert len(_bytes(changes).splitlines()) == 2

    # A change that must survive a power loss replaces the file, which then holds
    # everything, and starts the changes file again.
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_2, [_gpu("gpu-1")]))
    assert writes[2:] == [cp_path] and synced == ["file", "folder"]
    assert list(_file_claims(cp_path)) == [CLAIM_2.uid]
    assert changes.read_bytes() == b""
    await commit.apply(lambda cp: cp.complete_prepare(CLAIM_2.uid, [_gpu("gpu-1")]))
    assert writes[3:] == [changes]
    assert [c.completed for c in _load(cp_path, boot).claims()] == [True]


@pytest.mark.anyio
async def test_lines_of_a_replaced_file_are_never_applied(cp_path: Path, boot: Path) -> None:
    """The file is replaced and the changes file emptied, but a power loss takes the
    emptying: the old lines name the old file and are ignored."""
    commit = GroupCommit(_load(cp_path, boot))
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu("gpu-0")]))
    await commit.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu("gpu-0")]))
    await commit.apply(lambda cp: cp.remove(CLAIM_1.uid))
    changes = ChangesFile(cp_path).path
    old_lines = changes.read_bytes()
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu("gpu-0")]))  # synced
    changes.write_bytes(old_lines)  # the emptying lost

    again = _load(cp_path, boot)
    record = again.get(CLAIM_1.uid)
    assert record is not None and not record.completed  # not the old lines' removal
    # Nothing is appended after lines that were not read: the next write replaces the
    # file and empties the changes file.
    await GroupCommit(again).apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu()]))
    assert changes.read_bytes() == b""
    assert _file_claims(cp_path)[CLAIM_1.uid]["state"] == "PrepareCompleted"


@pytest.mark.anyio
async def test_a_failed_append_fails_its_caller_and_the_next_write_replaces_the_file(
    small_fs: Path, fill_small_fs: Callable[[], None], boot: Path
) -> None:
    path = small_fs / "checkpoint.json"
    checkpoint = _load(path, boot)
    commit = GroupCommit(checkpoint)
    big = _gpu("gpu-0", details=DeviceDetails(pod="x" * 8192))
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu("gpu-0")]))
    fill_small_fs()

    with pytest.raises(CheckpointError, match="cannot write checkpoint changes"):
        await commit.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [big]))
    record = checkpoint.get(CLAIM_1.uid)
    assert record is not None and not record.completed  # memory is what the disk says
    on_disk = _load(path, boot).get(CLAIM_1.uid)
    assert on_disk is not None and not on_disk.completed

    (small_fs / "filler").unlink()
    await commit.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [big]))
    assert _file_claims(path)[CLAIM_1.uid]["state"] == "PrepareCompleted"
    assert ChangesFile(path).read() == b""
    reread = _load(path, boot).get(CLAIM_1.uid)
    assert reread is not None and reread.completed


@pytest.mark.anyio
async def test_a_lone_line_is_written_before_apply_returns_without_a_turn_of_the_loop(
    cp_path: Path, boot: Path
) -> None:
    """The agent's common case: a prepare's end or a removal that is the only change not
    yet written is appended at once. No other task runs in between (so no cancel can
    come between the change and its line), and a write lock held elsewhere (a file
    cleanup) is still waited for."""
    lock = anyio.Lock()
    commit = GroupCommit(_load(cp_path, boot), lock=lock)
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu("gpu-0")]))
    others: list[str] = []

    async def other() -> None:
        others.append("ran")

    async with anyio.create_task_group() as group:
        group.start_soon(other)
        await commit.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu("gpu-0")]))
        assert others == []
        completed = _load(cp_path, boot).get(CLAIM_1.uid)
        assert completed is not None and completed.completed

    removed = anyio.Event()

    async def remove() -> None:
        await commit.apply(lambda cp: cp.remove(CLAIM_1.uid))
        removed.set()

    async with anyio.create_task_group() as group:
        await lock.acquire()
        group.start_soon(remove)
        await anyio.sleep(0.05)
        assert not removed.is_set()
        assert _load(cp_path, boot).get(CLAIM_1.uid) is not None
        lock.release()
    assert _load(cp_path, boot).get(CLAIM_1.uid) is None
    assert len(ChangesFile(cp_path).read().splitlines()) == 2


@pytest.mark.anyio
async def test_a_failed_line_fails_every_caller_whose_change_it_carried(
    small_fs: Path, fill_small_fs: Callable[[], None], boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a change that is alone is appended at once. Here one caller's change waits
    for a synced write in flight; the task that made that write goes straight on to a
    change of its own, before the waiting caller resumes. One line carries both, and
    it fails (a full disk, freed right after): both callers get the error, and neither
    change stays, in memory or on disk. Appended at once, the line would have undone
    the waiting caller's change behind its back, and that caller, resuming to a disk
    with room, would have written the state without it and gone on as if it were."""
    path = small_fs / "checkpoint.json"
    checkpoint = _load(path, boot)
    commit = GroupCommit(checkpoint, lock=anyio.Lock())
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu("gpu-0")]))
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_2, [_gpu("gpu-1")]))
    gate, stalled = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the synced write in its thread waits for the gate
        if threading.current_thread() is not threading.main_thread() and not gate.is_set():
            stalled.set()
            gate.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    outcomes: dict[str, str] = {}

    async def waiting() -> None:
        try:
            await commit.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu("gpu-0")]))
            outcomes["waiting"] = "written"
        except CheckpointError:
            outcomes["waiting"] = "failed"

    async def writing() -> None:
        await commit.apply(lambda cp: cp.begin_prepare(CLAIM_3, [_gpu("gpu-2")]))
        fill_small_fs()
        try:
            await commit.apply(lambda cp: cp.complete_prepare(CLAIM_2.uid, [_gpu("gpu-1")]))
            outcomes["writing"] = "written"
        except CheckpointError:
            outcomes["writing"] = "failed"
        (small_fs / "filler").unlink()  # the disk has room again, before anyone resumes

    async with anyio.create_task_group() as group:
        group.start_soon(writing)
        while not stalled.is_set():
            await anyio.sleep(0.01)
        group.start_soon(waiting)
        await anyio.sleep(0.05)
        gate.set()

    assert outcomes == {"waiting": "failed", "writing": "failed"}
    for reading in (checkpoint, _load(path, boot)):
        states = {c.uid: c.completed for c in reading.claims()}
        assert states == {CLAIM_1.uid: False, CLAIM_2.uid: False, CLAIM_3.uid: False}


@pytest.mark.anyio
async def test_a_long_changes_file_is_folded_into_the_file(
    cp_path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoint_module, "_CHANGES_LIMIT", 1)
    commit = GroupCommit(_load(cp_path, boot))
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu("gpu-0")]))
    writes = _count_writes(monkeypatch)
    await commit.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu("gpu-0")]))
    await commit.apply(lambda cp: cp.remove(CLAIM_1.uid))  # past the limit: replaced
    assert writes == [ChangesFile(cp_path).path, cp_path]
    assert _file_claims(cp_path) == {}
    assert ChangesFile(cp_path).read() == b""


@pytest.mark.anyio
async def test_compact_leaves_every_change_in_the_file_for_an_older_release(
    cp_path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent compacts when it stops: a release that reads the file alone (one
    from before the changes file) then finds what the changes file held."""
    commit = GroupCommit(_load(cp_path, boot))
    for ref, device in ((CLAIM_1, "gpu-0"), (CLAIM_2, "gpu-1")):
        await commit.apply(lambda cp, r=ref, d=device: cp.begin_prepare(r, [_gpu(d)]))
        await commit.apply(lambda cp, r=ref, d=device: cp.complete_prepare(r.uid, [_gpu(d)]))
    await commit.apply(lambda cp: cp.remove(CLAIM_1.uid))
    assert _file_claims(cp_path) != document(cp_path)["claims"]

    await commit.compact()
    assert _file_claims(cp_path) == document(cp_path)["claims"]
    assert list(_file_claims(cp_path)) == [CLAIM_2.uid]
    assert _file_claims(cp_path)[CLAIM_2.uid]["state"] == "PrepareCompleted"
    assert ChangesFile(cp_path).read() == b""
    writes = _count_writes(monkeypatch)
    await commit.compact()  # nothing appended since: nothing written
    assert writes == []


# The power-loss property: whatever a power loss does to the changes file (which is never
# synced), the agent reads back the state after some write since the file was last
# replaced, never an older one nor a mix; a plain crash of the process loses nothing.
_OPS = st.lists(
    st.tuples(st.sampled_from(["begin", "begin-memory", "complete", "remove"]), st.integers(0, 3)),
    max_size=24,
)


def _state(checkpoint: Checkpoint, memory_only: set[str] | None = None) -> dict[str, str]:
    """Claims and their states, but for prepares started in memory only, which a write
    may or may not carry (either is right: nothing on the node depends on them yet)."""
    return {
        c.uid: c.state.value
        for c in checkpoint.claims()
        if c.completed or c.uid not in (memory_only or set())
    }


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, cut=st.integers(0, 10_000), zeros=st.integers(0, 300))
def test_a_power_loss_leaves_the_state_of_an_earlier_write(
    ops: list[tuple[str, int]], cut: int, zeros: int
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path, boot = Path(folder) / "checkpoint.json", Path(folder) / "boot_id"
        boot.write_text(BOOT_A)
        checkpoint = _load(path, boot)
        commit = GroupCommit(checkpoint)
        memory_only: set[str] = set()
        states = [_state(checkpoint)]  # after each write
        since = 0  # the index of the state the file itself holds

        async def run() -> None:
            nonlocal since
            for op, i in ops:
                ref, gpu = _claim(i), _gpu(f"g{i}")
                record = checkpoint.get(ref.uid)
                if op.startswith("begin") and record is None:
                    persist = op == "begin"
                    await commit.apply(
                        lambda cp, r=ref, d=gpu, p=persist: cp.begin_prepare(r, [d], persist=p)
                    )
                    if not persist:
                        memory_only.add(ref.uid)
                        continue  # nothing written
                    memory_only.discard(ref.uid)
                elif op == "complete" and record is not None and not record.completed:
                    await commit.apply(lambda cp, r=ref, d=gpu: cp.complete_prepare(r.uid, [d]))
                elif op == "remove" and record is not None:
                    await commit.apply(lambda cp, r=ref: cp.remove(r.uid))
                else:
                    continue
                states.append(_state(checkpoint))
                if not ChangesFile(path).read():
                    since = len(states) - 1

        anyio.run(run)
        if not path.exists():
            return

        def seen(state: dict[str, str]) -> dict[str, str]:
            """Without the prepares started in memory only, at the end."""
            return {
                uid: v
                for uid, v in state.items()
                if v != "PrepareStarted" or uid not in memory_only
            }

        # A crash of the process loses nothing.
        assert _state(_load(path, boot), memory_only) == seen(states[-1])

        changes = ChangesFile(path).path
        data = changes.read_bytes() if changes.exists() else b""
        damaged = bytearray(data[: cut % (len(data) + 1)])
        start = cut % (len(damaged) + 1)
        damaged[start : start + zeros] = b"\0" * len(damaged[start : start + zeros])
        if changes.exists():
            changes.write_bytes(bytes(damaged))
        after = _load(path, boot)
        assert _state(after, memory_only) in [seen(state) for state in states[since:]]

        # The agent goes on from there; a restart reads what it then wrote.
        async def more() -> None:
            again = GroupCommit(after)
            for record in after.claims():
                if not record.completed:
                    await again.apply(
                        lambda cp, r=record: cp.complete_prepare(r.uid, list(r.devices))
                    )
                else:
                    await again.apply(lambda cp, r=record: cp.remove(r.uid))

        anyio.run(more)
        assert _state(_load(path, boot), set()) == _state(after, set())


@pytest.mark.anyio
async def test_a_newer_agent_takes_the_file_over_from_the_one_it_replaces(
    cp_path: Path, boot: Path
) -> None:
    """A rolling update with a surge pod runs the new agent beside the old one on the
    same files. The new one's load replaces the file under the lock every write takes:
    from then on the old one's writes are refused (they would be lost, or stop a reader
    at their lines), and its stop leaves the new one's state in place."""
    old = GroupCommit(load(cp_path, boot_id_path=boot, take_over=True))
    await old.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu("gpu-0")]))
    await old.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu("gpu-0")]))

    new = GroupCommit(load(cp_path, boot_id_path=boot, take_over=True))
    taken = new.checkpoint.get(CLAIM_1.uid)
    assert taken is not None and taken.completed  # it read the old agent's line
    assert list(_file_claims(cp_path)) == [CLAIM_1.uid]  # and wrote the file anew

    with pytest.raises(CheckpointError, match="another process"):
        await old.apply(lambda cp: cp.remove(CLAIM_1.uid))
    assert old.checkpoint.get(CLAIM_1.uid) is not None  # memory as on disk
    with pytest.raises(CheckpointError, match="another process"):
        await old.apply(lambda cp: cp.begin_prepare(CLAIM_3, [_gpu("gpu-2")]))

    # Also where the old agent's changes file was empty when the new one took over.
    older = GroupCommit(load(cp_path, boot_id_path=boot, take_over=True))
    await older.apply(lambda cp: cp.remove(CLAIM_1.uid))  # a line, its first
    await older.apply(lambda cp: cp.begin_prepare(CLAIM_3, [_gpu("gpu-2")]))  # replaced
    newer = GroupCommit(load(cp_path, boot_id_path=boot, take_over=True))
    with pytest.raises(CheckpointError, match="another process"):
        await older.apply(lambda cp: cp.complete_prepare(CLAIM_3.uid, [_gpu("gpu-2")]))
    await newer.apply(lambda cp: cp.remove(CLAIM_3.uid))
    await newer.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu("gpu-0")]))
    await newer.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu("gpu-0")]))
    new = newer

    await new.apply(lambda cp: cp.begin_prepare(CLAIM_2, [_gpu("gpu-1")], persist=False))
    await new.apply(lambda cp: cp.complete_prepare(CLAIM_2.uid, [_gpu("gpu-1")]))
    await old.compact()  # the old agent stops: nothing of its own goes back
    assert sorted(c.uid for c in _load(cp_path, boot).claims()) == [CLAIM_1.uid, CLAIM_2.uid]
    await new.compact()
    assert sorted(_file_claims(cp_path)) == [CLAIM_1.uid, CLAIM_2.uid]


@pytest.mark.anyio
async def test_a_removed_changes_file_makes_the_next_change_replace_the_file(
    cp_path: Path, boot: Path
) -> None:
    """Its lines gone, a line after them would be read by no one: the next change
    replaces the file, and appending starts again after it."""
    checkpoint = load(cp_path, boot_id_path=boot, take_over=True)
    commit = GroupCommit(checkpoint)
    writes: list[str] = []
    for _ in range(2):  # the second time, the file is removed before it ever had a line
        await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu()], persist=False))
        await commit.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu()]))
        ChangesFile(cp_path).path.unlink()
        await commit.apply(lambda cp: cp.remove(CLAIM_1.uid))
        writes.append("replaced" if ChangesFile(cp_path).read() == b"" else "appended")
        assert _file_claims(cp_path) == {}
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_2, [_gpu()], persist=False))
    await commit.apply(lambda cp: cp.complete_prepare(CLAIM_2.uid, [_gpu()]))
    assert ChangesFile(cp_path).read()  # appended again
    assert _state(_load(cp_path, boot)) == _state(checkpoint)
    assert writes == ["replaced", "replaced"]


@pytest.mark.anyio
async def test_lines_another_process_appended_are_never_dropped(cp_path: Path, boot: Path) -> None:
    """Another writer's lines (an agent whose take-over of the file failed, as on a full
    disk) make this one refuse its writes rather than replace the file without them."""
    checkpoint = load(cp_path, boot_id_path=boot, take_over=True)
    commit = GroupCommit(checkpoint)
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu()], persist=False))
    await commit.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu()]))
    other = load(cp_path, boot_id_path=boot)  # read, not taken over
    await GroupCommit(other).apply(lambda cp: cp.remove(CLAIM_1.uid))  # its line
    for change in (
        lambda cp: cp.begin_prepare(CLAIM_2, [_gpu("gpu-1")]),  # would replace the file
        lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu()]),  # would append
    ):
        with pytest.raises(CheckpointError, match="written by another process"):
            await commit.apply(change)
    assert _state(_load(cp_path, boot)) == {}  # the other's removal stands
    await commit.compact()  # the stop leaves the file alone too
    assert _state(_load(cp_path, boot)) == {}


@pytest.mark.anyio
async def test_a_checkpoint_edited_in_place_refuses_the_next_appended_change(
    cp_path: Path, boot: Path
) -> None:
    """An edit in place keeps the file's inode: the lines appended after it would name
    a base the file no longer has, and a restarted agent would drop them with the
    claims they prepared. So the next change is refused, as any change to a file
    changed under the agent is, rather than accepted and lost."""
    checkpoint = load(cp_path, boot_id_path=boot, take_over=True)
    commit = GroupCommit(checkpoint)
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_1, [_gpu()], persist=False))
    await commit.apply(lambda cp: cp.complete_prepare(CLAIM_1.uid, [_gpu()]))
    assert ChangesFile(cp_path).read()  # appended: the path an edit went unnoticed on
    with cp_path.open("ab") as edited:
        edited.write(b"\n")
    await commit.apply(lambda cp: cp.begin_prepare(CLAIM_2, [_gpu("gpu-1")], persist=False))
    with pytest.raises(CheckpointError, match="was changed by another process"):
        await commit.apply(lambda cp: cp.complete_prepare(CLAIM_2.uid, [_gpu("gpu-1")]))
    assert _state(checkpoint)[CLAIM_2.uid] == "PrepareStarted"  # its end undone in memory


def test_a_write_that_failed_after_its_rename_does_not_lock_the_agent_out(
    cp_path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder's sync failed after the file was replaced: the file is this process's
    own, so its next write goes ahead (it replaces the file: no line may extend one
    whose content this process did not keep)."""
    checkpoint = load(cp_path, boot_id_path=boot, take_over=True)
    checkpoint.begin_prepare(CLAIM_1, [_gpu()])

    def replaced_then_failed(path: Path, data: bytes, **kwargs: Any) -> None:
        atomic_write(path, data, **kwargs)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(checkpoint_module, "atomic_write", replaced_then_failed)
    with pytest.raises(CheckpointError, match="Input/output error"):
        checkpoint.begin_prepare(CLAIM_2, [_gpu("gpu-1")])
    monkeypatch.setattr(checkpoint_module, "atomic_write", atomic_write)
    checkpoint.begin_prepare(CLAIM_3, [_gpu("gpu-2")])
    assert [c.uid for c in _load(cp_path, boot).claims()] == [CLAIM_1.uid, CLAIM_3.uid]


def test_the_take_over_writes_records_back_as_another_release_wrote_them(
    cp_path: Path, boot: Path
) -> None:
    """The agent's start replaces the file (the take-over), but a record it did not
    change keeps the shape its writer gave it: no field this release would add (here
    `podUid`, which the previous release did not write)."""
    record = {
        "uid": CLAIM_1.uid,
        "namespace": "ns",
        "name": "claim-1",
        "state": "PrepareCompleted",
        "devices": [
            {
                "pool": "node-a",
                "device": "gpu-0",
                "requestNames": ["gpu"],
                "cdiDeviceIds": ["k8s.gpu.nvidia.com/claim=x-gpu-0"],
                "adminAccess": False,
                "exclusive": True,
                "details": {"type": "gpu", "request": "gpu", "uuid": "GPU-1", "pod": "p"},
            }
        ],
    }
    cp_path.parent.mkdir(parents=True)
    cp_path.write_text(
        json.dumps({"version": 1, "bootId": BOOT_A, "claims": {CLAIM_1.uid: record}})
    )
    checkpoint = load(cp_path, boot_id_path=boot, take_over=True)
    assert "writeId" in _doc(cp_path)  # replaced
    assert _file_claims(cp_path) == {CLAIM_1.uid: record}
    checkpoint.begin_prepare(CLAIM_2, [_gpu("gpu-1")])  # another claim's change
    assert _file_claims(cp_path)[CLAIM_1.uid] == record
