"""Creates the ResourceClaimTemplates converted pods refer to, through the API server.

Creation is idempotent, but a template that already exists is used only when its
content is what the conversion wrote: anyone who may create templates in the namespace
could otherwise pre-create ``gpudra-gpu-1`` asking for more devices than the tenant
check counted. A mismatch is refused (`TemplateConflict`), so the pod is denied with a
message naming the template; the webhook never deletes what it did not write. Dry-run
admission requests are passed on as dry-run creates, so they are validated but nothing is stored.

Templates known to exist are remembered for `ttl_s`, so a burst of pods of one
shape costs one API call, not one per pod: the webhook's latency budget (p99 under
10 ms) has no room for a round trip per admission. The price is a bounded window: a
template deleted by hand is re-created by the first pod after its entry expires; a
pod admitted inside the window stays Pending until then, and the controller-manager
retries its claim by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
from gpudra.common.kube import RESOURCE_API, ApiError, Kube
from gpudra.webhook.convert import same_claim_spec
from gpudra.webhook.owners import controller_of
from gpudra.webhook.tenant_rules import POD_CLAIM_NAME_ANNOTATION, StoredClaim

# Kueue's API versions with Workloads, newest first: each serves every Workload.
KUEUE_VERSIONS: Final = ("kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io/v1beta1")

DEFAULT_TTL_S = 60.0
_MAX_ENTRIES = 10_000

PODS_PER_PAGE: Final = 100
"""Pods one response of a pod list holds (`ApiClaimReader.pods`): a hostile tenant
makes its pods as big as the API server stores (1.5 MiB each), so a page is bounded by
count, the only bound a list has, and kept small; 10,000 pods are 100 round trips."""
_POD_PHASES: Final = "status.phase!=Succeeded,status.phase!=Failed"


class TemplateConflict(ValueError):
    """A template exists under a generated name with content the conversion did not write."""


class PodListError(Exception):
    """A namespace's pods could not be listed whole: what failed, for a denial."""


PodFilter = Callable[[Mapping[str, Any]], bool]
"""Which pods a reader of `ApiClaimReader.pods` keeps."""


@dataclass(eq=False)
class _PodList:
    """One LIST of a namespace's pods, shared by every read that joined it before it
    began: each gets the pods its filter keeps, or the list's failure."""

    readers: list[tuple[PodFilter, list[Mapping[str, Any]]]] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    failure: str | None = None
    abandoned: bool = False
    """Its leader was cancelled: the other readers list again, each from its own start."""


