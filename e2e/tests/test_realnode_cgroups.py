"""The real node's teardown reads its cgroups while containers exit: a cgroup that
goes away during the walk must not fail the teardown (it failed a CI run once)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from e2e.node.realnode import _procs_in


def test_a_cgroup_that_goes_away_during_the_walk_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods = {tmp_path / "pod-a": 11, tmp_path / "pod-b": 21}
    for pod, pid in pods.items():
        (pod / "ctr").mkdir(parents=True)
        (pod / "cgroup.procs").write_text("")
        (pod / "ctr" / "cgroup.procs").write_text(f"{pid}\n")
    read_text = Path.read_text

    def exiting(self: Path, *args: Any, **kwargs: Any) -> str:
        # Reading one pod's cgroups, the other pod's container exits: its cgroups go,
        # after the walk listed them and before it reached them.
        for pod in pods:
            if pod.exists() and not self.is_relative_to(pod):
                shutil.rmtree(pod)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", exiting)
    assert _procs_in(tmp_path) in ({11}, {21})


def test_pids_come_from_every_level_and_a_missing_cgroup_has_none(tmp_path: Path) -> None:
    (tmp_path / "pod" / "ctr").mkdir(parents=True)
    (tmp_path / "cgroup.procs").write_text("1\n")
    (tmp_path / "pod" / "ctr" / "cgroup.procs").write_text("2\n3\n")
    assert _procs_in(tmp_path) == {1, 2, 3}
    assert _procs_in(tmp_path / "gone") == set()
