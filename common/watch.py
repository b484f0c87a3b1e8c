"""The one list/watch loop: mirrors a collection of the API server into a caller's cache.

The protocol has sharp edges that every controller would otherwise handle on its own:

- A watch must start from the resourceVersion of a list, or events between the two
  are lost; so the loop always lists first and hands the caller the whole listing,
  which replaces (not merges into) what the caller had.
- The server ends every watch after `watch_timeout_s`. Resuming from the newest
  resourceVersion seen is cheap; listing again would cost a full read of the
  collection every few minutes per watcher (the slice benchmark runs 200 of them).
- A quiet watch (a selector that matches nothing changing) would otherwise hold an
  old resourceVersion that the server forgets; bookmarks (``allowWatchBookmarks``)
  carry the server's newer version, so resuming stays possible.
- When the version is forgotten anyway the server answers 410 Gone (an ERROR event,
  or the HTTP status): the only way on is a fresh list. Any other ERROR event means
  the same.
- A dropped connection, an API server outage or a malformed event must not end the
  loop (aiohttp's errors are not OSErrors): it lists again after a capped backoff,
  and the backoff starts over once the server delivers events again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, Literal

import anyio
import anyio.abc
from gpudra.common.backoff import Backoff
from gpudra.common.kube import ApiError, Kube

__all__ = ["EventType", "Reflector"]

log = logging.getLogger(__name__)

EventType = Literal["ADDED", "MODIFIED", "DELETED"]
_OBJECT_EVENTS: Final = ("ADDED", "MODIFIED", "DELETED")
_GONE: Final = 410


class Reflector:
    """Lists, then watches, the collection at `path`, calling back into the caller.

    `on_list(items)` gets every listing (the first and each relist) and must replace
    the caller's view; `on_event(type, object)` gets each ADDED, MODIFIED or DELETED
    event in between. Both are plain functions: they only update a cache and poke a
    `gpudra.common.reconcile.ReconcileLoop`, so the watch never waits on API writes.

    `absent_retry_s` is for collections that may not be served (a CRD not installed):
    a 404 on list then reads as an empty listing, checked again after that long,
    instead of an error retried at the backoff's pace.
    """

    def __init__(
        self,
        kube: Kube,
        path: str,
        *,
        on_list: Callable[[list[dict[str, Any]]], None],
        on_event: Callable[[EventType, dict[str, Any]], None],
        query: Mapping[str, str] | None = None,
        backoff: Backoff | None = None,
        watch_timeout_s: int = 300,
        absent_retry_s: float | None = None,
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        self._kube = kube
        self._path = path
        self._on_list = on_list
        self._on_event = on_event
        self._query = dict(query or {})
        self._backoff = backoff or Backoff()
        self._watch_timeout_s = watch_timeout_s
        self._absent_retry_s = absent_retry_s
        self._fields = {**(fields or {}), "path": path}
        self._delays: Iterator[float] = self._backoff.delays()
        self._progress = False
        self.resource_version: str | None = None
        """Where the next watch starts: the latest listing's, advanced by every event
        and bookmark since."""

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Mirror the collection until cancelled; reports started after the first list."""
        started = False
        while True:
            try:
                served = await self._list()
                if not started:
                    started = True
                    task_status.started()
                if not served:
                    await anyio.sleep(self._absent_retry_s or 0.0)
                    continue
                status = await self._watch_until_error()
            except Exception as exc:  # aiohttp's errors are not OSErrors; never die on them
                expired = isinstance(exc, ApiError) and exc.status == _GONE
                await self._pause_before_relist(repr(exc), expired=expired)
            else:
                error = f"{status.get('code')} {status.get('reason')}: {status.get('message')}"
                await self._pause_before_relist(error, expired=status.get("code") == _GONE)

    async def _list(self) -> bool:
        """List into the caller; False when the collection is not served (and may not be)."""
        try:
            listing = await self._kube.request("GET", self._path, query=self._query)
        except ApiError as exc:
            if self._absent_retry_s is None or exc.status != 404:
                raise
            self.resource_version = None
            self._on_list([])
            log.warning(
                "collection not served (CRD not installed?); treating it as empty until it is",
                extra={"fields": {**self._fields, "retry_s": self._absent_retry_s}},
            )
            return False
        self._on_list(listing.get("items") or [])
        self.resource_version = listing["metadata"]["resourceVersion"]
        return True

    async def _watch_until_error(self) -> dict[str, Any]:
        """Watch from `resource_version`, resuming after every clean end of the stream;
        returns the object of the ERROR event that calls for a relist."""
        while True:
            query = {
                **self._query,
                "resourceVersion": str(self.resource_version),
                "allowWatchBookmarks": "true",
            }
            events = 0
            async for event in self._kube.watch(self._path, query, self._watch_timeout_s):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    return dict(obj)
                if kind in _OBJECT_EVENTS:
                    self._on_event(kind, obj)
                elif kind != "BOOKMARK":
                    log.warning(
                        "ignoring a watch event of unknown type",
                        extra={"fields": {**self._fields, "type": str(kind)}},
                    )
                    continue
                events += 1
                self._progress = True
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if version:
                    self.resource_version = version
            if not events:
                # An empty stream is either a quiet collection (the server's bookmark
                # came too late or not at all) or an endpoint that closes every
                # stream at once (a proxy, a server shutting down): never spin on it.
                await anyio.sleep(self._next_delay())

    def _next_delay(self) -> float:
        if self._progress:
            self._progress = False
            self._delays = self._backoff.delays()
        return next(self._delays)

    async def _pause_before_relist(self, error: str, *, expired: bool) -> None:
        """Wait before the next list: even an expiry, so a server that keeps answering
        410 to a fresh version cannot make us list in a tight loop."""
        delay = self._next_delay()
        fields = {**self._fields, "error": error, "retry_s": delay}
        if expired:  # routine: the server forgot our version during a quiet spell
            log.debug("watch expired; listing again", extra={"fields": fields})
        else:
            log.warning("watch failed; listing again", extra={"fields": fields})
        await anyio.sleep(delay)
