"""The `container` label: which containers of a claim's pod use it, from the pod's
spec and status alone, and read from the real API server off the prepare path."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from gpudra.common.kube import ApiError, Kube
from gpudra.driver.checkpoint import ClaimRecord, ClaimState, DeviceRecord
from gpudra.driver.holders import ClaimInfo
from gpudra.driver.podclaims import ClaimContainers, container_label, containers_using
from gpudra.driver.records import DeviceDetails


def container(name: str, *claims: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "app:test", "resources": {"claims": list(claims)}, **extra}


def pod(
    entries: list[dict[str, str]],
    containers: list[dict[str, Any]],
    *,
    init: list[dict[str, Any]] | None = None,
    generated: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"resourceClaims": entries, "containers": containers}
    if init is not None:
        spec["initContainers"] = init
    status = {
        "resourceClaimStatuses": [
            {"name": k, "resourceClaimName": v} for k, v in (generated or {}).items()
        ]
    }
    return {"metadata": {"name": "trainer"}, "spec": spec, "status": status}


def test_the_containers_that_name_the_claims_entry() -> None:
    p = pod(
        [{"name": "gpu", "resourceClaimName": "big"}, {"name": "other", "resourceClaimName": "x"}],
        [
            container("main", {"name": "gpu"}),
            container("logger"),
            container("b", {"name": "other"}),
        ],
    )
    assert containers_using(p, "big", "gpu") == ("main",)
    assert containers_using(p, "x", "") == ("b",)
    assert containers_using(p, "absent", "gpu") == ()


def test_init_containers_and_sidecars_count() -> None:
    p = pod(
        [{"name": "gpu", "resourceClaimName": "big"}],
        [container("main", {"name": "gpu"})],
        init=[
            container("warmup", {"name": "gpu"}),
            container("proxy", {"name": "gpu"}, restartPolicy="Always"),
            container("setup"),
        ],
    )
    assert containers_using(p, "big", "gpu") == ("main", "proxy", "warmup")


def test_a_container_narrowed_to_another_request_does_not_use_this_one() -> None:
    p = pod(
        [{"name": "gpus", "resourceClaimName": "pair"}],
        [
            container("a", {"name": "gpus", "request": "first"}),
            container("b", {"name": "gpus", "request": "second"}),
            container("both", {"name": "gpus"}),
        ],
    )
    assert containers_using(p, "pair", "first") == ("a", "both")
    assert containers_using(p, "pair", "second") == ("b", "both")
    # A subrequest of a prioritized list stands for its parent request.
    assert containers_using(p, "pair", "first/big") == ("a", "both")
    assert containers_using(p, "pair", "") == ("a", "b", "both")


def test_a_claim_generated_from_a_template_is_found_through_the_pod_status() -> None:
    p = pod(
        [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
        [container("main", {"name": "gpu"})],
        generated={"gpu": "trainer-gpu-x7k2p"},
    )
    assert containers_using(p, "trainer-gpu-x7k2p", "gpu") == ("main",)
    assert containers_using(p, "one-gpu", "gpu") == ()  # the template is not the claim
    del p["status"]  # not generated yet: unknown
    assert containers_using(p, "trainer-gpu-x7k2p", "gpu") == ()


@pytest.mark.parametrize(
    "broken",
    [
        {},
        {"spec": "text"},
        {"spec": {"resourceClaims": "gpu", "containers": [None, 3, {"resources": []}]}},
        {"spec": {"containers": [{"name": "a", "resources": {"claims": [{"name": None}]}}]}},
        {"status": {"resourceClaimStatuses": [None]}, "spec": {"resourceClaims": [{}]}},
    ],
)
def test_a_malformed_pod_uses_nothing(broken: dict[str, Any]) -> None:
    assert containers_using(broken, "big", "gpu") == ()


def claim_record(uid: str, namespace: str, name: str, pod_name: str) -> ClaimRecord:
    return ClaimRecord(
        uid=uid,
        namespace=namespace,
        name=name,
        state=ClaimState.PREPARE_COMPLETED,
        devices=(
            DeviceRecord(
                pool="node-a",
                device="gpu-0",
                request_names=("gpu", "spare"),
                exclusive=True,
                details=DeviceDetails(type="gpu", gpu_uuid="GPU-1", uuid="GPU-1", pod=pod_name),
            ),
        ),
    )


class UnreachableKube(Kube):
    """An API server that never answers."""

    def __init__(self, status: int | None = None) -> None:
        self.calls = 0
        self.status = status

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.calls += 1
        if self.status is not None:
            raise ApiError(self.status, "pods is forbidden", method, path)
        raise OSError("connection refused")


@pytest.mark.anyio
async def test_a_pod_that_cannot_be_read_leaves_the_label_empty_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kube = UnreachableKube()
    containers = ClaimContainers(kube)
    claims = [claim_record("u1", "team-a", "big", "trainer")]
    infos = {"u1": ClaimInfo(pods={"trainer": "pod-uid-1"})}
    with caplog.at_level(logging.WARNING, logger="gpudra.driver.podclaims"):
        await containers.refresh(claims, infos)
        await containers.refresh(claims, infos)
    assert containers.snapshot() == {}
    assert kube.calls == 2  # the API server may come back: asked again
    assert len(caplog.records) == 1

    forbidden = UnreachableKube(403)
    containers = ClaimContainers(forbidden)
    await containers.refresh(claims, infos)
    await containers.refresh(claims, infos)
    assert containers.snapshot() == {"u1": {}}
    assert forbidden.calls == 1  # no permission: asking again changes nothing


@pytest.fixture
async def namespace(akube: Kube) -> AsyncIterator[str]:
    name = f"containers-{uuid.uuid4().hex[:8]}"
    await akube.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    yield name
    await akube.request("DELETE", f"/api/v1/namespaces/{name}")


@pytest.mark.cluster
@pytest.mark.anyio
async def test_the_pod_is_read_from_the_api_server_once_per_claim(
    akube: Kube, namespace: str
) -> None:
    p = pod(
        [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
        [container("main", {"name": "gpu", "request": "gpu"}), container("z-sidecar")],
        init=[container("proxy", {"name": "gpu"}, restartPolicy="Always")],
    )
    del p["status"]
    p["metadata"] = {"name": "trainer", "namespace": namespace}
    path = f"/api/v1/namespaces/{namespace}/pods"
    created = await akube.request("POST", path, p)
    status = {"status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "gen"}]}}
    await akube.request(
        "PATCH",
        f"{path}/trainer/status",
        status,
        content_type="application/strategic-merge-patch+json",
    )
    containers = ClaimContainers(akube)
    claims = [
        claim_record("u1", namespace, "gen", "trainer"),
        claim_record("u2", namespace, "gen", "gone"),  # no such pod: known to be unknown
    ]

    infos = {
        "u1": ClaimInfo(pods={"trainer": created["metadata"]["uid"]}),
        "u2": ClaimInfo(pods={"gone": "uid-of-gone"}),
    }

    await containers.refresh(claims, infos)

    assert containers.snapshot() == {
        "u1": {"gpu": "main,proxy", "spare": "proxy"},
        "u2": {},
    }
    await containers.refresh(claims[:1], infos)  # unprepared claims are forgotten
    assert set(containers.snapshot()) == {"u1"}


class PodKube(Kube):
    """An API server that has one pod, `trainer`, with the given UID and containers
    (by default one, `main`, using the claim `big`)."""

    def __init__(self, uid: str, containers: list[dict[str, Any]] | None = None) -> None:
        self.calls = 0
        self.uid = uid
        self.containers = containers or [container("main", {"name": "gpu"})]

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.calls += 1
        p = pod([{"name": "gpu", "resourceClaimName": "big"}], self.containers)
        p["metadata"]["uid"] = self.uid
        return p


@pytest.mark.anyio
async def test_a_pod_re_created_under_the_same_name_gets_no_container_label(
    caplog: pytest.LogCaptureFixture,
) -> None:
    claims = [claim_record("u1", "team-a", "big", "trainer")]
    reserved = {"u1": ClaimInfo(pods={"trainer": "uid-of-the-first"})}

    same = ClaimContainers(PodKube("uid-of-the-first"))
    await same.refresh(claims, reserved)
    assert same.snapshot() == {"u1": {"gpu": "main", "spare": "main"}}

    kube = PodKube("uid-of-a-new-pod")
    containers = ClaimContainers(kube)
    await containers.refresh(claims, {})  # the claim not read yet: the UID is not known
    assert kube.calls == 0 and containers.snapshot() == {}
    with caplog.at_level(logging.WARNING, logger="gpudra.driver.podclaims"):
        await containers.refresh(claims, reserved)
        await containers.refresh(claims, reserved)
    assert containers.snapshot() == {"u1": {}}
    assert kube.calls == 1  # another pod: asking again changes nothing
    [record] = caplog.records
    assert "re-created" in record.getMessage()


def test_the_container_label_names_five_containers_at_most() -> None:
    assert container_label([]) == ""
    assert container_label(["a", "b", "c", "d", "e"]) == "a,b,c,d,e"
    assert container_label(["a", "b", "c", "d", "e", "f", "g"]) == "a,b,c,d,e,+2 more"


def test_the_container_label_is_256_characters_at_most() -> None:
    names = [f"{i}" + "x" * 62 for i in range(9)]  # 63 characters: a container name's most
    label = container_label(names)
    assert label == ",".join(names[:3]) + ",+6 more"  # a fourth would pass 256
    assert len(label) <= 256
    assert len(container_label(["y" * 300, "z"])) <= 256  # not from the API; still capped


@pytest.mark.anyio
async def test_a_pod_with_thousands_of_containers_gets_a_short_container_label() -> None:
    """The pod spec is the tenant's: its label is on every series of the holder, so it
    must not grow with the number of containers (or the node's scrape would)."""
    many = [container(f"c{i:05d}" + "x" * 57, {"name": "gpu"}) for i in range(5000)]
    containers = ClaimContainers(PodKube("uid-1", many))
    reserved = {"u1": ClaimInfo(pods={"trainer": "uid-1"})}
    await containers.refresh([claim_record("u1", "team-a", "big", "trainer")], reserved)
    label = containers.snapshot()["u1"]["gpu"]
    assert len(label) <= 256
    assert label.startswith("c00000") and label.endswith(",+4997 more")
