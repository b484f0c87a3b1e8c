"""The Helm chart through the real helm binary: lint, schema, rendering, and agreement with
the objects the code builds (webhook configuration, DeviceClasses, CRDs)."""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpudra.api.config import GpuConfig, parse_opaque_config
from gpudra.api.deviceclasses import DEFAULT_SHARED_SHARING, device_classes
from gpudra.api.tenants import MigProfile, parse_tenant
from gpudra.cli.main import build_parser
from gpudra.cli.main import main as cli_main
from gpudra.cli.node import (
    EMULATED_DRIVER_ROOT,
    EMULATED_TOOLS_LOG,
    _agent_config,
    _metrics_address,
)
from gpudra.cli.webhook import conversion_policy, server_config
from gpudra.driver.devices import SharedGpus
from gpudra.driver.nvml import labelled_nvml
from gpudra.driver.prepare import MAX_CONFLICT_WAIT_S
from gpudra.webhook import registration
from gpudra.webhook.certs import generate_ca
from gpudra.webhook.convert import DEFAULT_POLICY, OPT_OUT_LABEL, ConversionPolicy
from gpudra.webhook.tenant_state import QUOTA_NAME
from gpudra.webhook.validate import driver_classes
from pydantic import TypeAdapter

from e2e.tools import helm as h

REPO = Path(__file__).resolve().parents[2]
API_CRDS = REPO / "api" / "crds"
CHART_CRDS = h.CHART / "files" / "crds"
CLIENT_CA = generate_ca().cert_pem.decode()


@pytest.fixture(scope="module")
def default(helm: Path) -> list[dict[str, Any]]:
    return h.template(helm)


@pytest.fixture(scope="module")
def full(helm: Path) -> list[dict[str, Any]]:
    return h.template(helm, h.FULL_VALUES, namespace="gpu-system", release="gpu")


def strip_chart_metadata(obj: dict[str, Any]) -> dict[str, Any]:
    """The chart adds labels (and cert-manager annotations); the code does not."""
    out = copy.deepcopy(obj)
    out["metadata"].pop("labels", None)
    out["metadata"].pop("annotations", None)
    return out


@pytest.mark.parametrize("values", [[], [h.FULL_VALUES]], ids=["default", "full"])
def test_lint_strict(helm: Path, values: list[Path]) -> None:
    out = h.run(helm, "lint", "--strict", str(h.CHART), *h.values_args(values, Path()))
    assert "0 chart(s) failed" in out


def test_default_renders_every_component(default: list[dict[str, Any]]) -> None:
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in default)
    for expected in (
        "DaemonSet/gpudra-node",
        "Deployment/gpudra-webhook",
        "Service/gpudra-webhook",
        "PodDisruptionBudget/gpudra-webhook",
        "MutatingWebhookConfiguration/gpudra-pod-conversion",
        "DeviceClass/gpu.nvidia.com",
        "DeviceClass/mig.nvidia.com",
        "DeviceClass/gpu-shared.nvidia.com",
        "ClusterRole/gpudra-node",
        "ClusterRole/gpudra-webhook",
        "ServiceAccount/gpudra-node",
        "ServiceAccount/gpudra-webhook",
        "ValidatingAdmissionPolicy/gpudra-node-own-node-slices",
        "ValidatingAdmissionPolicyBinding/gpudra-node-own-node-slices",
        "ValidatingWebhookConfiguration/gpudra-claim-validation",
        "CustomResourceDefinition/gputenants.gpudra.io",
    ):
        assert expected in kinds


def test_no_tenant_pod_outranks_what_every_gpu_pod_waits_on(
    default: list[dict[str, Any]],
) -> None:
    """The webhook (failurePolicy Fail: every GPU pod and driver claim waits on it) and
    the node agent run at system priorities, so a tenant's pod of a higher priority
    class cannot preempt them."""
    webhook = h.find(default, "Deployment", "gpudra-webhook")
    node = h.find(default, "DaemonSet", "gpudra-node")
    assert webhook["spec"]["template"]["spec"]["priorityClassName"] == "system-cluster-critical"
    assert node["spec"]["template"]["spec"]["priorityClassName"] == "system-node-critical"


