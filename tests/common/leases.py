"""An in-process coordination.k8s.io/v1 Lease API, for tests of leader election: one
Lease, resourceVersions, 409 on a stale PUT or a POST of a taken name, as the API server."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from gpudra.common.kube import ApiError

LEASES = "/apis/coordination.k8s.io/v1/namespaces/gpudra/leases"
PATH = f"{LEASES}/quota-writer"


class LeaseApi:
    """`fail`: every request answers 500 (the API server away); `conflict_next_put`:
    the next PUT answers 409, as when another candidate wrote in between."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.fail = False
        self.conflict_next_put = False
        self.writes: list[tuple[str, dict[str, Any]]] = []
        self._versions = itertools.count(1)

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        if self.fail:
            raise ApiError(500, "etcdserver: request timed out", method, path)
        if method == "GET":
            assert path == PATH, path
            if self.lease is None:
                raise ApiError(404, "leases.coordination.k8s.io not found", method, path)
            return copy.deepcopy(self.lease)
        if method == "POST":
            assert path == LEASES, path
            if self.lease is not None:
                raise ApiError(409, "already exists", method, path)
            return self._store(method, body)
        if method == "PUT":
            assert path == PATH, path
            assert self.lease is not None
            stale = body["metadata"].get("resourceVersion") != self.version
            if self.conflict_next_put or stale:
                self.conflict_next_put = False
                raise ApiError(409, "the object has been modified", method, path)
            return self._store(method, body)
        raise AssertionError(method)

    def _store(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        obj["metadata"]["resourceVersion"] = str(next(self._versions))
        self.lease = obj
        self.writes.append((method, copy.deepcopy(obj)))
        return copy.deepcopy(obj)

    @property
    def version(self) -> str | None:
        return None if self.lease is None else self.lease["metadata"]["resourceVersion"]

    @property
    def spec(self) -> dict[str, Any]:
        assert self.lease is not None
        spec: dict[str, Any] = self.lease["spec"]
        return spec


class Clock:
    """A monotonic clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
