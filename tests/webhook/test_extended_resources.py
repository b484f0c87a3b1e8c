"""The claim kube-scheduler creates for a pod's DRA extended resources, built as it builds
it (``createRequestsAndMappings`` in its dynamicresources plugin, Kubernetes 1.36)."""

from __future__ import annotations

import random
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


def _reference_counts(containers: list[tuple[int, bool]]) -> dict[int, int]:
    """The scheduler's rule written out plainly (container index -> count): each
    long-lived container its own; each init container what the long-lived ones from it
    on do not cover, and of those only the largest (the first of equals)."""
    chosen = {i: n for i, (n, lives) in enumerate(containers) if lives and n}
    rest = [
        (n - sum(m for m, lives in containers[i:] if lives), i)
        for i, (n, lives) in enumerate(containers)
        if not lives and n
    ]
    rest = [(n, i) for n, i in rest if n > 0]
    if rest:
        count = max(n for n, _ in rest)
        chosen[next(i for n, i in rest if n == count)] = count
    return chosen


def test_the_requests_follow_the_schedulers_rule_for_any_container_layout() -> None:
    """Random layouts of init containers, sidecars and containers, against the rule
    written out plainly; and a pod with 30,000 init containers, which a walk over the
    later containers for each one took 18 s to answer, holding the webhook's loop."""
    rng = random.Random(7)
    for _ in range(300):
        init = [(rng.choice((0, 0, 1, 2, 5)), rng.random() < 0.3) for _ in range(rng.randint(0, 6))]
        regular = [(rng.choice((0, 1, 3)), True) for _ in range(rng.randint(1, 4))]
        containers = [
            {
                "name": f"i{i}",
                "resources": {"limits": {GPU: str(n)}} if n else {},
                **({"restartPolicy": "Always"} if sidecar else {}),
            }
            for i, (n, sidecar) in enumerate(init)
        ]
        pod = {
            "spec": {
                "initContainers": containers,
                "containers": [
                    {"name": f"c{i}", "resources": {"limits": {GPU: str(n)}} if n else {}}
                    for i, (n, _) in enumerate(regular)
                ],
            }
        }
        want = _reference_counts([*init, *regular])
        claim = extended_resource_claim(pod, ["gpu.nvidia.com"])
        got = (
            {}
            if claim is None
            else {
                int(r["name"].split("-")[1]): r["exactly"]["count"]
                for r in claim.spec["devices"]["requests"]
            }
        )
        assert got == want, (init, regular)

    many = {
        "spec": {
            "initContainers": [{"resources": {"requests": {GPU: "1"}}}] * 30_000,
            "containers": [{"name": "c"}],
        }
    }
    claim = extended_resource_claim(many, ["gpu.nvidia.com"])
    assert claim is not None
    assert [r["exactly"]["count"] for r in claim.spec["devices"]["requests"]] == [1]
