"""Kubernetes Quantity parsing: the forms the API server accepts, and nothing else."""

from fractions import Fraction

import pytest
from gpudra.api.quantity import Quantity, QuantityError, parse_quantity


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1", 1),
        ("+5", 5),
        ("10Gi", 10 * 1024**3),
        ("1Ki", 1024),
        ("1Mi", 1024**2),
        ("2Ti", 2 * 1024**4),
        ("1Pi", 1024**5),
        ("1Ei", 1024**6),
        ("1.5Gi", 3 * 1024**3 // 2),
        ("0.5Mi", 512 * 1024),
        (".5Ki", 512),
        ("1.", 1),
        ("1k", 1000),
        ("1M", 10**6),
        ("3G", 3 * 10**9),
        ("1T", 10**12),
        ("1P", 10**15),
        ("1E", 10**18),  # a lone E is the exa suffix, not an exponent
        ("1e3", 1000),
        ("1E3", 1000),
        ("12e+2", 1200),
        ("5e-1", 1),  # Value() rounds up, as in Go
        ("100m", 1),
        ("1500m", 2),
        ("1n", 1),
        ("1u", 1),
    ],
)
def test_valid_quantities(text: str, expected: int) -> None:
    quantity = parse_quantity(text)
    assert quantity.value() == expected
    assert str(quantity) == text


def test_amount_is_exact() -> None:
    assert parse_quantity("100m").amount == Fraction(1, 10)
    assert parse_quantity("0.1Gi").amount == Fraction(1024**3, 10)
    assert parse_quantity("1e-3").amount == Fraction(1, 1000)


def test_equal_values_compare_equal() -> None:
    assert parse_quantity("1Gi") == parse_quantity("1024Mi")
    assert parse_quantity("1G") != parse_quantity("1Gi")
    assert isinstance(parse_quantity("1"), Quantity)


@pytest.mark.parametrize(
    "text",
    [
        "",
        " 1Gi",
        "1Gi ",
        "1 Gi",
        "Gi",
        ".",
        "1.2.3",
        "1GB",
        "1gi",
        "1K",  # decimal kilo is lower-case k
        "1KiB",
        "1e",
        "1e3Ki",
        "1e1.5",
        "0x10",
        "1_000",
        "١٢",  # non-ASCII digits
        "1Gi\n",
        "abc",
        "--1",
        "1e101",
        "9" * 65,
    ],
)
def test_garbage_is_rejected(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)


@pytest.mark.parametrize("text", ["-1", "-1Gi", "-0.5", "-1e3"])
def test_negative_rejected_by_default(text: str) -> None:
    with pytest.raises(QuantityError, match="negative"):
        parse_quantity(text)


def test_negative_allowed_on_request() -> None:
    assert parse_quantity("-1Ki", allow_negative=True).value() == -1024
    assert parse_quantity("-0").value() == 0


def test_non_string_rejected() -> None:
    with pytest.raises(QuantityError, match="must be a string"):
        parse_quantity(5)  # type: ignore[arg-type]


def test_error_names_accepted_suffixes() -> None:
    with pytest.raises(QuantityError) as info:
        parse_quantity("10GB")
    assert "Ki Mi Gi" in str(info.value)
