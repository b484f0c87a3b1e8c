"""The kind cluster config cannot be run here (no Docker), so it is checked against what
the real components accept: every feature gate must be one the pinned Kubernetes
binaries know and that is not GA (a GA or unknown gate stops kind's control plane),
and it must be exactly the set the local harness enables, so both providers test the
same features. CDI must be on where the chart writes its specs. The file as a whole is
decoded by e2e/kind/validate, built against the pinned kind's own config types, so a
misspelt field, a wrong type or an unknown node role fails here and not at `kind
create cluster`."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpudra.cli.main import build_parser
from gpudra.driver.nvml import labelled_nvml
from gpudra.driver.nvml.emulator import load_builtin_profile

from e2e.cluster.harness import BUILD_SCRIPT, WANTED_GATES, known_gates
from e2e.kind.cluster import CONFIG, VALUES, KindCluster, node_image
from e2e.kind.gpus import EMULATED_LABEL, PROFILE_LABEL, KindGpus, KindNode
from e2e.kind.nodeimage import CONTAINERD_BUILD, NodeImageError, kind_module
from e2e.pins import TOOL_VERSIONS, PinMissing, pinned
from e2e.progress import BuildFailed, build_script
from e2e.tools import helm as h

KIND = yaml.safe_load(CONFIG.read_text())
COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet")
REPO = Path(__file__).resolve().parents[2]
VALIDATE_BUILD = REPO / "e2e" / "tools" / "build-kind-validate.sh"


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


@pytest.fixture(scope="module")
def node_containerd() -> Path:
    """The containerd the node image built here runs (cached, built once)."""
    try:
        return build_script(CONTAINERD_BUILD, prefix="build", what="building containerd") / (
            "containerd"
        )
    except BuildFailed as e:
        pytest.skip(f"containerd could not be built: {e}")


@pytest.fixture(scope="module")
def kind_containerd_config() -> Path:
    """kind's own containerd config, which `containerdConfigPatches` patch on each node."""
    try:
        base = kind_module(pinned("KIND_VERSION", TOOL_VERSIONS))
    except (NodeImageError, PinMissing) as e:
        pytest.skip(f"kind's module source is not at hand: {e}")
    return base / "files" / "etc" / "containerd" / "config.toml"


def _leaf_keys(table: dict[str, Any]) -> set[str]:
    return {
        leaf
        for key, value in table.items()
        for leaf in (_leaf_keys(value) if isinstance(value, dict) else {key})
    }


