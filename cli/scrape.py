"""Reading what the node agents and Prometheus serve over HTTP, for `gpudra top` and
`gpudra report`: endpoints, fetching with one clear line on failure, durations.

An endpoint is not trusted to be well-behaved: in the cluster, whoever runs the pod
behind it writes what it serves. So a fetch has a deadline for the whole answer (not
for each read, which a server sending a byte at a time never trips), reads at most
`MAX_BODY` bytes, follows no redirect (which would send the admin's client, from the
admin's network, wherever the endpoint names), and takes only UTF-8; and the
Prometheus text is parsed here, into finite numbers. Whatever fails is one
`Unanswered`, which the commands show as one line for that endpoint while the others'
answers still count.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import urllib.parse
from collections.abc import Callable
from typing import Final

import aiohttp
import anyio
from aiohttp.helpers import get_env_proxy_for_url
from gpudra.cli.flagvalues import seconds_within
from gpudra.cli.terminal import printable
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from yarl import URL

__all__ = [
    "MAX_BODY",
    "Unanswered",
    "agent_endpoint",
    "fetch",
    "get",
    "metric_samples",
    "parse_duration",
    "timeout_seconds",
]

# The most read from one endpoint. An agent's metrics are tens of KiB per GPU (a few
# MiB for the largest nodes), a report query's answer less: 16 MiB is room to spare,
# and keeps an endpoint that never stops from filling the admin's memory.
MAX_BODY: Final = 16 * 2**20
# How much of a parser's complaint (which quotes what it read) a warning carries.
_QUOTED: Final = 160

_DURATION: Final = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


def parse_duration(raw: str) -> float:
    """'90s', '30m', '1h30m' -> seconds; raises ValueError naming the forms."""
    match = _DURATION.fullmatch(raw.strip())
    if not raw.strip() or match is None or not any(match.groups()):
        msg = f"{raw!r} is not a duration; give e.g. 90s, 30m, 1h or 1h30m"
        raise ValueError(msg)
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return float(hours * 3600 + minutes * 60 + seconds)


def timeout_seconds(raw: str) -> float:
    """--timeout: seconds, finite and more than 0 (a deadline of 0 would be none)."""
    value = seconds_within(raw, 0, low_excluded=True)
    if value is None:
        raise argparse.ArgumentTypeError(f"{raw!r}: give seconds, more than 0, e.g. 5")
    return value


def agent_endpoint(raw: str, *, command: str) -> tuple[str, str]:
    """`NODE=URL` or `URL` (the node is then the URL's host) -> (node, URL)."""
    node, sep, url = raw.partition("=")
    if not sep:
        url = raw
        node = urllib.parse.urlparse(url).hostname or url
    if not url.startswith(("http://", "https://")):
        msg = f"--metrics {raw!r}: give http://HOST:PORT/metrics, or NODE=URL"
        raise SystemExit(f"gpudra {command}: {msg}")
    return node, url


class Unanswered(Exception):
    """An endpoint that gave no usable answer; the message names it and the reason."""


def get(url: str, timeout_s: float, *, limit: int = MAX_BODY) -> str:
    """The body at `url`, read within `timeout_s` seconds in all, or `Unanswered` for
    a caller that goes on without it."""
    body = anyio.run(_get, url, timeout_s, limit)
    try:
        return body.decode()
    except UnicodeDecodeError as e:
        raise Unanswered(f"{url} answered what is not UTF-8 text (byte {e.start})") from None


async def _get(url: str, timeout_s: float, limit: int) -> bytes:
    try:
        proxy: URL | None = None
        auth: aiohttp.BasicAuth | None = None
        # The environment's HTTP(S)_PROXY and NO_PROXY, as urllib and kubectl take them;
        # not ~/.netrc (aiohttp's trust_env), whose passwords no endpoint should get.
        with contextlib.suppress(LookupError):
            proxy, auth = get_env_proxy_for_url(URL(url))
        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                # Compressed, a small answer would be a large one once read.
                auto_decompress=False,
                headers={"Accept-Encoding": "identity"},
            ) as session,
            session.get(url, allow_redirects=False, proxy=proxy, proxy_auth=auth) as response,
        ):
            _check_status(url, response)
            if (response.content_length or 0) > limit:
                raise Unanswered(_too_long(url, limit))
            body = bytearray()
            async for chunk in response.content.iter_any():
                body += chunk
                if len(body) > limit:
                    raise Unanswered(_too_long(url, limit))
            return bytes(body)
    except TimeoutError:
        msg = f"{url} did not answer within {timeout_s:g} s (give a longer --timeout)"
        raise Unanswered(msg) from None
    except (aiohttp.ClientError, OSError, ValueError) as e:
        raise Unanswered(f"{url} did not answer: {_brief(str(e))}") from None


def _check_status(url: str, response: aiohttp.ClientResponse) -> None:
    status = f"HTTP {response.status} {response.reason or ''}".rstrip()
    if 300 <= response.status < 400:
        to = response.headers.get("Location", "nowhere")
        msg = (
            f"{url} did not answer: {status}, a redirect to {to}, which is not followed; "
            "give the URL that answers itself"
        )
        raise Unanswered(msg)
    if not 200 <= response.status < 300:
        raise Unanswered(f"{url} did not answer: {status}")


def _too_long(url: str, limit: int) -> str:
    size = f"{limit // 2**20} MiB" if limit % 2**20 == 0 else f"{limit} bytes"
    return f"{url} answered more than {size}, the most read from one endpoint"


def metric_samples(url: str, text: str, wanted: Callable[[str], bool]) -> list[Sample]:
    """The samples of Prometheus `text` whose name `wanted` accepts; `Unanswered`,
    naming `url`, when `text` is not Prometheus text or a wanted sample's value is not
    a finite number (what the commands add, compare and print must be one)."""
    found: list[Sample] = []
    try:
        for family in text_string_to_metric_families(text):
            found.extend(s for s in family.samples if wanted(s.name))
    except (ValueError, IndexError) as e:
        raise Unanswered(f"{url} answered what is not Prometheus text: {_brief(str(e))}") from None
    for sample in found:
        if not math.isfinite(sample.value):
            msg = f"{url} answered {sample.name} {sample.value}, where a finite number belongs"
            raise Unanswered(msg)
    return found


def _brief(complaint: str) -> str:
    """A parser's complaint on one line, cut short: it quotes what it read, which may
    be lines of anything."""
    flat = " ".join(complaint.split())
    return flat if len(flat) <= _QUOTED else f"{flat[:_QUOTED]}..."


def fetch(url: str, timeout_s: float, *, command: str) -> str:
    """The body at `url`; one line naming it and the reason when it does not answer."""
    try:
        return get(url, timeout_s)
    except Unanswered as e:
        raise SystemExit(f"gpudra {command}: {printable(str(e))}") from None
