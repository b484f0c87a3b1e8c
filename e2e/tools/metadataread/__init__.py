"""Kubernetes' own readers of DRA device metadata files (`devicemetadata` of
k8s.io/dynamic-resource-allocation, as a workload links it), one per release whose
reader differs: v1.37 knows metadata.resource.k8s.io/v1beta1 and v1alpha1 and validates
what it decodes, v1.36 knows v1alpha1 only. Built from the Go module proxy on first use
(`e2e.gobuild`), so that the tests judge gpudra's files by upstream's code."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from e2e.gobuild import go_binary

__all__ = ["VERSIONS", "read"]

HERE = Path(__file__).resolve().parent
VERSIONS = ("1.37", "1.36")


def read(version: str, path: Path) -> dict[str, Any]:
    """`path` as the reader of Kubernetes `version` decodes it: `apiVersion` (the
    object it chose; empty from 1.36's), `object` (the internal type, Go's field names)
    and `validation` (what 1.37's validation said; empty when it found nothing).
    Raises `e2e.gobuild.GoBuildError` where it cannot be built, and AssertionError with
    the reader's message where it refuses the file."""
    binary = go_binary(HERE / f"v{version}", f"metadataread-{version}")
    done = subprocess.run(
        [str(binary), str(path)], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, f"the {version} reader refused {path}: {done.stderr.strip()}"
    out: dict[str, Any] = json.loads(done.stdout)
    return out