class ApiTemplateEnsurer:
    def __init__(
        self,
        kube: Kube,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self._ttl_s = ttl_s
        self._clock = clock
        self._known: dict[tuple[str, str], float] = {}  # (namespace, name) -> expiry

    async def __call__(
        self, namespace: str, templates: Sequence[Mapping[str, Any]], dry_run: bool
    ) -> None:
        path = f"{RESOURCE_API}/namespaces/{namespace}/resourceclaimtemplates"
        query = {"dryRun": "All"} if dry_run else None
        now = self._clock()
        for tpl in templates:
            key = (namespace, str(tpl["metadata"]["name"]))
            if not dry_run and self._known.get(key, 0.0) > now:
                continue
            body = {**tpl, "metadata": {**tpl["metadata"], "namespace": namespace}}
            try:
                await self.kube.request("POST", path, body, query=query)
            except ApiError as e:
                if e.status != 409:
                    raise
                await self._check_existing(f"{path}/{key[1]}", key, tpl)
            if not dry_run:
                self._remember(key, now)

    async def _check_existing(
        self, path: str, key: tuple[str, str], tpl: Mapping[str, Any]
    ) -> None:
        existing = await self.kube.request("GET", path)
        spec = (existing.get("spec") or {}).get("spec") if isinstance(existing, dict) else None
        if isinstance(spec, Mapping) and same_claim_spec(spec, tpl["spec"]["spec"]):
            return
        raise TemplateConflict(
            f"ResourceClaimTemplate {key[1]} in namespace {key[0]} exists with other content "
            f"than gpudra writes under that name; delete it so the webhook can create its own"
        )

    def _remember(self, key: tuple[str, str], now: float) -> None:
        if len(self._known) >= _MAX_ENTRIES:
            self._known = {k: t for k, t in self._known.items() if t > now}
            if len(self._known) >= _MAX_ENTRIES:
                self._known.clear()
        self._known[key] = now + self._ttl_s


class ApiClaimReader:
    """Reads the claims and templates a pod refers to (admission's `ClaimReader`).

    Not cached: a claim can be deleted and re-created with other content under its name,
    and only pods in tenant namespaces that name claims by hand pay the round trip (and
    for templates only where a per-pod device limit counts them). Pod lists are shared
    by the reads made together, and never kept (`pods`).
    """

    def __init__(self, kube: Kube, *, pods_per_page: int = PODS_PER_PAGE) -> None:
        self.kube = kube
        self._pods_per_page = pods_per_page
        # By namespace: the pod list readers may still join, and the one being made.
        self._waiting: dict[str, _PodList] = {}
        self._listing: dict[str, anyio.Event] = {}

    async def __call__(self, namespace: str, kind: str, name: str) -> StoredClaim | None:
        template = kind == "ResourceClaimTemplate"
        resource = "resourceclaimtemplates" if template else "resourceclaims"
        try:
            obj = await self.kube.request(
                "GET", f"{RESOURCE_API}/namespaces/{namespace}/{resource}/{name}"
            )
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        spec = obj.get("spec") if isinstance(obj, dict) else None
        if template and isinstance(spec, dict):
            spec = spec.get("spec")
        status = obj.get("status") if isinstance(obj, dict) and not template else None
        allocated = isinstance(status, dict) and bool(status.get("allocation"))
        return StoredClaim(spec if isinstance(spec, dict) else {}, allocated)

    async def namespace_labels(self, namespace: str) -> Mapping[str, str] | None:
        """The labels of `namespace`, or None when it does not exist."""
        try:
            obj = await self.kube.request("GET", f"/api/v1/namespaces/{namespace}")
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        labels = (obj.get("metadata") or {}).get("labels") if isinstance(obj, dict) else None
        return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}

    async def claims_made_for(self, namespace: str, pod_uid: str) -> Mapping[str, Sequence[str]]:
        """The claims of `namespace` the pod `pod_uid` controls, by the template entry the
        resourceclaim controller made each for (its ``pod-claim-name`` annotation). Only
        Kubernetes sets either on a claim (the chart's claim-links policy refuses others)."""
        listing = await self.kube.request(
            "GET", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims"
        )
        items = listing.get("items") if isinstance(listing, dict) else None
        found: dict[str, list[str]] = {}
        for claim in items if isinstance(items, list) else ():
            metadata = claim.get("metadata") if isinstance(claim, dict) else None
            if not isinstance(metadata, dict):
                continue
            owner = controller_of(claim)
            controlled = owner is not None and owner.get("uid") == pod_uid
            annotations = metadata.get("annotations")
            entry = (
                annotations.get(POD_CLAIM_NAME_ANNOTATION)
                if isinstance(annotations, dict)
                else None
            )
            name = metadata.get("name")
            if controlled and isinstance(entry, str) and isinstance(name, str):
                found.setdefault(entry, []).append(name)
        return found

    async def workloads_admitted_with(self, namespace: str, template: str) -> list[str]:
        """The Kueue Workloads of `namespace` holding quota (admitted: ``status.admission``
        set) and not finished, with a pod set that refers to the ResourceClaimTemplate
        `template`; none where no Kueue API version this knows is served."""
        for version in KUEUE_VERSIONS:
            try:
                listing = await self.kube.request(
                    "GET", f"/apis/{version}/namespaces/{namespace}/workloads"
                )
            except ApiError as e:
                if e.status == 404:  # the version is not served (no Kueue, or a newer one)
                    continue
                raise
            items = listing.get("items") if isinstance(listing, dict) else None
            return sorted(
                str((w.get("metadata") or {}).get("name"))
                for w in (items if isinstance(items, list) else ())
                if _admitted(w) and template in _templates_of(w)
            )
        return []

    async def pods(self, namespace: str, keep: PodFilter) -> list[Mapping[str, Any]]:
        """The namespace's pods that may still start containers (not Succeeded or
        Failed) and that `keep` accepts, in the API server's order; raises
        `PodListError` (or the read's own error) where they cannot all be listed.

        Each read of a claim being created lists them, and a tenant controls both its
        pods and its claims: thousands of cheap pending pods and as many claims created
        at once would make the API server serialise, and the webhook parse and hold,
        the whole list once per claim. So:

        - Reads of one namespace share lists (single flight). A read joins only a list
          that has not begun, and a list begins only once the one before it has ended:
          every pod stored before a read began is in the list it gets, as in a list of
          its own (a list already under way may have been read before a pod the claim's
          user stored a moment ago, and would let the claim be counted without it). So
          at most one list of a namespace is made at a time, and claims created together
          cost two lists, however many they are; a read waits for at most the list under
          way and its own. A read whose list's leader was cancelled (its admission ran
          out of time) lists again, from its own start.
        - A list is read in pages of `PODS_PER_PAGE` (``limit``/``continue``), and each
          read keeps of each page only the pods its `keep` accepts (for a claim, those
          that will use it), so the webhook holds one page and the pods that matter,
          not the namespace. An error on any page, a continue token that expired (410)
          included, fails the whole list: a list missing pages would leave their pods
          uncounted, and one restarted from an expired token is not consistent.
        - The list is a consistent read (no ``resourceVersion``), and its pages are
          served from the first page's snapshot. ``resourceVersion=0`` would let the
          watch cache answer, cheaper for the API server but as stale as the cache: a
          pod stored just before the claim could be missing, and uncounted. (Older API
          servers also ignore ``limit`` for it, returning the whole list in one.)

        A list is not stopped once one read's answer is known: the others that share it
        need the rest, and a claim's answer needs each of its pods' claims read, after.
        """
        while True:
            waiting = self._waiting.get(namespace)
            leader = waiting is None
            if waiting is None:
                waiting = self._waiting[namespace] = _PodList()
            found: list[Mapping[str, Any]] = []
            reader = (keep, found)
            waiting.readers.append(reader)
            try:
                if leader:
                    await self._list_pods(namespace, waiting)
                else:
                    await waiting.done.wait()
            finally:
                if not waiting.done.is_set():
                    waiting.readers.remove(reader)
            if waiting.abandoned:
                continue
            if waiting.failure is not None:
                raise PodListError(waiting.failure)
            return found

    async def _list_pods(self, namespace: str, pods: _PodList) -> None:
        """Make the list `pods` (its leader's part): once the namespace's list under way
        has ended, closed to new readers, page by page."""
        try:
            while (under_way := self._listing.get(namespace)) is not None:
                await under_way.wait()
            if self._waiting.get(namespace) is pods:
                del self._waiting[namespace]
            self._listing[namespace] = ended = anyio.Event()
            try:
                await self._pages(namespace, pods)
            finally:
                del self._listing[namespace]
                ended.set()
        except Exception as exc:
            pods.failure = str(exc) or type(exc).__name__
            raise
        except BaseException:  # cancelled: the other readers are not, and list again
            pods.abandoned = True
            raise
        finally:
            if self._waiting.get(namespace) is pods:
                del self._waiting[namespace]
            pods.done.set()

    async def _pages(self, namespace: str, pods: _PodList) -> None:
        path = f"/api/v1/namespaces/{namespace}/pods"
        query = {"fieldSelector": _POD_PHASES, "limit": str(self._pods_per_page)}
        page = 0
        while True:
            page += 1
            try:
                listing = await self.kube.request("GET", path, query=dict(query))
            except ApiError as e:
                if page == 1:
                    raise
                raise PodListError(
                    f"{e} (page {page} of the list of pods of namespace {namespace}; the "
                    "pods of the pages not read would be left uncounted)"
                ) from e
            items = listing.get("items") if isinstance(listing, dict) else None
            readers = tuple(pods.readers)  # one cancelled meanwhile still gets this page
            for pod in items if isinstance(items, list) else ():
                if isinstance(pod, dict):
                    for keep, found in readers:
                        if keep(pod):
                            found.append(pod)
            metadata = listing.get("metadata") if isinstance(listing, dict) else None
            token = metadata.get("continue") if isinstance(metadata, dict) else None
            if not isinstance(token, str) or not token:
                return
            query["continue"] = token


