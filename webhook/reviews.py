"""AdmissionReview shapes (admission.k8s.io/v1), typed, and their parsing and encoding.

The API server's body is checked once here, field by field, and handed on as a typed
`AdmissionRequest`: the admission code then reads fields the type checker knows, instead
of guarding every ``dict[str, Any]`` lookup. A body that is not a usable review raises
`ReviewError` with a message naming the field and the fix; the transport answers it
with HTTP 400. Only the fields the webhook reads are typed; the rest pass through
unchecked.
"""

from __future__ import annotations

import base64
from collections.abc import Collection, Sequence
from typing import Any, Final, Literal, NamedTuple, NotRequired, TypedDict, cast

from gpudra.api import jsonbytes

__all__ = [
    "ADMISSION_API_VERSION",
    "AdmissionRequest",
    "AdmissionResponse",
    "GroupVersionKind",
    "ResourceKind",
    "ReviewError",
    "Status",
    "allow",
    "deny",
    "encode_review",
    "parse_review",
]

ADMISSION_API_VERSION: Final = "admission.k8s.io/v1"
_REASONS: Final = {400: "BadRequest", 403: "Forbidden"}
AS_GO_MAX_BYTES: Final = 64 * 1024
"""The largest review read the slower way where orjson refuses it (`jsonbytes.loads`):
what the API server keeps raw in a claim (an unpaired surrogate, invalid UTF-8, nesting
past 1024 levels) is then judged by what it says, with the field named. The typed
fields of a pod or claim the API server always writes as valid UTF-8, so only such a
claim's opaque parameters, at most 10 KiB each, ever need it. Not past this size: a
body comes from whoever reaches the port, and one made to fail orjson at its end buys
about ten times the CPU of a review its size; a larger one is refused unread (400)."""


class ResourceKind(NamedTuple):
    """The (group, version, kind) an endpoint admits; the core group is ""."""

    group: str
    version: str
    kind: str

    def __str__(self) -> str:
        return f"{self.group or 'core'}/{self.version} {self.kind}"


class GroupVersionKind(TypedDict):
    group: str
    version: str
    kind: str


class AdmissionRequest(TypedDict):
    """``request`` of an AdmissionReview: the fields the webhook reads."""

    uid: str
    kind: GroupVersionKind
    namespace: NotRequired[str]
    operation: NotRequired[str]
    object: NotRequired[object]
    """The object being admitted: any JSON value until its endpoint checks it."""
    dryRun: NotRequired[bool]


class Status(TypedDict):
    status: Literal["Failure"]
    code: int
    reason: str
    message: str


class AdmissionResponse(TypedDict):
    """``response`` of an AdmissionReview."""

    uid: str
    allowed: bool
    status: NotRequired[Status]
    patchType: NotRequired[Literal["JSONPatch"]]
    patch: NotRequired[str]
    """The JSON patch, base64-encoded."""
    warnings: NotRequired[list[str]]


class ReviewError(ValueError):
    """A body that is not a usable AdmissionReview for the endpoint (HTTP 400)."""


def parse_review(body: bytes, kinds: Collection[ResourceKind]) -> AdmissionRequest:
    """The request of an AdmissionReview body for one of `kinds`, its fields checked."""
    try:
        review = jsonbytes.loads(body, as_go=len(body) <= AS_GO_MAX_BYTES)
    except jsonbytes.DecodeError as exc:
        raise ReviewError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(review, dict):
        raise ReviewError("request body must be an AdmissionReview object")
    api_version, kind = review.get("apiVersion"), review.get("kind")
    if api_version != ADMISSION_API_VERSION or kind != "AdmissionReview":
        raise ReviewError(
            f"expected apiVersion {ADMISSION_API_VERSION} kind AdmissionReview, got "
            f"apiVersion {api_version!r} kind {kind!r}; set admissionReviewVersions: [v1] "
            "in the webhook configuration"
        )
    request = review.get("request")
    if not isinstance(request, dict):
        raise ReviewError("AdmissionReview has no request")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ReviewError("AdmissionReview request.uid is missing")
    resource_kind = request.get("kind")
    if (
        not isinstance(resource_kind, dict)
        or (
            resource_kind.get("group", ""),
            resource_kind.get("version"),
            resource_kind.get("kind"),
        )
        not in kinds
    ):
        wanted = ", ".join(str(k) for k in kinds)
        raise ReviewError(
            f"unsupported resource kind {resource_kind!r}: this path admits {wanted} only; "
            "restrict the webhook rules to those resources"
        )
    resource_kind.setdefault("group", "")
    for name, expected in (("namespace", str), ("operation", str), ("dryRun", bool)):
        value = request.get(name)
        if value is not None and not isinstance(value, expected):
            raise ReviewError(
                f"AdmissionReview request.{name} must be a {expected.__name__}, got {value!r}"
            )
    return cast(AdmissionRequest, request)


def allow(
    uid: str, *, patch: Sequence[dict[str, Any]] = (), warnings: Sequence[str] = ()
) -> AdmissionResponse:
    """Admit, with the JSON patch to apply (none: unchanged) and warnings for the user."""
    response = AdmissionResponse(uid=uid, allowed=True)
    if patch:
        encoded = jsonbytes.dumps(list(patch))
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(encoded).decode("ascii")
    if warnings:
        response["warnings"] = list(warnings)
    return response


def deny(uid: str, code: int, message: str) -> AdmissionResponse:
    """Refuse with `message`: 400 bad object, 403 forbidden by policy, 500 our failure."""
    status = Status(
        status="Failure", code=code, reason=_REASONS.get(code, "InternalError"), message=message
    )
    return AdmissionResponse(uid=uid, allowed=False, status=status)


def encode_review(response: AdmissionResponse) -> bytes:
    """The AdmissionReview body that carries `response` back to the API server."""
    review = {"apiVersion": ADMISSION_API_VERSION, "kind": "AdmissionReview", "response": response}
    return jsonbytes.dumps(review)
