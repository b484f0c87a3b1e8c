"""The shell blocks of README.md and docs/ marked `<!-- doc-test: run -->`, run as a user
would type them, in order per file, in one folder, against the local cluster (its
kubeconfig, its kubectl, helm and `gpudra` on PATH). Each must exit 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.cluster.harness import REPO, Cluster
from e2e.doc_commands import doc_files, shell_blocks
from e2e.tools import helm as h

pytestmark = pytest.mark.cluster
RUNNABLE = [f for f in doc_files(REPO) if any(b.runs for b in shell_blocks(f))]


@pytest.mark.parametrize("doc", RUNNABLE, ids=lambda p: p.name)
def test_doc_commands_run(cluster: Cluster, doc: Path, tmp_path: Path) -> None:
    state = cluster.require_state()
    try:
        helm_dir = str(h.helm_binary().parent)
    except h.HelmUnavailable as e:
        pytest.skip(f"helm could not be built: {e}")
    (tmp_path / "charts").symlink_to(REPO / "charts")  # the docs run from a checkout
    path = os.pathsep.join([str(Path(sys.executable).parent), state.bin_dir, helm_dir])
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.layout.admin_kubeconfig),
        "PATH": f"{path}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    for block in shell_blocks(doc):
        if not block.runs:
            continue
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, f"{block.where} failed:\n{proc.stdout}\n{proc.stderr}"