@pytest.mark.parametrize(
    ("values", "namespace", "port", "ca_from_chart"),
    [
        ([], "gpudra", 8443, False),
        ([{"webhook": {"tls": {"source": "helm"}, "port": 9443}}], "gpu-system", 9443, True),
        # Installed in kube-system: the namespace the webhook never reviews is listed once.
        ([], "kube-system", 8443, False),
    ],
    ids=["self-signed", "chart-tls", "in-kube-system"],
)
def test_webhook_configurations_match_the_code(
    helm: Path, values: list[Any], namespace: str, port: int, ca_from_chart: bool
) -> None:
    objects = h.template(helm, *values, namespace=namespace)
    service = ("gpudra-webhook", namespace, port)
    expected = [
        registration.mutating_configuration(
            ca_bundle_b64="", own_namespace=namespace, service=service
        ),
        registration.validating_configuration(
            ca_bundle_b64="",
            own_namespace=namespace,
            device_classes=sorted(driver_classes(DEFAULT_POLICY)),
            driver=DEFAULT_POLICY.driver,
            service=service,
        ),
    ]
    bundles = set()
    for want in expected:
        rendered = strip_chart_metadata(h.find(objects, want["kind"]))
        for hook in [*rendered["webhooks"], *want["webhooks"]]:
            bundles.add(hook["clientConfig"].pop("caBundle", ""))
        assert rendered == want
    bundles.discard("")
    if ca_from_chart:
        # The bundle the API server trusts is the CA in the Secret the pods mount.
        secret = h.find(objects, "Secret", "gpudra-webhook-tls")
        assert bundles == {secret["data"]["ca.crt"]}
        assert base64.b64decode(secret["data"]["ca.crt"]).startswith(b"-----BEGIN CERTIFICATE-----")
        deployment = h.find(objects, "Deployment")
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        assert {"name": "certs", "secret": {"secretName": "gpudra-webhook-tls"}} in volumes
        # It keeps the CA key, so the webhook renews its serving certificate from it.
        assert base64.b64decode(secret["data"]["ca.key"]).startswith(b"-----BEGIN")
        assert secret["metadata"]["annotations"]["gpudra.nvidia.com/ca-renew-after"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["certs"]["readOnly"] is True
        assert f"--ca-dir={mounts['certs']['mountPath']}" in container["args"]
        assert f"--cert-dir={mounts['serving']['mountPath']}" in container["args"]
    else:
        assert bundles == set()  # the webhook registers its own caBundle


@pytest.mark.parametrize("tenants", [True, False])
def test_conversion_namespace_selector_matches_the_code(helm: Path, tenants: bool) -> None:
    """The chart's pod webhook and the one `gpudra webhook` re-applies from the chart's
    flags are the same. With tenant rules the registration is not narrowed (the webhook
    evaluates the selector, so the rules reach every namespace's GPU pods); without, it
    is narrowed to the selected namespaces, never widened."""
    selector = {
        "matchLabels": {"gpudra.nvidia.com/dra": True},  # as `--set ...=true` gives it
        "matchExpressions": [{"key": "team", "operator": "In", "values": ["a", "b"]}],
    }
    values = {
        "webhook": {"conversion": {"namespaceSelector": selector}},
        "tenants": {"enabled": tenants},
    }
    objects = h.template(helm, values)
    args, _ = webhook_policy(objects)
    parsed = build_parser().parse_args(args)
    flag = parsed.conversion_namespace_selector
    assert flag == {**selector, "matchLabels": {"gpudra.nvidia.com/dra": "true"}}
    assert parsed.tenants is tenants
    want = registration.mutating_configuration(
        ca_bundle_b64="",
        own_namespace="gpudra",
        service=("gpudra-webhook", "gpudra", 8443),
        namespace_selector=flag,
        selector_in_webhook=parsed.tenants,
    )
    rendered = strip_chart_metadata(h.find(objects, "MutatingWebhookConfiguration"))
    want["webhooks"][0]["clientConfig"].pop("caBundle")  # self: the webhook writes it
    assert rendered == want
    (hook,) = rendered["webhooks"]
    expressions = hook["namespaceSelector"]["matchExpressions"]
    assert expressions[0]["values"] == ["kube-system", "gpudra"]
    if tenants:
        assert hook["namespaceSelector"] == {"matchExpressions": [expressions[0]]}
        config = server_config(parsed, conversion_policy(parsed))
        assert config.conversion_selector is not None
        assert config.conversion_selector.matches({"gpudra.nvidia.com/dra": "true", "team": "a"})
        assert not config.conversion_selector.matches({"gpudra.nvidia.com/dra": "true"})
    else:
        assert hook["namespaceSelector"]["matchLabels"] == {"gpudra.nvidia.com/dra": "true"}
        assert expressions[1:] == selector["matchExpressions"]
    # Unset: every namespace but the system ones, and no flag.
    default_args, _ = webhook_policy(h.template(helm))
    assert not [a for a in default_args if a.startswith("--conversion-namespace-selector")]


def test_optional_webhook_features_switch_the_flags(helm: Path) -> None:
    objects = h.template(
        helm, {"webhook": {"validation": {"enabled": False}}, "tenants": {"enabled": False}}
    )
    assert not [o for o in objects if o["kind"] == "ValidatingWebhookConfiguration"]
    args = h.find(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--no-validate-claims", "--no-tenants"} <= set(args)
    rules = h.find(objects, "ClusterRole", "gpudra-webhook")["rules"]
    assert not any("resourcequotas" in r["resources"] for r in rules)


def test_extended_resource_opt_in(helm: Path, default: list[dict[str, Any]]) -> None:
    assert "extendedResourceName" not in h.find(default, "DeviceClass", "gpu.nvidia.com")["spec"]
    objects = h.template(
        helm, {"deviceClasses": {"gpu": {"extendedResourceName": "nvidia.com/gpu"}}}
    )
    assert (
        h.find(objects, "DeviceClass", "gpu.nvidia.com")["spec"]["extendedResourceName"]
        == "nvidia.com/gpu"
    )
    # The webhook steps aside: pods asking only for nvidia.com/gpu are not sent to it, and
    # it is told to leave that resource to the scheduler.
    cel = h.find(objects, "MutatingWebhookConfiguration")["webhooks"][0]["matchConditions"][0]
    assert "k != 'nvidia.com/gpu'" in cel["expression"]
    assert cel["expression"].count("k.startsWith('nvidia.com/')") == registration.GPU_POD_CEL.count(
        "k.startsWith('nvidia.com/')"
    )
    args = h.find(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--extended-resource-name=nvidia.com/gpu" in args


@pytest.mark.parametrize(
    ("values", "driver", "sharing"),
    [
        ({}, "gpu.nvidia.com", DEFAULT_SHARED_SHARING),
        ({"driverName": "gpu.example.com"}, "gpu.example.com", DEFAULT_SHARED_SHARING),
        (
            {"deviceClasses": {"shared": {"timeSlicing": {"interval": "Long"}}}},
            "gpu.nvidia.com",
            {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
        ),
        (
            {
                "deviceClasses": {
                    "shared": {
                        "strategy": "MPS",
                        "mps": {
                            "defaultActiveThreadPercentage": 25,
                            "defaultPinnedDeviceMemoryLimit": "10Gi",
                        },
                    }
                }
            },
            "gpu.nvidia.com",
            {
                "strategy": "MPS",
                "mpsConfig": {
                    "defaultActiveThreadPercentage": 25,
                    "defaultPinnedDeviceMemoryLimit": "10Gi",
                },
            },
        ),
    ],
    ids=["default", "driver", "interval", "mps"],
)
def test_device_classes_match_the_code(
    helm: Path, values: dict[str, Any], driver: str, sharing: dict[str, Any]
) -> None:
    """The chart renders exactly `api.deviceclasses`, which the demo and the tests apply:
    any difference, the shared class's config included, fails here."""
    objects = h.template(helm, values)
    rendered = [strip_chart_metadata(o) for o in objects if o["kind"] == "DeviceClass"]
    assert rendered == device_classes(driver, sharing)


EVERY_SUFFIX = [
    "1g.10gb",
    "1g.10gb+me",
    "1g.20gb+me.all",
    "1g.10gb+gfx",
    "1g.10gb-me",
    "1c.2g.20gb",
]
"""MIG profiles with every suffix the class name rule rewrites, and a compute-instance one."""


@pytest.mark.parametrize("driver", ["gpu.nvidia.com", "gpu.example.com"])
def test_per_profile_mig_classes_match_the_code(helm: Path, driver: str) -> None:
    """`deviceClasses.mig.profiles` renders exactly the classes `api.deviceclasses` builds,
    named by its one name rule, and the validating webhook covers them as the code's."""
    values = {"driverName": driver, "deviceClasses": {"mig": {"profiles": EVERY_SUFFIX}}}
    objects = h.template(helm, values)
    rendered = [strip_chart_metadata(o) for o in objects if o["kind"] == "DeviceClass"]
    assert rendered == device_classes(driver, DEFAULT_SHARED_SHARING, EVERY_SUFFIX)
    _, policy = webhook_policy(objects)
    want = registration.validating_configuration(
        ca_bundle_b64="",
        own_namespace="gpudra",
        device_classes=sorted(driver_classes(policy)),
        driver=driver,
        service=("gpudra-webhook", "gpudra", 8443),
    )
    validating = strip_chart_metadata(h.find(objects, "ValidatingWebhookConfiguration"))
    for hook in [*validating["webhooks"], *want["webhooks"]]:
        hook["clientConfig"].pop("caBundle", None)
    assert validating == want
    assert "mig-1g.10gb-nome.nvidia.com" in driver_classes(policy)


def test_extra_device_classes_reach_the_webhook_and_its_registration(helm: Path) -> None:
    """An admin's DeviceClass listed in `webhook.extraDeviceClasses` is judged by the
    webhook (`--device-class`) and its claims are sent there, as the code registers them."""
    extra = ["a100-80gb.example.com", "l4.example.com"]
    objects = h.template(helm, {"webhook": {"extraDeviceClasses": extra}})
    args, policy = webhook_policy(objects)
    parsed = build_parser().parse_args(args)
    assert parsed.device_class == extra
    want = registration.validating_configuration(
        ca_bundle_b64="",
        own_namespace="gpudra",
        device_classes=sorted(driver_classes(policy, parsed.device_class)),
        driver=policy.driver,
        service=("gpudra-webhook", "gpudra", 8443),
    )
    validating = strip_chart_metadata(h.find(objects, "ValidatingWebhookConfiguration"))
    for hook in [*validating["webhooks"], *want["webhooks"]]:
        hook["clientConfig"].pop("caBundle", None)
    assert validating == want
    assert all("'l4.example.com'" in str(hook["matchConditions"]) for hook in want["webhooks"])
    # Values of a release from before the key (helm upgrade --reuse-values) still render.
    h.template(helm, {"webhook": {"extraDeviceClasses": None}})


def test_the_previous_releases_values_render_every_flag(
    helm: Path, tmp_path: Path, previous_release_file: Callable[[str], str]
) -> None:
    """`helm upgrade --reset-then-reuse-values` (docs/install.md) from the previous
    release: an admin who set every value that release knew, and the new chart's
    defaults for the rest. Every container flag gets a value (an empty `--flag=` is one
    the agent or webhook refuses at start)."""
    old = tmp_path / "previous-values.yaml"
    old.write_text(previous_release_file("charts/gpudra/values.yaml"))
    objects = h.template(helm, old)
    flags = [
        arg
        for o in objects
        if o["kind"] in {"Deployment", "DaemonSet"}
        for c in o["spec"]["template"]["spec"]["containers"]
        for arg in c.get("args", [])
    ]
    assert flags
    assert [f for f in flags if f.startswith("--") and f.endswith("=")] == []


def test_the_profile_schema_is_the_tenants_profile_rule() -> None:
    """The chart's profile pattern is GpuTenant's allowedMigProfiles pattern."""
    schema = yaml.safe_load((h.CHART / "values.schema.json").read_text())
    items = schema["properties"]["deviceClasses"]["properties"]["mig"]["properties"]["profiles"]
    assert items["items"]["pattern"] == TypeAdapter(MigProfile).json_schema()["pattern"]


@pytest.mark.parametrize(
    ("shared", "expected"),
    [
        ({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}, ("TimeSlicing", "Long")),
        (
            {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 25}},
            ("MPS", 25),
        ),
    ],
    ids=["time-slicing", "mps"],
)
def test_shared_class_config_is_valid_for_the_driver(
    helm: Path, shared: dict[str, Any], expected: tuple[str, Any]
) -> None:
    objects = h.template(helm, {"deviceClasses": {"shared": shared}})
    cls = h.find(objects, "DeviceClass", "gpu-shared.nvidia.com")
    gpu = h.find(objects, "DeviceClass", "gpu.nvidia.com")
    assert cls["spec"]["selectors"] == gpu["spec"]["selectors"]
    (entry,) = cls["spec"]["config"]
    assert entry["opaque"]["driver"] == "gpu.nvidia.com"
    config = parse_opaque_config(entry["opaque"]["parameters"])  # the driver's own parser
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None
    assert config.sharing.strategy == expected[0]
    if expected[0] == "TimeSlicing":
        assert config.sharing.time_slicing_config is not None
        assert config.sharing.time_slicing_config.interval == expected[1]
    else:
        assert config.sharing.mps_config is not None
        assert config.sharing.mps_config.default_active_thread_percentage == expected[1]


def test_node_daemonset(default: list[dict[str, Any]], full: list[dict[str, Any]]) -> None:
    ds = h.find(default, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["tini", "--", "gpudra"]  # an init that reaps MPS daemons
    assert c["args"][:3] == ["node", "--node-name=$(NODE_NAME)", "--driver-name=gpu.nvidia.com"]
    assert "--nvml=real" in c["args"]
    assert "--host-root=/host" in c["args"]
    assert c["securityContext"]["privileged"] is True  # real GPUs need device access
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins/gpu.nvidia.com",
        "/var/run/cdi",
        "/var/lib/gpudra",
        "/",
    }
    # Sockets are mounted at their host path: the kubelet dials the path GetInfo returns.
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["plugins"] == "/var/lib/kubelet/plugins/gpu.nvidia.com"
    assert mounts["cdi"] == "/var/run/cdi"
    probe = c["livenessProbe"]["exec"]["command"]
    assert probe == ["python3", "/etc/gpudra/probe/probe.py", "/var/lib/kubelet", "gpu.nvidia.com"]
    # The kubelet does not expand $(VAR) in exec probes: the probe reads $POD_UID itself.
    assert not any("$(" in arg for arg in probe)
    configmap = h.find(default, "ConfigMap", "gpudra-node-probe")
    assert configmap["data"]["probe.py"] == (h.CHART / "files" / "probe.py").read_text()

    emulated = h.find(full, "DaemonSet")["spec"]["template"]["spec"]
    (ec,) = emulated["containers"]
    assert "--nvml=emulated:h100-80gb-hbm3-x8-mig" in ec["args"]
    assert "--application-xids=13,31" in ec["args"]
    assert "--driver-root=/run/nvidia/driver" in ec["args"]
    assert "--metrics-address=0.0.0.0:9500" in ec["args"]
    assert "--host-root=/host" in ec["args"]  # a driver root other than / is used as given
    assert ec["securityContext"]["privileged"] is False  # no devices to reach
    # Only what removing a claim's plain MPS folders needs, whoever made their files;
    # its MPS daemon pods remove nothing.
    assert ec["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["DAC_OVERRIDE", "FOWNER"],
    }
    daemon = json.loads(h.find(full, "ConfigMap", "gpu-gpudra-node-mps")["data"]["pod.json"])
    (dc,) = daemon["spec"]["containers"]
    assert dc["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert dc["securityContext"]["privileged"] is False
    assert emulated["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def pod_spec(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = h.find(objects, kind)["spec"]["template"]["spec"]
    return spec


def driver_root_of(objects: list[dict[str, Any]]) -> tuple[list[str], Any, Any]:
    """The node agent's driver-root flags, the driver-root mount and volume (None if absent)."""
    pod = pod_spec(objects, "DaemonSet")
    (c,) = pod["containers"]
    flags = [a for a in c["args"] if a.startswith(("--driver-root", "--host-root"))]
    mount = next((m for m in c["volumeMounts"] if m["name"] == "driver-root"), None)
    volume = next((v for v in pod["volumes"] if v["name"] == "driver-root"), None)
    return flags, mount, volume


@pytest.mark.parametrize(
    ("nvml", "driver_root", "mount_path"),
    [
        ("real", "/", "/host"),
        ("real", "/run/nvidia/driver", "/host/run/nvidia/driver"),
        ("emulated:l4", "/", None),
        ("emulated:l4", "/run/nvidia/driver", "/host/run/nvidia/driver"),
    ],
    ids=["real", "real-driver-container", "emulated", "emulated-driver-container"],
)
def test_driver_root_is_mounted_unless_emulated_without_one(
    helm: Path, nvml: str, driver_root: str, mount_path: str | None
) -> None:
    """Emulated GPUs with driver root / get nothing: the agent installs a stand-in driver
    root under its state dir. Any other combination mounts the root and passes both flags."""
    objects = h.template(helm, {"node": {"nvml": nvml, "driverRoot": driver_root}})
    flags, mount, volume = driver_root_of(objects)
    if mount_path is None:
        assert (flags, mount, volume) == ([], None, None)
    else:
        assert flags == [f"--driver-root={driver_root}", "--host-root=/host"]
        assert mount == {
            "name": "driver-root",
            "mountPath": mount_path,
            "readOnly": True,
            "mountPropagation": "HostToContainer",
        }
        assert volume == {
            "name": "driver-root",
            "hostPath": {"path": driver_root, "type": "Directory"},
        }
    (c,) = pod_spec(objects, "DaemonSet")["containers"]
    assert c["securityContext"]["privileged"] is (nvml == "real")  # follows nvml alone


def daemon_pod_mounts(objects: list[dict[str, Any]]) -> dict[str, tuple[str, str, bool]]:
    """The MPS daemon pod template's mounts: mount path to (volume name, host path or
    '', read-only)."""
    pod = json.loads(h.find(objects, "ConfigMap", "gpudra-node-mps")["data"]["pod.json"])
    volumes = {v["name"]: v.get("hostPath", {}).get("path", "") for v in pod["spec"]["volumes"]}
    (c,) = pod["spec"]["containers"]
    return {
        m["mountPath"]: (m["name"], volumes[m["name"]], m.get("readOnly", False))
        for m in c["volumeMounts"]
    }


@pytest.mark.parametrize(
    ("nvml", "driver_root", "expected"),
    [
        ("real", "/", {"/host": ("driver-root", "/", True)}),
        (
            "emulated:l4",
            "/run/nvidia/driver",
            {"/host/run/nvidia/driver": ("driver-root", "/run/nvidia/driver", True)},
        ),
        (
            "emulated:l4",
            "/",
            {
                f"/var/lib/gpudra/{EMULATED_DRIVER_ROOT}": (
                    "standin-driver-root",
                    f"/var/lib/gpudra/{EMULATED_DRIVER_ROOT}",
                    True,
                ),
                f"/var/lib/gpudra/{EMULATED_TOOLS_LOG}": (
                    "standin-tools-log",
                    f"/var/lib/gpudra/{EMULATED_TOOLS_LOG}",
                    False,
                ),
            },
        ),
    ],
    ids=["real", "emulated-driver-container", "emulated"],
)
def test_mps_daemon_pods_do_not_mount_the_state_folder(
    helm: Path, nvml: str, driver_root: str, expected: dict[str, tuple[str, str, bool]]
) -> None:
    """A claim's containers talk to its daemon: its pod gets the driver root the agent
    sees (the stand-in one, and its tools' call log, with emulated GPUs and none), and
    of the state folder only the claim's own folders, which the agent adds. The
    checkpoint and the other claims' folders are not there."""
    objects = h.template(helm, {"node": {"nvml": nvml, "driverRoot": driver_root}})
    assert daemon_pod_mounts(objects) == {"/tmp": ("tmp", "", False), **expected}
    # The agent itself mounts the whole state folder, where it installs the stand-in.
    (c,) = pod_spec(objects, "DaemonSet")["containers"]
    assert {"name": "state", "mountPath": "/var/lib/gpudra"}.items() <= next(
        m for m in c["volumeMounts"] if m["name"] == "state"
    ).items()


API_ENV = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")


def api_env(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each component's KUBERNETES_SERVICE_* entries, by workload kind."""
    out = {}
    for kind in ("DaemonSet", "Deployment"):
        (c,) = pod_spec(objects, kind)["containers"]
        out[kind] = {e["name"]: e.get("value") for e in c.get("env", []) if e["name"] in API_ENV}
    return out


@pytest.mark.parametrize("host", ["10.0.0.1", "api.example.com", "fd00:10::1"])
def test_kubernetes_api_address_reaches_both_components(
    helm: Path, default: list[dict[str, Any]], host: str
) -> None:
    assert api_env(default) == {"DaemonSet": {}, "Deployment": {}}  # the kubelet's, by default
    objects = h.template(helm, {"kubernetesApi": {"host": host, "port": 6443}})
    want = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": "6443"}
    assert api_env(objects) == {"DaemonSet": want, "Deployment": want}
    # The node agent's downward-API variables are still there.
    (c,) = pod_spec(objects, "DaemonSet")["containers"]
    assert [e["name"] for e in c["env"]][:3] == ["NODE_NAME", "POD_UID", "POD_NAMESPACE"]


@pytest.mark.parametrize(
    ("component", "kind", "other"),
    [("node", "DaemonSet", "Deployment"), ("webhook", "Deployment", "DaemonSet")],
    ids=["node", "webhook"],
)
def test_host_network_per_component(
    helm: Path, default: list[dict[str, Any]], component: str, kind: str, other: str
) -> None:
    for k in ("DaemonSet", "Deployment"):
        pod = pod_spec(default, k)
        assert "hostNetwork" not in pod and "dnsPolicy" not in pod
    objects = h.template(helm, {component: {"hostNetwork": True}})
    pod = pod_spec(objects, kind)
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # cluster DNS still resolves
    untouched = pod_spec(objects, other)
    assert "hostNetwork" not in untouched and "dnsPolicy" not in untouched


def test_a_webhook_on_the_host_network_rolls_without_a_surge_pod(
    helm: Path, default: list[dict[str, Any]]
) -> None:
    """A surge pod could not bind the port the old pod holds on the node: the rollout
    of `helm upgrade` would wait for it forever."""
    assert "strategy" not in h.find(default, "Deployment")["spec"]
    objects = h.template(helm, {"webhook": {"hostNetwork": True}})
    assert h.find(objects, "Deployment")["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }


def test_a_lone_webhook_on_the_host_network_drains_for_one_second(
    helm: Path, default: list[dict[str, Any]]
) -> None:
    """Its successor waits for the node's port and no other replica serves meanwhile:
    each second of the drain past the API servers' withdrawal of its endpoint is a
    second in which every GPU pod is refused, and so is each second between the new pod
    serving and its first readiness probe. Beside another replica, or off the node's
    network, it drains as long as the webhook's default."""

    def delays(objects: list[dict[str, Any]]) -> list[str]:
        (container,) = pod_spec(objects, "Deployment")["containers"]
        return [a for a in container["args"] if a.startswith("--shutdown-delay")]

    assert delays(default) == []
    # Ready as soon as it serves: with a probe every 5 s the gap was 7.7 s, against
    # 2.9 and 4.0 with one every second.
    (webhook,) = pod_spec(default, "Deployment")["containers"]
    assert webhook["readinessProbe"]["periodSeconds"] == 1
    assert delays(h.template(helm, {"webhook": {"hostNetwork": True}})) == ["--shutdown-delay=1"]
    two = {"hostNetwork": True, "replicas": 2, "tls": {"source": "helm"}}
    assert delays(h.template(helm, {"webhook": two})) == []


SURGE = {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


@pytest.mark.parametrize("surge", [1, "10%"])
def test_a_node_agent_on_the_host_network_with_metrics_is_refused_a_surge_pod(
    helm: Path, surge: Any
) -> None:
    """The surge pod binds the node's metrics port, which the old pod holds: it exits,
    and the DaemonSet's rollout never ends."""
    node = {"hostNetwork": True, "updateStrategy": {"rollingUpdate": {"maxSurge": surge}}}
    with pytest.raises(h.HelmFailed) as failure:
        h.template(helm, {"node": node})
    (line,) = [x for x in str(failure.value).splitlines() if "maxSurge" in x]  # one line
    assert (
        f"node.updateStrategy.rollingUpdate.maxSurge={surge} cannot go with "
        "node.hostNetwork=true and node.metricsPort=9477" in line
    )
    assert "Set node.updateStrategy.rollingUpdate.maxSurge=0" in line


@pytest.mark.parametrize(
    "node",
    [
        {"hostNetwork": True, "metricsPort": 0, "updateStrategy": SURGE},
        {"updateStrategy": SURGE},
        {"hostNetwork": True},
        {"hostNetwork": True, "updateStrategy": {"rollingUpdate": {"maxSurge": "0%"}}},
    ],
    ids=["no-metrics-port", "pod-network", "no-surge", "zero-percent"],
)
def test_a_node_agent_surges_where_no_port_is_held(helm: Path, node: dict[str, Any]) -> None:
    objects = h.template(helm, {"node": node})
    spec = h.find(objects, "DaemonSet")["spec"]
    assert spec["template"]["spec"].get("hostNetwork", False) is node.get("hostNetwork", False)
    surge = node.get("updateStrategy", {}).get("rollingUpdate", {}).get("maxSurge")
    assert spec["updateStrategy"]["rollingUpdate"].get("maxSurge") == surge


@pytest.mark.parametrize(
    ("value", "flag"),
    [
        (None, "--shared-gpus=none"),
        ("all", "--shared-gpus=all"),
        ("0,3", "--shared-gpus=0,3"),
        (3, "--shared-gpus=3"),
        (
            [1, "GPU-86737bf0-609a-5b5b-b9e7-de8873112c51"],
            "--shared-gpus=1,GPU-86737bf0-609a-5b5b-b9e7-de8873112c51",
        ),
    ],
    ids=["default", "all", "string", "index", "list"],
)
def test_shared_gpus_reach_the_node_agent(helm: Path, value: Any, flag: str) -> None:
    objects = h.template(helm, {"node": {"sharedGpus": value}} if value is not None else {})
    (c,) = h.find(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert [a for a in c["args"] if a.startswith("--shared-gpus")] == [flag]
    SharedGpus.parse(flag.partition("=")[2])  # a value the agent takes


def test_string_maps_from_set_render_as_strings(helm: Path) -> None:
    """`--set k=true` gives a boolean (the install command in docs/install.md): the schema
    takes it in every map of labels or annotations, and the value reaches the objects as
    the string Kubernetes needs."""
    objects = h.template(
        helm,
        extra=[
            "--set",
            # What the shell passes for node.nodeSelector."nvidia\.com/gpu\.present"=true.
            "node.nodeSelector.nvidia\\.com/gpu\\.present=true",
            "--set",
            "webhook.nodeSelector.pool=7",
            "--set",
            "commonLabels.team=true",
            "--set",
            "node.podAnnotations.scrape=true",
            "--set",
            "webhook.podAnnotations.weight=3",
        ],
    )
    node = h.find(objects, "DaemonSet")["spec"]["template"]
    webhook = h.find(objects, "Deployment")["spec"]["template"]
    assert node["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert webhook["spec"]["nodeSelector"] == {"pool": "7"}
    assert node["metadata"]["annotations"]["scrape"] == "true"
    assert webhook["metadata"]["annotations"] == {"weight": "3"}
    assert {o["metadata"]["labels"].get("team") for o in objects} == {"true"}


@pytest.mark.parametrize(
    ("node", "flags"),
    [
        ({}, ["--gpu-shares=0", "--gpu-shares-gpus=all"]),
        (
            {"gpuShares": 4, "gpuSharesByNode": {"big-1": 8, "cpu-1": 0}},
            [
                "--gpu-shares=4",
                "--gpu-shares-gpus=all",
                "--gpu-shares-node=big-1=8",
                "--gpu-shares-node=cpu-1=0",
            ],
        ),
        ({"gpuShares": 2, "gpuSharesGpus": [0, 3]}, ["--gpu-shares=2", "--gpu-shares-gpus=0,3"]),
    ],
    ids=["default", "per-node", "some-gpus"],
)
def test_gpu_shares_reach_the_node_agent(
    helm: Path, node: dict[str, Any], flags: list[str]
) -> None:
    objects = h.template(helm, {"node": node})
    (c,) = h.find(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(NODE_NAME)", "big-1") for a in c["args"]]
    assert [a for a in args if a.startswith("--gpu-shares")] == flags
    shares = _agent_config(build_parser().parse_args(args)).gpu_shares  # what the agent runs
    assert shares.for_node("big-1") == node.get("gpuSharesByNode", {}).get(
        "big-1", node.get("gpuShares", 0)
    )


@pytest.mark.parametrize(
    ("labels", "nvml"),
    [
        ({}, "emulated:h100-80gb-hbm3-x8"),
        ({"gpudra.dev/emulated-profile": "l4"}, "emulated:l4"),
        (
            {"gpudra.dev/emulated-profile": "h100-80gb-hbm3-x8-mig"},
            "emulated:h100-80gb-hbm3-x8-mig",
        ),
    ],
    ids=["unlabelled", "l4", "h100-mig"],
)
def test_a_node_label_picks_each_nodes_emulated_profile(
    helm: Path, labels: dict[str, str], nvml: str
) -> None:
    """One release, one DaemonSet: each agent runs the profile its node's label names,
    and nodes without the label run node.nvml's."""
    values = {
        "node": {
            "nvml": "emulated:h100-80gb-hbm3-x8",
            "emulatedProfileLabel": "gpudra.dev/emulated-profile",
        }
    }
    (c,) = h.find(h.template(helm, values), "DaemonSet")["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args([a.replace("$(NODE_NAME)", "n1") for a in c["args"]])
    label = args.emulated_profile_label
    assert labelled_nvml(args.nvml, label=label, node="n1", labels=labels) == nvml


def test_no_profile_label_by_default(default: list[dict[str, Any]]) -> None:
    (c,) = h.find(default, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert build_parser().parse_args(c["args"]).emulated_profile_label == ""


@pytest.mark.parametrize(
    ("value", "flag", "option"),
    [
        ("legacyAttributes", "--legacy-attributes", "legacy_attributes"),
        ("numaNodeList", "--numa-node-list", "numa_node_list"),
    ],
)
@pytest.mark.parametrize("on", [False, True])
def test_attribute_options_reach_the_node_agent_only_when_asked(
    helm: Path, value: str, flag: str, option: str, on: bool
) -> None:
    values = {"node": {value: True}} if on else {}
    (c,) = h.find(h.template(helm, values), "DaemonSet")["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(NODE_NAME)", "n1") for a in c["args"]]
    assert (flag in args) is on
    assert getattr(_agent_config(build_parser().parse_args(args)), option) is on


@pytest.mark.parametrize(
    ("health", "flags"),
    [
        ({}, []),
        ({"resetXids": [74, 94]}, ["--reset-xids=74,94"]),
        (
            {"resetXids": [94], "applicationXids": [43]},
            ["--application-xids=43", "--reset-xids=94"],
        ),
    ],
    ids=["default", "reset", "both"],
)
def test_reset_xids_reach_the_node_agent(
    helm: Path, health: dict[str, Any], flags: list[str]
) -> None:
    """node.health.resetXids: XIDs whose taint waits for a GPU reset, on top of NVIDIA's."""
    objects = h.template(helm, {"node": {"health": health}})
    (c,) = h.find(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(NODE_NAME)", "n1") for a in c["args"]]
    assert [a for a in args if a.startswith(("--reset-xids", "--application-xids"))] == flags
    config = _agent_config(build_parser().parse_args(args))  # what the agent runs
    assert config.health.extra_reset_xids == frozenset(health.get("resetXids", ()))
    assert all(config.health.needs_reset(x) for x in (48, 79, *health.get("resetXids", ())))
    assert config.state_dir == Path("/var/lib/gpudra")  # where the reset marks go


@pytest.mark.parametrize("enabled", [True, False])
def test_health_checks_reach_the_node_agent(helm: Path, enabled: bool) -> None:
    """node.health.enabled: false turns the agent's NVML event watch off."""
    values = {} if enabled else {"node": {"health": {"enabled": False}}}
    (c,) = h.find(h.template(helm, values), "DaemonSet")["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(NODE_NAME)", "n1") for a in c["args"]]
    assert ("--no-health-checks" in args) is not enabled
    assert _agent_config(build_parser().parse_args(args)).health_events is enabled


def test_the_migration_plan_installs_as_written(helm: Path, tmp_path: Path) -> None:
    """What `gpudra migrate --out` writes is what docs/migration.md installs: the chart takes
    its values.yaml and the agent gets the shares; its GpuTenants parse as the controller's."""
    (tmp_path / "config.yaml").write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: false\n"
        "    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    plan = tmp_path / "plan"
    assert cli_main(["migrate", f"--config={tmp_path / 'config.yaml'}", f"--out={plan}"]) == 0
    values = yaml.safe_load((plan / "values.yaml").read_text())
    objects = h.template(helm, values)
    (c,) = h.find(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(NODE_NAME)", "node-1") for a in c["args"]]
    assert _agent_config(build_parser().parse_args(args)).gpu_shares.for_node("node-1") == 4
    tenants = list(yaml.safe_load_all((plan / "tenants.yaml").read_text()))
    assert tenants
    for tenant in tenants:
        parse_tenant(tenant)


def test_per_node_shares_of_the_migration_plan_reach_each_agent(helm: Path, tmp_path: Path) -> None:
    """Per-node device plugin configs (a ConfigMap key per node label) come out of
    `gpudra migrate` as node.gpuSharesByNode, which gives each node its own shares."""
    shared = (
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    configmap = {"kind": "ConfigMap", "data": {"default": "version: v1\n", "t4": shared}}
    (tmp_path / "cm.yaml").write_text(yaml.safe_dump(configmap))
    labels = {"nvidia.com/device-plugin.config": "t4"}
    nodes = {
        "kind": "List",
        "items": [{"kind": "Node", "metadata": {"name": "t4-1", "labels": labels}}],
    }
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(nodes))
    plan = tmp_path / "plan"
    args = [f"--config={tmp_path / 'cm.yaml'}", f"--nodes={tmp_path / 'nodes.yaml'}"]
    assert cli_main(["migrate", *args, f"--out={plan}"]) == 0
    objects = h.template(helm, yaml.safe_load((plan / "values.yaml").read_text()))
    (c,) = h.find(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    for node, shares in (("t4-1", 4), ("cpu-1", 0)):
        args = [a.replace("$(NODE_NAME)", node) for a in c["args"]]
        assert _agent_config(build_parser().parse_args(args)).gpu_shares.for_node(node) == shares


def test_webhook_runs_as_non_root(full: list[dict[str, Any]]) -> None:
    pod = h.find(full, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (c,) = pod["containers"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    # tls.source=helm: the chart's CA, the serving certificate renewed by the webhook.
    assert {"--cert-source=ca", "--ca-dir=/etc/gpudra/webhook-ca"} <= set(c["args"])
    assert "--namespace=gpu-system" in c["args"]
    assert "--port=9443" in c["args"]
    assert h.find(full, "Deployment")["spec"]["replicas"] == 2
    assert h.find(full, "Service")["spec"]["ports"][0]["port"] == 9443


def test_least_privilege_rbac(default: list[dict[str, Any]]) -> None:
    node = h.find(default, "ClusterRole", "gpudra-node")["rules"]
    node_resources = {r for rule in node for r in rule["resources"]}
    # gputenants and namespaces: read-only, for the tenant label of device accounting;
    # pods: get only, for the container label.
    assert node_resources == {
        "resourceslices",
        "resourceclaims",
        "nodes",
        "events",
        "gputenants",
        "namespaces",
        "pods",
    }
    for rule in node:
        if {"gputenants", "namespaces"} & set(rule["resources"]):
            assert rule["verbs"] == ["list", "watch"]
        if "pods" in rule["resources"]:
            assert (rule["resources"], rule["verbs"]) == (["pods"], ["get"])
    claims = next(r for r in node if r["resources"] == ["resourceclaims"])
    assert claims["verbs"] == ["get"]  # read-only: the scheduler owns allocation
    webhook = h.find(default, "ClusterRole", "gpudra-webhook")["rules"]
    for rule in webhook:
        if "admissionregistration.k8s.io" in rule["apiGroups"]:
            assert rule["resourceNames"], "webhook configurations are writable only by name"
    # ResourceQuotas: only the one it owns may be read, changed or deleted by name;
    # create, list and watch cannot be limited by name in RBAC.
    quota_rules = [r for r in webhook if "resourcequotas" in r["resources"]]
    for rule in quota_rules:
        if rule.get("resourceNames"):
            assert rule["resourceNames"] == [QUOTA_NAME]
        else:
            assert set(rule["verbs"]) <= {"create", "list", "watch"}
    assert {v for r in quota_rules for v in r["verbs"]} >= {"get", "update", "delete", "create"}
    for role in (node, webhook):
        assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in role)
        assert not any("secrets" in rule["resources"] for rule in role)


def test_admission_policy_names_the_node_agent(default: list[dict[str, Any]]) -> None:
    policy = h.find(default, "ValidatingAdmissionPolicy", "gpudra-node-own-node-slices")
    (condition,) = policy["spec"]["matchConditions"]
    assert "system:serviceaccount:gpudra:gpudra-node" in condition["expression"]
    binding = h.find(default, "ValidatingAdmissionPolicyBinding", "gpudra-node-own-node-slices")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_webhook_skips_its_own_namespace_and_opted_out_pods(full: list[dict[str, Any]]) -> None:
    hook = h.find(full, "MutatingWebhookConfiguration")["webhooks"][0]
    assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == [
        "kube-system",
        "gpu-system",
    ]
    assert hook["objectSelector"]["matchExpressions"][0]["key"] == OPT_OUT_LABEL
    for validating in h.find(full, "ValidatingWebhookConfiguration")["webhooks"]:
        assert validating["clientConfig"]["service"]["port"] == 9443
        assert validating["clientConfig"]["caBundle"] == hook["clientConfig"]["caBundle"]


def test_crds_are_copies_of_the_api(default: list[dict[str, Any]]) -> None:
    """files/crds must equal api/crds (`make chart-crds` copies them)."""
    api = {p.name: p.read_text() for p in API_CRDS.glob("*.yaml")} if API_CRDS.is_dir() else {}
    chart = {p.name: p.read_text() for p in CHART_CRDS.glob("*.yaml")}
    assert chart == api, "charts/gpudra/files/crds differs from api/crds: run `make chart-crds`"
    rendered = [o for o in default if o["kind"] == "CustomResourceDefinition"]
    assert sorted(o["metadata"]["name"] for o in rendered) == sorted(
        yaml.safe_load(text)["metadata"]["name"] for text in api.values()
    )
    for crd in rendered:
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_notes_tell_how_to_check(helm: Path) -> None:
    out = h.run(helm, "install", "gpudra", str(h.CHART), "--dry-run=client", "-n", "gpudra")
    assert "kubectl get resourceslices --field-selector spec.driver=gpu.nvidia.com" in out
    assert "rollout status daemonset/gpudra-node" in out


def rendered_notes(helm: Path, tmp_path: Path, kube_version: str, *values: str) -> str:
    """The chart's NOTES.txt rendered for a cluster at `kube_version`. `helm install
    --dry-run` prints the notes but cannot be told a version, and `helm template`, which
    can, leaves them out; so a copy of the chart carries the same text in a ConfigMap."""
    chart = tmp_path / "gpudra"
    shutil.copytree(h.CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes_under_test.tpl").write_text(
        '{{- define "notes-under-test" -}}\n' + notes + "{{- end -}}\n"
    )
    (chart / "templates" / "notes-under-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes-under-test\ndata:\n"
        '  notes: |\n{{ include "notes-under-test" . | indent 4 }}\n'
    )
    out = h.run(
        helm,
        "template",
        "gpudra",
        str(chart),
        "-n",
        "gpudra",
        f"--kube-version={kube_version}",
        *(f"--set={v}" for v in values),
    )
    notes_cm = h.find([d for d in yaml.safe_load_all(out) if d], "ConfigMap", "notes-under-test")
    text: str = notes_cm["data"]["notes"]
    return text


@pytest.mark.parametrize(("kube_version", "warned"), [("v1.36.5", True), ("v1.37.2", False)])
def test_notes_warn_that_1_36_does_not_evict_pods_served_by_the_class_mapping(
    helm: Path, tmp_path: Path, kube_version: str, warned: bool
) -> None:
    """kubernetes#142289: before 1.37 the device taint eviction controller reads only
    `spec.resourceClaims`, so NoExecute leaves a mapped pod on its GPU
    (e2e/tests/test_migration.py runs it on the real node)."""
    mapped = "deviceClasses.gpu.extendedResourceName=nvidia.com/gpu"
    notes = rendered_notes(helm, tmp_path, kube_version, mapped)
    assert "Pods asking for nvidia.com/gpu are allocated through DRA" in notes
    warning = "WARNING: on Kubernetes 1.36 a NoExecute device taint does not evict those pods"
    assert (warning in notes) is warned
    assert ("WARNING: on Kubernetes" in notes) is warned
    # Without the mapping there is nothing to warn of.
    assert "WARNING" not in rendered_notes(helm, tmp_path / "plain", kube_version)
    assert "kubectl get deviceclasses" in notes


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"deviceClasses": {"shared": {"strategy": "Spatial"}}}, "/deviceClasses/shared/strategy"),
        ({"node": {"driverRoot": "run/nvidia/driver"}}, "/node/driverRoot"),
        ({"node": {"kubeletRoot": "var/lib/kubelet"}}, "/node/kubeletRoot"),
        ({"node": {"kubeletRoot": "/var/lib/kube%2elet"}}, "/node/kubeletRoot"),
        ({"webhook": {"port": 70000}}, "/webhook/port"),
        ({"webhook": {"port": 0}}, "/webhook/port"),
        ({"webhook": {"maxConnections": 0}}, "/webhook/maxConnections"),
        ({"webhook": {"maxBufferedBodyBytes": 3145727}}, "/webhook/maxBufferedBodyBytes"),
        ({"node": {"metricsMaxConnections": 0}}, "/node/metricsMaxConnections"),
        ({"node": {"metricsDeadlineSeconds": 0}}, "/node/metricsDeadlineSeconds"),
        ({"node": {"metricsMaxConnectionsPerClient": 0}}, "/node/metricsMaxConnectionsPerClient"),
        ({"node": {"metricsHeadDeadlineSeconds": 0}}, "/node/metricsHeadDeadlineSeconds"),
        ({"kubernetesApi": {"port": 0}}, "/kubernetesApi/port"),
        ({"kubernetesApi": {"port": 70000}}, "/kubernetesApi/port"),
        (
            {"kubernetesApi": {"host": "https://10.0.0.1"}},
            "kubernetesApi.host=https://10.0.0.1: give the host only",
        ),
        (
            {"kubernetesApi": {"host": "10.0.0.1:6443"}},
            "put the port in kubernetesApi.port: here kubernetesApi.host=10.0.0.1 and "
            "kubernetesApi.port=6443",
        ),
        ({"kubernetesApi": {"host": "[fd00::1]"}}, "here kubernetesApi.host=fd00::1"),
        ({"kubernetesApi": {"host": "api..example"}}, "kubernetesApi.host=api..example is not"),
        ({"kubernetesApi": {"host": "300.0.0.1"}}, "kubernetesApi.host=300.0.0.1 is not"),
        ({"kubernetesApi": {"host": "api server"}}, "/kubernetesApi/host"),
        ({"node": {"nvml": "fake"}}, "/node/nvml"),
        (
            {"node": {"emulatedProfileLabel": "gpudra.dev/emulated-profile"}},
            "node.emulatedProfileLabel=gpudra.dev/emulated-profile needs "
            "node.nvml=emulated:<profile>",
        ),
        (
            {"node": {"nvml": "emulated:l4", "emulatedProfileLabel": "emulated profile"}},
            "/node/emulatedProfileLabel",
        ),
        ({"node": {"migStrategy": "mixed"}}, "/node/migStrategy"),
        ({"node": {"health": {"resetXids": ["48"]}}}, "/node/health/resetXids/0"),
        (
            {"node": {"health": {"applicationXids": [13, 31], "resetXids": [31, 48]}}},
            "XIDs 31 are in both node.health.applicationXids and node.health.resetXids",
        ),
        ({"deviceClasses": {"mig": {"profiles": ["1g.10gb+ME"]}}}, "/deviceClasses/mig/profiles/0"),
        ({"deviceClasses": {"mig": {"profiles": ["1g.10gb", "1g.10gb"]}}}, "/deviceClasses/mig"),
        ({"node": {"sharedGpus": "some"}}, "/node/sharedGpus"),
        ({"node": {"sharedGpus": "0,,1"}}, "/node/sharedGpus"),
        ({"node": {"sharedGpus": "all,0"}}, "/node/sharedGpus"),
        ({"node": {"sharedGpus": [-1]}}, "/node/sharedGpus"),
        ({"node": {"sharedGpus": -2}}, "/node/sharedGpus"),
        ({"node": {"sharedGpus": []}}, "/node/sharedGpus"),
        ({"node": {"sharedGpus": ["MIG-86737bf0"]}}, "/node/sharedGpus"),
        ({"node": {"gpuShares": -1}}, "/node/gpuShares"),
        ({"node": {"gpuShares": 1025}}, "/node/gpuShares"),
        ({"node": {"gpuSharesByNode": {"n1": "four"}}}, "/node/gpuSharesByNode/n1"),
        ({"node": {"gpuSharesByNode": {"N_1": 4}}}, "invalid propertyName 'N_1'"),
        ({"node": {"gpuSharesGpus": "none"}}, "/node/gpuSharesGpus"),
        ({"webhook": {"prot": 8443}}, "prot"),
        ({"driverName": "GPU"}, "/driverName"),
        ({"webhook": {"tls": {"source": "vault"}}}, "/webhook/tls/source"),
        ({"webhook": {"replicas": 2}}, "webhook.replicas=2 needs webhook.tls.source"),
        (
            {"webhook": {"extraArgs": ["--device-class=l4.example.com"]}},
            "list the class in webhook.extraDeviceClasses instead",
        ),
        ({"webhook": {"extraDeviceClasses": ["L4"]}}, "/webhook/extraDeviceClasses/0"),
        (
            {"webhook": {"validation": {"enabled": False}}},
            "tenants.enabled needs webhook.validation.enabled",
        ),
        ({"webhook": {"tls": {"source": "secret"}}}, "webhook.tls.secretName"),
        (
            {"webhook": {"clientAuth": {"enabled": True}}},
            "webhook.clientAuth.enabled needs webhook.clientAuth.caCert",
        ),
        (
            {"webhook": {"clientAuth": {"enabled": True, "caCert": CLIENT_CA, "healthPort": 8443}}},
            "webhook.clientAuth.healthPort=8443 must differ from webhook.port",
        ),
        (
            {"webhook": {"networkPolicy": {"enabled": True}}},
            "webhook.networkPolicy.enabled needs webhook.networkPolicy.controlPlaneCIDRs",
        ),
        (
            {
                "webhook": {
                    "hostNetwork": True,
                    "networkPolicy": {"enabled": True, "controlPlaneCIDRs": ["10.0.0.0/24"]},
                }
            },
            "webhook.networkPolicy.enabled has no effect with webhook.hostNetwork=true",
        ),
        (
            {"webhook": {"networkPolicy": {"controlPlaneCIDRs": ["10.0.0.0"]}}},
            "/webhook/networkPolicy/controlPlaneCIDRs/0",
        ),
        (
            {"webhook": {"tls": {"source": "secret", "secretName": "tls"}}},
            "webhook.tls.caBundle",
        ),
        # Past it the kubelet's 45 s for the call would leave a prepare no time of its own.
        ({"node": {"conflictWaitSeconds": 31}}, "/node/conflictWaitSeconds"),
        ({"node": {"conflictWaitSeconds": -1}}, "/node/conflictWaitSeconds"),
        (
            # The tenant rules count only the device plugin's names at a pod's admission.
            {"deviceClasses": {"gpu": {"extendedResourceName": "example.com/gpu"}}},
            "/deviceClasses/gpu/extendedResourceName",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_values_fail_naming_the_value(helm: Path, values: dict[str, Any], message: str) -> None:
    with pytest.raises(h.HelmFailed) as failure:
        h.template(helm, values)
    assert message in str(failure.value)


def test_full_values_cover_every_schema_property() -> None:
    """A property the full values file never sets is a branch no test renders."""
    schema = yaml.safe_load((h.CHART / "values.schema.json").read_text())
    full = yaml.safe_load(h.FULL_VALUES.read_text())

    def leaves(node: dict[str, Any], prefix: str = "") -> set[str]:
        out: set[str] = set()
        for key, sub in node.get("properties", {}).items():
            path = f"{prefix}{key}"
            out |= leaves(sub, path + ".") if "properties" in sub else {path}
        return out

    def present(data: Any, path: str) -> bool:
        for part in path.split("."):
            if not isinstance(data, dict) or part not in data:
                return False
            data = data[part]
        return True

    # Shapes the full file cannot hold at once (one TLS source, one sharing strategy)
    # are rendered by their own tests above; node.allowStateMove acts only against a live
    # DaemonSet, which `helm template` never sees (test_cluster_support.py renders it).
    alternatives = re.compile(
        r"^(global|node\.(affinity|tolerations|priorityClassName|resources|livenessProbe|"
        r"updateStrategy|allowStateMove)|webhook\.(enabled|affinity|tolerations|nodeSelector|resources|"
        r"podAnnotations|extraArgs|tls\.(secretName|caBundle|injectCAFrom)|clientAuth|"
        r"networkPolicy)|"
        r"deviceClasses\.shared\.timeSlicing)"
    )
    missing = sorted(
        p for p in leaves(schema) if not present(full, p) and not alternatives.match(p)
    )
    assert missing == []


@pytest.mark.parametrize(
    "values",
    [
        [],
        [{"node": {"nvml": "emulated:l4"}}],
        [h.FULL_VALUES, {"deviceClasses": {"gpu": {"extendedResourceName": ""}}}],
    ],
    ids=["default", "emulated", "full"],
)
def test_rendered_args_are_accepted_by_the_cli(helm: Path, values: list[Any]) -> None:
    """Every flag the chart passes exists in `gpudra`, with a valid value."""
    objects = h.template(helm, *values)
    parser = build_parser()
    for kind in ("DaemonSet", "Deployment"):
        (container,) = h.find(objects, kind)["spec"]["template"]["spec"]["containers"]
        assert container["command"][-1] == "gpudra"
        args = [a.replace("$(NODE_NAME)", "node-1") for a in container["args"]]
        parsed = parser.parse_args(args)
        assert parsed.command == args[0]
        if kind == "DaemonSet":
            SharedGpus.parse(parsed.shared_gpus)  # the value, too, is one the agent takes
        else:
            conversion_policy(parsed)  # and the webhook's values, one it starts with


def test_connection_bounds_reach_both_components(helm: Path) -> None:
    """The bounds that keep held connections from exhausting the webhook and the agent's
    metrics port are values, and what `gpudra` parses from the rendered args."""
    parser = build_parser()

    def parsed(objects: list[dict[str, Any]], kind: str) -> Any:
        (container,) = h.find(objects, kind)["spec"]["template"]["spec"]["containers"]
        return parser.parse_args([a.replace("$(NODE_NAME)", "n1") for a in container["args"]])

    default = h.template(helm)
    webhook = parsed(default, "Deployment")
    assert (webhook.max_connections, webhook.max_buffered_body_bytes) == (640, 64 * 2**20)
    # A full port fits the default memory limit: about 0.4 MiB a held connection and
    # 0.06 MiB a handshake under way (each bounded by it) beside the process at rest and
    # a full body budget (docs/security.md, known gaps).
    (container,) = h.find(default, "Deployment")["spec"]["template"]["spec"]["containers"]
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Mi")
    assert 60 + 64 + (0.4 + 0.06) * webhook.max_connections <= int(limit[:-2])
    assert metrics_bounds(parsed(default, "DaemonSet")) == (16, 4, 10.0, 2.0)
    values = {
        "webhook": {"maxConnections": 4096, "maxBufferedBodyBytes": 256 * 2**20},
        "node": {
            "metricsMaxConnections": 64,
            "metricsMaxConnectionsPerClient": 16,
            "metricsDeadlineSeconds": 2.5,
            "metricsHeadDeadlineSeconds": 0.5,
        },
    }
    raised = h.template(helm, values)
    webhook = parsed(raised, "Deployment")
    assert (webhook.max_connections, webhook.max_buffered_body_bytes) == (4096, 256 * 2**20)
    agent = parsed(raised, "DaemonSet")
    assert metrics_bounds(agent) == (64, 16, 2.5, 0.5)
    _metrics_address(agent)  # the agent takes what the chart renders


def metrics_bounds(agent: Any) -> tuple[int, int, float, float]:
    """The agent's metrics endpoint bounds as its parsed flags give them: connections,
    per client, deadline, head deadline."""
    return (
        agent.metrics_max_connections,
        agent.metrics_max_per_client,
        agent.metrics_deadline,
        agent.metrics_head_deadline,
    )


def webhook_policy(objects: list[dict[str, Any]]) -> tuple[list[str], ConversionPolicy]:
    """The webhook container's args and the conversion policy `gpudra webhook` makes of them."""
    (container,) = h.find(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    return args, conversion_policy(build_parser().parse_args(args))


@pytest.mark.parametrize(
    ("values", "flags", "field", "expected"),
    [
        (
            {"driverName": "gpu.example.com"},
            ["--driver-name=gpu.example.com"],
            "driver",
            "gpu.example.com",
        ),
        (
            {"deviceClasses": {"shared": {"strategy": "MPS"}}},
            ["--shared-strategy=MPS"],
            "shared_strategy",
            "MPS",
        ),
        (
            {"deviceClasses": {"shared": {"timeSlicing": {"interval": "Short"}}}},
            ["--time-slice-interval=Short"],
            "time_slice_interval",
            "Short",
        ),
        (
            {
                "deviceClasses": {
                    "shared": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 30}}
                }
            },
            ["--mps-default-active-thread-percentage=30"],
            "mps_config",
            (("defaultActiveThreadPercentage", 30),),
        ),
        (
            {
                "deviceClasses": {
                    "shared": {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "4Gi"}}
                }
            },
            ["--mps-default-pinned-device-memory-limit=4Gi"],
            "mps_config",
            (("defaultPinnedDeviceMemoryLimit", "4Gi"),),
        ),
        (
            {"deviceClasses": {"mig": {"profiles": ["1g.10gb", "3g.40gb"]}}},
            ["--mig-profile-class=1g.10gb", "--mig-profile-class=3g.40gb"],
            "mig_profile_classes",
            ("1g.10gb", "3g.40gb"),
        ),
        (
            {"webhook": {"conversion": {"sharedWholeGpuFallback": False}}},
            ["--no-shared-whole-gpu-fallback"],
            "shared_whole_gpu_fallback",
            False,
        ),
    ],
    ids=[
        "driverName",
        "shared.strategy",
        "timeSlicing.interval",
        "mps.threads",
        "mps.pinned",
        "mig.profiles",
        "conversion.sharedWholeGpuFallback",
    ],
)
def test_values_that_change_conversion_reach_the_webhook(
    helm: Path, values: dict[str, Any], flags: list[str], field: str, expected: Any
) -> None:
    """Each value the DeviceClasses or node agent act on is also a webhook flag, so
    converted claims and validation agree with them (the flags' effect on conversion is
    tested in tests/cli/test_webhook_flags.py)."""
    _, default_policy = webhook_policy(h.template(helm))
    assert getattr(default_policy, field) != expected
    args, policy = webhook_policy(h.template(helm, values))
    assert set(flags) <= set(args)
    assert getattr(policy, field) == expected


def test_a_release_without_the_fallback_value_keeps_the_whole_gpu_fallback(helm: Path) -> None:
    """Only an explicit `sharedWholeGpuFallback: false` drops it: a release upgraded with
    `--reuse-values` from a chart without the key (null here) keeps today's conversion."""
    args, policy = webhook_policy(
        h.template(helm, {"webhook": {"conversion": {"sharedWholeGpuFallback": None}}})
    )
    assert not [a for a in args if "shared-whole-gpu-fallback" in a]
    assert policy.shared_whole_gpu_fallback is True


def test_client_certificate_authentication_reaches_the_webhook(
    helm: Path, default: list[dict[str, Any]]
) -> None:
    (container,) = h.find(default, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert not any(a.startswith(("--client-ca-file", "--health-port")) for a in container["args"])
    objects = h.template(
        helm,
        {"webhook": {"clientAuth": {"enabled": True, "caCert": CLIENT_CA, "healthPort": 9444}}},
    )
    pod = h.find(objects, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = build_parser().parse_args(container["args"])
    # The CA the ConfigMap holds is the file the webhook is told to trust.
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "client-ca"]
    assert str(args.client_ca_file) == f"{mount['mountPath']}/ca.crt"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "client-ca"]
    config_map = h.find(objects, "ConfigMap", volume["configMap"]["name"])
    assert config_map["data"]["ca.crt"].strip() == CLIENT_CA.strip()
    # The kubelet's probes, which present no client certificate, use the health port.
    assert args.health_port == 9444
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"https": 8443, "health": 9444}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "health"
    assert args.client_cert_name == []  # any certificate the CA signed
    names = ["gpudra-webhook.gpudra.svc", "kube-apiserver"]
    objects = h.template(
        helm,
        {"webhook": {"clientAuth": {"enabled": True, "caCert": CLIENT_CA, "allowedNames": names}}},
    )
    (container,) = h.find(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert build_parser().parse_args(container["args"]).client_cert_name == names


def test_network_policy_admits_only_the_control_plane(
    helm: Path, default: list[dict[str, Any]]
) -> None:
    assert not [o for o in default if o["kind"] == "NetworkPolicy"]  # off by default
    scraper = {"from": [{"namespaceSelector": {}}], "ports": [{"port": 8444}]}
    objects = h.template(
        helm,
        {
            "webhook": {
                "port": 9443,
                "networkPolicy": {
                    "enabled": True,
                    "controlPlaneCIDRs": ["10.0.0.0/24", "fd00::/64"],
                    "extraIngress": [scraper],
                },
            }
        },
    )
    spec = h.find(objects, "NetworkPolicy")["spec"]
    deployment = h.find(objects, "Deployment")
    assert spec["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert spec["policyTypes"] == ["Ingress"]
    control_plane, extra = spec["ingress"]
    assert control_plane["from"] == [
        {"ipBlock": {"cidr": "10.0.0.0/24"}},
        {"ipBlock": {"cidr": "fd00::/64"}},
    ]
    assert control_plane["ports"] == [{"port": 9443, "protocol": "TCP"}]
    assert extra == scraper


def test_node_network_policy_admits_only_the_scrapers_to_the_metrics_port(
    helm: Path, default: list[dict[str, Any]]
) -> None:
    """The agents' series name every GPU's holder: with node.networkPolicy only the
    listed scrapers reach the metrics port, and nothing else reaches the agents."""
    assert not [o for o in default if o["kind"] == "NetworkPolicy"]  # off by default
    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}]
    node = {"metricsPort": 9500, "networkPolicy": {"enabled": True, "metricsFrom": scrapers}}
    objects = h.template(helm, {"node": node})
    spec = h.find(objects, "NetworkPolicy")["spec"]
    daemonset = h.find(objects, "DaemonSet")
    assert spec["podSelector"]["matchLabels"] == daemonset["spec"]["selector"]["matchLabels"]
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["ingress"] == [{"from": scrapers, "ports": [{"port": 9500, "protocol": "TCP"}]}]
    # No metrics listener: nothing reaches the agents.
    closed = {"metricsPort": 0, "networkPolicy": {"enabled": True}}
    assert h.find(h.template(helm, {"node": closed}), "NetworkPolicy")["spec"]["ingress"] == []


@pytest.mark.parametrize(
    ("node", "complaint"),
    [
        ({"networkPolicy": {"enabled": True}}, "needs node.networkPolicy.metricsFrom"),
        (
            {"hostNetwork": True, "networkPolicy": {"enabled": True, "metricsFrom": [{}]}},
            "no effect with node.hostNetwork=true",
        ),
    ],
    ids=["no-scrapers", "host-network"],
)
def test_a_node_network_policy_that_would_not_work_is_refused(
    helm: Path, node: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(h.HelmFailed) as failure:
        h.template(helm, {"node": node})
    assert complaint in str(failure.value)


@pytest.mark.parametrize("allowed", [[], ["kube-public", "gpu-operator"]], ids=["none", "named"])
def test_opt_out_policy_matches_the_code(helm: Path, allowed: list[str]) -> None:
    objects = h.template(helm, {"webhook": {"optOutNamespaces": allowed}})
    for want in registration.opt_out_policy(allowed):
        rendered = strip_chart_metadata(h.find(objects, want["kind"], want["metadata"]["name"]))
        assert rendered == want


def test_the_pod_rule_is_the_codes(default: list[dict[str, Any]]) -> None:
    """Pods asking for a DeviceClass as an extended resource are sent too."""
    cel = h.find(default, "MutatingWebhookConfiguration")["webhooks"][0]["matchConditions"][0]
    assert cel["expression"] == registration.GPU_POD_CEL
    assert "k.startsWith('deviceclass.resource.kubernetes.io/')" in cel["expression"]


def test_native_resource_pods_are_sent_for_the_tenant_rules(helm: Path) -> None:
    objects = h.template(
        helm, {"deviceClasses": {"gpu": {"extendedResourceName": "nvidia.com/gpu"}}}
    )
    cel = h.find(objects, "MutatingWebhookConfiguration")["webhooks"][0]["matchConditions"][0]
    assert cel["expression"] == registration.gpu_pod_cel(["nvidia.com/gpu"])
    assert "k in ['nvidia.com/gpu']" in cel["expression"]


@pytest.mark.parametrize(
    "trusted",
    [[], ["system:serviceaccount:ops:claim-maker", "o'neil@example.com", "back\\slash"]],
    ids=["none", "named"],
)
def test_claim_links_policy_matches_the_code(helm: Path, trusted: list[str]) -> None:
    objects = h.template(helm, {"claimLinks": {"trustedUsers": trusted}})
    for want in registration.claim_links_policy(trusted):
        rendered = strip_chart_metadata(h.find(objects, want["kind"], want["metadata"]["name"]))
        assert rendered == want
    off = h.template(helm, {"claimLinks": {"enabled": False}})
    names = (registration.CLAIM_LINKS_POLICY_NAME, registration.TEMPLATE_LINKS_POLICY_NAME)
    assert not [o for o in off if o["metadata"]["name"] in names]


def test_the_schema_bounds_the_conflict_wait_as_the_agent_does() -> None:
    schema = yaml.safe_load((h.CHART / "values.schema.json").read_text())
    wait = schema["properties"]["node"]["properties"]["conflictWaitSeconds"]
    assert (wait["minimum"], wait["maximum"]) == (0, MAX_CONFLICT_WAIT_S)


@pytest.mark.parametrize(("value", "seconds"), [(None, 10.0), (0, 0.0), (2.5, 2.5), (30, 30.0)])
def test_the_conflict_wait_reaches_the_agents_plugin_config(
    helm: Path, value: float | None, seconds: float
) -> None:
    """`node.conflictWaitSeconds`, as the agent parses it from the rendered args."""
    objects = h.template(helm, {} if value is None else {"node": {"conflictWaitSeconds": value}})
    (container,) = h.find(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args([a.replace("$(NODE_NAME)", "n1") for a in container["args"]])
    assert args.conflict_wait == seconds  # as the plugin config takes it (tests/cli)


def test_the_node_agent_reads_pods_with_sampling_off(helm: Path) -> None:
    """Its sweep of deleted claims asks whether a claim's pod still runs on the node;
    without the read it could never tell, and would leave every deleted claim prepared."""
    objects = h.template(helm, {"node": {"sampleIntervalSeconds": 0}})
    rules = h.find(objects, "ClusterRole", "gpudra-node")["rules"]
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]} in rules
    assert not [r for r in rules if "gputenants" in r["resources"]]


def test_daemon_pod_policy_runs_the_agents_pod_script(default: list[dict[str, Any]]) -> None:
    """The daemon-pod policy pins the command to the shell the agent runs in every daemon
    pod (gpudra.driver.sharing); a changed script must change the chart with it."""
    from gpudra.driver.sharing import _POD_SCRIPT  # noqa: PLC0415 - only here

    policy = h.find(default, "ValidatingAdmissionPolicy", "gpudra-node-own-node-daemon-pods")
    script = next(v for v in policy["spec"]["variables"] if v["name"] == "podScript")
    assert script["expression"] == f"'{_POD_SCRIPT}'"
    template = h.find(default, "ConfigMap", "gpudra-node-mps")
    pod = json.loads(template["data"]["pod.json"])
    assert pod["spec"]["serviceAccountName"] == "gpudra-node-mps"
    account = h.find(default, "ServiceAccount", "gpudra-node-mps")
    assert account["automountServiceAccountToken"] is False
    bound = [o for o in default if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert not any(s["name"] == "gpudra-node-mps" for o in bound for s in o["subjects"])
