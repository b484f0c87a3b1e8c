"""Which containers of a pod use a claim: the `container` label of device metrics.

The checkpoint knows the pod a claim is reserved for, not the containers that use
it; only the pod says that. A container names a pod-level claim entry in
`resources.claims` (optionally narrowed to one `request` of the claim), and the entry
names the ResourceClaim either directly (`resourceClaimName`) or through a template,
whose generated claim name the resourceclaim controller records in the pod's
`status.resourceClaimStatuses`. Init containers count like the others: a sidecar (an
init container with `restartPolicy: Always`) holds the device for the pod's life, a
plain one while the pod starts.

`containers_using` is that mapping, pure. `ClaimContainers` reads each holding pod
once, after the claim is prepared and never on a prepare's path, and keeps the label
per claim and request: the container names sorted and joined with ",", empty where
unknown (the pod could not be read, or no container names the claim), and capped
(`container_label`: five names, 256 characters, then "+N more") since the pod spec is
the tenant's. The checkpoint keeps the pod's name only, so the read pod's UID is
compared with the one the claim was reserved for (remembered from the claim read for
the prepare, `ClaimInfo.pods`): a pod re-created under the same name while the claim
is held is another pod, and labelling its containers would name the wrong ones.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any, Final

from gpudra.api.names import base_request
from gpudra.common.errors import exception_text
from gpudra.common.kube import ApiError, Kube
from gpudra.driver.checkpoint import ClaimRecord
from gpudra.driver.holders import ClaimInfo

__all__ = [
    "ClaimContainers",
    "container_label",
    "containers_using",
    "entries_naming",
    "uses_claim_on",
]

log = logging.getLogger(__name__)

_CONTAINER_KINDS: Final = ("initContainers", "containers")
_FINISHED: Final = frozenset({"Succeeded", "Failed"})
_GIVE_UP: Final = frozenset({401, 403, 404})  # asking again changes nothing
_LABEL_NAMES: Final = 5  # container names in one `container` label, at most
_LABEL_CHARS: Final = 256  # a `container` label's length, at most


def _items(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def containers_using(pod: Mapping[str, Any], claim: str, request: str) -> tuple[str, ...]:
    """The names, sorted, of `pod`'s containers (init containers included) that use the
    ResourceClaim named `claim` for `request`.

    A container whose claim entry names no request uses every request of the claim;
    one that names a request uses only that one. `request` may be a subrequest
    ("gpu/big"), which its parent request's name stands for; "" matches any request.
    """
    spec = _mapping(pod.get("spec"))
    entries = entries_naming(pod, claim)
    wanted = base_request(request)
    found = {
        str(container.get("name"))
        for kind in _CONTAINER_KINDS
        for container in _items(spec.get(kind))
        for ref in _items(_mapping(container.get("resources")).get("claims"))
        if ref.get("name") in entries and (not wanted or ref.get("request") in (None, "", wanted))
    }
    return tuple(sorted(found))


def entries_naming(pod: Mapping[str, Any], claim: str) -> set[str]:
    """The names of `pod`'s claim entries that stand for the ResourceClaim named
    `claim`: by `resourceClaimName`, or through a template, by the name the resource
    claim controller recorded in the pod's status."""
    generated = {
        str(s.get("name")): s.get("resourceClaimName")
        for s in _items(_mapping(pod.get("status")).get("resourceClaimStatuses"))
    }
    return {
        str(e.get("name"))
        for e in _items(_mapping(pod.get("spec")).get("resourceClaims"))
        if claim and claim in (e.get("resourceClaimName"), generated.get(str(e.get("name"))))
    }


def uses_claim_on(pod: Mapping[str, Any], node: str, claim: str, pod_uid: str = "") -> bool:
    """Whether `pod` (of UID `pod_uid`, where known) is bound to `node`, not finished, and
    names the ResourceClaim `claim` in a claim entry or as its extended-resource claim."""
    meta, spec, status = (_mapping(pod.get(k)) for k in ("metadata", "spec", "status"))
    if pod_uid and meta.get("uid") != pod_uid:
        return False
    if spec.get("nodeName") != node or status.get("phase") in _FINISHED:
        return False
    extended = _mapping(status.get("extendedResourceClaimStatus")).get("resourceClaimName")
    return extended == claim or bool(entries_naming(pod, claim))


