"""Namespace-wide LISTs an admission reads, shared by the admissions made together.

Some admissions read a whole collection of their namespace: a claim created under a
per-pod device limit lists the namespace's pods, and the claims made for each pod that
uses it; a template created lists the namespace's Kueue Workloads. A tenant controls
both how many objects the namespace holds and how often those admissions come: thousands
of cheap objects, then as many creations at once, would make the API server serialise,
and the webhook parse and hold, the whole collection once per admission. `SharedLists`
makes each such list once for the reads that arrive together, in pages, keeping for each
read only what it asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
from gpudra.common.kube import ApiError, Kube

__all__ = ["PER_PAGE", "Keep", "ListError", "SharedLists"]

PER_PAGE: Final = 100
"""Objects one response of a list holds: a hostile tenant makes its objects as big as
the API server stores (1.5 MiB each), so a page is bounded by count, the only bound a
list has, and kept small; 10,000 objects are 100 round trips."""

Keep = Callable[[Mapping[str, Any]], bool]
"""Which objects of a list a read keeps."""


class ListError(Exception):
    """A collection could not be listed whole: what failed, for a denial."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The API server's status where the list's first page was refused (404: the
        resource is not served there), else None: a later page's failure means the
        collection is served but could not be read whole."""


@dataclass(eq=False)
class _List:
    """One LIST of a collection, shared by every read that joined it before it began:
    each gets the objects its filter keeps, or the list's failure."""

    readers: list[tuple[Keep, list[Mapping[str, Any]]]] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    failure: ListError | None = None
    abandoned: bool = False
    """Its leader was cancelled: the other readers list again, each from its own start."""


_Key = tuple[str, tuple[tuple[str, str], ...]]
"""A list's collection path and query (without ``limit``/``continue``)."""


class SharedLists:
    """The lists of collections being made for the reads waiting on them, by collection
    and query; nothing is kept once a list has ended.

    - Reads of one collection and query share lists (single flight). A read joins only a
      list that has not begun, and a list begins only once the one before it has ended:
      every object stored before a read began is in the list it gets, as in a list of
      its own (a list already under way may have been read before an object the read's
      admission depends on was stored a moment ago, and would let it be decided without
      it). So at most one list of a collection is made at a time, and reads made
      together cost two lists, however many they are; a read waits for at most the list
      under way and its own. A read whose list's leader was cancelled (its admission
      ran out of time) lists again, from its own start.
    - A list is read in pages of `PER_PAGE` (``limit``/``continue``), and each read
      keeps of each page only the objects its filter accepts, so the webhook holds one
      page and the objects that matter, not the namespace. An error on any page, a
      continue token that expired (410) included, fails the whole list for every read
      of it (`ListError`): a list missing pages would leave their objects uncounted, and
      one restarted from an expired token is not consistent.
    - The list is a consistent read (no ``resourceVersion``), and its pages are served
      from the first page's snapshot. ``resourceVersion=0`` would let the watch cache
      answer, cheaper for the API server but as stale as the cache: an object stored
      just before the admission could be missing. (Older API servers also ignore
      ``limit`` for it, returning the whole list in one.)

    A list is not stopped once one read's answer is known: the others that share it
    need the rest.
    """

    def __init__(self, kube: Kube, *, per_page: int = PER_PAGE) -> None:
        self.kube = kube
        self._per_page = per_page
        # By key: the list readers may still join, and the one being made.
        self._waiting: dict[_Key, _List] = {}
        self._listing: dict[_Key, anyio.Event] = {}

    async def read(
        self, path: str, keep: Keep, query: Mapping[str, str] | None = None
    ) -> list[Mapping[str, Any]]:
        """The objects of the collection at `path` (listed with `query`) that `keep`
        accepts, in the API server's order; raises `ListError` where they cannot all
        be listed."""
        key: _Key = (path, tuple(sorted((query or {}).items())))
        while True:
            waiting = self._waiting.get(key)
            leader = waiting is None
            if waiting is None:
                waiting = self._waiting[key] = _List()
            found: list[Mapping[str, Any]] = []
            reader = (keep, found)
            waiting.readers.append(reader)
            try:
                if leader:
                    await self._list(key, waiting)
                else:
                    await waiting.done.wait()
            finally:
                if not waiting.done.is_set():
                    waiting.readers.remove(reader)
            if waiting.abandoned:
                continue
            if (failure := waiting.failure) is not None:
                raise ListError(str(failure), status=failure.status) from failure.__cause__
            return found

    async def _list(self, key: _Key, made: _List) -> None:
        """Make the list `made` (its leader's part): once the list of `key` under way
        has ended, closed to new readers, page by page."""
        try:
            while (under_way := self._listing.get(key)) is not None:
                await under_way.wait()
            if self._waiting.get(key) is made:
                del self._waiting[key]
            self._listing[key] = ended = anyio.Event()
            try:
                await self._pages(key, made)
            finally:
                del self._listing[key]
                ended.set()
        except ListError as exc:
            made.failure = exc
        except Exception as exc:
            failure = ListError(str(exc) or type(exc).__name__)
            failure.__cause__ = exc
            made.failure = failure
        except BaseException:  # cancelled: the other readers are not, and list again
            made.abandoned = True
            raise
        finally:
            if self._waiting.get(key) is made:
                del self._waiting[key]
            made.done.set()

    async def _pages(self, key: _Key, made: _List) -> None:
        path = key[0]
        query = {**dict(key[1]), "limit": str(self._per_page)}
        page = 0
        while True:
            page += 1
            try:
                listing = await self.kube.request("GET", path, query=dict(query))
            except ApiError as e:
                if page == 1:
                    raise ListError(str(e), status=e.status) from e
                raise ListError(
                    f"{e} (page {page} of the list of {_described(path)}; what the pages "
                    "not read hold would be left uncounted)"
                ) from e
            items = listing.get("items") if isinstance(listing, dict) else None
            readers = tuple(made.readers)  # one cancelled meanwhile still gets this page
            for obj in items if isinstance(items, list) else ():
                if isinstance(obj, dict):
                    for keep, found in readers:
                        if keep(obj):
                            found.append(obj)
            metadata = listing.get("metadata") if isinstance(listing, dict) else None
            token = metadata.get("continue") if isinstance(metadata, dict) else None
            if not isinstance(token, str) or not token:
                return
            query["continue"] = token


def _described(path: str) -> str:
    """A collection's path in words: ``pods of namespace ns``, with the API group and
    version of a resource outside the core group."""
    parts = path.strip("/").split("/")
    if len(parts) < 4 or parts[-3] != "namespaces":
        return path
    group = f" ({'/'.join(parts[1:-3])})" if parts[0] == "apis" else ""
    return f"{parts[-1]}{group} of namespace {parts[-2]}"
