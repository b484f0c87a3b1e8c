"""The kind cluster config cannot be run here (no Docker), so it is checked against what
the real components accept: every feature gate must be one the pinned Kubernetes
binaries know and that is not GA (a GA or unknown gate stops kind's control plane),
and it must be exactly the set the local harness enables, so both providers test the
same features. CDI must be on where the chart writes its specs."""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from e2e.cluster.harness import BUILD_SCRIPT, WANTED_GATES, known_gates
from e2e.kind.cluster import CONFIG, VALUES, node_image
from e2e.tools import helm as h

KIND = yaml.safe_load(CONFIG.read_text())
COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet")


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    """The binaries of the version the kind node image runs (cached, built once)."""
    tag = node_image().rsplit(":", 1)[1]
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "K8S_VERSION": tag.removeprefix("v")},
    )
    if proc.returncode != 0:
        pytest.skip(f"Kubernetes binaries could not be built: {proc.stderr.strip()[-300:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def test_config_shape() -> None:
    assert KIND["kind"] == "Cluster"
    assert KIND["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    roles = [n["role"] for n in KIND["nodes"]]
    assert roles.count("control-plane") == 1
    assert roles.count("worker") >= 1
    assert KIND["runtimeConfig"] == {"api/all": "true"}


def test_feature_gates_are_the_harness_gates(bin_dir: Path) -> None:
    gates = KIND["featureGates"]
    assert all(v is True for v in gates.values())
    apiserver = known_gates(bin_dir / "kube-apiserver")
    wanted = {g for g in WANTED_GATES if apiserver.get(g) in ("ALPHA", "BETA")}
    assert set(gates) == wanted
    for component in COMPONENTS:
        known = known_gates(bin_dir / component)
        unknown = sorted(g for g in gates if known.get(g) not in ("ALPHA", "BETA"))
        assert unknown == [], f"{component} of {bin_dir.parent.name} rejects {unknown}"


def test_cdi_is_enabled_where_the_chart_writes_specs() -> None:
    (patch,) = KIND["containerdConfigPatches"]
    runtime = tomllib.loads(patch)["plugins"]["io.containerd.cri.v1.runtime"]
    assert runtime["enable_cdi"] is True
    chart_defaults = yaml.safe_load((h.CHART / "values.yaml").read_text())
    assert chart_defaults["node"]["cdiRoot"] in runtime["cdi_spec_dirs"]


def test_kind_values_select_the_labelled_workers_with_emulated_gpus() -> None:
    values = yaml.safe_load(VALUES.read_text())
    assert values["node"]["nvml"].startswith("emulated:")
    assert values["image"]["pullPolicy"] == "Never"  # loaded into the nodes, never pulled
    labels = [n.get("labels", {}) for n in KIND["nodes"] if n["role"] == "worker"]
    for key, value in values["node"]["nodeSelector"].items():
        assert all(lb.get(key) == value for lb in labels)


def test_kind_values_render() -> None:
    try:
        helm = h.helm_binary()
    except h.HelmUnavailable as e:
        pytest.skip(f"helm could not be built: {e}")
    objects = h.template(helm, VALUES)
    ds = h.find(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert "--nvml=emulated:h100-80gb-hbm3-x8" in ds["containers"][0]["args"]
    assert ds["containers"][0]["securityContext"]["privileged"] is False
