"""bench-prepare's floor with files: the least the files of a crash-safe prepare cost,
so its journal must share syncs as a group commit does, lose nothing, and never let a
caller believe a record is durable when its sync failed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest
from gpudra.driver.claims import AllocatedDevice, Claim, ClaimRef

from bench.prepare import Journal, WithFiles

pytestmark = pytest.mark.anyio


def _counting_syncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return calls


async def test_concurrent_appends_share_syncs_and_all_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs = _counting_syncs(monkeypatch)
    journal = Journal(tmp_path / "journal")
    try:
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(journal.append, f"{i}\n".encode())
    finally:
        journal.close()
    lines = (tmp_path / "journal").read_text().split()
    assert sorted(lines) == [str(i) for i in range(8)]
    # The first append syncs alone; the seven that arrive meanwhile share the next sync.
    assert 1 <= len(syncs) < 8


async def test_a_failed_sync_fails_every_append_that_waited_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fdatasync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    journal = Journal(tmp_path / "journal")
    failed: list[str] = []

    async def append(line: bytes) -> None:
        try:
            await journal.append(line)
        except OSError as e:
            failed.append(str(e))

    try:
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(append, f"{i}\n".encode())
    finally:
        journal.close()
    assert len(failed) == 4


async def test_with_files_writes_a_spec_and_a_record_and_removes_both(tmp_path: Path) -> None:
    cdi, records = tmp_path / "cdi", tmp_path / "journal"
    cdi.mkdir()
    journal = Journal(records)
    handler = WithFiles("gpu.example.dev", cdi, journal)
    ref = ClaimRef("ns", "0b7e6c38-5d43-4ad6-9d57-5f0f3c1b2a11", "claim")
    claim = Claim(ref, (AllocatedDevice(index=0, request="gpu", device="gpu-3"),))
    try:
        prepared = await handler.prepare([claim])
        (spec_path,) = cdi.iterdir()
        spec = json.loads(spec_path.read_text())
        (cdi_id,) = prepared[ref.uid].devices[0].cdi_device_ids
        assert cdi_id == f"{spec['kind']}={spec['devices'][0]['name']}"
        assert await handler.unprepare([ref]) == {ref.uid: None}
    finally:
        journal.close()
    assert list(cdi.iterdir()) == []
    written = [json.loads(line) for line in records.read_text().splitlines()]
    assert written == [
        {"uid": ref.uid, "device": "gpu-3", "cdi": f"{ref.uid}-gpu-3"},
        {"uid": ref.uid, "removed": True},
    ]
