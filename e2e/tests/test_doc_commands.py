"""The shell blocks of README.md and docs/ marked `<!-- doc-test: run -->`, run as a user
would type them, in order per file, in one folder, against the local cluster (its
kubeconfig, its kubectl, helm and `gpudra` on PATH). Each must exit 0.

Those marked `<!-- doc-test: kind -->` run the same way against the kind cluster of
`make e2e-kind`, from the checkout (they build and load the image, install the chart
with e2e/kind/values.yaml and run a pod), with kind, its kubectl and helm on PATH and
the cluster's Docker engine in the environment, as on a machine with Docker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.cluster.harness import REPO, Cluster
from e2e.doc_commands import ShellBlock, doc_files, shell_blocks
from e2e.kind.cluster import KindCluster
from e2e.tools import helm as h

pytestmark = pytest.mark.cluster
RUNNABLE = [f for f in doc_files(REPO) if any(b.runs for b in shell_blocks(f))]
ON_KIND = [f for f in doc_files(REPO) if any(b.on_kind for b in shell_blocks(f))]


def helm_dir() -> str:
    try:
        return str(h.helm_binary().parent)
    except h.HelmUnavailable as e:
        pytest.skip(f"helm could not be built: {e}")


def run_blocks(blocks: list[ShellBlock], cwd: Path, env: dict[str, str]) -> None:
    for block in blocks:
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.code],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, f"{block.where} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("doc", RUNNABLE, ids=lambda p: p.name)
def test_doc_commands_run(cluster: Cluster, doc: Path, tmp_path: Path) -> None:
    if isinstance(cluster, KindCluster):
        pytest.skip("these blocks run against the local cluster; kind runs the kind blocks")
    (tmp_path / "charts").symlink_to(REPO / "charts")  # the docs run from a checkout
    path = os.pathsep.join([str(Path(sys.executable).parent), str(cluster.bin_dir()), helm_dir()])
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.layout.admin_kubeconfig),
        "PATH": f"{path}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    run_blocks([b for b in shell_blocks(doc) if b.runs], tmp_path, env)


@pytest.mark.kind
@pytest.mark.parametrize("doc", ON_KIND, ids=lambda p: p.name)
def test_kind_doc_commands_run(cluster: Cluster, doc: Path) -> None:
    if not isinstance(cluster, KindCluster):
        pytest.skip("these blocks run against kind: make e2e-kind")
    from e2e.kind.gpus import fresh_state, gpu_workers  # noqa: PLC0415 - only with Docker
    from e2e.node.chart import NAMESPACE, RELEASE, remove_unreleased  # noqa: PLC0415

    # As a cluster just created: no node state, no gpudra object other suites left.
    for worker in gpu_workers(cluster):
        fresh_state(worker)
    remove_unreleased(cluster.kube())
    tools = [str(Path(sys.executable).parent), str(cluster.bin_dir()), helm_dir()]
    kind = cluster._kind()
    path = os.pathsep.join([*tools, str(Path(kind).parent)])
    env = {
        **cluster.env(),
        # What the first block exports, kept as the user's shell keeps it for the next.
        "KUBECONFIG": str(cluster.layout.admin_kubeconfig),
        "PATH": f"{path}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    try:
        run_blocks([b for b in shell_blocks(doc) if b.on_kind], REPO, env)
    finally:
        subprocess.run(
            ["helm", "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait",
             "--ignore-not-found"],
            env=env, capture_output=True, check=False, timeout=300,
        )  # fmt: skip
