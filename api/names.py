"""Kubernetes name rules, written once: every module that checks a name uses these.

The rules are the API server's own (apimachinery's RFC 1123 label and subdomain, and
resource.k8s.io's attribute names), so a name checked here is one the server accepts;
checking early only turns a rejected write into an error that names the field and the
fix. Each rule has a `*_problem` function (why a value breaks it, or None) for callers
that raise their own error type, a `check_*` function that raises `InvalidName`, and,
where pydantic models need it, an annotated type whose JSON schema carries the same
pattern and length (CRD schemas are derived from those models).
"""

from __future__ import annotations

import re
from typing import Annotated, Final

from pydantic import Field

__all__ = [
    "ATTRIBUTE_DOMAIN_MAX",
    "ATTRIBUTE_ID_MAX",
    "DNS_LABEL_MAX",
    "DNS_LABEL_PATTERN",
    "DNS_SUBDOMAIN_MAX",
    "DNS_SUBDOMAIN_PATTERN",
    "DRIVER_NAME_MAX",
    "POD_CLAIM_NAME_ANNOTATION",
    "DnsLabel",
    "DnsSubdomain",
    "InvalidName",
    "attribute_name_problem",
    "base_request",
    "check_dns_label",
    "check_dns_subdomain",
    "dns_label_problem",
    "dns_subdomain_problem",
    "driver_name_problem",
    "is_dns_label",
    "is_dns_subdomain",
]

POD_CLAIM_NAME_ANNOTATION: Final = "resource.kubernetes.io/pod-claim-name"
"""On a claim the resourceclaim controller made from a pod's template entry: the entry's
name (the pod is the claim's controlling owner). The claim's own name is generated, so
this is the name a pod's containers know the claim by."""

DNS_LABEL_MAX: Final = 63
DNS_SUBDOMAIN_MAX: Final = 253
# resource.k8s.io QualifiedName: `<domain>/<C identifier>` or a bare C identifier
# (DeviceMaxDomainLength and DeviceMaxIDLength of the API).
ATTRIBUTE_DOMAIN_MAX: Final = 63
ATTRIBUTE_ID_MAX: Final = 32

# For schemas (pydantic, CRDs): anchored, no look-arounds, no named groups. Python code
# checks with the functions below, which say which part of a name is wrong.
DNS_LABEL_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Valid names take one regex match (publishing checks every key of every device); the
# step-by-step checks run only to explain a refusal.
_LABEL: Final = re.compile(DNS_LABEL_PATTERN)
_SUBDOMAIN: Final = re.compile(DNS_SUBDOMAIN_PATTERN)
_ATTRIBUTE_NAME: Final = re.compile(
    r"(?:[a-zA-Z0-9](?:[-a-zA-Z0-9]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[-a-zA-Z0-9]*[a-zA-Z0-9])?)*/)?"
    r"[A-Za-z_][A-Za-z0-9_]*"
)
_LABEL_CHARS: Final = re.compile(r"[^-a-z0-9]")
_C_IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_LABEL_RULE: Final = (
    "lower-case letters, digits and '-', starting and ending with a letter or digit"
)

DnsLabel = Annotated[str, Field(pattern=DNS_LABEL_PATTERN, max_length=DNS_LABEL_MAX)]
DnsSubdomain = Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=DNS_SUBDOMAIN_MAX)]


class InvalidName(ValueError):
    """A name breaks a Kubernetes rule; the message names the field, the value and the fix."""

    def __init__(self, field: str, value: str, problem: str) -> None:
        super().__init__(f"{field} {value!r} {problem}")
        self.field = field
        self.value = value


def _label_flaw(label: str) -> str | None:
    """What keeps one dot-free part from the RFC 1123 label characters, if anything."""
    if not label:
        return "is empty"
    bad = sorted(set(_LABEL_CHARS.findall(label)))
    if bad:
        return "contains " + ", ".join(repr(c) for c in bad)
    if label.startswith("-"):
        return "starts with '-'"
    if label.endswith("-"):
        return "ends with '-'"
    return None


