"""JSON access to the API server through kubernetes_asyncio's ApiClient.

The ApiClient gives us kubeconfig/in-cluster auth and TLS; we exchange plain JSON
instead of generated model objects because a node agent (and the slice benchmark,
200 of them in one process) spends most of its time (de)serialising otherwise.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from kubernetes_asyncio import config as kconfig
from kubernetes_asyncio.client import ApiClient, Configuration

log = logging.getLogger(__name__)

RESOURCE_API = "/apis/resource.k8s.io/v1"


class ApiError(Exception):
    """An HTTP error from the API server, with its Status message."""

    def __init__(self, status: int, message: str, method: str, path: str) -> None:
        self.status = status
        self.message = message
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


class Kube:
    def __init__(self, api: ApiClient) -> None:
        self.api = api

    @classmethod
    async def connect(
        cls, kubeconfig: str | None = None, *, max_connections: int | None = 100
    ) -> Kube:
        """kubeconfig if given (or $KUBECONFIG), else the in-cluster service account.

        Each watch holds a connection for its lifetime, so a process that runs many
        watches (the slice benchmark) needs `max_connections` above their count.
        """
        cfg = Configuration()
        cfg.connection_pool_maxsize = max_connections  # type: ignore[assignment]  # None: no limit
        path = kubeconfig or os.environ.get("KUBECONFIG")
        if path:
            await kconfig.load_kube_config(config_file=path, client_configuration=cfg)
        else:
            kconfig.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        return cls(ApiClient(configuration=cfg))

    async def close(self) -> None:
        await self.api.close()

    async def _send(
        self,
        *,
        method: str,
        path: str,
        body: Any,
        query: dict[str, str] | None,
        content_type: str,
        request_timeout: float | aiohttp.ClientTimeout | None,
    ) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        if body is not None:
            return await self._send_body(method, path, body, query, headers, request_timeout)
        return await self.api.call_api(
            path,
            method,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=request_timeout,
        )

    async def _send_body(
        self,
        method: str,
        path: str,
        body: Any,
        query: dict[str, str] | None,
        headers: dict[str, str],
        request_timeout: float | aiohttp.ClientTimeout | None,
    ) -> Any:
        """Send a body serialised once, compactly, straight through the ApiClient's session.

        `call_api` walks every value of a body to "sanitise" it and then encodes it
        again; for a ResourceSlice of 64 devices that is most of a write's CPU time.
        Auth, TLS and connection pooling are still the ApiClient's.
        """
        queries = list((query or {}).items())
        await self.api.update_params_for_auth(headers, queries, ["BearerToken"])
        if isinstance(request_timeout, aiohttp.ClientTimeout):
            timeout = request_timeout
        else:
            timeout = aiohttp.ClientTimeout(total=request_timeout)
        data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":"))
        session: aiohttp.ClientSession = self.api.rest_client.pool_manager
        return await session.request(
            method,
            f"{self.api.configuration.host}{path}",
            params=queries,
            data=data,
            headers=headers,
            timeout=timeout,
        )

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        request_timeout_s: float = 30.0,
    ) -> Any:
        resp = await self._send(
            method=method,
            path=path,
            body=body,
            query=query,
            content_type=content_type,
            request_timeout=request_timeout_s,
        )
        try:
            raw = await resp.read()
        finally:
            resp.release()
        data: Any = json.loads(raw) if raw else None
        if resp.status >= 400:
            msg = data.get("message", "") if isinstance(data, dict) else str(data)
            raise ApiError(resp.status, msg, method, path)
        return data

    async def watch(
        self, path: str, query: dict[str, str], timeout_s: int = 300
    ) -> AsyncIterator[dict[str, Any]]:
        """Yields watch events; ends when the server closes the stream."""
        q = {**query, "watch": "true", "timeoutSeconds": str(timeout_s)}
        resp = await self._send(
            method="GET",
            path=path,
            body=None,
            query=q,
            content_type="application/json",
            request_timeout=aiohttp.ClientTimeout(sock_connect=10, sock_read=timeout_s + 30),
        )
        try:
            if resp.status >= 400:
                raw = await resp.read()
                raise ApiError(resp.status, raw.decode(errors="replace"), "WATCH", path)
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        finally:
            resp.release()

    async def server_minor(self) -> int:
        info = await self.request("GET", "/version")
        return int("".join(ch for ch in str(info.get("minor", "0")) if ch.isdigit()) or 0)
