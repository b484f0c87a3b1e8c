"""The chart lets the webhook's replicas elect the one quota writer: a namespaced Role on
the Lease the Deployment names, and each pod's name as its identity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpudra.cli.main import build_parser
from gpudra.cli.webhook import QUOTA_LEASE, quota_leader

from e2e.tools import helm as h


def webhook_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = h.find(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = container
    return found


def test_the_role_grants_the_lease_the_deployment_elects_on(helm: Path) -> None:
    objects = h.template(helm, namespace="gpu-system", release="gpu")
    container = webhook_container(objects)
    args = container["args"]
    (lease,) = [a.split("=", 1)[1] for a in args if a.startswith("--leader-elect-lease-name=")]
    assert lease == QUOTA_LEASE
    # The webhook, started with these args, elects on that Lease in the release namespace.
    parsed = build_parser().parse_args(args)
    leader = quota_leader(parsed, None)  # type: ignore[arg-type]
    assert leader is not None and (leader.namespace, leader.name) == ("gpu-system", lease)

    role = h.find(objects, "Role", "gpu-gpudra-webhook-leader-election")
    assert role["metadata"]["namespace"] == "gpu-system"
    by_verbs = {tuple(r["verbs"]): r for r in role["rules"]}
    assert set(by_verbs) == {("create",), ("get", "update")}
    assert by_verbs["get", "update"]["resourceNames"] == [lease]
    assert "resourceNames" not in by_verbs["create",]  # RBAC cannot name what is created
    for rule in role["rules"]:
        assert (rule["apiGroups"], rule["resources"]) == (["coordination.k8s.io"], ["leases"])

    binding = h.find(objects, "RoleBinding", "gpu-gpudra-webhook-leader-election")
    assert binding["metadata"]["namespace"] == "gpu-system"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    account = h.find(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "gpu-system"}
    ]
    # Each replica's identity is its pod's name, from the downward API.
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_without_tenants_there_is_no_lease_to_elect_on(helm: Path) -> None:
    objects = h.template(helm, {"tenants": {"enabled": False}})
    assert not [
        o
        for o in objects
        if o["kind"] in ("Role", "RoleBinding") and "leader" in o["metadata"]["name"]
    ]
    args = webhook_container(objects)["args"]
    assert not [a for a in args if a.startswith("--leader-elect")]