def dns_label_problem(value: str, *, max_length: int = DNS_LABEL_MAX) -> str | None:
    """Why `value` is not an RFC 1123 label of at most `max_length` characters, or None.

    `max_length` may only tighten the rule (for a caller that appends to the name).
    """
    if len(value) <= max_length and _LABEL.fullmatch(value):
        return None
    flaw = f"has {len(value)} characters" if len(value) > max_length else _label_flaw(value)
    return f"must be a DNS label of at most {max_length} {_LABEL_RULE} (it {flaw})"


def dns_subdomain_problem(value: str, *, max_length: int = DNS_SUBDOMAIN_MAX) -> str | None:
    """Why `value` is not an RFC 1123 subdomain of at most `max_length` characters, or None."""
    if len(value) <= max_length and _SUBDOMAIN.fullmatch(value):
        return None
    where, flaw = "it", f"has {len(value)} characters"
    if len(value) <= max_length:
        part, flaw = next((p, f) for p in value.split(".") if (f := _label_flaw(p)) is not None)
        where = "it" if part == value else f"part {part!r}"
    return (
        f"must be a DNS subdomain of at most {max_length} characters: dot-separated parts "
        f"of {_LABEL_RULE} ({where} {flaw})"
    )


# resource.k8s.io's driver names (ValidateCSIDriverName): at most 63 characters.
DRIVER_NAME_MAX: Final = 63


def driver_name_problem(value: str) -> str | None:
    """Why `value` cannot be gpudra's DRA driver name, or None.

    A DNS subdomain of at most 63 characters, in lower case: the API checks driver
    names case-insensitively, but the name also goes into ResourceSlice names
    (`<node>-<driver>-<n>`) and device taint keys (`<driver>/xid`), which must be lower
    case, so an upper-case driver name would be accepted and then every slice refused.
    `gpudra node` checks its --driver-name with it; `gpudra webhook` applies the same
    rule to its own.
    """
    return dns_subdomain_problem(value, max_length=DRIVER_NAME_MAX)


def attribute_name_problem(value: str) -> str | None:
    """Why `value` is not a resource.k8s.io attribute or capacity name, or None.

    The API's QualifiedName: a C identifier of at most 32 characters, optionally after
    `<domain>/` where the domain is a DNS subdomain of at most 63 characters (checked
    case-insensitively, as the API checks driver names).
    """
    domain, slash, ident = value.rpartition("/")
    if (
        len(domain) <= ATTRIBUTE_DOMAIN_MAX
        and len(ident) <= ATTRIBUTE_ID_MAX
        and _ATTRIBUTE_NAME.fullmatch(value)
    ):
        return None
    if slash:
        if not domain:
            return "has an empty domain before '/'; drop the '/' or name the domain"
        problem = dns_subdomain_problem(domain.lower(), max_length=ATTRIBUTE_DOMAIN_MAX)
        if problem is not None:
            return f"has domain {domain!r}, which {problem}"
    if len(ident) > ATTRIBUTE_ID_MAX or not _C_IDENTIFIER.fullmatch(ident):
        return (
            f"has name {ident!r}, which must be a C identifier (letters, digits and '_', "
            f"not starting with a digit) of at most {ATTRIBUTE_ID_MAX} characters"
        )
    return None


def is_dns_label(value: str) -> bool:
    return dns_label_problem(value) is None


def is_dns_subdomain(value: str) -> bool:
    return dns_subdomain_problem(value) is None


def check_dns_label(value: str, field: str, *, max_length: int = DNS_LABEL_MAX) -> str:
    """`value` if it is a DNS label; otherwise `InvalidName` naming `field`."""
    problem = dns_label_problem(value, max_length=max_length)
    if problem is not None:
        raise InvalidName(field, value, problem)
    return value


def check_dns_subdomain(value: str, field: str, *, max_length: int = DNS_SUBDOMAIN_MAX) -> str:
    """`value` if it is a DNS subdomain; otherwise `InvalidName` naming `field`."""
    problem = dns_subdomain_problem(value, max_length=max_length)
    if problem is not None:
        raise InvalidName(field, value, problem)
    return value


def base_request(request: str) -> str:
    """The request a result's or a config's request name belongs to: `gpu` for the
    subrequest `gpu/large` of a `firstAvailable` request, the name itself otherwise
    (upstream's `resourceclaim.BaseRequestRef`). A pod's containers, a config's
    `requests` and a device metadata path name the request, never the subrequest."""
    return request.split("/", 1)[0]