def _admitted(workload: Any) -> bool:
    """Whether a Kueue Workload holds quota: admitted (``status.admission``, which an
    eviction clears) and not finished."""
    status = workload.get("status") if isinstance(workload, dict) else None
    if not isinstance(status, dict) or not status.get("admission"):
        return False
    conditions = status.get("conditions")
    return not any(
        isinstance(c, dict) and c.get("type") == "Finished" and c.get("status") == "True"
        for c in (conditions if isinstance(conditions, list) else ())
    )


def _templates_of(workload: Any) -> set[str]:
    """The ResourceClaimTemplates a Workload's pod sets refer to."""
    spec = workload.get("spec") if isinstance(workload, dict) else None
    pod_sets = spec.get("podSets") if isinstance(spec, dict) else None
    found: set[str] = set()
    for pod_set in pod_sets if isinstance(pod_sets, list) else ():
        template = pod_set.get("template") if isinstance(pod_set, dict) else None
        pod_spec = template.get("spec") if isinstance(template, dict) else None
        claims = pod_spec.get("resourceClaims") if isinstance(pod_spec, dict) else None
        for entry in claims if isinstance(claims, list) else ():
            name = entry.get("resourceClaimTemplateName") if isinstance(entry, dict) else None
            if isinstance(name, str):
                found.add(name)
    return found
