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
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Final

from gpudra.api.names import POD_CLAIM_NAME_ANNOTATION
from gpudra.common.kube import RESOURCE_API, ApiError, Kube
from gpudra.webhook.convert import same_claim_spec
from gpudra.webhook.lists import PER_PAGE, Keep, ListError, SharedLists
from gpudra.webhook.owners import controller_of
from gpudra.webhook.tenant_rules import StoredClaim

# Kueue's API versions with Workloads, newest first: each serves every Workload.
KUEUE_VERSIONS: Final = ("kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io/v1beta1")

DEFAULT_TTL_S = 60.0
_MAX_ENTRIES = 10_000

_POD_PHASES: Final = "status.phase!=Succeeded,status.phase!=Failed"


class TemplateConflict(ValueError):
    """A template exists under a generated name with content the conversion did not write."""


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
    for templates only where a per-pod device limit counts them). The namespace-wide
    lists (pods, claims, Kueue Workloads) are shared by the reads made together, read in
    pages of `per_page`, and never kept (`SharedLists`).
    """

    def __init__(self, kube: Kube, *, per_page: int = PER_PAGE) -> None:
        self.kube = kube
        self._lists = SharedLists(kube, per_page=per_page)

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

    async def claims_made_for(
        self, namespace: str, pod_uids: Collection[str]
    ) -> Mapping[str, Mapping[str, Sequence[str]]]:
        """The claims of `namespace` each pod of `pod_uids` controls, by pod UID, then by
        the template entry the resourceclaim controller made each for (its
        ``pod-claim-name`` annotation); a pod with none is left out. Only Kubernetes sets
        either on a claim (the chart's claim-links policy refuses others).

        A tenant controls how many claims its namespace holds and, by the pods it makes,
        how often claims are created under a per-pod device limit, and how many pods
        each such claim's admission reads this for: one list answers all of them, and
        it is shared and paged (`SharedLists`), raising its `ListError` where the claims
        cannot all be listed."""
        wanted = frozenset(pod_uids)
        found: dict[str, dict[str, list[str]]] = {}

        def keep(claim: Mapping[str, Any]) -> bool:
            # Only the names are kept, not the claims: a tenant decides how large they
            # are. A list its leader gave up is read again: each name goes in once.
            if (made := _made_for(claim, wanted)) is not None:
                uid, entry, name = made
                names = found.setdefault(uid, {}).setdefault(entry, [])
                if name not in names:
                    names.append(name)
            return False

        await self._lists.read(f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims", keep)
        return found

    async def workloads_admitted_with(self, namespace: str, template: str) -> list[str]:
        """The Kueue Workloads of `namespace` that Kueue counted (`_counted`: admitted,
        or waiting with the count it will admit them with) and that are not finished,
        with a pod set that refers to the ResourceClaimTemplate `template`; none where
        no Kueue API version this knows is served (its list's first page answers 404).
        Each template created reads it, and a tenant controls how many Workloads there
        are: the list is shared and paged (`SharedLists`), and raises its `ListError`
        where the Workloads cannot all be listed."""
        names: set[str] = set()  # a version not served answers its first page 404

        def keep(workload: Mapping[str, Any]) -> bool:
            # Only the names are kept, not the Workloads (a tenant decides their size).
            if _counted(workload) and template in _templates_of(workload):
                names.add(str((workload.get("metadata") or {}).get("name")))
            return False

        for version in KUEUE_VERSIONS:
            try:
                await self._lists.read(f"/apis/{version}/namespaces/{namespace}/workloads", keep)
            except ListError as e:
                if e.status == 404:  # the version is not served (no Kueue, or a newer one)
                    continue
                raise
            return sorted(names)
        return []

    async def pods(self, namespace: str, keep: Keep) -> list[Mapping[str, Any]]:
        """The namespace's pods that may still start containers (not Succeeded or
        Failed) and that `keep` accepts, in the API server's order; raises `ListError`
        where they cannot all be listed.

        Each read of a claim being created lists them, and a tenant controls both its
        pods and its claims: the list is shared by the claims created together, read in
        pages, and each read keeps of each page only the pods its `keep` accepts (for a
        claim, those that will use it); `SharedLists` says how, and why a read still
        sees every pod stored before it began. A claim's answer needs each of its pods'
        claims read, after.
        """
        return await self._lists.read(
            f"/api/v1/namespaces/{namespace}/pods", keep, {"fieldSelector": _POD_PHASES}
        )


def _made_for(claim: Mapping[str, Any], pod_uids: Collection[str]) -> tuple[str, str, str] | None:
    """The controlling pod's UID, template entry and name of `claim` where one of the
    pods `pod_uids` controls it and it is annotated with the entry the resourceclaim
    controller made it for."""
    metadata = claim.get("metadata")
    if not isinstance(metadata, dict):
        return None
    owner = controller_of(claim)
    uid = owner.get("uid") if owner is not None else None
    if not isinstance(uid, str) or uid not in pod_uids:
        return None
    annotations = metadata.get("annotations")
    entry = annotations.get(POD_CLAIM_NAME_ANNOTATION) if isinstance(annotations, dict) else None
    name = metadata.get("name")
    return (uid, entry, name) if isinstance(entry, str) and isinstance(name, str) else None


def _counted(workload: Any) -> bool:
    """Whether Kueue counted a Workload's templates and will not read them again before
    its pods are made: not finished, and either admitted (``status.admission``, which an
    eviction clears) or waiting in its queue with a count (``status.resourceRequests``,
    which Kueue's scheduler writes when the Workload does not fit yet).

    Kueue reads a pending Workload's templates when it queues it and keeps that count;
    it watches no ResourceClaimTemplate, so a template replaced while the Workload
    waits is admitted at the count of the one it replaced (Kueue v0.19.2). A Workload
    Kueue has not counted yet (its template missing, say) and one deactivated
    (``spec.active: false``, read again when reactivated) are not counted here, so a
    template may still be created after its Job."""
    status = workload.get("status") if isinstance(workload, dict) else None
    if not isinstance(status, dict):
        return False
    conditions = status.get("conditions")
    if any(
        isinstance(c, dict) and c.get("type") == "Finished" and c.get("status") == "True"
        for c in (conditions if isinstance(conditions, list) else ())
    ):
        return False
    if status.get("admission"):
        return True
    spec = workload.get("spec")
    active = spec.get("active", True) if isinstance(spec, dict) else True
    return active is not False and bool(status.get("resourceRequests"))


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
