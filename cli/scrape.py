"""Reading what the node agents and Prometheus serve over HTTP, for `gpudra top` and
`gpudra report`: endpoints, fetching with one clear line on failure, durations."""

from __future__ import annotations

import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Final

__all__ = ["Unanswered", "agent_endpoint", "fetch", "get", "parse_duration"]

_DURATION: Final = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


def parse_duration(raw: str) -> float:
    """'90s', '30m', '1h30m' -> seconds; raises ValueError naming the forms."""
    match = _DURATION.fullmatch(raw.strip())
    if not raw.strip() or match is None or not any(match.groups()):
        msg = f"{raw!r} is not a duration; give e.g. 90s, 30m, 1h or 1h30m"
        raise ValueError(msg)
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return float(hours * 3600 + minutes * 60 + seconds)


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
    """An endpoint that did not answer; the message names it and the reason."""


def get(url: str, timeout_s: float) -> str:
    """The body at `url`, or `Unanswered` for a caller that goes on without it."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            return str(response.read().decode())
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise Unanswered(f"{url} did not answer: {reason}") from None


def fetch(url: str, timeout_s: float, *, command: str) -> str:
    """The body at `url`; one line naming it and the reason when it does not answer."""
    try:
        return get(url, timeout_s)
    except Unanswered as e:
        raise SystemExit(f"gpudra {command}: {e}") from None
