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
from gpudra.common.kube import AnswerTooLarge, ApiError, Kube

__all__ = ["PAGES_AT_ONCE", "PAGE_BYTES", "PER_PAGE", "Keep", "ListError", "SharedLists"]

PER_PAGE: Final = 100
"""Objects one response of a list holds: a hostile tenant makes its objects as big as
the API server stores (1.5 MiB each), so a page is bounded by count, the only bound a
list has, and kept small; 10,000 objects are 100 round trips. Where the objects are
that big a page of them is over `PAGE_BYTES`, and read again in smaller pages."""

PAGE_BYTES: Final = 4 * 2**20
"""The JSON a page of a list is read within (`Kube.request`'s ``max_bytes``): a count of
objects does not bound a page's size, a tenant deciding how large its objects are, and
parsed JSON takes up to about 14 times its size (measured for pods of ~50,000 tiny env
entries each: 20 of them, 28 MiB of JSON, held ~390 MiB), so a page of 4 MiB holds at
most ~56 MiB parsed, which the webhook's memory budget counts beside its connections
(`PAGES_AT_ONCE`, docs/security.md). A page over it is read again with a quarter of its
objects; an object over it alone fails the list (`ListError`), denying the admissions of
its namespace that need the list, and only those. 4 MiB is above the 3 MiB the API
server takes in a JSON request body, so an object written as JSON fits a page of its
own; only one made to be larger (the JSON of an object stored as protobuf, whose 1.5 MiB
limit in etcd can render as twice that and more) fails its own namespace's lists."""

PAGES_AT_ONCE: Final = 1
"""How many pages the lists of one `SharedLists`, of every namespace, read and hold at
a time: each is bounded (`PAGE_BYTES`), but the admissions of many namespaces list at
once, each tenant's at its own pace; at most this many pages are in memory together,
and the others wait their turn. One: a page is read and parsed in milliseconds, and the
webhook's memory limit (512Mi by default) already holds its connections' worst case
(docs/security.md), which leaves room for one page of the worst kind (~60 MiB), not
more."""

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
      page and the objects that matter, not the namespace. A page is read within
      `PAGE_BYTES` (a smaller page where it is over), and at most `PAGES_AT_ONCE` pages
      of all the lists are read and held at a time, so that what the webhook holds for
      its lists is bounded whatever its tenants store. A page that is not a list of
      objects fails the list too. An error on any page, a
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

    def __init__(
        self,
        kube: Kube,
        *,
        per_page: int = PER_PAGE,
        page_bytes: int = PAGE_BYTES,
        pages_at_once: int = PAGES_AT_ONCE,
    ) -> None:
        self.kube = kube
        self._per_page = per_page
        self._page_bytes = page_bytes
        self._pages_at_once = anyio.CapacityLimiter(pages_at_once)
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
        """Read the list of `key` page by page, each page's objects handed to the
        readers of `made` before the next is read; at most `pages_at_once` pages of all
        this instance's lists are read and held at a time."""
        path = key[0]
        query = {**dict(key[1]), "limit": str(self._per_page)}
        page = 0
        while True:
            page += 1
            async with self._pages_at_once:
                listing = await self._page(path, query, page)
                token = self._hand_on(path, page, listing, made)
                del listing  # held no longer than the limiter is
            if token is None:
                return
            query["continue"] = token

    async def _page(self, path: str, query: dict[str, str], page: int) -> Any:
        """Page `page` of the list of `path` (`query` its ``limit`` and ``continue``),
        read within `page_bytes`: a page over it is read again, from the same place,
        with a quarter of its ``limit`` (the API server takes another limit with a
        continue token), and `query` keeps that limit for the pages after it."""
        while True:
            try:
                return await self.kube.request(
                    "GET", path, query=dict(query), max_bytes=self._page_bytes
                )
            except AnswerTooLarge as e:
                limit = int(query["limit"])
                if limit > 1:
                    query["limit"] = str(max(1, limit // 4))
                    continue
                raise ListError(
                    f"an object of the {_described(path)} is over the {e.bound} bytes the "
                    f"webhook reads at a time (page {page} of their list is at least {e.size} "
                    "bytes): the namespace's objects are too large to count; delete or "
                    "shrink them"
                ) from e
            except ApiError as e:
                if page == 1:
                    raise ListError(str(e), status=e.status) from e
                raise ListError(
                    f"{e} (page {page} of the list of {_described(path)}; what the pages "
                    "not read hold would be left uncounted)"
                ) from e

    @staticmethod
    def _hand_on(path: str, page: int, listing: Any, made: _List) -> str | None:
        """Hand each object of page `page` of the list of `path` to the readers of
        `made` whose filters keep it: the continue token of the next page, None where
        this was the last. A page that is not a list of objects raises `ListError`:
        ended as if complete, the list would leave the objects of the pages after it
        uncounted."""

        def malformed(what: str) -> ListError:
            return ListError(
                f"page {page} of the list of {_described(path)} is not a list the API "
                f"server sends: {what}"
            )

        if not isinstance(listing, dict):
            raise malformed(f"the answer is a {type(listing).__name__}, not an object")
        items = listing.get("items")
        if items is None:
            items = []  # the API server leaves out an empty list's items
        if not isinstance(items, list):
            raise malformed(f"its items are a {type(items).__name__}, not a list")
        if not all(isinstance(obj, dict) for obj in items):
            raise malformed("one of its items is not an object")
        metadata = listing.get("metadata")
        token = metadata.get("continue") if isinstance(metadata, dict) else None
        if token is not None and not isinstance(token, str):
            raise malformed(f"its continue token is a {type(token).__name__}, not a string")
        readers = tuple(made.readers)  # one cancelled meanwhile still gets this page
        for obj in items:
            for keep, found in readers:
                if keep(obj):
                    found.append(obj)
        return token or None


def _described(path: str) -> str:
    """A collection's path in words: ``pods of namespace ns``, with the API group and
    version of a resource outside the core group."""
    parts = path.strip("/").split("/")
    if len(parts) < 4 or parts[-3] != "namespaces":
        return path
    group = f" ({'/'.join(parts[1:-3])})" if parts[0] == "apis" else ""
    return f"{parts[-1]}{group} of namespace {parts[-2]}"
