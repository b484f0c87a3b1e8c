"""Kubernetes name rules: the boundaries the API server draws, and errors that say why."""

from __future__ import annotations

import re

import pytest
from gpudra.api.names import (
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    DnsLabel,
    DnsSubdomain,
    InvalidName,
    attribute_name_problem,
    check_dns_label,
    check_dns_subdomain,
    dns_label_problem,
    dns_subdomain_problem,
    is_dns_label,
    is_dns_subdomain,
)
from pydantic import TypeAdapter, ValidationError

LABELS_OK = ["a", "0", "a-b", "a--b", "9abc", "x" * 63, "a" + "-" * 61 + "b"]
LABELS_BAD = ["", "x" * 64, "A", "aB", "-a", "a-", "a.b", "a_b", "a b", "é", "a\n"]
SUBDOMAINS_OK = [
    "a",
    "a.b",
    "gpu.nvidia.com",
    "a-1.b-2",
    "x" * 253,
    ".".join(["x" * 63] * 3 + ["x" * 61]),
]
SUBDOMAINS_BAD = ["", "x" * 254, "A.b", "a..b", ".a", "a.", "-a.b", "a-.b", "a.-b", "a_b.c"]


@pytest.mark.parametrize("value", LABELS_OK)
def test_dns_labels_accepted(value: str) -> None:
    assert is_dns_label(value)
    assert check_dns_label(value, "name") == value
    assert TypeAdapter(DnsLabel).validate_python(value) == value


@pytest.mark.parametrize("value", LABELS_BAD)
def test_dns_labels_refused(value: str) -> None:
    assert not is_dns_label(value)
    with pytest.raises(InvalidName) as err:
        check_dns_label(value, "spec.name")
    assert err.value.field == "spec.name"
    assert str(err.value).startswith(f"spec.name {value!r} must be a DNS label of at most 63")
    with pytest.raises(ValidationError):
        TypeAdapter(DnsLabel).validate_python(value)


@pytest.mark.parametrize("value", SUBDOMAINS_OK)
def test_dns_subdomains_accepted(value: str) -> None:
    assert is_dns_subdomain(value)
    assert check_dns_subdomain(value, "name") == value
    assert TypeAdapter(DnsSubdomain).validate_python(value) == value


@pytest.mark.parametrize("value", SUBDOMAINS_BAD)
def test_dns_subdomains_refused(value: str) -> None:
    assert not is_dns_subdomain(value)
    with pytest.raises(InvalidName, match=r"must be a DNS subdomain of at most 253"):
        check_dns_subdomain(value, "name")
    with pytest.raises(ValidationError):
        TypeAdapter(DnsSubdomain).validate_python(value)


def test_schema_patterns_agree_with_the_checks() -> None:
    for value in LABELS_OK + LABELS_BAD + SUBDOMAINS_OK + SUBDOMAINS_BAD:
        label = len(value) <= 63 and re.fullmatch(DNS_LABEL_PATTERN, value) is not None
        subdomain = len(value) <= 253 and re.fullmatch(DNS_SUBDOMAIN_PATTERN, value) is not None
        assert is_dns_label(value) == label, value
        assert is_dns_subdomain(value) == subdomain, value


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("", "(it is empty)"),
        ("x" * 64, "(it has 64 characters)"),
        ("Bad_NS", "(it contains 'B', 'N', 'S', '_')"),
        ("-a", "(it starts with '-')"),
        ("a-", "(it ends with '-')"),
        ("a.b", "(it contains '.')"),
    ],
)
def test_label_errors_say_what_is_wrong(value: str, why: str) -> None:
    problem = dns_label_problem(value)
    assert problem is not None
    assert problem.endswith(why)


def test_a_tighter_label_limit_is_honoured() -> None:
    assert dns_label_problem("x" * 20, max_length=20) is None
    assert dns_label_problem("x" * 21, max_length=20) == (
        "must be a DNS label of at most 20 lower-case letters, digits and '-', starting and "
        "ending with a letter or digit (it has 21 characters)"
    )


def test_subdomain_errors_name_the_bad_part() -> None:
    assert (dns_subdomain_problem("a..b") or "").endswith("(part '' is empty)")
    assert (dns_subdomain_problem("gpu.Nvidia.com") or "").endswith("(part 'Nvidia' contains 'N')")
    assert (dns_subdomain_problem("x" * 254) or "").endswith("(it has 254 characters)")


@pytest.mark.parametrize(
    "value",
    [
        "type",
        "_x",
        "productName",
        "gpu.nvidia.com/memory",
        "resource.kubernetes.io/pciBusID",
        "Example.COM/x",  # the API checks domains case-insensitively
        "x" * 32,
        f"{'d' * 63}/{'n' * 32}",
    ],
)
def test_attribute_names_accepted(value: str) -> None:
    assert attribute_name_problem(value) is None


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("x" * 33, "has name"),
        ("1abc", "must be a C identifier"),
        ("copy-engines", "must be a C identifier"),
        ("a.b", "must be a C identifier"),
        ("/x", "empty domain"),
        ("gpu.nvidia.com/", "has name ''"),
        (f"{'d' * 64}/x", "has domain"),
        ("bad_domain/x", "has domain 'bad_domain'"),
    ],
)
def test_attribute_names_refused(value: str, why: str) -> None:
    problem = attribute_name_problem(value)
    assert problem is not None
    assert why in problem