def test_containerd_reads_cdi_specs_where_the_chart_writes_them(
    node_containerd: Path, kind_containerd_config: Path, tmp_path: Path
) -> None:
    """What decides CDI in a kind node is its containerd: 2.x injects CDI devices
    without a switch (2.4 removed `enable_cdi` and ignores it with a warning) from the
    folders in `cdi_spec_dirs`. So the node image's containerd loads kind's config with
    our patch, and must know every key the patch sets and end up reading specs from
    the chart's cdiRoot, with no switch left that could turn CDI off."""
    (patch,) = KIND["containerdConfigPatches"]
    # The patch adds a table kind's config lacks, so kind's merge patch is the two texts
    # one after the other (TOML refuses a table defined twice, which a merge would not be).
    merged = kind_containerd_config.read_text() + "\n" + patch + "\n"
    tomllib.loads(merged)
    config = tmp_path / "config.toml"
    config.write_text(merged)
    proc = subprocess.run(
        [str(node_containerd), "--config", str(config), "config", "dump"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ignored = set(re.findall(r"Ignoring unknown key.* key=(\S+)", proc.stderr))
    assert not ignored & _leaf_keys(tomllib.loads(patch)), proc.stderr
    runtime = tomllib.loads(proc.stdout)["plugins"]["io.containerd.cri.v1.runtime"]
    assert "enable_cdi" not in runtime
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
    assert f"--emulated-profile-label={PROFILE_LABEL}" in ds["containers"][0]["args"]
    assert ds["containers"][0]["securityContext"]["privileged"] is False


def test_each_gpu_worker_runs_the_profile_its_label_names() -> None:
    """Two GPU workers, two products: an H100 node in MIG mode and an L4 node, as the
    agent the kind values start (its flags, parsed by `gpudra node`) resolves each
    worker's labels. The multi-node scheduling tests (e2e/tests/test_kind_nodes.py)
    rely on exactly this split."""
    values = yaml.safe_load(VALUES.read_text())
    assert values["node"]["emulatedProfileLabel"] == PROFILE_LABEL
    args = build_parser().parse_args(
        ["node", "--node-name=w", f"--nvml={values['node']['nvml']}",
         f"--emulated-profile-label={values['node']['emulatedProfileLabel']}"]
    )  # fmt: skip
    workers = [n.get("labels", {}) for n in KIND["nodes"] if n["role"] == "worker"]
    chosen = [
        labelled_nvml(args.nvml, label=args.emulated_profile_label, node="w", labels=lb)
        for lb in workers
        if lb.get(EMULATED_LABEL) == "true"
    ]
    products = [load_builtin_profile(c.removeprefix("emulated:")) for c in chosen]
    assert len(chosen) >= 2 and len(set(chosen)) == len(chosen), chosen
    mig = [any(g.migEnabled for g in p.gpus) for p in products]
    names = [{p.products[g.product].name for g in p.gpus} for p in products]
    assert mig[0] and names[0] == {"NVIDIA H100 80GB HBM3"}
    assert not mig[1] and names[1] == {"NVIDIA L4"}


def test_kind_gpu_node_values_pin_one_worker_with_the_node_profile(tmp_path: Path) -> None:
    """What the GPU-pod suite installs on kind (KindGpus), rendered by the real helm:
    the chart's defaults for host paths and networking, the image the suite loads,
    one worker, and the GPU profile the suite writes into the agent's state dir."""
    try:
        helm = h.helm_binary()
    except h.HelmUnavailable as e:
        pytest.skip(f"helm could not be built: {e}")
    gpus = KindGpus(KindNode(KindCluster(root=tmp_path), "gpudra-e2e-worker"))
    crashing = gpus.values(node_args=["--crash-at=cdi-written"], api_port=1)
    objects = h.template(helm, gpus.values())
    spec = h.find(objects, "DaemonSet")["spec"]["template"]["spec"]
    (agent,) = spec["containers"]
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": "gpudra-e2e-worker"}
    assert "hostNetwork" not in spec  # kind has kube-proxy and a pod network
    assert agent["image"] == "gpudra.local/gpudra:e2e"
    assert "--nvml=emulated:/var/lib/gpudra/profile.json" in agent["args"]
    # The suite's own profile, not the one the worker's label names.
    assert not [a for a in agent["args"] if a.startswith("--emulated-profile-label")]
    assert "--kubelet-root=/var/lib/kubelet" in agent["args"]
    assert not [a for a in agent["args"] if a.startswith(("--driver-root", "--host-root"))]
    assert not [e for e in agent["env"] if e["name"].startswith("KUBERNETES_SERVICE")]
    # The fault variants: a crash point, and an API server address that answers nothing.
    (agent,) = h.find(h.template(helm, crashing), "DaemonSet")["spec"]["template"]["spec"][
        "containers"
    ]
    assert "--crash-at=cdi-written" in agent["args"]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", "1")


@pytest.fixture(scope="module")
def kind_validate() -> Path:
    """e2e/kind/validate built against the pinned kind (cached, built once)."""
    proc = subprocess.run(
        ["bash", str(VALIDATE_BUILD)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("build-kind-validate:")]
        reason = lines[-1] if lines else proc.stderr.strip()[-300:]
        pytest.skip(f"kind config validator could not be built: {reason}")
    return Path(proc.stdout.strip().splitlines()[-1])


def validate(binary: Path, config: Path) -> tuple[int, list[str]]:
    proc = subprocess.run(
        [str(binary), str(config)], capture_output=True, text=True, check=False, timeout=60
    )
    assert proc.stderr == "", proc.stderr
    return proc.returncode, proc.stdout.splitlines()


def test_validator_requires_the_pinned_kind() -> None:
    versions = dict(
        line.split("=", 1)
        for line in (REPO / "e2e" / "tools" / "versions.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    go_mod = (REPO / "e2e" / "kind" / "validate" / "go.mod").read_text()
    assert re.search(
        rf"^\s*sigs\.k8s\.io/kind {re.escape(versions['KIND_VERSION'])}$", go_mod, re.M
    )


def test_config_is_valid_for_the_pinned_kind(kind_validate: Path) -> None:
    assert validate(kind_validate, CONFIG) == (0, ["ok"])


def _misspelt_key(cfg: dict[str, Any]) -> None:
    cfg["featureGate"] = cfg.pop("featureGates")


def _unknown_role(cfg: dict[str, Any]) -> None:
    worker = next(n for n in cfg["nodes"] if n["role"] == "worker")
    worker["role"] = "wroker"


def _string_gate(cfg: dict[str, Any]) -> None:
    gate = next(iter(cfg["featureGates"]))
    cfg["featureGates"][gate] = "true"


def _not_toml(cfg: dict[str, Any]) -> None:
    cfg["containerdConfigPatches"][0] = cfg["containerdConfigPatches"][0].replace("]", "", 1)


def _wrong_api_version(cfg: dict[str, Any]) -> None:
    cfg["apiVersion"] = "kind.x-k8s.io/v1alpha3"


FIRST_GATE = re.escape(next(iter(KIND["featureGates"])))
FIRST_WORKER = next(i for i, n in enumerate(KIND["nodes"]) if n["role"] == "worker")
BROKEN = {
    "misspelt-top-level-key": (
        _misspelt_key,
        r'featureGate: unknown field, v1alpha4\.Cluster has no "featureGate"'
        r' \(did you mean "featureGates"\?\)',
    ),
    "unknown-node-role": (
        _unknown_role,
        rf'nodes\[{FIRST_WORKER}\]\.role: "wroker" is not one of control-plane, worker',
    ),
    "feature-gate-string": (
        _string_gate,
        rf"featureGates\.{FIRST_GATE}: cannot unmarshal !!str `true` into bool",
    ),
    "containerd-patch-not-toml": (_not_toml, r"containerdConfigPatches\[0\]: not valid TOML: .+"),
    "wrong-api-version": (
        _wrong_api_version,
        r'apiVersion: "kind\.x-k8s\.io/v1alpha3" is not kind\.x-k8s\.io/v1alpha4, .+',
    ),
}


def test_an_unchanged_copy_is_valid(kind_validate: Path, tmp_path: Path) -> None:
    """The broken copies below are written the same way; this one, unbroken, passes."""
    copy = tmp_path / "cluster.yaml"
    copy.write_text(yaml.safe_dump(KIND, sort_keys=False))
    assert validate(kind_validate, copy) == (0, ["ok"])


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_copy_fails_naming_the_field(
    kind_validate: Path, tmp_path: Path, case: str
) -> None:
    breaks, expected = BROKEN[case]
    cfg = yaml.safe_load(CONFIG.read_text())
    breaks(cfg)
    assert cfg != KIND, "the edit did not change the config"
    broken = tmp_path / "cluster.yaml"
    broken.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, lines = validate(kind_validate, broken)
    assert rc == 1, lines
    assert len(lines) == 1, lines
    assert re.fullmatch(rf"{expected}( \(line \d+\))?", lines[0]), lines
