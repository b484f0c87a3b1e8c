"""A fake API server for the namespace-wide lists the webhook reads, as `Kube.request`
answers them: ``limit``/``continue`` pages served from the snapshot the first page
took, the pod phase field selector, an object read by name, and 404 for a collection it
does not serve (a Kueue API version that is not installed).

`held` holds the answer to the first page of the lists of `held_path` (the first
collection unless named) it numbers (1 for the first), once its snapshot is taken,
until the test sets the event; `fail_page` answers that page of every list with
`fail_status`, the API server's 410 for an expired continue token unless set.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.lowlevel
from gpudra.common.kube import ApiError

EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. "
    "You can start a new list without the continue parameter."
)


class ListsApi:
    """The collections of `objects` (by path), listed and read as the API server does."""

    def __init__(
        self, objects: dict[str, list[dict[str, Any]]], held_path: str | None = None
    ) -> None:
        self.objects = objects
        self.held_path = held_path if held_path is not None else next(iter(objects))
        self.lists = 0
        self.lists_of: dict[str, int] = {}
        """Lists begun, by collection path."""
        self.pages = 0
        self.pages_of: dict[str, int] = {}
        self.largest_page = 0
        self.bytes = 0
        """What the webhook parsed: the JSON bodies of every page."""
        self.bytes_of: dict[str, int] = {}
        self.queries: list[dict[str, str]] = []
        self.held: dict[int, anyio.Event] = {}
        self.fail_page: int | None = None
        self.fail_status = 410
        self._snapshots: dict[str, list[dict[str, Any]]] = {}

    async def request(
        self, method: str, path: str, body: Any = None, *, query: Any = None, **_: Any
    ) -> Any:
        if method != "GET":
            raise AssertionError(f"unexpected {method} {path}")
        collection, _, name = path.rpartition("/")
        if path not in self.objects and collection in self.objects:
            await anyio.lowlevel.checkpoint()
            for obj in self.objects[collection]:
                if obj["metadata"]["name"] == name:
                    return json.loads(json.dumps(obj))
            raise ApiError(404, f"{name} not found", method, path)
        if path not in self.objects:
            raise ApiError(404, "the server could not find the requested resource", method, path)
        query = dict(query or {})
        self.queries.append(query)
        token = query.get("continue")
        if token is None:
            self.lists += 1
            self.lists_of[path] = self.lists_of.get(path, 0) + 1
            snapshot = token = str(self.lists)
            self._snapshots[snapshot] = [o for o in self.objects[path] if _selected(o, query)]
            offset = 0
            hold = self.held.get(self.lists_of[path]) if path == self.held_path else None
            if hold is not None:
                await hold.wait()
        else:
            snapshot, _, at = token.partition(":")
            offset = int(at)
        page_number = offset // int(query["limit"]) + 1 if "limit" in query else 1
        await anyio.lowlevel.checkpoint()  # the round trip: other admissions run meanwhile
        if page_number == self.fail_page:
            message = EXPIRED if self.fail_status == 410 else "failed"
            raise ApiError(self.fail_status, message, method, path)
        items = self._snapshots[snapshot][offset:]
        metadata: dict[str, str] = {}
        if "limit" in query and len(items) > int(query["limit"]):
            items = items[: int(query["limit"])]
            metadata["continue"] = f"{snapshot}:{offset + len(items)}"
        raw = json.dumps({"kind": "List", "metadata": metadata, "items": items})
        self.pages += 1
        self.pages_of[path] = self.pages_of.get(path, 0) + 1
        self.largest_page = max(self.largest_page, len(items))
        self.bytes += len(raw)
        self.bytes_of[path] = self.bytes_of.get(path, 0) + len(raw)
        return json.loads(raw)


def _selected(obj: Mapping[str, Any], query: Mapping[str, str]) -> bool:
    """The phase field selector the webhook sends for pods, as the API server applies it."""
    if "fieldSelector" not in query:
        return True
    excluded = {term.split("!=")[1] for term in query["fieldSelector"].split(",") if "!=" in term}
    return obj.get("status", {}).get("phase") not in excluded
