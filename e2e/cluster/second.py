"""A second local control plane beside the shared test cluster, for a test that needs
one of its own (a crash to provoke, a feature gate the shared one keeps off): its own
folder and ports, driven through the harness's command line as a user drives it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Final

from e2e.cluster.harness import REPO

# Ports apart from the shared cluster's (`Ports` defaults), as GPUDRA_<NAME>_PORT: below
# the kernel's ephemeral range (32768 and up), so no client connection or OS-chosen
# test port can hold one of them while a test runs.
PORTS: Final = {
    "ETCD": 24790,
    "ETCD_PEER": 24800,
    "APISERVER": 27443,
    "CONTROLLER_MANAGER": 21257,
    "SCHEDULER": 21259,
    "ADMISSION_WEBHOOK": 29443,
}


def second_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a control plane in `tmp / "c"` on `PORTS`, with `extra`."""
    env = {**os.environ, "GPUDRA_CLUSTER_DIR": str(tmp / "c"), **extra}
    env.update({f"GPUDRA_{k}_PORT": str(v) for k, v in PORTS.items()})
    return env


def harness(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m e2e.cluster ARGS` (up, down, status) in `env`."""
    return subprocess.run(
        [sys.executable, "-m", "e2e.cluster", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
