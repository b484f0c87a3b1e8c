"""The API client's transport: the ApiClient's TLS, pool and auth, without per-request
environment lookups, which cost two worker-thread hops per call."""

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from gpudra.common.kube import ApiError, Kube
from kubernetes_asyncio.client import ApiClient, Configuration

from tests.common.loopback import serving


@asynccontextmanager
async def _server(
    seen: list[dict[str, Any]], reply: Callable[[], web.Response] | None = None
) -> AsyncIterator[str]:
    """An HTTP server answering every path with `reply()` (default {"ok": true});
    records each request."""

    async def answer(request: web.Request) -> web.Response:
        seen.append({"url": str(request.url), "headers": dict(request.headers)})
        return reply() if reply is not None else web.json_response({"ok": True})

    async with serving(answer) as host:
        yield host


def _kube(host: str, *, token: str | None = None) -> Kube:
    cfg = Configuration(host=host)
    if token is not None:
        cfg.api_key = {"BearerToken": token}
        cfg.api_key_prefix = {"BearerToken": "Bearer"}
    return Kube(ApiClient(configuration=cfg))


def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


def _netrc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "netrc"
    path.write_text("machine 127.0.0.1 login someone password secret\n")
    path.chmod(0o600)
    monkeypatch.setenv("NETRC", str(path))


@pytest.mark.anyio
async def test_requests_carry_the_bearer_token_and_skip_netrc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_proxy_env(monkeypatch)
    _netrc(tmp_path, monkeypatch)
    seen: list[dict[str, Any]] = []
    async with _server(seen) as host:
        kube = _kube(host)
        try:
            assert await kube.request("GET", "/api/v1/x", query={"a": "b=c"}) == {"ok": True}
            authed = _kube(host, token="t0ken")
            try:
                await authed.request("POST", "/api/v1/y", {"k": 1})
            finally:
                await authed.close()
        finally:
            await kube.close()
    # client-go never reads netrc; a per-request netrc lookup also costs a thread hop.
    assert "Authorization" not in seen[0]["headers"]
    assert seen[0]["url"].endswith("/api/v1/x?a=b%3Dc")
    assert seen[1]["headers"]["Authorization"] == "Bearer t0ken"


@pytest.mark.anyio
async def test_the_proxy_from_the_environment_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_proxy_env(monkeypatch)
    through_proxy: list[dict[str, Any]] = []
    async with _server(through_proxy) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy)
        # The target is never contacted directly: the proxy answers for it.
        kube = _kube("http://apiserver.invalid:6443")
        try:
            assert await kube.request("GET", "/version") == {"ok": True}
            assert await kube.request("GET", "/version") == {"ok": True}
        finally:
            await kube.close()
    assert [r["url"] for r in through_proxy] == ["http://apiserver.invalid:6443/version"] * 2


@pytest.mark.anyio
async def test_plain_text_errors_become_api_errors() -> None:
    """An API group that is not served (a CRD not installed) answers `404 page not
    found` as text; callers tell it apart by the status, so it must not be a JSON error."""

    def not_found() -> web.Response:
        return web.Response(status=404, text="404 page not found\n")

    async with _server([], not_found) as host:
        kube = _kube(host)
        try:
            with pytest.raises(ApiError) as caught:
                await kube.request("GET", "/apis/gpudra.io/v1alpha1/gputenants")
            assert caught.value.status == 404
            assert "404 page not found" in str(caught.value)
        finally:
            await kube.close()