def container_label(names: Iterable[str]) -> str:
    """The `container` label value of a holder: the names joined with ",", at most
    `_LABEL_NAMES` of them and `_LABEL_CHARS` characters in all, then "+N more".

    The names come from a tenant's pod spec, which may list thousands of containers;
    the label is on every series of the holder, rendered at every scrape of the node
    and stored by Prometheus per series, so one pod must not make it unbounded.
    """
    found = list(names)
    shown: list[str] = []
    for name in found[:_LABEL_NAMES]:
        rest = len(found) - len(shown) - 1
        if len(",".join([*shown, name, *_more(rest)])) > _LABEL_CHARS:
            break
        shown.append(name)
    return ",".join([*shown, *_more(len(found) - len(shown))])


def _more(count: int) -> list[str]:
    return [f"+{count} more"] if count else []


class ClaimContainers:
    """Claim UID -> request -> `container` label, for the prepared claims' pods.

    `refresh` (the agent calls it on the sampling interval, apart from prepares) reads
    the pod of each prepared claim it has no answer for yet, once the claim's reserved
    pods are known (`ClaimInfo.pods`). A read that fails is logged once per claim; it
    is tried again next time unless the answer cannot change (the pod is gone or is
    another pod of the same name, or the agent may not read pods), in which case the
    label stays empty. The answers are replaced whole, so any thread may read
    `snapshot`.
    """

    def __init__(self, kube: Kube, *, timeout_s: float = 5.0) -> None:
        self._kube = kube
        self._timeout_s = timeout_s
        self._known: Mapping[str, tuple[str, Mapping[str, str]]] = {}  # uid -> (pod, labels)
        self._logged: set[str] = set()

    def snapshot(self) -> Mapping[str, Mapping[str, str]]:
        return {uid: labels for uid, (_pod, labels) in self._known.items()}

    async def refresh(self, claims: Iterable[ClaimRecord], infos: Mapping[str, ClaimInfo]) -> None:
        """Read the pods of `claims` not known yet; forget claims no longer given.
        `infos`: the claims as read from the API server, by UID, for the pods' UIDs."""
        current = [c for c in claims if c.completed]
        known = {
            c.uid: self._known[c.uid]
            for c in current
            if c.uid in self._known and self._known[c.uid][0] == c.pod
        }
        for record in current:
            pod = record.pod
            info = infos.get(record.uid)
            if record.uid in known or not pod or info is None:
                continue  # without the claim's read, the pod's UID is not known yet
            labels = await self._read(record, pod, info.pods.get(pod, ""))
            if labels is not None:
                known[record.uid] = (pod, labels)
        self._known = known
        self._logged &= {c.uid for c in current}

    async def _read(self, record: ClaimRecord, pod: str, pod_uid: str) -> Mapping[str, str] | None:
        """The labels of `record`'s requests; {} where they cannot be known; None to
        ask again next time. `pod_uid`: the UID the claim was reserved for."""
        path = f"/api/v1/namespaces/{record.namespace}/pods/{urllib.parse.quote(pod, safe='')}"
        try:
            obj = await self._kube.request("GET", path, request_timeout_s=self._timeout_s)
        except Exception as exc:
            final = isinstance(exc, ApiError) and exc.status in _GIVE_UP
            if record.uid not in self._logged:
                self._logged.add(record.uid)
                log.warning(
                    "could not read a claim's pod; its device series have no container label"
                    + ("" if final else " until a later read succeeds"),
                    extra={
                        "fields": {
                            "claim": record.ref.describe(),
                            "pod": pod,
                            "error": exception_text(exc),
                        }
                    },
                )
            return {} if final else None
        pod_obj = _mapping(obj)
        found = _mapping(pod_obj.get("metadata")).get("uid")
        if not pod_uid or found != pod_uid:
            log.warning(
                "the claim's pod was re-created under the same name (or is no longer the "
                "one the claim is reserved for); its device series have no container label",
                extra={
                    "fields": {
                        "claim": record.ref.describe(),
                        "pod": pod,
                        "reserved_for_uid": pod_uid,
                        "pod_uid": found,
                    }
                },
            )
            return {}
        requests = {r for d in record.devices for r in d.request_names}
        return {r: container_label(containers_using(pod_obj, record.name, r)) for r in requests}
