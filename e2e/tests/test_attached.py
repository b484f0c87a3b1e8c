"""What runs against the control plane (a real node) records how to stop it, and the
harness's `down` runs that first, knowing nothing else of it; a stop that fails keeps
the control plane up. No cluster needed: `down` stops attachments before it looks for
the control plane's own state."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from e2e.cluster.harness import Cluster, ClusterError, Layout


def _stop(marker: Path) -> list[str]:
    """A stop command that writes the cluster dir it was given, then says so."""
    code = (
        "import os, pathlib, sys; "
        "pathlib.Path(sys.argv[1]).write_text(os.environ['GPUDRA_CLUSTER_DIR']); "
        "print('node stopped')"
    )
    return [sys.executable, "-c", code, str(marker)]


def test_down_runs_each_attached_stop_command_first(tmp_path: Path) -> None:
    cluster = Cluster(Layout(tmp_path / "c"))
    cluster.attach("real-1", _stop(tmp_path / "stopped"))
    record = cluster.layout.attached / "real-1.json"
    assert json.loads(record.read_text())["stop"] == _stop(tmp_path / "stopped")
    lines: list[str] = []
    cluster.down(log=lines.append)
    assert (tmp_path / "stopped").read_text() == str(cluster.layout.root)
    assert lines[0] == "node stopped"
    assert not record.exists()


def test_detached_is_not_stopped_again(tmp_path: Path) -> None:
    cluster = Cluster(Layout(tmp_path / "c"))
    cluster.attach("real-1", _stop(tmp_path / "stopped"))
    cluster.detach("real-1")
    cluster.down(log=lambda _m: None)
    assert not (tmp_path / "stopped").exists()


def test_failed_stop_keeps_the_record_and_raises(tmp_path: Path) -> None:
    cluster = Cluster(Layout(tmp_path / "c"))
    fail = [sys.executable, "-c", "import sys; sys.exit('could not unmount /x')"]
    cluster.attach("real-1", fail)
    with pytest.raises(ClusterError, match=r"^stopping real-1 failed: could not unmount /x;"):
        cluster.down(log=lambda _m: None)
    assert (cluster.layout.attached / "real-1.json").exists()
