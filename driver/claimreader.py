"""Reading the ResourceClaims the kubelet names from the API server.

What the upstream kubeletplugin library does before it calls a driver: GET each
claim and check it (`gpudra.driver.claims.checked_claim`), every failure becoming
that claim's error. The GET is a consistent read (no resourceVersion=0): a claim
deleted and re-created a moment ago must not be answered from a watch cache that
still has the old one. The sweep for claims deleted behind the kubelet's back asks
the same object for a claim's current UID.

After an agent restart the claims prepared before it are read again for what the
checkpoint does not keep (`ClaimInfo`: DeviceClass, slice memory, integer shares), and
a read that fails only for the moment (a timeout, 429, an API server restarting) is
retried with the shared backoff until the claim is read or leaves the checkpoint:
until then its holders are `Unknown` and not billed (`gpudra.driver.holders`), so one
failed read must not leave them so for the claim's whole life.

This is the only place the node reads claims from the API; the device layer sees
neither HTTP nor API objects.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import anyio
from gpudra.common.backoff import Backoff
from gpudra.common.errors import exception_text
from gpudra.common.kube import ApiError, Kube, claim_path
from gpudra.driver.checkpoint import ClaimRecord
from gpudra.driver.claims import (
    Claim,
    ClaimError,
    ClaimRef,
    check_ref,
    checked_claim,
    reserved_pods,
)
from gpudra.driver.holders import ClaimInfos, claim_info
from gpudra.driver.podclaims import uses_claim_on

__all__ = ["ApiClaims", "ReadFailed"]

log = logging.getLogger(__name__)


class ReadFailed(ClaimError):
    """Reading a claim failed without an answer about the claim (a timeout, 429, an
    API server restarting): a later read may succeed, where a 404 or a claim that is
    not the one prepared would say the same again."""


class ApiClaims:
    """The claims of `driver` in `pool` (this node), as the API server has them.

    A `ClaimSource` for the kubelet plugin and a `ClaimLookup` for the preparer's
    sweep of deleted claims.
    """

    def __init__(
        self,
        kube: Kube,
        *,
        driver: str,
        pool: str,
        timeout_s: float = 10.0,
        infos: ClaimInfos | None = None,
    ) -> None:
        """`infos` remembers what the metrics need of each claim read (DeviceClass,
        slice memory) that the checkpoint does not keep."""
        self._infos = infos
        self._kube = kube
        self._driver = driver
        self._pool = pool
        self._timeout_s = timeout_s

    async def read(self, ref: ClaimRef) -> Claim:
        """The claim `ref` names, checked; raises ClaimError with the kubelet's message."""
        check_ref(ref)
        path = claim_path(ref.namespace, ref.name)
        try:
            obj = await self._kube.request("GET", path, request_timeout_s=self._timeout_s)
        except ApiError as exc:
            if exc.status == 404:
                raise ClaimError(
                    f"{ref.describe()} does not exist in the API server (deleted?); nothing "
                    "to prepare"
                ) from None
            raise ReadFailed(f"{ref.describe()}: reading it failed: {exc}") from None
        except Exception as exc:
            raise ReadFailed(
                f"{ref.describe()}: reading it from the API server failed: {exception_text(exc)}"
            ) from None
        claim = checked_claim(ref, obj, driver=self._driver, pool=self._pool)
        if self._infos is not None and isinstance(obj, Mapping):
            self._infos.remember(ref.uid, claim_info(obj, claim))
        return claim

    async def read_unknown(
        self, prepared: Callable[[], Iterable[ClaimRecord]], *, backoff: Backoff | None = None
    ) -> None:
        """Read each completed claim of `prepared()` whose `ClaimInfo` is not known yet,
        until every one is read or settled, then return.

        A read that failed for the moment (`ReadFailed`) is tried again after the next
        delay of `backoff`; a claim that is gone (404) or is no longer the one prepared
        is settled, since reading it again would answer the same, and so is one read
        without an object to remember. `prepared()` is asked again before every pass,
        so a claim that left the checkpoint is no longer read. Each claim is read at
        most once per pass, and the loop ends once nothing is left to read: a claim
        prepared later was read for its prepare.
        """
        infos = self._infos
        if infos is None:
            return
        delays = (backoff or Backoff()).delays()
        settled: set[str] = set()
        failing: set[str] = set()
        while True:
            known = infos.snapshot()
            unread = [r.ref for r in prepared() if r.completed and r.uid not in known]
            settled &= {ref.uid for ref in unread}
            failing &= {ref.uid for ref in unread}
            pending = [ref for ref in unread if ref.uid not in settled]
            if not pending:
                return
            retry = False
            for ref in pending:
                fields = {"claim": ref.describe()}
                try:
                    await self.read(ref)
                except ReadFailed as exc:
                    retry = True
                    # Once per claim at info: an API server away for long repeats it.
                    level = logging.DEBUG if ref.uid in failing else logging.INFO
                    failing.add(ref.uid)
                    log.log(
                        level,
                        "a prepared claim could not be read again; its holders stay "
                        "Unknown and unbilled until a retry reads it",
                        extra={"fields": {**fields, "error": str(exc)}},
                    )
                    continue
                except ClaimError as exc:
                    log.info(
                        "a prepared claim is no longer there to read; its holders stay "
                        "Unknown and unbilled",
                        extra={"fields": {**fields, "error": str(exc)}},
                    )
                settled.add(ref.uid)
                failing.discard(ref.uid)
            if retry:
                await anyio.sleep(next(delays))

    async def current_uid(self, ref: ClaimRef) -> str | None:
        """The UID of the claim now at `ref`'s namespace and name; None when there is
        none. Raises when the API server cannot tell."""
        obj = await self._get_or_none(claim_path(ref.namespace, ref.name))
        return (_uid(obj) or None) if isinstance(obj, Mapping) else None

    async def still_used(self, ref: ClaimRef, pod: str, pod_uid: str) -> bool:
        """Whether pod `pod` of the claim's namespace (that very pod, where its UID
        `pod_uid` is known) still runs on this node and names the claim `ref` names, in
        a claim entry or as its extended-resource claim: its containers may still have
        the devices, and the kubelet unprepares the claim once that pod ends. A new pod
        of the same name is another pod. Raises when the API server cannot tell."""
        if not pod:
            return False
        name = urllib.parse.quote(pod, safe="")
        obj = await self._get_or_none(f"/api/v1/namespaces/{ref.namespace}/pods/{name}")
        if not (isinstance(obj, Mapping) and uses_claim_on(obj, self._pool, ref.name, pod_uid)):
            return False
        if pod_uid:
            return True
        # A record of a release that kept no pod UID: a pod of that name may be a new one,
        # naming a claim created again under the claim's name. The claim now there, if
        # another and reserved for this pod, is the one the pod uses.
        current = await self._get_or_none(claim_path(ref.namespace, ref.name))
        if not isinstance(current, Mapping) or _uid(current) in ("", ref.uid):
            return True
        return _uid(obj) not in reserved_pods(current).values()

    async def _get_or_none(self, path: str) -> Any:
        """The object at `path`; None when there is none (404). Raises otherwise."""
        try:
            return await self._kube.request("GET", path, request_timeout_s=self._timeout_s)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise


def _uid(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    return uid if isinstance(uid, str) else ""
