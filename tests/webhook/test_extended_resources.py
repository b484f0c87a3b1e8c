"""The claim kube-scheduler creates for a pod's DRA extended resources, built as it builds
it (``createRequestsAndMappings`` in its dynamicresources plugin, Kubernetes 1.36)."""

from __future__ import annotations

from typing import Any

from gpudra.webhook.extended_resources import (
    DEVICE_CLASS_PREFIX,
    extended_resource_claim,
    fills_extended_resources,
)

GPU = f"{DEVICE_CLASS_PREFIX}gpu.nvidia.com"
MIG = f"{DEVICE_CLASS_PREFIX}mig.nvidia.com"
CLASSES = frozenset({"gpu.nvidia.com", "mig.nvidia.com"})


def container(name: str, restart: str | None = None, **requests: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "resources": {"requests": requests}}
    if restart:
        out["restartPolicy"] = restart
    return out


def requests_of(pod: dict[str, Any]) -> list[tuple[str, str, int]]:
    found = extended_resource_claim(pod, CLASSES)
    assert found is not None
    return [
        (r["name"], r["exactly"]["deviceClassName"], r["exactly"]["count"])
        for r in found.spec["devices"]["requests"]
    ]


def test_each_long_lived_container_gets_its_own_request_named_as_the_scheduler_names_it() -> None:
    pod = {
        "spec": {
            "containers": [
                container("a", **{"cpu": "1", GPU: "2"}),
                container("b", **{GPU: "1", MIG: "3", "memory": "1Gi"}),
            ]
        }
    }
    # container-<index among init and regular containers>-request-<index of the resource
    # among the container's sorted request names>.
    assert requests_of(pod) == [
        ("container-0-request-1", "gpu.nvidia.com", 2),
        ("container-1-request-0", "gpu.nvidia.com", 1),
        ("container-1-request-1", "mig.nvidia.com", 3),
    ]


def test_init_containers_reuse_what_runs_after_them_and_the_largest_rest_is_one_request() -> None:
    pod = {
        "spec": {
            "initContainers": [
                container("setup", **{GPU: "5"}),
                container("sidecar", "Always", **{GPU: "1"}),
                container("small", **{GPU: "2"}),
            ],
            "containers": [container("app", **{GPU: "2"})],
        }
    }
    # setup reuses the sidecar's and app's 3 and asks for 2 more; small is covered.
    assert requests_of(pod) == [
        ("container-0-request-0", "gpu.nvidia.com", 2),
        ("container-1-request-0", "gpu.nvidia.com", 1),
        ("container-3-request-0", "gpu.nvidia.com", 2),
    ]


def test_a_limit_stands_for_a_missing_request_and_other_classes_ask_for_nothing() -> None:
    limits_only = {"spec": {"containers": [{"name": "a", "resources": {"limits": {GPU: "4"}}}]}}
    assert requests_of(limits_only) == [("container-0-request-0", "gpu.nvidia.com", 4)]
    for asked in (
        {f"{DEVICE_CLASS_PREFIX}fpga.example.com": "1"},
        {"gpu.nvidia.com": "1"},
        {GPU: "0"},
        {GPU: "500m"},
        {GPU: True},
    ):
        assert (
            extended_resource_claim({"spec": {"containers": [container("a", **asked)]}}, CLASSES)
            is None
        )
    assert extended_resource_claim({"spec": "not a pod spec"}, CLASSES) is None


def test_the_claim_filling_a_pods_extended_resources_is_the_one_the_pod_controls() -> None:
    pod = {"metadata": {"name": "p", "uid": "u"}}
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u", "controller": True}
    claim = {
        "metadata": {
            "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
            "ownerReferences": [owner],
        }
    }
    assert fills_extended_resources(claim, pod)
    for change in ({"uid": "v"}, {"name": "q"}, {"controller": False}, {"kind": "Job"}):
        other = {
            **claim,
            "metadata": {**claim["metadata"], "ownerReferences": [{**owner, **change}]},
        }
        assert not fills_extended_resources(other, pod)
    unannotated = {"metadata": {"ownerReferences": [owner]}}
    assert not fills_extended_resources(unannotated, pod)
