"""Creates the ResourceClaimTemplates converted pods refer to, through the API server.

Creation is idempotent (AlreadyExists is success: a template name always stands for
the same content) and dry-run admission requests are passed on as dry-run creates,
so they are validated but nothing is stored.

Templates known to exist are remembered for `ttl_s`, so a burst of pods of one
shape costs one API call, not one per pod: the webhook's latency budget (p99 under
10 ms) has no room for a round trip per admission. The price is a bounded window: a
template deleted by hand is re-created by the first pod after its entry expires; a
pod admitted inside the window stays Pending until then, and the controller-manager
retries its claim by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpudra.common.kube import RESOURCE_API, ApiError, Kube

DEFAULT_TTL_S = 60.0
_MAX_ENTRIES = 10_000


class ApiTemplateEnsurer:
    def __init__(
        self,
        kube: Kube,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self._ttl_s = ttl_s
        self._clock = clock
        self._known: dict[tuple[str, str], float] = {}  # (namespace, name) -> expiry

    async def __call__(
        self, namespace: str, templates: Sequence[Mapping[str, Any]], dry_run: bool
    ) -> None:
        path = f"{RESOURCE_API}/namespaces/{namespace}/resourceclaimtemplates"
        query = {"dryRun": "All"} if dry_run else None
        now = self._clock()
        for tpl in templates:
            key = (namespace, str(tpl["metadata"]["name"]))
            if not dry_run and self._known.get(key, 0.0) > now:
                continue
            body = {**tpl, "metadata": {**tpl["metadata"], "namespace": namespace}}
            try:
                await self.kube.request("POST", path, body, query=query)
            except ApiError as e:
                if e.status != 409:
                    raise
            if not dry_run:
                self._remember(key, now)

    def _remember(self, key: tuple[str, str], now: float) -> None:
        if len(self._known) >= _MAX_ENTRIES:
            self._known = {k: t for k, t in self._known.items() if t > now}
            if len(self._known) >= _MAX_ENTRIES:
                self._known.clear()
        self._known[key] = now + self._ttl_s
