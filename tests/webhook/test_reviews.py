"""AdmissionReview parsing and the response shapes, without HTTP."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from gpudra.webhook.reviews import (
    AS_GO_MAX_BYTES,
    ResourceKind,
    ReviewError,
    allow,
    deny,
    encode_review,
    parse_review,
)

POD = ResourceKind("", "v1", "Pod")


def body(**request: Any) -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {"uid": "u1", "kind": {"version": "v1", "kind": "Pod"}, **request},
        }
    ).encode()


def test_a_review_parses_to_its_request_with_the_core_group_filled_in() -> None:
    request = parse_review(body(namespace="ns", dryRun=True, object={"a": 1}), (POD,))
    assert request["uid"] == "u1"
    assert request["kind"] == {"group": "", "version": "v1", "kind": "Pod"}
    assert (request.get("namespace"), request.get("dryRun")) == ("ns", True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"namespace": 5}, "request.namespace must be a str, got 5"),
        ({"operation": ["CREATE"]}, "request.operation must be a str"),
        ({"dryRun": "yes"}, "request.dryRun must be a bool, got 'yes'"),
    ],
)
def test_a_field_of_the_wrong_type_is_named(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ReviewError, match=re.escape(message)):
        parse_review(body(**fields), (POD,))


def test_what_only_go_reads_is_read_in_a_small_review_and_refused_in_a_large_one() -> None:
    """An unpaired surrogate escape, which the API server keeps in a claim's opaque
    parameters: a review of a claim's size is read as Go reads it (U+FFFD), so its
    config is judged by what it says; past `AS_GO_MAX_BYTES` it is refused unread, so
    that a body made to fail the fast decoder at its end buys no slower reading."""
    surrogate = {"object": {"note": "\ud800"}}
    request = parse_review(body(**surrogate), (POD,))
    assert request["object"] == {"note": "\ufffd"}
    padding = "x" * AS_GO_MAX_BYTES
    with pytest.raises(ReviewError, match="request body is not valid JSON"):
        parse_review(body(**surrogate, padding=padding), (POD,))
    assert parse_review(body(object={"note": "ok"}, padding=padding), (POD,))["uid"] == "u1"


def test_the_admitted_kinds_are_listed_when_another_arrives() -> None:
    claim = ResourceKind("resource.k8s.io", "v1", "ResourceClaim")
    with pytest.raises(ReviewError, match=r"admits resource\.k8s\.io/v1 ResourceClaim only"):
        parse_review(body(), (claim,))


def test_allow_carries_the_patch_base64_encoded_and_the_warnings() -> None:
    patch = [{"op": "add", "path": "/spec/resourceClaims", "value": []}]
    response = allow("u1", patch=patch, warnings=["converted"])
    assert response["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(response["patch"])) == patch
    assert response["warnings"] == ["converted"]
    assert allow("u2") == {"uid": "u2", "allowed": True}


@pytest.mark.parametrize(
    ("code", "reason"), [(400, "BadRequest"), (403, "Forbidden"), (500, "InternalError")]
)
def test_deny_names_the_reason_of_its_code(code: int, reason: str) -> None:
    response = deny("u1", code, "why")
    assert response == {
        "uid": "u1",
        "allowed": False,
        "status": {"status": "Failure", "code": code, "reason": reason, "message": "why"},
    }


def test_the_response_travels_in_an_admission_review() -> None:
    review = json.loads(encode_review(allow("u1")))
    assert review == {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": "u1", "allowed": True},
    }
