"""What every results file records about where and when it was measured, so that a
number is never read without its commit, Kubernetes version, core count and load."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from e2e.cluster.harness import REPO
from e2e.cluster.kube import ApiError, Kube


def run_context(kube: Kube, load_at_start: float) -> dict[str, Any]:
    """The commit, the API server's version, the core count, and the 1-minute load
    average at the run's start (`load_at_start`, from `load_avg`) and now, at its end:
    the fields every results file carries under the same names."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        k8s = kube.request("GET", "/version").get("gitVersion", "")
    except (ApiError, OSError, AttributeError):  # a record of the run, never a reason to fail it
        k8s = ""
    return {
        "commit": commit.stdout.strip() if commit.returncode == 0 else "",
        "kubernetes_version": k8s,
        "cpus": os.cpu_count(),
        "load_avg_1m_at_start": round(load_at_start, 2),
        "load_avg_1m_at_end": load_avg(),
    }


def load_avg() -> float:
    """The 1-minute load average now: above the core count, the machine was shared."""
    return round(os.getloadavg()[0], 2)
