"""Creates the ResourceClaimTemplates converted pods refer to, through the API server.

Creation is idempotent (AlreadyExists is success: a template name always stands for
the same content) and dry-run admission requests are passed on as dry-run creates,
so they are validated but nothing is stored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpudra.common.kube import RESOURCE_API, ApiError, Kube


class ApiTemplateEnsurer:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    async def __call__(
        self, namespace: str, templates: Sequence[Mapping[str, Any]], dry_run: bool
    ) -> None:
        path = f"{RESOURCE_API}/namespaces/{namespace}/resourceclaimtemplates"
        query = {"dryRun": "All"} if dry_run else None
        for tpl in templates:
            body = {**tpl, "metadata": {**tpl["metadata"], "namespace": namespace}}
            try:
                await self.kube.request("POST", path, body, query=query)
            except ApiError as e:
                if e.status != 409:
                    raise
