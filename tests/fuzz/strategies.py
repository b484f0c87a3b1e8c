"""Hypothesis strategies shared by the fuzz tests: JSON values, and type-confusing
mutations of a well-formed document (a value somewhere replaced by one of another type).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)

JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
"""Any JSON value, nested a little."""

CONFUSING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-5, max_value=2**64),
    st.just(""),
    st.text(max_size=12),
    st.just([]),
    st.lists(SCALARS, min_size=1, max_size=3),
    st.just({}),
    st.dictionaries(st.text(max_size=6), SCALARS, max_size=3),
)
"""A value of any type: what goes where an object, a list or a string should be."""


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path in `doc` (keys and indices), the root's children and below."""
    found: list[tuple[Any, ...]] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            found.append((*prefix, key))
            found.extend(_paths(value, (*prefix, key)))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            found.append((*prefix, index))
            found.extend(_paths(value, (*prefix, index)))
    return found


def replace_at(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(doc)
    parent = out
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return out


@st.composite
def mutated(
    draw: Callable[..., Any],
    base: Any,
    *,
    values: st.SearchStrategy[Any] = CONFUSING,
    max_mutations: int = 3,
    keep: Callable[[tuple[Any, ...]], bool] = lambda _path: True,
) -> Any:
    """`base` with up to `max_mutations` values replaced, deleted or added (at paths
    `keep` accepts), so every part of a valid shape is tried with the wrong type."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(min_value=0, max_value=max_mutations))):
        paths = [p for p in _paths(doc) if keep(p)]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(("replace", "replace", "delete", "add")))
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        if action == "replace":
            parent[path[-1]] = draw(values)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=10))] = draw(values)
        else:
            parent.append(draw(values))
    return doc
