"""`gpudra node` as a process: it publishes an emulated node's pool, freezes its
start-up heap once ready, and exits cleanly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from e2e.cluster.harness import REPO, Cluster
from e2e.cluster.kube import Kube, wait_for

pytestmark = pytest.mark.cluster
DRIVER = "cli.gpudra.dev"


def test_node_command_publishes_and_stops_on_sigterm(cluster: Cluster, kube: Kube) -> None:
    # Short: the plugin's unix socket paths under it must stay within 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="gpudra-node-"))
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.layout.admin_kubeconfig),
        "NODE_NAME": "worker-2",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpudra.cli",
            "node",
            "--nvml",
            "emulated:l4",
            "--driver-name",
            DRIVER,
            # Its own folders, not the host's /var/lib/kubelet and /var/lib/gpudra.
            "--kubelet-root",
            str(scratch / "kubelet"),
            "--state-dir",
            str(scratch / "state"),
        ],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
    reader.start()
    try:
        items = wait_for(
            "the L4 pool",
            lambda: kube.list("ResourceSlice", fieldSelector=f"spec.driver={DRIVER}"),
            timeout=60,
        )
        devices = [d for o in items for d in o["spec"].get("devices", [])]
        assert [d["name"] for d in devices] == ["gpu-0"]
        assert devices[0]["attributes"]["productName"] == {"string": "NVIDIA L4"}
        # Once ready, the start-up heap leaves the collector's full passes
        # (gpudra.common.heap): tens of thousands of objects, not a handful.
        frozen = wait_for(
            "the start-up heap frozen",
            lambda: [json.loads(x) for x in list(lines) if "start-up heap frozen" in x],
            timeout=60,
        )
        assert frozen[0]["objects"] > 10_000, frozen
    finally:
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 30
        for o in kube.list("ResourceSlice", fieldSelector=f"spec.driver={DRIVER}"):
            kube.delete("ResourceSlice", o["metadata"]["name"])
        shutil.rmtree(scratch, ignore_errors=True)
