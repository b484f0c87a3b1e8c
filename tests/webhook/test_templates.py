"""ResourceClaimTemplate creation against the real API server, and its TTL cache."""

from __future__ import annotations

import copy
import secrets
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
import pytest
from gpudra.common.kube import Kube as AsyncKube
from gpudra.webhook.convert import convert_pod
from gpudra.webhook.templates import ApiClaimReader, ApiTemplateEnsurer, TemplateConflict

from e2e.cluster.kube import Kube

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]


def _template(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
                }
            }
        },
    }


@pytest.fixture
async def namespace(kube: Kube) -> AsyncIterator[str]:
    name = f"tpl-{secrets.token_hex(3)}"
    await anyio.to_thread.run_sync(
        lambda: kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    )
    yield name
    await anyio.to_thread.run_sync(lambda: kube.delete("Namespace", name))


async def test_known_templates_are_not_posted_again_until_the_ttl_passes(
    akube: AsyncKube, kube: Kube, namespace: str
) -> None:
    now = [1000.0]
    ensure = ApiTemplateEnsurer(akube, ttl_s=60, clock=lambda: now[0])

    def exists() -> bool:
        return kube.get_or_none("ResourceClaimTemplate", "shape-a", namespace) is not None

    await ensure(namespace, [_template("shape-a")], False)
    assert await anyio.to_thread.run_sync(exists)

    # Deleted behind its back: inside the TTL the ensurer trusts its memory ...
    await anyio.to_thread.run_sync(
        lambda: kube.delete("ResourceClaimTemplate", "shape-a", namespace)
    )
    now[0] += 30
    await ensure(namespace, [_template("shape-a")], False)
    assert not await anyio.to_thread.run_sync(exists)

    # ... and after it, the next pod re-creates the template.
    now[0] += 31
    await ensure(namespace, [_template("shape-a")], False)
    assert await anyio.to_thread.run_sync(exists)


async def test_dry_runs_create_nothing_and_are_not_remembered(
    akube: AsyncKube, kube: Kube, namespace: str
) -> None:
    ensure = ApiTemplateEnsurer(akube)
    await ensure(namespace, [_template("shape-b")], True)
    assert kube.get_or_none("ResourceClaimTemplate", "shape-b", namespace) is None
    await ensure(namespace, [_template("shape-b")], False)
    assert kube.get_or_none("ResourceClaimTemplate", "shape-b", namespace) is not None


async def test_a_template_pre_created_under_a_generated_name_is_used_only_if_identical(
    akube: AsyncKube, kube: Kube, namespace: str
) -> None:
    [ours] = convert_pod(
        {"spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    ).templates
    name = ours["metadata"]["name"]
    forged = copy.deepcopy(ours)
    forged["metadata"]["namespace"] = namespace
    forged["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = 4
    await anyio.to_thread.run_sync(lambda: kube.create(forged))

    with pytest.raises(TemplateConflict, match=f"ResourceClaimTemplate {name} in namespace"):
        await ApiTemplateEnsurer(akube)(namespace, [ours], False)
    with pytest.raises(TemplateConflict):
        await ApiTemplateEnsurer(akube)(namespace, [ours], True)

    # The same content, as the API server stores it (defaults filled in), is reused.
    await anyio.to_thread.run_sync(lambda: kube.delete("ResourceClaimTemplate", name, namespace))
    same = copy.deepcopy(ours)
    same["metadata"]["namespace"] = namespace
    del same["spec"]["spec"]["devices"]["requests"][0]["exactly"]["allocationMode"]
    await anyio.to_thread.run_sync(lambda: kube.create(same))
    await ApiTemplateEnsurer(akube)(namespace, [ours], False)


async def test_the_api_reader_reads_a_namespaces_labels(
    akube: AsyncKube, kube: Kube, namespace: str
) -> None:
    """The conversion selector's fallback for a namespace the tenant view has not seen:
    the labels as the API server has them, None for a namespace that does not exist."""
    reader = ApiClaimReader(akube)
    labels = await reader.namespace_labels(namespace)
    assert labels == {"kubernetes.io/metadata.name": namespace}
    await anyio.to_thread.run_sync(
        lambda: kube.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}",
            {"metadata": {"labels": {"gpudra.nvidia.com/dra": "true"}}},
            content_type="application/merge-patch+json",
        )
    )
    labels = await reader.namespace_labels(namespace)
    assert labels is not None and labels["gpudra.nvidia.com/dra"] == "true"
    assert await reader.namespace_labels(f"{namespace}-none") is None


async def test_the_api_reader_finds_no_kueue_workloads_where_kueue_is_not_served(
    akube: AsyncKube, namespace: str
) -> None:
    """Without Kueue's API (this cluster has none) no Workload holds a template: a
    template is judged as anywhere else, not refused for a list the server cannot
    answer. Kueue's own Workloads are read in e2e/tests/test_kueue.py."""
    reader = ApiClaimReader(akube)
    assert await reader.workloads_admitted_with(namespace, "one-gpu") == []


class _Counted:
    """The webhook's API client, counting the queries of the pod lists it sends."""

    def __init__(self, kube: AsyncKube) -> None:
        self.kube = kube
        self.pod_queries: list[dict[str, str]] = []

    async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        if path.endswith("/pods"):
            self.pod_queries.append(dict(kw.get("query") or {}))
        return await self.kube.request(method, path, body, **kw)


async def test_the_api_reader_pages_a_namespaces_pods_and_keeps_what_its_filter_does(
    akube: AsyncKube, kube: Kube, namespace: str
) -> None:
    """The API server pages the phase-selected list (``limit``/``continue``) as the
    reader asks: five waiting pods in pages of two are three requests, and the reader
    keeps the pods its filter accepts from every page; a pod that finished (its status
    set Failed) is left out by the field selector."""
    names = [f"p{i}" for i in range(5)]
    for name in [*names, "done"]:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"n": name}},
            "spec": {
                "nodeSelector": {"gpudra.test/none": "none"},  # never scheduled
                "containers": [{"name": "c", "image": "busybox"}],
            },
        }
        await anyio.to_thread.run_sync(lambda pod=pod: kube.create(pod))
    await anyio.to_thread.run_sync(
        lambda: kube.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/done/status",
            {"status": {"phase": "Failed"}},
            content_type="application/merge-patch+json",
        )
    )
    counted = _Counted(akube)
    reader = ApiClaimReader(counted, per_page=2)  # type: ignore[arg-type]

    found = await reader.pods(namespace, lambda p: p["metadata"]["name"] != "p3")

    assert sorted(p["metadata"]["name"] for p in found) == ["p0", "p1", "p2", "p4"]
    assert len(counted.pod_queries) == 3
    assert [q.get("continue") is None for q in counted.pod_queries] == [True, False, False]
    everything = await reader.pods(namespace, lambda p: True)
    assert sorted(p["metadata"]["name"] for p in everything) == names
