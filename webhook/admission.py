"""Admission decisions: an AdmissionReview body in, an AdmissionReview response out.

Two endpoints. `MUTATE_PATH` converts pods that ask for device-plugin GPU resources to
DRA claims (``convert.py``) under their namespace's tenant rules; `VALIDATE_CLAIMS_PATH`
holds hand-written ResourceClaims and ResourceClaimTemplates to the same rules and to
the driver's config parser (``validate.py``). Both read the tenant rules from the
in-memory `TenantState`, so a decision is computation over the request and that view.

A pod in a namespace whose tenant limits devices per pod is counted whole: besides the
converted claims, every ResourceClaim and template it refers to is read through the
injected `ClaimReader` and counted (``tenant_rules.claim_devices``), so hand-written and
shared claims cannot add devices past the limit one claim at a time. The count is made
again when a claim is created in such a namespace, for every pod that will use it (those
naming it, and the pod a template's claim is generated for), the same way, device-plugin
resources included: a claim deleted and created again under its name with more devices,
while its pod waits to be scheduled, would otherwise give the pod what its admission
never counted.

The one write, creating the ResourceClaimTemplates a converted pod refers to, goes
through the injected `TemplateEnsurer`, which owns all API-server writes. Dry runs
create nothing: the dry-run flag is passed on to it. Nothing here knows HTTP: a body
that is not a usable review raises `ReviewError`, which the transport answers with 400.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import anyio
from gpudra.api import jsonbytes
from gpudra.api.configcache import ConfigCache
from gpudra.api.names import POD_CLAIM_NAME_ANNOTATION, is_dns_label, is_dns_subdomain
from gpudra.api.tenants import LabelSelector, excluded_namespaces
from gpudra.webhook.convert import (
    DEFAULT_POLICY,
    OPT_OUT_LABEL,
    Conversion,
    ConversionError,
    ConversionPolicy,
    convert_pod,
    generated_template_name,
)
from gpudra.webhook.extended_resources import extended_resource_claim, fills_extended_resources
from gpudra.webhook.metrics import WebhookMetrics
from gpudra.webhook.owners import api_group, controller_of
from gpudra.webhook.reviews import (
    AdmissionRequest,
    AdmissionResponse,
    ResourceKind,
    ReviewError,
    allow,
    deny,
    parse_review,
)
from gpudra.webhook.tenant_rules import (
    Lookup,
    ReferencedClaim,
    StoredClaim,
    TenantRules,
    claim_devices,
    device_counts,
    pod_devices,
    rules_view,
)
from gpudra.webhook.tenant_state import TenantState
from gpudra.webhook.validate import ClaimVerdict, ClassConfigs, driver_classes
from gpudra.webhook.verdicts import ClaimJudge

__all__ = [
    "MUTATE_PATH",
    "VALIDATE_CLAIMS_PATH",
    "Admission",
    "ClaimReader",
    "Decision",
    "ReviewHandler",
    "TemplateEnsurer",
]

logger = logging.getLogger(__name__)

MUTATE_PATH: Final = "/mutate-pods"
VALIDATE_CLAIMS_PATH: Final = "/validate-claims"
POD: Final = ResourceKind("", "v1", "Pod")
CLAIM: Final = ResourceKind("resource.k8s.io", "v1", "ResourceClaim")
CLAIM_TEMPLATE: Final = ResourceKind("resource.k8s.io", "v1", "ResourceClaimTemplate")


class TemplateEnsurer(Protocol):
    """Makes sure the ResourceClaimTemplates a converted pod refers to exist.

    Called before the patch is returned, so the controller-manager finds the template
    when it creates the pod's claim. The templates carry no namespace: they belong in
    `namespace`, and one that already exists under the name is reused (a name always
    stands for the same content). With ``dry_run`` it must not write anything. Raising (or
    exceeding the admission's ``ensure_timeout``) denies the pod.
    """

    async def __call__(
        self, namespace: str, templates: Sequence[Mapping[str, Any]], dry_run: bool
    ) -> None: ...


class ClaimReader(Protocol):
    """Reads what counting a pod's devices needs: its claims and templates, and pods.

    `kind` is ``ResourceClaim`` or ``ResourceClaimTemplate``; the answer is its
    ResourceClaimSpec (a template's ``spec.spec``) and whether the claim is allocated,
    or None when there is no such object.
    `pods` lists the namespace's pods that have not terminated and that its filter
    keeps, to find those that will use a claim being created (the filter bounds what a
    namespace of many pods makes the webhook hold); `namespace_labels` reads a namespace
    the tenant view has not seen yet (None: there is no such namespace);
    `claims_made_for` names the claims the resourceclaim controller made for the
    template entries of the pods whose UIDs it is given (controlled by the pod,
    annotated with the entry's name), by pod UID and then entry, in one read however
    many pods there are;
    `workloads_admitted_with` names the Kueue Workloads of the namespace admitted, and
    not finished, with pods that refer to a template of that name (none where Kueue is
    not installed).
    """

    async def __call__(self, namespace: str, kind: str, name: str) -> StoredClaim | None: ...

    async def claims_made_for(
        self, namespace: str, pod_uids: Collection[str]
    ) -> Mapping[str, Mapping[str, Sequence[str]]]: ...

    async def namespace_labels(self, namespace: str) -> Mapping[str, str] | None: ...

    async def pods(
        self, namespace: str, keep: Callable[[Mapping[str, Any]], bool]
    ) -> Sequence[Mapping[str, Any]]: ...

    async def workloads_admitted_with(self, namespace: str, template: str) -> Sequence[str]: ...


@dataclass(frozen=True)
class Decision:
    """The answer to one review, and how it went for the requests metric."""

    response: AdmissionResponse
    result: str
    """``allowed`` (unchanged), ``patched`` or ``denied``."""


ReviewHandler = Callable[[bytes], Awaitable[Decision]]
"""One endpoint: an AdmissionReview body in, a decision out; raises `ReviewError`."""

READS_AT_ONCE: Final = 16
"""Claims a pod's admission reads again at the same time (`Admission._changed_since`)."""

MAX_CLAIM_USERS: Final = 256
"""Pods a claim's admission counts (`Admission._users_over_limit`): past it, denied.

A tenant decides how many pods name a claim, and each is counted whole, so the work of
one claim's creation grows with them. Kubernetes reserves a claim for at most 256 pods
at a time (``status.reservedFor``, which it may raise but never lower), so a workload
that shares one claim, a Deployment's replicas say, never runs more than that on it;
pods past it wait unscheduled until some of the others end. Counting as many as
Kubernetes can run keeps every working use; a tenant's thousands of pending pods
naming one claim are refused before any of them is counted."""

MAX_CLAIM_USERS_BYTES: Final = 32 * 2**20
"""The JSON of the pods a claim's admission counts, at most (`_ClaimUsers`): past it,
denied. A tenant decides how large its pods are (up to what the API server stores, some
1.5 MiB each), and parsed JSON takes up to about 14 times its size, so the pods are kept
as their JSON, within this bound, and parsed one at a time as each is counted. 256 pods
of 128 KiB each fit; real pods are a few KiB."""


@dataclass(slots=True)
class _ClaimsRead:
    """What one admission read to count devices: each claim and template by kind and
    name, as read (None: not there), and the deadline all its reads share.

    One per admission, however many pods it counts (`Admission._users_over_limit`): an
    object many of them name is read once, and a tenant whose pods name many objects
    cannot make one admission read past its deadline, pod after pod."""

    deadline: float
    read: dict[tuple[str, str], StoredClaim | None] = field(default_factory=dict)

    def claims(self) -> dict[str, StoredClaim | None]:
        """The ResourceClaims read, by name."""
        return {name: stored for (kind, name), stored in self.read.items() if kind == CLAIM.kind}


class Admission:
    """The webhook's endpoints over the conversion policy and the tenant view."""

    def __init__(
        self,
        ensure_templates: TemplateEnsurer,
        metrics: WebhookMetrics,
        *,
        policy: ConversionPolicy = DEFAULT_POLICY,
        extra_device_classes: Sequence[str] = (),
        tenants: TenantState | None = None,
        ensure_timeout: float = 5.0,
        device_classes: Mapping[str, ClassConfigs] | None = None,
        read_claims: ClaimReader | None = None,
        own_namespace: str = "gpudra",
        configs: ConfigCache | None = None,
        conversion_selector: LabelSelector | None = None,
    ) -> None:
        self._ensure = ensure_templates
        self._metrics = metrics
        self._policy = policy
        self._classes = driver_classes(policy, extra_device_classes)
        self._tenants = tenants
        self._ensure_timeout = ensure_timeout
        self._read_claims = read_claims
        self._excluded = excluded_namespaces(own_namespace)
        # Claims repeat their templates' configs: each is validated once (configcache).
        self._configs = configs if configs is not None else ConfigCache()
        # And their specs: each allowed one is judged once under the same rules and
        # DeviceClasses (`device_classes` is a live view, read at each decision).
        self._claims = ClaimJudge(policy, self._classes, device_classes, self._configs.parse)
        # The same view says which native resources a stored class maps (`_stored_natives`);
        # those it does not, as last logged, so each change is logged once, not per pod.
        self._device_classes: Mapping[str, ClassConfigs] = (
            device_classes if device_classes is not None else {}
        )
        self._unmapped: frozenset[str] = frozenset()
        # Evaluated here only with the tenant view, which watches the Namespaces; without
        # it the registration's namespaceSelector narrows instead (`registration`).
        self._conversion_selector = conversion_selector if tenants is not None else None

    def endpoints(self) -> dict[str, ReviewHandler]:
        """Path -> handler, for the transport to route to."""
        return {MUTATE_PATH: self.mutate_pod, VALIDATE_CLAIMS_PATH: self.validate_claim}

    async def mutate_pod(self, body: bytes) -> Decision:
        """Convert a pod's device-plugin GPU resources to DRA claims (or deny it)."""
        request = parse_review(body, (POD,))
        uid = request["uid"]
        if request.get("operation", "CREATE") != "CREATE":
            return Decision(allow(uid), "allowed")
        pod, namespace = _pod_and_namespace(request)
        dry_run = request.get("dryRun", False)
        fields = {"uid": uid, "namespace": namespace, "dry_run": dry_run}
        if namespace in self._excluded:
            # The registration never sends these: nothing is converted or written here.
            logger.warning("review for an excluded namespace ignored", extra={"fields": fields})
            return Decision(allow(uid), "allowed")
        lookup = self._lookup(namespace)
        policy = self._stored_natives(
            lookup.rules.policy if lookup and lookup.rules else self._policy
        )
        refused: ConversionError | None = None
        try:
            conversion = convert_pod(pod, policy)
        except ConversionError as exc:
            # Not a refusal yet: a namespace the migration leaves out keeps its pods'
            # device-plugin requests, whether or not gpudra could convert them.
            conversion, refused = Conversion(skipped="not convertible"), exc
        if conversion.changed or refused is not None:
            problem = "it was not found"
            try:
                with anyio.fail_after(self._ensure_timeout):
                    selected = await self._converts_in(namespace)
            except Exception as exc:
                logger.warning(
                    "could not read a namespace", exc_info=True, extra={"fields": fields}
                )
                selected = None
                problem = _unanswered(exc)
            if selected is None:
                message = (
                    f"could not read the labels of namespace {namespace} ({problem}), which "
                    "say whether its pods are converted (webhook.conversion.namespaceSelector); "
                    "retry in a few seconds"
                )
                logger.info("denied pod", extra={"fields": {**fields, "error": message}})
                return self._deny(uid, 403, message, "not_ready")
            if not selected:
                conversion = Conversion(skipped="namespace not selected for conversion")
                refused = None
        if refused is not None:
            logger.info("denied pod", extra={"fields": {**fields, "error": str(refused)}})
            return self._deny(uid, 400, str(refused), "invalid")
        if lookup is not None:
            view = conversion
            if (lookup.rules or lookup.denial) and (
                policy.native_resources or not conversion.changed
            ):
                try:
                    view = _rules_view(pod, policy, patched=conversion.changed)
                except ConversionError as exc:
                    logger.info("denied pod", extra={"fields": {**fields, "error": str(exc)}})
                    return self._deny(uid, 400, str(exc), "invalid")
            reason = await self._tenant_denial(lookup, pod, view, namespace, dry_run)
            if reason:
                logger.info("denied pod", extra={"fields": {**fields, "error": reason}})
                return self._deny(uid, 403, reason, "tenant")
        if not conversion.changed:
            return Decision(allow(uid), "allowed")
        if conversion.templates:
            failure = await self._ensure_templates(namespace, conversion, dry_run, fields)
            if failure:
                return self._deny(uid, 500, failure, "templates")
        metrics = self._metrics
        metrics.inc(metrics.conversions, "true" if dry_run else "false")
        for claim in conversion.claims:
            metrics.inc(metrics.converted_claims, claim.kind.value)
        logger.info(
            "converted pod",
            extra={"fields": {**fields, "claims": [c.template_name for c in conversion.claims]}},
        )
        warnings = [
            f"gpudra: converted device-plugin GPU resources to DRA claim {c.pod_claim_name} "
            f"(template {c.template_name}, {c.devices} device(s))"
            for c in conversion.claims
        ]
        return Decision(allow(uid, patch=conversion.patch, warnings=warnings), "patched")

    def _stored_natives(self, policy: ConversionPolicy) -> ConversionPolicy:
        """`policy` with only the native resources a stored DeviceClass of the driver maps.

        `--extended-resource-name` says the chart set a class's extendedResourceName, not
        that the API server kept it: with its DRAExtendedResource gate off (the default of
        Kubernetes 1.34 and 1.35) it drops the field on write, the scheduler then serves no
        pod by that name, and a pod left unconverted would wait forever with nothing said.
        So a resource is left to the scheduler only while a stored class carries it;
        otherwise its pods are converted like any other (and the tenant rules count them
        as converted), and the change is logged once.
        """
        configured = policy.native_resources
        if not configured:
            return policy
        stored = {
            found.extended_resource_name
            for name in self._classes
            if (found := self._device_classes.get(name)) is not None
        }
        served = configured.intersection(stored)
        unmapped = configured - served
        if unmapped != self._unmapped:
            self._log_mapping(unmapped, policy.gpu_class)
        return policy if not unmapped else dataclasses.replace(policy, native_resources=served)

    def _log_mapping(self, unmapped: frozenset[str], device_class: str) -> None:
        """Say which native resources just lost, or found, a stored class that maps them."""
        for resource in sorted(unmapped - self._unmapped):
            logger.warning(
                "no stored DeviceClass maps an extended resource the webhook was told a class "
                "maps: its pods are converted to claims instead of left to the scheduler, "
                "which would serve them nothing. The API server drops "
                "spec.extendedResourceName while its DRAExtendedResource feature gate is off "
                "(the default on Kubernetes 1.34 and 1.35): enable DRAExtendedResource on the "
                "API server and the scheduler and apply the class again (helm upgrade), or "
                "unset deviceClasses.gpu.extendedResourceName",
                extra={"fields": {"device_class": device_class, "resource": resource}},
            )
        for resource in sorted(self._unmapped - unmapped):
            logger.info(
                "a stored DeviceClass maps the extended resource: its pods are left to the "
                "scheduler",
                extra={"fields": {"resource": resource}},
            )
        self._unmapped = unmapped

    async def validate_claim(self, body: bytes) -> Decision:
        """Hand-written ResourceClaims and templates: tenant rules and opaque configs."""
        request = parse_review(body, (CLAIM, CLAIM_TEMPLATE))
        uid = request["uid"]
        if request.get("operation", "CREATE") != "CREATE":
            return Decision(allow(uid), "allowed")
        obj = request.get("object")
        if not isinstance(obj, dict):
            raise ReviewError("request.object is required")
        namespace = _namespace_of(request, obj)
        lookup = self._lookup(namespace)
        kind = request["kind"]["kind"]
        if kind == CLAIM_TEMPLATE.kind:
            policy = lookup.rules.policy if lookup and lookup.rules else self._policy
            forged = _forged_template(obj, policy)
            if forged:
                logger.info(
                    "denied claim",
                    extra={"fields": {"uid": uid, "namespace": namespace, "error": forged}},
                )
                return self._deny(uid, 403, forged, "tenant")
        if kind == CLAIM_TEMPLATE.kind:
            swapped = await self._admitted_with(obj, namespace)
            if swapped:
                logger.info(
                    "denied claim",
                    extra={"fields": {"uid": uid, "namespace": namespace, "error": swapped}},
                )
                return self._deny(uid, 403, swapped, "kueue")
        verdict = self._claims.judge(
            obj,
            template=kind == CLAIM_TEMPLATE.kind,
            rules=lookup.rules if lookup is not None else None,
            denial=lookup.denial if lookup is not None else "",
        )
        if verdict.allowed and kind == CLAIM.kind and lookup is not None and lookup.rules:
            reason = self._group_claim(lookup.rules, obj) or await self._users_over_limit(
                lookup.rules, obj, namespace
            )
            if reason:
                name = verdict.name or "(generated name)"
                message = f"{kind} {name}: {reason}"
                logger.info(
                    "denied claim",
                    extra={"fields": {"uid": uid, "namespace": namespace, "error": message}},
                )
                return self._deny(uid, 403, message, "tenant")
        if verdict.allowed:
            return Decision(allow(uid), "allowed")
        name = verdict.name or "(generated name)"
        message = f"{kind} {name}: {verdict.message}"
        logger.info(
            "denied claim",
            extra={"fields": {"uid": uid, "namespace": namespace, "error": message}},
        )
        if verdict.invalid:
            return self._deny(uid, 400, message, "invalid_config")
        return self._deny(uid, 403, message, "tenant")

    async def _admitted_with(self, template: Mapping[str, Any], namespace: str) -> str | None:
        """Why a ResourceClaimTemplate of the driver's devices may not be created under
        its name now: a Kueue Workload was admitted with pods that refer to that name.

        Kueue charges a Workload for its templates when it admits it, and never again
        (kubernetes-sigs/kueue#13842): a template deleted after admission and created
        again asking for more would give every pod created afterwards devices Kueue did
        not charge. Fails closed, like the other reads: a list that fails denies, and
        the API server's retry reads again.
        """
        name = (template.get("metadata") or {}).get("name")
        spec = template.get("spec")
        if not name or not claim_devices(
            spec.get("spec") if isinstance(spec, Mapping) else None, self._classes
        ):
            return None
        heading = f"{CLAIM_TEMPLATE.kind} {name}"
        if self._read_claims is None:
            return None
        try:
            with anyio.fail_after(self._ensure_timeout):
                admitted = await self._read_claims.workloads_admitted_with(namespace, str(name))
        except Exception as exc:
            logger.warning(
                "could not list Kueue Workloads",
                exc_info=True,
                extra={"fields": {"namespace": namespace, "template": name}},
            )
            return (
                f"{heading}: could not list the namespace's Kueue Workloads, which say "
                f"whether one was admitted with this template: {_unanswered(exc)}; retry"
            )
        if not admitted:
            return None
        return (
            f"{heading}: Kueue Workload {', '.join(sorted(admitted))} was admitted or counted "
            "for admission with pods that use a template of this name, and Kueue does not "
            "read a template again once it counted it: its pods would get devices the queue "
            "did not count. Create it "
            "before the job, under another name, or once the job has finished or been "
            "deleted (docs/kueue.md)"
        )

    async def _converts_in(self, namespace: str) -> bool | None:
        """Whether pods of `namespace` are converted; None when its labels are unknown.

        Pods of namespaces the conversion selector leaves out keep their device-plugin
        requests and get the tenant rules like pods that opt out; a forged review for
        one makes the webhook write no template there. A namespace the tenant view has
        not seen yet (made a moment ago) is read from the API server.
        """
        selector = self._conversion_selector
        if selector is None:
            return True
        assert self._tenants is not None  # the selector is kept only with the tenant view
        labels = self._tenants.namespace_labels(namespace)
        if labels is None and self._read_claims is not None:
            labels = await self._read_claims.namespace_labels(namespace)
        return None if labels is None else selector.matches(labels)

    def _lookup(self, namespace: str) -> Lookup | None:
        return self._tenants.lookup(namespace) if self._tenants is not None else None

    async def _tenant_denial(
        self,
        lookup: Lookup,
        pod: Mapping[str, Any],
        conversion: Conversion,
        namespace: str,
        dry_run: bool,
    ) -> str | None:
        """`conversion` is the rules' view of the pod (`rules_view`), patched or not.

        The claim the scheduler will create for the pod's DRA extended resources
        (`extended_resources`) is judged as a claim and counted with the pod's others.
        """
        extended = extended_resource_claim(pod, self._classes)
        if lookup.denial:
            if conversion.claims or extended:
                return lookup.denial
            # Claims the pod names by hand: denied where any asks for the driver's
            # devices, or cannot be read to tell (rules unknown: nothing unchecked).
            found = await self._referenced(
                lookup.denial, pod, namespace, dry_run, self._start_reads()
            )
            return lookup.denial if isinstance(found, str) or found else None
        if lookup.rules is None:
            return None
        # Every hand-written claim the pod names is judged again under today's rules
        # (one stored before its namespace got them, or before they were tightened, is
        # not handed to a new pod), and counted with the pod's other devices.
        counted = lookup.rules.tenant.spec.max_devices_per_pod is not None
        heading = _limit(lookup.rules) if counted else lookup.rules.label
        reads = self._start_reads()
        found = await self._referenced(
            heading, pod, namespace, dry_run, reads, rules=lookup.rules, count=counted
        )
        if isinstance(found, str):
            return found
        referenced = found
        if extended is not None:
            verdict = self._judge({"spec": extended.spec}, lookup.rules)
            if not verdict.allowed:
                return (
                    f"the ResourceClaim the scheduler would create for this pod's extended "
                    f"resources breaks its namespace's rules: {verdict.message} (its "
                    f"requests: {extended.asked})"
                )
            devices = claim_devices(extended.spec, self._classes)
            referenced.append(ReferencedClaim(EXTENDED_RESOURCES, extended.asked, devices))
        denial = None
        if conversion.claims or referenced:
            assert self._tenants is not None  # a lookup comes from it
            usage = self._tenants.quota_usage(namespace) if conversion.claims else None
            denial = lookup.rules.check_pod(conversion, namespace, usage, referenced)
        if denial is None and counted and not dry_run:
            denial = await self._changed_since(heading, namespace, reads)
        return denial

    def _start_reads(self) -> _ClaimsRead:
        """The reads of an admission that begins now: they share one deadline."""
        return _ClaimsRead(anyio.current_time() + self._ensure_timeout)

    async def _changed_since(self, heading: str, namespace: str, reads: _ClaimsRead) -> str | None:
        """Why the pod's count may be wrong: a claim it names changed since it was read.

        A claim deleted and created again under its name after the pod's admission read
        it is judged at its own creation without this pod, which is not stored yet: it
        would be counted by neither. The claims are read one after another, so a pod
        naming hundreds would hold that window open for as long as those reads take.
        Read again all at once (`READS_AT_ONCE` at a time) once counted, the window
        left is that read and the rest of the pod's admission (docs/security.md). A
        claim's spec never changes in place, so a different one was created anew;
        allocated since or not, an unchanged claim counts the same.
        """
        reader = self._read_claims
        claims = reads.claims()
        if not claims or reader is None:
            return None
        limiter = anyio.CapacityLimiter(READS_AT_ONCE)
        changed: list[str] = []

        async def again(name: str, before: StoredClaim | None) -> None:
            async with limiter:
                now = await reader(namespace, CLAIM.kind, name)
            if (None if now is None else now.spec) != (None if before is None else before.spec):
                changed.append(name)

        try:
            with anyio.fail_at(reads.deadline):
                async with anyio.create_task_group() as group:
                    for name, before in claims.items():
                        group.start_soon(again, name, before)
        except Exception as exc:
            return _uncounted(heading, "read the pod's claims again", exc, namespace)
        if changed:
            names = ", ".join(sorted(changed))
            return (
                f"{heading}; ResourceClaim {names} was deleted and created again while the "
                "pod was admitted, so its devices were not counted as they are now; retry"
            )
        return None

    def _judge(self, claim: Mapping[str, Any], rules: TenantRules) -> ClaimVerdict:
        """A claim the pod's admission met (one it names, the one the scheduler will make
        for it) judged under `rules` as the claim's own admission judges it."""
        return self._claims.judge(claim, template=False, rules=rules)

    def _group_claim(self, rules: TenantRules, claim: Mapping[str, Any]) -> str | None:
        """Why a claim of the driver's devices may not be created as a PodGroup's.

        Kubernetes 1.36 (``DRAWorkloadResourceClaims``) hands a pod of a PodGroup whose
        template entry matches one of the group's ``spec.resourceClaims`` the group's
        claim: made from the template with the PodGroup as its controlling owner, and
        recorded in the PodGroup's status, not the pod's. What ties a claim to a pod here
        (`_entry_filled_by`, the pod's own status) never links it to the pods that use
        it, so ``maxDevicesPerPod`` would not count it with them (a template created
        again smaller before a later pod joins lends it room), and a claim made under
        looser rules would be handed to new pods unjudged. Until a group's claim is
        counted with the group's pods it is refused where a GpuTenant governs: without
        it the group's pods do not start, so nothing escapes.
        """
        owner = controller_of(claim)
        if owner is None or (api_group(owner), owner.get("kind")) != POD_GROUP:
            return None
        if not claim_devices(claim.get("spec"), self._classes):
            return None
        return (
            f"{rules.label}: its controlling owner is PodGroup {owner.get('name')} "
            f"({owner.get('apiVersion')}), and a PodGroup's claim is shared by the group's "
            "pods and recorded in the PodGroup's status, not theirs, so it can be neither "
            "counted with each pod under maxDevicesPerPod nor judged again for each pod; "
            "leave the entry out of the PodGroup's spec.resourceClaims so that each pod "
            "gets its own claim, from the template its spec.resourceClaims names, or run "
            "the workload in a namespace no GpuTenant governs"
        )

    async def _users_over_limit(
        self, rules: TenantRules, claim: Mapping[str, Any], namespace: str
    ) -> str | None:
        """Why a claim being created would give a pod more devices than its tenant allows.

        The pods that will use it are those naming it and, for a claim generated from a
        template, the pod that owns it; each is counted whole with this claim's devices
        in place of the entry it fills, as its own admission counted it: its claims, and
        the device-plugin resources it keeps (the rules' view of it as stored, which the
        webhook did not patch: `_rules_view`), so a pod admitted with ``nvidia.com/gpu``
        beside a claim of no GPU cannot have that claim created again with one. The
        native resources the scheduler's claim for the pod holds are counted there, not
        twice. Fails closed: pods that cannot be listed deny. Only the pods that use the
        claim are kept of the list (`ClaimReader.pods`), which the claims created at the
        same time share (``templates.ApiClaimReader.pods`` says how, and why that still
        sees every pod stored before this admission began). The claims made for the
        template entries their statuses do not name yet are read once for all of them
        (`ClaimReader.claims_made_for`), and only where one has such an entry: a tenant
        decides how many pods use a claim, and a read per pod would list the namespace's
        claims that many times. For the same reason the admission's reads, the lists
        included, share one deadline and read each object once however many pods name
        it (`_ClaimsRead`), and more than `MAX_CLAIM_USERS` pods deny.
        """
        limit = rules.tenant.spec.max_devices_per_pod
        if limit is None:
            return None
        devices = claim_devices(claim.get("spec"), self._classes)
        if not devices:
            return None
        heading = _limit(rules)
        if self._read_claims is None:
            return f"{heading}, and this webhook cannot read the pods that use this claim"
        reads = self._start_reads()
        kept = _ClaimUsers(claim)
        try:
            with anyio.fail_at(reads.deadline):
                await self._read_claims.pods(namespace, kept.keep)
        except Exception as exc:
            logger.warning(
                "could not list pods", exc_info=True, extra={"fields": {"namespace": namespace}}
            )
            reason = _unanswered(exc)
            return f"{heading}; could not list the pods that use this claim: {reason}; retry"
        if kept.count > MAX_CLAIM_USERS:
            return (
                f"{heading}, and {kept.count} pods use this claim, more than the "
                f"{MAX_CLAIM_USERS} its creation counts devices for (Kubernetes reserves a "
                f"claim for at most {MAX_CLAIM_USERS} pods at a time); delete pods that name "
                f"it until no more than {MAX_CLAIM_USERS} do, or give each pod its own claim "
                "from a ResourceClaimTemplate, then create it again"
            )
        if kept.size > MAX_CLAIM_USERS_BYTES:
            return (
                f"{heading}, and the {kept.count} pods that use this claim hold more than "
                f"{MAX_CLAIM_USERS_BYTES // 2**20} MiB of JSON, more than its creation reads "
                "to count their devices; make those pods smaller (or fewer), then create the "
                "claim again"
            )
        made: Mapping[str, Mapping[str, Sequence[str]]] = {}
        if kept.awaiting:
            try:
                with anyio.fail_at(reads.deadline):
                    made = await self._read_claims.claims_made_for(namespace, kept.awaiting)
            except Exception as exc:
                what = "list the claims made for the pod"
                return _uncounted(heading, what, exc, namespace)
        policy = self._stored_natives(rules.policy)
        for pod, entry in kept.users():
            if anyio.current_time() >= reads.deadline:
                # Objects read once, what is left is each pod's entries: bounded alike.
                what = f"read what pod {_name_of(pod)} names"
                return _uncounted(heading, what, TimeoutError(), namespace)
            found = await self._referenced(
                heading,
                pod,
                namespace,
                dry_run=False,
                reads=reads,
                filled=(entry, devices),
                claims_made=made.get(_uid_of(pod) or "", {}),
            )
            if isinstance(found, str):
                return found
            try:
                view = _rules_view(
                    pod, policy, patched=False, natives=not any(r.scheduled for r in found)
                )
            except ConversionError as exc:
                return (
                    f"{heading}, and pod {_name_of(pod)} uses this claim, but its "
                    f"device-plugin resources cannot be counted: {exc}; delete the pod first"
                )
            total = pod_devices(view, found)
            if total > limit:
                return (
                    f"{heading}, and pod {_name_of(pod)} uses this claim: with its "
                    f"{devices} device(s) the pod would get {total} devices "
                    f"({device_counts(view, found)}); ask for fewer devices or delete the "
                    "pod first"
                )
        return None

    async def _referenced(
        self,
        heading: str,
        pod: Mapping[str, Any],
        namespace: str,
        dry_run: bool,
        reads: _ClaimsRead,
        filled: tuple[str, int] | None = None,
        rules: TenantRules | None = None,
        count: bool = True,
        claims_made: Mapping[str, Sequence[str]] | None = None,
    ) -> list[ReferencedClaim] | str:
        """The pod's own claims and templates with the driver's devices, with their
        device counts, or a denial starting with `heading` (the rule it is for).

        `filled` is a claim being created: the name of the pod's entry it fills and its
        device count, used instead of reading that entry; the pod's extended-resource
        claim is counted beside it (`_extended_devices`). For a stored pod (one
        `filled` is given for), a template entry the resourceclaim controller has
        already generated a claim for (the pod's ``status.resourceClaimStatuses``, or,
        for an entry missing there, a claim the pod controls that is annotated with the
        entry's name, `claims_made` by entry, read with its fellow users' by
        `_users_over_limit`: the controller applies the status of only the entries one
        pass made, which drops the others' from it) counts that claim, not the template
        stored under the name now: a template deleted and created again differently
        changes no claim already made from it.
        With `rules`, each claim named by hand is judged under them as at its own
        creation, quota included (a template's claims are, as they are created). Without
        `count` (no per-pod limit to count against) only that judgement is made:
        templates are not read, and a claim not created yet is left to its own
        admission. Each object is read once, and judged once, within the deadline of
        the admission's `reads`, which keeps what was read: a pod may name thousands,
        and a claim's admission counts every pod that uses it with the same `reads`.
        """
        spec = pod.get("spec")
        entries = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
        # Only a stored pod's status and UID are Kubernetes' own: at a pod's creation
        # the webhook sees them as the request sent them (the API server resets the
        # status after the mutating webhooks), and no claim can have been made for it.
        stored_pod = filled is not None
        generated = _generated_claims(pod) if count and stored_pod else {}
        awaiting = (
            _entries_awaiting_claims(pod, filled[0])
            if count and filled is not None
            else frozenset[int]()
        )
        result: list[ReferencedClaim] = []
        read = reads.read
        judged: set[tuple[str, str]] = set()
        usage = (
            self._tenants.quota_usage(namespace)
            if rules is not None and self._tenants is not None
            else None
        )

        async def load(reference: tuple[str, str], pod_claim: str) -> StoredClaim | str | None:
            """The stored object, None where there is none, or the denial."""
            if reference in read:
                return read[reference]
            source = f"{reference[0]} {reference[1]}"
            if self._read_claims is None:
                return f"{heading}, and this webhook cannot read pod claim {pod_claim} ({source})"
            try:
                with anyio.fail_at(reads.deadline):
                    read[reference] = await self._read_claims(namespace, *reference)
            except Exception as exc:
                return _uncounted(heading, f"read {source}", exc, namespace)
            return read[reference]

        async def made_for(pod_claim: str) -> str | None:
            """The claim made for template entry `pod_claim` that the pod's status does
            not name, or a denial; of several, the one with the most devices."""
            best: tuple[int, str] | None = None
            for name in (claims_made or {}).get(pod_claim, ()):
                stored = await load((CLAIM.kind, name), pod_claim)
                if isinstance(stored, str):
                    raise _Unreadable(stored)
                if stored is not None:
                    devices = claim_devices(stored.spec, self._classes)
                    best = max(best or (devices, name), (devices, name))
            return best[1] if best is not None else None

        for index, entry in enumerate(entries if isinstance(entries, list) else ()):
            if not isinstance(entry, Mapping):
                continue
            reference = _reference(entry)
            if reference is None:
                continue
            kind, name = reference
            if not count and kind != CLAIM.kind:
                continue
            pod_claim = _pod_claim(entry, index)
            source = f"{kind} {name}"
            if filled is not None and entry.get("name") == filled[0]:
                result.append(ReferencedClaim(pod_claim, f"ResourceClaim {name} (new)", filled[1]))
                continue
            if not is_dns_subdomain(name):
                return f"spec.resourceClaims[{index}]: {source} is not a valid object name"
            made = generated.get(pod_claim) if kind == CLAIM_TEMPLATE.kind else None
            if index in awaiting:
                try:
                    made = await made_for(pod_claim)
                except _Unreadable as exc:
                    return str(exc)
            stored = await load((CLAIM.kind, made), pod_claim) if made is not None else None
            if isinstance(stored, StoredClaim):
                source = f"ResourceClaim {made} (generated from {source})"
            elif stored is None:
                stored = await load(reference, pod_claim)
            if isinstance(stored, str):
                return stored
            if stored is None:
                if dry_run or not count:
                    continue  # nothing is stored, and a dry run's templates do not exist
                return (
                    f"{heading}; pod claim {pod_claim} refers to {source}, which does not "
                    f"exist, so its devices cannot be counted: create it before the pod"
                )
            if rules is not None and kind == CLAIM.kind and reference not in judged:
                judged.add(reference)
                verdict = self._judge({"metadata": {"name": name}, "spec": stored.spec}, rules)
                why = (
                    verdict.message
                    if not verdict.allowed
                    else rules.stored_claim_over_quota(stored, namespace, usage)
                )
                if why:
                    return (
                        f"{rules.label}: pod claim {pod_claim} refers to {source}, which "
                        f"its namespace's rules do not allow now: {why}; "
                        "delete it and create one they allow"
                    )
            devices = claim_devices(stored.spec, self._classes)
            if devices:
                result.append(ReferencedClaim(pod_claim, source, devices))
        if filled is not None and filled[0] == EXTENDED_RESOURCES:
            result.append(
                ReferencedClaim(EXTENDED_RESOURCES, "the new claim", filled[1], scheduled=True)
            )
        elif filled is not None:
            extended = await self._extended_devices(pod, load)
            if isinstance(extended, str):
                return extended
            if extended is not None:
                result.append(extended)
        return result

    async def _extended_devices(
        self,
        pod: Mapping[str, Any],
        load: Callable[[tuple[str, str], str], Awaitable[StoredClaim | str | None]],
    ) -> ReferencedClaim | str | None:
        """The claim of the pod's DRA extended resources, counted beside a claim being
        created for one of its entries: the one the scheduler stored for it, or the one
        it would create (`extended_resource_claim`) while none is stored."""
        name = _extended_claim_name(pod)
        if name is not None:
            stored = await load((CLAIM.kind, name), EXTENDED_RESOURCES)
            if isinstance(stored, str):
                return stored
            if stored is not None:
                devices = claim_devices(stored.spec, self._classes)
                source = f"ResourceClaim {name}"
                if not devices:
                    return None
                return ReferencedClaim(EXTENDED_RESOURCES, source, devices, scheduled=True)
        extended = extended_resource_claim(pod, self._classes)
        if extended is None:
            return None
        devices = claim_devices(extended.spec, self._classes)
        return ReferencedClaim(EXTENDED_RESOURCES, extended.asked, devices) if devices else None

    async def _ensure_templates(
        self, namespace: str, conversion: Conversion, dry_run: bool, fields: dict[str, Any]
    ) -> str | None:
        """Create the pod's templates; the denial message when that failed."""
        try:
            with anyio.fail_after(self._ensure_timeout):
                await self._ensure(namespace, conversion.templates, dry_run)
        except Exception as exc:
            names = ", ".join(t["metadata"]["name"] for t in conversion.templates)
            logger.warning(
                "could not ensure ResourceClaimTemplates",
                exc_info=True,
                extra={"fields": {**fields, "templates": names}},
            )
            if isinstance(exc, TimeoutError):
                reason = f"no answer within {self._ensure_timeout:g}s"
            else:
                reason = str(exc) or type(exc).__name__
            return (
                f"could not create ResourceClaimTemplates {names} in namespace "
                f"{namespace}: {reason}; retry, or label the pod "
                f'{OPT_OUT_LABEL}="false" to skip conversion'
            )
        return None

    def _deny(self, uid: str, code: int, message: str, reason: str) -> Decision:
        self._metrics.inc(self._metrics.denials, reason)
        return Decision(deny(uid, code, message), "denied")


def _rules_view(
    pod: Mapping[str, Any], policy: ConversionPolicy, *, patched: bool, natives: bool = True
) -> Conversion:
    """What the tenant rules judge of `pod` (`rules_view`): its devices, however it asks.

    A pod the webhook does not patch (its namespace is not converted, it opts out, or it
    looks converted) keeps its device-plugin requests and the device plugin serves them,
    as it did before gpudra: no claim is made of them, so the limits only a claim has
    must not refuse it (more devices than one claim holds, a MIG resource whose profile
    gpudra cannot read). The tenant rules hold for it all the same (docs/security.md,
    guarantee 1), so nothing is left out of the view (`left_to_device_plugin`): every
    device it asks for counts against maxDevicesPerPod and the quota, and a MIG
    resource gpudra cannot read is a MIG device of the profile its name gives, of the
    MIG class, which no allowedMigProfiles can list: a tenant that restricts profiles
    refuses it, and one that does not counts it. A tenant cannot pass a device by
    asking for it under a name gpudra does not convert. What no pod may ask for (a
    count that is not a whole number) is still refused.

    Without `natives`, the native resources (`ConversionPolicy.native_resources`) are
    left out: the claim the scheduler made for the pod's extended resources holds those
    it serves through DRA and is counted instead. The claim the webhook builds as the
    scheduler would make it (`extended_resource_claim`) holds only the classes' implicit
    names, so beside it the view counts them.
    """
    if not patched:
        policy = dataclasses.replace(policy, left_to_device_plugin=True)
    if not natives:
        return convert_pod(pod, policy, every_pod=True)
    return rules_view(pod, policy)


def _limit(rules: TenantRules) -> str:
    """How denials under a tenant's per-pod device limit start."""
    return f"{rules.label}: maxDevicesPerPod is {rules.tenant.spec.max_devices_per_pod}"


def _reference(entry: Mapping[str, Any]) -> tuple[str, str] | None:
    """What a ``spec.resourceClaims`` entry refers to: (kind, name), or nothing."""
    claim = entry.get("resourceClaimName")
    if isinstance(claim, str) and claim:
        return CLAIM.kind, claim
    template = entry.get("resourceClaimTemplateName")
    if isinstance(template, str) and template:
        return CLAIM_TEMPLATE.kind, template
    return None


EXTENDED_RESOURCES: Final = "(extended resources)"
"""Stands for the claim of a pod's DRA extended resources in device counts and messages:
it fills no ``spec.resourceClaims`` entry."""


def _unanswered(exc: Exception) -> str:
    """Why a read of the API failed, for a denial: the first error of a group of reads."""
    while isinstance(exc, ExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return "no answer in time" if isinstance(exc, TimeoutError) else str(exc)


def _uncounted(heading: str, what: str, exc: Exception, namespace: str) -> str:
    """The denial, logged, of a pod whose devices a failed read (`what`) left uncounted:
    fail closed, and the API server's retry reads again."""
    logger.warning(
        "could not read what a pod's devices are counted from",
        exc_info=True,
        extra={"fields": {"namespace": namespace, "read": what}},
    )
    return f"{heading}; could not {what} to count its devices: {_unanswered(exc)}; retry"


class _Unreadable(Exception):
    """What a pod's devices could not be counted without: the denial, as its message."""


def _generated_claims(pod: Mapping[str, Any]) -> dict[str, str]:
    """The claims the resourceclaim controller generated for the pod's template entries,
    by entry name, from ``status.resourceClaimStatuses``: only Kubernetes writes it to a
    stored pod, so it is read only for one (never from a pod's create request)."""
    status = pod.get("status")
    statuses = status.get("resourceClaimStatuses") if isinstance(status, Mapping) else None
    found: dict[str, str] = {}
    for item in statuses if isinstance(statuses, list) else ():
        if not isinstance(item, Mapping):
            continue
        entry, claim = item.get("name"), item.get("resourceClaimName")
        if isinstance(entry, str) and isinstance(claim, str) and is_dns_subdomain(claim):
            found[entry] = claim
    return found


def _awaiting_claims(pod: Mapping[str, Any], filled: str) -> str | None:
    """The UID of a stored pod with entries awaiting claims (`_entries_awaiting_claims`)
    besides `filled` (the one a claim being created fills), whose count needs the claims
    made for them (`ClaimReader.claims_made_for`); None for any other pod."""
    return _uid_of(pod) if _entries_awaiting_claims(pod, filled) else None


def _entries_awaiting_claims(pod: Mapping[str, Any], filled: str) -> frozenset[int]:
    """Where in a stored pod's ``spec.resourceClaims`` the template entries are, other
    than `filled`, whose status names no claim generated for them (`_generated_claims`).

    Their counts take the claim the pod controls for the entry, when there is one: which
    pods need those claims read (`_awaiting_claims`) and which entries count them
    (`Admission._referenced`) is this one rule, so no pod is counted from claims never
    read for it.
    """
    generated = _generated_claims(pod)
    spec = pod.get("spec")
    entries = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
    awaiting: set[int] = set()
    for index, entry in enumerate(entries if isinstance(entries, list) else ()):
        if not isinstance(entry, Mapping) or entry.get("name") == filled:
            continue
        reference = _reference(entry)
        template = reference is not None and reference[0] == CLAIM_TEMPLATE.kind
        if template and _pod_claim(entry, index) not in generated:
            awaiting.add(index)
    return frozenset(awaiting)


def _pod_claim(entry: Mapping[str, Any], index: int) -> str:
    """How a ``spec.resourceClaims`` entry is named: its name, else its place."""
    return str(entry.get("name", f"spec.resourceClaims[{index}]"))


def _uid_of(pod: Mapping[str, Any]) -> str | None:
    """A pod's UID, None where it has none (a pod's create request may not)."""
    metadata = pod.get("metadata")
    uid = metadata.get("uid") if isinstance(metadata, Mapping) else None
    return uid if isinstance(uid, str) and uid else None


def _extended_claim_name(pod: Mapping[str, Any]) -> str | None:
    """The claim the scheduler stored for the pod's DRA extended resources, by name, from
    ``status.extendedResourceClaimStatus``; None before it made one."""
    status = pod.get("status")
    extended = status.get("extendedResourceClaimStatus") if isinstance(status, Mapping) else None
    name = extended.get("resourceClaimName") if isinstance(extended, Mapping) else None
    return name if isinstance(name, str) and is_dns_subdomain(name) else None


POD_GROUP: Final = ("scheduling.k8s.io", "PodGroup")
"""The API group and kind of Kubernetes' PodGroup, the controlling owner of the claims
made from a group's ``spec.resourceClaims`` (`Admission._group_claim`)."""


class _ClaimUsers:
    """The pods of a namespace that fill an entry with a claim being created, counted
    as the list goes by and kept as their JSON (within `MAX_CLAIM_USERS` pods and
    `MAX_CLAIM_USERS_BYTES`), not as the parsed objects: a tenant decides how large its
    pods are, and a parsed pod can take 14 times its JSON. `users` parses them again one
    at a time, so only the pod being counted is held whole. `awaiting`: the UIDs of those
    whose generated claims must be read (`_awaiting_claims`), told as they go by."""

    def __init__(self, claim: Mapping[str, Any]) -> None:
        self._claim = claim
        self._seen: set[str] = set()
        self._kept: dict[str, tuple[bytes, str]] = {}
        self.size = 0
        self.awaiting: set[str] = set()

    @property
    def count(self) -> int:
        """The user pods listed."""
        return len(self._seen)

    def keep(self, pod: Mapping[str, Any]) -> bool:
        """A `SharedLists` reader's keep: counts and encodes a user; keeps no object. By
        the pod's UID: a list its leader gave up is read again from the start (a pod seen
        only in the list given up still counts: the stricter way)."""
        entry = _entry_filled_by(pod, self._claim)
        if entry is None:
            return False
        key = _uid_of(pod) or _name_of(pod)
        self._seen.add(key)
        if key in self._kept:  # listed again: the later snapshot's
            self.size -= len(self._kept.pop(key)[0])
        if len(self._seen) <= MAX_CLAIM_USERS and self.size <= MAX_CLAIM_USERS_BYTES:
            data = jsonbytes.dumps(pod)
            self.size += len(data)
            self._kept[key] = (data, entry)
            if uid := _awaiting_claims(pod, entry):
                self.awaiting.add(uid)
        return False

    def users(self) -> Iterator[tuple[Mapping[str, Any], str]]:
        """Each user pod, parsed anew, with the entry the claim fills."""
        for data, entry in self._kept.values():
            yield jsonbytes.loads(data), entry


def _entry_filled_by(pod: Mapping[str, Any], claim: Mapping[str, Any]) -> str | None:
    """The name of `pod`'s claim entry that `claim` fills, or None when it fills none.

    A pod entry naming the claim is filled by it; so is the entry the annotation names
    when the pod owns the claim (the controller generated it from that entry's template).
    The claim the scheduler creates for the pod's extended resources fills no entry of
    its own: it is `EXTENDED_RESOURCES`, counted beside the entries.
    """
    if fills_extended_resources(claim, pod):
        return EXTENDED_RESOURCES
    spec = pod.get("spec")
    entries = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
    entries = [e for e in entries if isinstance(e, Mapping)] if isinstance(entries, list) else []
    metadata = claim.get("metadata")
    metadata = metadata if isinstance(metadata, Mapping) else {}
    name = metadata.get("name")
    for entry in entries:
        if name and entry.get("resourceClaimName") == name:
            return str(entry.get("name", ""))
    pod_meta = pod.get("metadata")
    uid = pod_meta.get("uid") if isinstance(pod_meta, Mapping) else None
    owners = metadata.get("ownerReferences")
    owned = uid is not None and any(
        isinstance(o, Mapping) and o.get("kind") == "Pod" and o.get("uid") == uid
        for o in (owners if isinstance(owners, list) else ())
    )
    annotations = metadata.get("annotations")
    wanted = (
        annotations.get(POD_CLAIM_NAME_ANNOTATION) if isinstance(annotations, Mapping) else None
    )
    if owned and wanted:
        for entry in entries:
            if entry.get("name") == wanted and entry.get("resourceClaimTemplateName"):
                return str(wanted)
    return None


def _name_of(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    return str(name) if name else "(unnamed)"


def _forged_template(obj: dict[str, Any], policy: ConversionPolicy) -> str | None:
    """Why a template under a name the conversion generates is not the conversion's.

    Converted pods refer to templates by generated name, so a name in that space is bound
    to the one content the conversion writes for it; anything else there would be used
    in place of what the tenant check counted.
    """
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    prefix = f"{policy.name_prefix}-"
    if not isinstance(name, str) or not name.startswith(prefix):
        return None
    spec = obj.get("spec")
    inner = spec.get("spec") if isinstance(spec, dict) else None
    if generated_template_name(inner, policy) == name:
        return None
    return (
        f"ResourceClaimTemplate {name}: names starting with {prefix} are reserved for the "
        "templates gpudra generates for converted pods, and this content is not the one "
        "gpudra writes under that name; choose a name without that prefix"
    )


def _pod_and_namespace(request: AdmissionRequest) -> tuple[dict[str, Any], str]:
    """The pod under review and its namespace (the request's, else the pod's own)."""
    pod = request.get("object")
    if not isinstance(pod, dict):
        raise ReviewError("request.object must be the Pod being admitted")
    return pod, _namespace_of(request, pod)


def _namespace_of(request: AdmissionRequest, obj: Mapping[str, Any]) -> str:
    """The namespace a review is about: the request's, else the object's own, which must
    agree, and a valid namespace name. The API server always sends one; a forged review
    with a path in it (``x/../kube-system``) would otherwise reach the webhook's own reads
    and writes as part of a URL."""
    metadata = obj.get("metadata")
    own = metadata.get("namespace") if isinstance(metadata, Mapping) else None
    namespace = request.get("namespace") or own
    if not isinstance(namespace, str) or not namespace:
        raise ReviewError("request.namespace is missing")
    if not is_dns_label(namespace):
        raise ReviewError(f"request.namespace {namespace[:70]!r} is not a namespace name")
    if own not in (None, "", namespace):
        raise ReviewError(
            f"request.namespace {namespace!r} and the object's metadata.namespace differ"
        )
    return namespace
