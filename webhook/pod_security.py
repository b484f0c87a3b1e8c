"""Pod Security levels of tenant namespaces, read from their labels as the API server
reads them.

Why the webhook looks at Pod Security at all: a GpuTenant's rules bound the GPUs a pod
gets through claims and `nvidia.com/*` resources, but a privileged container gets every
device node of its node, so every GPU there, with no claim, and a hostPath volume
reaches the node agent's sockets, state and CDI specs. Kubernetes' Pod Security
admission (level ``baseline`` or ``restricted``) refuses both; gpudra relies on it in
tenant namespaces (docs/security.md) and reports the tenant namespaces where it is not
enforced, so the gap is visible rather than silent.

The level is the namespace's ``pod-security.kubernetes.io/enforce`` label, or the
cluster's default where there is none (the API server's PodSecurity admission
configuration, which the webhook cannot read: ``--pod-security-default`` says it; with
no configuration Kubernetes' default is ``privileged``). A label with an unknown value
is enforced as ``restricted``, as the API server does (k8s.io/pod-security-admission,
``api.ParseLevel``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = ["ENFORCE_LABEL", "LEVELS", "PRIVILEGED", "enforce_level"]

ENFORCE_LABEL: Final = "pod-security.kubernetes.io/enforce"
PRIVILEGED: Final = "privileged"
LEVELS: Final = (PRIVILEGED, "baseline", "restricted")
"""From least to most strict."""


def enforce_level(labels: Mapping[str, str], default: str = PRIVILEGED) -> str:
    """The Pod Security level the API server enforces in a namespace with `labels`."""
    level = labels.get(ENFORCE_LABEL)
    if level is None:
        return default
    return level if level in LEVELS else LEVELS[-1]
