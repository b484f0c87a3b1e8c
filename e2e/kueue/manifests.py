"""What Kueue's release installs, rewritten for the local control plane, and the Kueue
Configuration for gpudra's device classes.

Why rewritten: the local control plane has no kube-proxy, so the API server cannot call
a webhook behind a Service. Kueue's own CRDs (their conversion webhooks) and webhook
configurations are taken unchanged from the module's `config/components`, except that
each `clientConfig.service` becomes a `url` on loopback with the CA bundle of the
certificate the manager serves, as gpudra's own webhook is registered in e2e.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml
from gpudra.api.deviceclasses import SHARED_CLASS, mig_profile_class

NAMESPACE: Final = "kueue-system"
SERVICE: Final = "kueue-webhook-service"
SECRET: Final = "kueue-webhook-server-cert"
NAME_PREFIX: Final = "kueue-"
"""The release's kustomize `namePrefix`: the rotator looks the configurations up by it."""

FRAMEWORK_PATHS: Final[Mapping[str, str]] = {
    "batch/job": "batch-v1-job",
    "pod": "-v1-pod",
}
"""The integrations this harness enables and the part of their webhook paths that names
them; webhooks of other integrations are left out, so a pod or Deployment outside a
queue never waits on Kueue."""

MIG_PROFILES: Final = ("1g.10gb", "3g.40gb")
"""The profiles with classes of their own here (the chart's deviceClasses.mig.profiles)."""
DEFAULT_MAPPINGS: Final[Mapping[str, Sequence[str]]] = {
    "nvidia.com/gpu": ("gpu.nvidia.com",),
    "nvidia.com/gpu.shared": (SHARED_CLASS,),
    "mig.nvidia.com": ("mig.nvidia.com",),
    **{f"nvidia.com/mig-{p}": (mig_profile_class(p),) for p in MIG_PROFILES},
}
"""Quota names for gpudra's classes. Whole GPUs count as `nvidia.com/gpu`, the name a
legacy Job requests, so one ClusterQueue quota covers legacy and native Jobs alike; each
per-profile MIG class counts as `nvidia.com/mig-<profile>` for the same reason."""


@dataclass(frozen=True)
class Endpoint:
    """Where the API server reaches the manager's webhook server, and the CA it trusts."""

    url: str
    ca_bundle_b64: str


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def crds(config: Path, endpoint: Endpoint) -> list[dict[str, Any]]:
    """The release's CRDs, with the conversion webhooks its kustomization patches in
    pointed at `endpoint`."""
    kustomization = yaml.safe_load((config / "crd" / "kustomization.yaml").read_text())
    converted = {
        load_all(config / "crd" / p["path"])[0]["metadata"]["name"]
        for p in kustomization.get("patches", [])
        if "webhook_in_" in p["path"]
    }
    out = []
    for resource in kustomization["resources"]:
        for crd in load_all(config / "crd" / resource):
            if crd["metadata"]["name"] in converted:
                crd["spec"]["conversion"] = {
                    "strategy": "Webhook",
                    "webhook": {
                        "clientConfig": {
                            "url": f"{endpoint.url}/convert",
                            "caBundle": endpoint.ca_bundle_b64,
                        },
                        "conversionReviewVersions": ["v1"],
                    },
                }
            out.append(crd)
    return out


def webhook_configurations(
    config: Path, endpoint: Endpoint, frameworks: Iterable[str]
) -> list[dict[str, Any]]:
    """The release's two webhook configurations: Kueue's own kinds and the enabled
    integrations, each webhook called at `endpoint`, system namespaces left alone as
    the release's kustomization does."""
    wanted = {FRAMEWORK_PATHS[f] for f in frameworks}
    skip_namespaces = {
        "matchExpressions": [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": ["kube-system", NAMESPACE],
            }
        ]
    }
    out = []
    for obj in load_all(config / "webhook" / "manifests.yaml"):
        obj["metadata"]["name"] = NAME_PREFIX + obj["metadata"]["name"]
        hooks = []
        for hook in obj["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            own = path.split("-", 1)[1].startswith("kueue-x-k8s-io")
            if not own and not any(path.endswith(w) for w in wanted):
                continue
            if not own:
                hook["namespaceSelector"] = skip_namespaces
            hook["clientConfig"] = {
                "url": f"{endpoint.url}{path}",
                "caBundle": endpoint.ca_bundle_b64,
            }
            hooks.append(hook)
        obj["webhooks"] = hooks
        out.append(obj)
    return out


def configuration(
    *,
    webhook_port: int,
    health_port: int,
    cert_dir: Path,
    frameworks: Sequence[str],
    mappings: Mapping[str, Sequence[str]] = DEFAULT_MAPPINGS,
    pods_ready_timeout_s: int | None = None,
) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for a manager on loopback.

    Its certificate management stays on, as in the release; the harness pre-creates the
    secret it keeps, with a serving certificate valid for loopback too, so the rotator
    keeps it and the API server can verify the `url` webhooks. The visibility server and
    metrics are off: they listen on fixed ports and nothing here reads them.

    `pods_ready_timeout_s` turns on waitForPodsReady: an admitted Workload whose pods are
    not all ready by then is evicted, and with `backoffLimitCount: 0` deactivated, so a
    Job whose pods can never be created gives its quota back instead of holding it."""
    unknown = sorted(set(frameworks) - set(FRAMEWORK_PATHS))
    if unknown:
        raise ValueError(
            f"integrations {unknown} are not wired here: use some of {sorted(FRAMEWORK_PATHS)}"
        )
    config: dict[str, Any] = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": SERVICE,
            "webhookSecretName": SECRET,
        },
        "featureGates": {"VisibilityOnDemand": False},
        "integrations": {"frameworks": list(frameworks)},
        "resources": {
            "deviceClassMappings": [
                {"name": name, "deviceClassNames": list(classes)}
                for name, classes in mappings.items()
            ]
        },
    }
    if pods_ready_timeout_s is not None:
        config["waitForPodsReady"] = {
            "timeout": f"{pods_ready_timeout_s}s",
            "requeuingStrategy": {"backoffLimitCount": 0},
        }
    return config
