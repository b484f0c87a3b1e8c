"""kubernetes_asyncio's generated code stays out of a process until something uses it,
and nothing is lost when something does."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpudra.common.kubeimports import defer_package

# One process, as `gpudra node` starts: the node command's imports, then
# `Kube.connect` on a kubeconfig (token auth, no server needed to load it).
AGENT_PROCESS = """
import json, sys
from types import SimpleNamespace
import anyio
from gpudra.cli.main import build_parser, command_of
from gpudra.common.kube import Kube


async def connect(kubeconfig):
    kube = await Kube.connect(kubeconfig)
    headers = {}
    await kube.api.update_params_for_auth(headers, [], ["BearerToken"])  # as Kube sends
    return kube, headers

build_parser(command_of(["node"]))
kube, auth = anyio.run(connect, sys.argv[1])
loaded = sorted(sys.modules)

# The generated code is still all there for whoever asks for it.
import kubernetes_asyncio
from kubernetes_asyncio.client import CoreV1Api, V1ObjectMeta
from kubernetes_asyncio.client.models.v1_object_meta import V1ObjectMeta as Direct

print(json.dumps({
    "loaded": loaded,
    "auth": auth,
    "same_model": V1ObjectMeta is Direct,
    "model_by_name": kube.api.deserialize(
        SimpleNamespace(data='{"name": "x"}'), "V1ObjectMeta"
    ).name,
    "api": CoreV1Api.__module__,
    "version": kubernetes_asyncio.__version__,
}))
"""

KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: u, user: {token: s3cret}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def test_the_agent_process_holds_no_generated_models_and_loses_none(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    done = subprocess.run(
        [sys.executable, "-c", AGENT_PROCESS, str(kubeconfig)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(done.stdout)
    generated = [
        m
        for m in seen["loaded"]
        if m.startswith(("kubernetes_asyncio.client.models.", "kubernetes_asyncio.client.api."))
    ]
    assert generated == []
    # Nor the webhook's code, which `gpudra node` does not run.
    assert [m for m in seen["loaded"] if m.startswith(("gpudra.webhook", "cryptography"))] == []
    assert "kubernetes_asyncio.config.kube_config" in seen["loaded"]
    assert seen["auth"] == {"authorization": "Bearer s3cret"}
    assert seen["same_model"] is True
    assert seen["model_by_name"] == "x"
    assert seen["api"] == "kubernetes_asyncio.client.api.core_v1_api"
    assert seen["version"]


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package whose `__init__` imports a heavy submodule and counts its runs."""
    name = f"deferred_{tmp_path.name.replace('-', '_')}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text(
        textwrap.dedent(f"""
        from {name} import runs
        runs.COUNT += 1
        from {name}.heavy import Heavy
        VERSION = "1"
        """)
    )
    (root / "runs.py").write_text("COUNT = 0\n")
    (root / "heavy.py").write_text("class Heavy: ...\n")
    (root / "light.py").write_text("LIGHT = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in [m for m in sys.modules if m.split(".")[0] == name]:
        del sys.modules[module]


def _runs(name: str) -> int:
    runs = sys.modules.get(f"{name}.runs")
    count: int = runs.COUNT if runs is not None else 0
    return count


def test_a_submodule_imports_without_the_package_init(package: str) -> None:
    deferred = defer_package(package)
    light = importlib.import_module(f"{package}.light")
    assert light.LIGHT == 1
    assert deferred.light is light
    assert _runs(package) == 0
    assert f"{package}.heavy" not in sys.modules


def test_any_other_name_runs_the_init_once_in_the_package(package: str) -> None:
    deferred = defer_package(package)
    assert deferred.VERSION == "1"
    assert deferred.Heavy is sys.modules[f"{package}.heavy"].Heavy
    assert _runs(package) == 1
    assert "__getattr__" not in vars(deferred)
    with pytest.raises(AttributeError, match="nothing"):
        _ = deferred.nothing
    assert _runs(package) == 1
