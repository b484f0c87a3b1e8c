"""JSON access to the API server through kubernetes_asyncio's ApiClient.

The ApiClient gives us kubeconfig/in-cluster auth and TLS; we exchange plain JSON
instead of generated model objects because a node agent (and the slice benchmark,
200 of them in one process) spends most of its time (de)serialising otherwise. Nor do
we import those models: kubernetes_asyncio is imported only in `Kube.connect`, after
`defer_generated_code()` (see `common/kubeimports.py`), which keeps about 1,000 unused
generated modules out of every process.

The JSON itself goes through `gpudra.api.jsonbytes` (orjson): a node's slices are
hundreds of KiB of JSON, written once and read back twice (the write's answer and the
watch event), and the standard library's codec took several times its CPU for them,
on cores a node shares with its workloads.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from gpudra.api import jsonbytes
from gpudra.common.kubeimports import defer_generated_code
from yarl import URL

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

log = logging.getLogger(__name__)

RESOURCE_API = "/apis/resource.k8s.io/v1"


def claim_path(namespace: str, name: str) -> str:
    """The API path of one ResourceClaim."""
    return f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims/{name}"


class ApiError(Exception):
    """An HTTP error from the API server, with its Status message."""

    def __init__(self, status: int, message: str, method: str, path: str) -> None:
        self.status = status
        self.message = message
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


class UndecodableAnswer(ApiError):
    """An answer the API server sent that is not JSON even as Go reads it (see
    `gpudra.api.jsonbytes`): nothing it stores is, but a listing or a watch event wraps
    an object in two more levels of nesting, which can take one at Go's limit past it.
    An ApiError, so whoever handles the server's errors handles this one too, and names
    the request, the status and the place in the answer."""

    def __init__(self, status: int, error: jsonbytes.DecodeError, method: str, path: str) -> None:
        super().__init__(
            status,
            f"the answer is not JSON that Go's decoder reads either: {error}",
            method,
            path,
        )


class AnswerTooLarge(ApiError):
    """An answer larger than the read that asked for it takes (`Kube.request`'s
    ``max_bytes``): its Content-Length said so, or more than that arrived, and the rest
    was not read. Parsed JSON takes many times its size in memory, and a tenant decides
    how large what it stores is: a read of what a tenant stores is bounded before its
    answer is held whole. An ApiError, so whoever handles the server's errors handles
    this one too, and names the request, the status and both sizes."""

    def __init__(self, status: int, size: int, bound: int, method: str, path: str) -> None:
        super().__init__(
            status,
            f"the answer is at least {size} bytes, over the {bound} bytes this read takes",
            method,
            path,
        )
        self.size = size
        """How large the answer is at least: its Content-Length, or what arrived."""
        self.bound = bound


_CHUNK = 2**16
"""What a bounded read takes of an answer at a time: how far past its bound it reads."""


class KubeConfigError(Exception):
    """Neither a usable kubeconfig nor an in-cluster service account."""


def kubeconfig_source(explicit: str | None, environ: Mapping[str, str], home: Path) -> str | None:
    """The kubeconfig to read, or None for the in-cluster service account.

    The order kubectl and client-go follow, so that a command that works with kubectl
    works with gpudra: the file given, else `$KUBECONFIG` (a list of files, merged),
    else `~/.kube/config` where it exists, else the service account of the pod we run
    in. The agent and the webhook run in pods whose image has no `~/.kube/config`.
    """
    if explicit:
        return explicit
    if listed := environ.get("KUBECONFIG"):
        return listed
    default = home / ".kube" / "config"
    return str(default) if default.is_file() else None


class Kube:
    def __init__(self, api: ApiClient) -> None:
        self.api = api
        self._session: aiohttp.ClientSession | None = None
        self._options: dict[str, Any] = {}

    @classmethod
    async def connect(
        cls, kubeconfig: str | None = None, *, max_connections: int | None = 100
    ) -> Kube:
        """The cluster `kubeconfig_source` names: a kubeconfig, or the in-cluster
        service account.

        Each watch holds a connection for its lifetime, so a process that runs many
        watches (the slice benchmark) needs `max_connections` above their count.
        Raises KubeConfigError (callers need not import kubernetes_asyncio for it).
        """
        defer_generated_code()
        # Imported here, after the deferral, so that no import of this module loads
        # the client's generated code.
        from kubernetes_asyncio import config as kconfig  # noqa: PLC0415
        from kubernetes_asyncio.client import ApiClient, Configuration  # noqa: PLC0415

        cfg = Configuration()
        cfg.connection_pool_maxsize = max_connections  # type: ignore[assignment]  # None: no limit
        path = kubeconfig_source(kubeconfig, os.environ, Path.home())
        try:
            if path:
                await kconfig.load_kube_config(config_file=path, client_configuration=cfg)
            else:
                kconfig.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except kconfig.ConfigException as e:
            raise KubeConfigError(str(e)) from e
        return cls(ApiClient(configuration=cfg))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self.api.close()

    def _http(self) -> aiohttp.ClientSession:
        """A session over the ApiClient's connector (its TLS and connection pool).

        The ApiClient's own session trusts the environment, which makes aiohttp look
        up ~/.netrc and the proxy variables in worker threads on every request: two
        thread hops per call, most of a small GET's CPU time. The proxy the
        environment names (as client-go honours HTTPS_PROXY/NO_PROXY) is resolved
        here once instead; the environment does not change while we run.
        """
        if self._session is None:
            cfg = self.api.configuration
            options: dict[str, Any] = {}
            if cfg.proxy:
                options["proxy"] = cfg.proxy
                if cfg.proxy_headers:
                    options["proxy_headers"] = cfg.proxy_headers
            else:
                with contextlib.suppress(LookupError):
                    options["proxy"], options["proxy_auth"] = get_env_proxy_for_url(
                        URL(str(cfg.host))
                    )
            if cfg.tls_server_name:
                options["server_hostname"] = cfg.tls_server_name
            pool: aiohttp.ClientSession = self.api.rest_client.pool_manager
            self._options = options
            self._session = aiohttp.ClientSession(
                connector=pool.connector,
                connector_owner=False,
                # As the ApiClient's: watch events of large objects exceed the default.
                read_bufsize=2**21,
            )
        return self._session

    async def _send(
        self,
        *,
        method: str,
        path: str,
        body: Any,
        query: dict[str, str] | None,
        content_type: str,
        request_timeout: float | aiohttp.ClientTimeout | None,
    ) -> aiohttp.ClientResponse:
        """Send a request, with a body serialised once, compactly.

        `call_api` walks every value of a body to "sanitise" it and then encodes it
        again; for a ResourceSlice of 64 devices that is most of a write's CPU time.
        Auth (including token refresh) is still the ApiClient's.
        """
        session = self._http()
        headers = {"Accept": "application/json", "Content-Type": content_type}
        queries = list((query or {}).items())
        await self.api.update_params_for_auth(headers, queries, ["BearerToken"])
        if isinstance(request_timeout, aiohttp.ClientTimeout):
            timeout = request_timeout
        else:
            timeout = aiohttp.ClientTimeout(total=request_timeout)
        url = f"{self.api.configuration.host}{path}"
        if queries:
            url += "?" + urlencode(queries)
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else jsonbytes.dumps(body)
        return await session.request(
            method, url, data=data, headers=headers, timeout=timeout, **self._options
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
        max_bytes: int | None = None,
    ) -> Any:
        """The answer to a request, parsed; raises ApiError for an HTTP error.

        With `max_bytes`, an answer larger than that raises `AnswerTooLarge` having held
        no more than about that many bytes of it (and the connection's read buffer), for
        a read of what a tenant decides the size of; without, the answer is read whole.
        """
        resp = await self._send(
            method=method,
            path=path,
            body=body,
            query=query,
            content_type=content_type,
            request_timeout=request_timeout_s,
        )
        try:
            raw = await self._body(resp, max_bytes, method, path)
        except BaseException:
            # An answer not read to its end: its connection is closed, not pooled,
            # where the rest of it would be read as the next request's answer.
            resp.close()
            raise
        resp.release()
        if resp.status >= 400:
            # A Status object, or plain text (`404 page not found` for an API group
            # that is not served, e.g. a CRD not installed).
            try:
                data: Any = jsonbytes.loads(raw) if raw else None
            except ValueError:
                data = raw.decode(errors="replace").strip()
            msg = data.get("message", "") if isinstance(data, dict) else str(data)
            raise ApiError(resp.status, msg, method, path)
        try:
            return jsonbytes.loads(raw) if raw else None
        except jsonbytes.DecodeError as exc:
            raise UndecodableAnswer(resp.status, exc, method, path) from None

    @staticmethod
    async def _body(
        resp: aiohttp.ClientResponse, max_bytes: int | None, method: str, path: str
    ) -> bytes:
        """The body of `resp`, refused (`AnswerTooLarge`) once it is known to exceed
        `max_bytes`: at once where its Content-Length says so, else (a chunked or
        compressed answer, whose Content-Length, if any, is not what it decodes to) as
        soon as more than that has arrived, read in `_CHUNK`s."""
        if max_bytes is None:
            return await resp.read()
        if resp.content_length is not None and resp.content_length > max_bytes:
            raise AnswerTooLarge(resp.status, resp.content_length, max_bytes, method, path)
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_chunked(_CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise AnswerTooLarge(resp.status, size, max_bytes, method, path)
            chunks.append(chunk)
        return b"".join(chunks)

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
                        try:
                            event = jsonbytes.loads(line)
                        except jsonbytes.DecodeError as exc:
                            raise UndecodableAnswer(resp.status, exc, "WATCH", path) from None
                        yield event
        finally:
            resp.release()

    async def server_minor(self) -> int:
        info = await self.request("GET", "/version")
        return int("".join(ch for ch in str(info.get("minor", "0")) if ch.isdigit()) or 0)
