"""Kubernetes resource.Quantity parsing.

Opaque configs carry memory limits as Quantity strings ("10Gi", "512M", "1e9").
The grammar follows k8s.io/apimachinery so a value the API server or the upstream
driver accepts is accepted here, and the value is kept exact (a Fraction) so that
"0.5Gi" or "100m" never drift through floating point.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction

__all__ = ["Quantity", "QuantityError", "parse_quantity"]

# <signedNumber><suffix>; the exponent form is tried before the single-letter "E" (exa).
_QUANTITY_RE = re.compile(
    r"(?P<sign>[+-]?)"
    r"(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?P<suffix>[eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?"
)

_BINARY_SUFFIXES = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

# Far beyond any real value; bounds the work a hostile "1e999999999" can cause.
_MAX_EXPONENT = 100
_MAX_LENGTH = 64

ACCEPTED_FORMS = "a number with an optional suffix: Ki Mi Gi Ti Pi Ei, n u m k M G T P E, or e<exp>"


class QuantityError(ValueError):
    """A string that is not a valid (or not an allowed) Kubernetes quantity."""


@dataclass(frozen=True, slots=True)
class Quantity:
    """An exact quantity; `text` is kept so a config round-trips unchanged."""

    amount: Fraction
    text: str = field(compare=False)

    def value(self) -> int:
        """Integer value rounded up, as Go's Quantity.Value() does."""
        return math.ceil(self.amount)

    def __str__(self) -> str:
        return self.text


def parse_quantity(text: str, *, allow_negative: bool = False) -> Quantity:
    """Parse a quantity string; negatives are rejected unless asked for.

    Leading or trailing whitespace is an error here, as in Go's ParseQuantity;
    callers decoding JSON strip it first, as Go's UnmarshalJSON does.
    """
    if not isinstance(text, str):
        raise QuantityError(f"must be a string ({ACCEPTED_FORMS}), got {type(text).__name__}")
    if not text:
        raise QuantityError(f"must not be empty; expected {ACCEPTED_FORMS}")
    if len(text) > _MAX_LENGTH:
        raise QuantityError(f"is longer than {_MAX_LENGTH} characters")
    match = _QUANTITY_RE.fullmatch(text)
    if match is None:
        raise QuantityError(f"{text!r} is not a quantity; expected {ACCEPTED_FORMS}")
    sign, number, suffix = match.group("sign"), match.group("number"), match.group("suffix")
    amount = Fraction(number if not number.endswith(".") else number[:-1])
    if suffix is None:
        pass
    elif suffix in _BINARY_SUFFIXES:
        amount *= 1024 ** (_BINARY_SUFFIXES.index(suffix) + 1)
    elif suffix in _DECIMAL_SUFFIXES:
        amount *= Fraction(10) ** _DECIMAL_SUFFIXES[suffix]
    else:
        exponent = int(suffix[1:])
        if abs(exponent) > _MAX_EXPONENT:
            raise QuantityError(f"{text!r}: exponent must be between -100 and 100")
        amount *= Fraction(10) ** exponent
    if sign == "-":
        amount = -amount
    if amount < 0 and not allow_negative:
        raise QuantityError(f"{text!r} is negative; a non-negative quantity is required")
    return Quantity(amount=amount, text=text)
