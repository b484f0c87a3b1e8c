"""The webhook's ServiceAccount may write no more than the webhook does: its webhook
configurations only with tls.source=self, and then only their caBundle; ResourceQuotas
only its own device quota. The admission policies that hold it there name what the
code writes (the e2e escape tests run them on a real API server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpudra.api.tenants import QUOTA_RESOURCE_SUFFIX
from gpudra.webhook import registration
from gpudra.webhook.tenant_state import QUOTA_NAME
from gpudra.webhook.tenants import MANAGED_BY_LABEL, MANAGED_BY_VALUE

from e2e.tools import helm as h

USER = "system:serviceaccount:gpudra:gpudra-webhook"
CONFIGURATIONS = "gpudra-webhook-configurations"
QUOTAS = "gpudra-webhook-quotas"


def render(helm: Path, *values: dict[str, Any]) -> list[dict[str, Any]]:
    return h.template(helm, *values)


def policy_names(objects: list[dict[str, Any]]) -> set[str]:
    return {
        o["metadata"]["name"]
        for o in objects
        if o["kind"] == "ValidatingAdmissionPolicy"
        and o["metadata"]["name"] in (CONFIGURATIONS, QUOTAS)
    }


def configuration_rules(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    role = h.find(objects, "ClusterRole", "gpudra-webhook")
    return [r for r in role["rules"] if "admissionregistration.k8s.io" in r["apiGroups"]]


def test_self_signed_webhook_writes_its_configurations_by_name_under_a_policy(
    helm: Path,
) -> None:
    objects = render(helm)  # tls.source=self by default
    rules = configuration_rules(objects)
    assert {n for r in rules for n in r["resourceNames"]} == {
        registration.NAME,
        registration.VALIDATING_NAME,
    }
    assert {v for r in rules for v in r["verbs"]} == {"get", "list", "watch", "patch", "update"}
    assert policy_names(objects) == {CONFIGURATIONS, QUOTAS}
    policy = h.find(objects, "ValidatingAdmissionPolicy", CONFIGURATIONS)["spec"]
    assert policy["failurePolicy"] == "Fail"
    (match,) = policy["matchConstraints"]["resourceRules"]
    assert set(match["resources"]) == {
        "mutatingwebhookconfigurations",
        "validatingwebhookconfigurations",
    }
    assert set(match["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    (condition,) = policy["matchConditions"]
    assert condition["expression"] == f"request.userInfo.username == '{USER}'"
    # Every webhook key but clientConfig, and every clientConfig key but caBundle, is
    # compared with the old object's, both ways.
    expressions = " ".join(v["expression"] for v in policy["validations"])
    assert "k == 'clientConfig' || (k in o && w[k] == o[k])" in expressions
    assert "k == 'caBundle' || (k in o.clientConfig" in expressions
    assert "o.clientConfig.all(k, k == 'caBundle' || k in w.clientConfig)" in expressions
    assert "w.name) == variables.oldHooks.map(w, w.name)" in expressions
    for name in (CONFIGURATIONS, QUOTAS):
        binding = h.find(objects, "ValidatingAdmissionPolicyBinding", name)["spec"]
        assert binding == {"policyName": name, "validationActions": ["Deny"]}


@pytest.mark.parametrize(
    "tls",
    [{"source": "helm"}, {"source": "secret", "secretName": "tls", "caBundle": "eA=="}],
    ids=["helm", "secret"],
)
def test_webhook_gets_no_grant_on_its_configurations_it_does_not_write(
    helm: Path, tls: dict[str, str]
) -> None:
    """The chart or cert-manager writes the caBundle: the webhook may not even read them."""
    objects = render(helm, {"webhook": {"tls": tls}})
    assert configuration_rules(objects) == []
    assert policy_names(objects) == {QUOTAS}


def test_quota_policy_names_what_the_tenant_controller_writes(helm: Path) -> None:
    objects = render(helm)
    policy = h.find(objects, "ValidatingAdmissionPolicy", QUOTAS)["spec"]
    (match,) = policy["matchConstraints"]["resourceRules"]
    assert (match["apiGroups"], match["resources"]) == ([""], ["resourcequotas"])
    assert set(match["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    (condition,) = policy["matchConditions"]
    assert condition["expression"] == f"request.userInfo.username == '{USER}'"
    text = " ".join(
        [v["expression"] for v in policy["variables"]]
        + [v["expression"] for v in policy["validations"]]
    )
    assert f"variables.quota.metadata.name == '{QUOTA_NAME}'" in text
    assert f"[?'{MANAGED_BY_LABEL}'].orValue('') == '{MANAGED_BY_VALUE}'" in text
    assert f"k.endsWith('{QUOTA_RESOURCE_SUFFIX}')" in text
    assert "object.spec.all(k, k == 'hard')" in text


def test_no_quota_policy_without_tenants_nor_policies_without_the_webhook(helm: Path) -> None:
    objects = render(helm, {"tenants": {"enabled": False}})
    assert policy_names(objects) == {CONFIGURATIONS}
    role = h.find(objects, "ClusterRole", "gpudra-webhook")
    assert not [r for r in role["rules"] if "resourcequotas" in r["resources"]]
    objects = render(helm, {"webhook": {"enabled": False}, "tenants": {"enabled": False}})
    assert policy_names(objects) == set()
