"""The checkpoint reader under generated files: it loads, or raises CheckpointError when
the file as a whole is unusable; a bad record is kept and reported, never fatal."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from gpudra.driver.checkpoint import CheckpointError, load
from gpudra.driver.checkpoint_changes import ChangesFile, base_of, encode_line
from gpudra.driver.claims import ClaimRef
from gpudra.driver.records import DeviceDetails, details_from_json, details_to_json
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.strategies import JSON, mutated

FIXTURE = Path(__file__).parent.parent / "driver" / "fixtures" / "checkpoint-v1.json"
SEED: dict[str, Any] = json.loads(FIXTURE.read_text())
BOOT = SEED["bootId"]

MUTATED = mutated(SEED, max_mutations=4) | mutated(SEED, values=JSON, max_mutations=2)


def _write(folder: Path, data: bytes) -> tuple[Path, Path]:
    """A checkpoint file and a boot ID file in a folder of their own."""
    case = folder / uuid.uuid4().hex
    case.mkdir()
    boot = case / "boot_id"
    boot.write_text(BOOT + "\n")
    path = case / "checkpoint.json"
    path.write_bytes(data)
    return path, boot


def _assert_written_back(details: DeviceDetails) -> None:
    """What undo needs (every side effect and every problem) survives a write, and the
    written form is stable."""
    again = details_from_json(details_to_json(details))
    for effect in ("mig", "time_slice", "compute_mode", "mps"):
        assert getattr(again, effect) == getattr(details, effect)
    assert again.problems.keys() == details.problems.keys()
    assert (again.gpu_uuid or None) == (details.gpu_uuid or None)
    assert details_to_json(again) == details_to_json(details)


def _load_checked(path: Path, boot: Path) -> None:
    """Load; when it loads, every query answers and a write keeps the file loadable."""
    try:
        cp = load(path, boot_id_path=boot)
    except CheckpointError as exc:
        assert str(path) in str(exc)
        return
    for record in cp.claims() + cp.previous_boot():
        for device in record.devices:
            _assert_written_back(device.details)
    unreadable = cp.unreadable()
    cp.incomplete()
    new = ClaimRef(namespace="fuzz", uid="ffffffff-0000-4000-8000-000000000000", name="new")
    if cp.get(new.uid) is None and new.uid not in unreadable:
        cp.begin_prepare(new)  # a change: the file is written, the rest written back
    again = load(path, boot_id_path=boot)
    assert again.unreadable() == unreadable
    assert [c.uid for c in again.claims()] == [c.uid for c in cp.claims()]
    assert again.claims() == cp.claims()


@given(MUTATED)
def test_mutated_checkpoints_load_or_raise_checkpoint_error(
    state_root: Path, doc: dict[str, Any]
) -> None:
    path, boot = _write(state_root, json.dumps(doc).encode())
    _load_checked(path, boot)


DETAILS = [device["details"] for claim in SEED["claims"].values() for device in claim["devices"]]


@given(st.sampled_from(DETAILS).flatmap(lambda d: mutated(d, max_mutations=2)))
@example({"mps": {"pipeDir": "/run/mps/pipe", "logDir": 5}})
@example({"mps": {"pipeDir": "/run/mps/pipe", "logDir": ["x"]}})
@example({"type": "gpu", "request": False, "uuid": 7})
def test_mutated_device_details_read_and_write_back(details: dict[str, Any]) -> None:
    """One record's details, a field of it the wrong type: read without raising, a
    side effect that cannot be read named in `problems`, and written back as read."""
    typed = details_from_json(details)
    _assert_written_back(typed)
    for key in ("request", "uuid"):
        if details.get(key) is not None and not isinstance(details[key], str):
            assert details_to_json(typed)[key] == details[key]  # kept as it was
    for problem in typed.problems.values():
        assert problem.startswith("details.")


@given(JSON)
def test_any_json_document_loads_or_raises_checkpoint_error(state_root: Path, doc: Any) -> None:
    path, boot = _write(state_root, json.dumps(doc).encode())
    _load_checked(path, boot)


@given(
    st.binary(max_size=300)
    | st.builds(
        lambda cut, junk: FIXTURE.read_bytes()[:cut] + junk,
        st.integers(min_value=0, max_value=len(FIXTURE.read_bytes())),
        st.binary(max_size=8),
    )
)
def test_torn_or_random_bytes_load_or_raise_checkpoint_error(state_root: Path, data: bytes) -> None:
    path, boot = _write(state_root, data)
    _load_checked(path, boot)


@pytest.mark.parametrize("depth", [10, 5000, 200_000])
def test_deeply_nested_checkpoint_is_a_checkpoint_error_or_loads(
    state_root: Path, depth: int
) -> None:
    """Nesting past the JSON decoder's recursion limit is an unreadable file, not a crash."""
    path, boot = _write(state_root, b'{"claims": {}, "x": ' + b"[" * depth + b"]" * depth + b"}")
    _load_checked(path, boot)


RECORDS = list(SEED["claims"].items())


@given(
    st.lists(
        st.dictionaries(
            st.sampled_from([uid for uid, _ in RECORDS] + ["ffffffff-0000-4000-8000-00000000000f"]),
            st.none() | JSON | st.sampled_from([r for _, r in RECORDS]).flatmap(mutated),
            max_size=3,
        ),
        max_size=3,
    ),
    st.binary(max_size=40),
)
def test_changes_file_lines_load_or_raise_checkpoint_error(
    state_root: Path, changes: list[dict[str, Any]], tail: bytes
) -> None:
    """Lines the reader applies (whole, of this file, in order) carrying any record, and
    bytes after them: a bad record is kept and reported like one in the file itself."""
    data = json.dumps(SEED).encode()
    path, boot = _write(state_root, data)
    lines = b"".join(
        encode_line(
            base_of(data),
            n,
            [json.dumps(uid).encode() + b":" + json.dumps(rec).encode() for uid, rec in c.items()],
        )
        for n, c in enumerate(changes)
    )
    ChangesFile(path).path.write_bytes(lines + tail)
    _load_checked(path, boot)
