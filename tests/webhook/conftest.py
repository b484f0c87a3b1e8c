"""Webhook tests run on anyio's asyncio backend with uvloop, like the webhook itself."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest

PatchApplier = Callable[[Any, Sequence[dict[str, Any]]], Any]


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return "asyncio", {"use_uvloop": True}


def _apply_json_patch(document: Any, patch: Sequence[dict[str, Any]]) -> Any:
    """RFC 6902 add/remove/replace/test, enough to check the webhook's patches."""
    doc = copy.deepcopy(document)
    for op in patch:
        tokens = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
        parent = doc
        for token in tokens[:-1]:
            parent = parent[int(token)] if isinstance(parent, list) else parent[token]
        last = tokens[-1]
        if op["op"] == "add":
            if isinstance(parent, list):
                if last == "-":
                    parent.append(copy.deepcopy(op["value"]))
                else:
                    parent.insert(int(last), copy.deepcopy(op["value"]))
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                del parent[last]  # KeyError: the path must exist
        elif op["op"] == "replace":
            key = int(last) if isinstance(parent, list) else last
            parent[key] = copy.deepcopy(op["value"])
        elif op["op"] == "test":
            key = int(last) if isinstance(parent, list) else last
            assert parent[key] == op["value"]
        else:
            raise AssertionError(f"unexpected op {op['op']}")
    return doc


@pytest.fixture
def apply_patch() -> PatchApplier:
    return _apply_json_patch
