"""The quantity parser under generated input: a Quantity or a QuantityError, nothing else."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from gpudra.api.quantity import Quantity, QuantityError, parse_quantity
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.strategies import JSON

SUFFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E")

NEAR_QUANTITIES = st.builds(
    lambda sign, whole, dot, frac, suffix: f"{sign}{whole}{dot}{frac}{suffix}",
    st.sampled_from(("", "+", "-", "--", " ")),
    st.text("0123456789", max_size=8),
    st.sampled_from(("", ".", "..", ",")),
    st.text("0123456789", max_size=4),
    st.sampled_from(SUFFIXES)
    | st.builds(lambda e, n: f"{e}{n}", st.sampled_from("eE"), st.integers(-(10**6), 10**6))
    | st.text(max_size=3),
)
"""Strings close to the grammar: the edges are where a parser breaks."""


def _parse(value: Any, allow_negative: bool) -> Quantity | None:
    try:
        return parse_quantity(value, allow_negative=allow_negative)
    except QuantityError as exc:
        assert str(exc)
        return None


@given(st.text(max_size=80) | NEAR_QUANTITIES, st.booleans())
def test_any_string_is_a_quantity_or_a_quantity_error(text: str, allow_negative: bool) -> None:
    quantity = _parse(text, allow_negative)
    if quantity is not None:
        assert quantity.text == text
        assert isinstance(quantity.amount, Fraction)
        assert isinstance(quantity.value(), int)
        assert allow_negative or quantity.amount >= 0


@given(JSON)
def test_any_json_value_is_a_quantity_or_a_quantity_error(value: Any) -> None:
    _parse(value, False)


@given(
    st.integers(min_value=0, max_value=10**12),
    st.sampled_from(("Ki", "Mi", "Gi", "Ti", "k", "M", "G", "T")),
)
def test_well_formed_quantities_parse_exactly(number: int, suffix: str) -> None:
    scale = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6}
    scale |= {"G": 10**9, "T": 10**12}
    quantity = parse_quantity(f"{number}{suffix}")
    assert quantity.amount == number * scale[suffix]
