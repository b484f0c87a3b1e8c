"""Reading the version pins: `e2e/cluster/versions.env` (Kubernetes) and
`e2e/tools/versions.env` (the other tools and peers).

The build scripts source these files in bash; the Python side reads the same
`NAME=value` lines here, so one file stays the only place a version is pinned.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLUSTER_VERSIONS = REPO / "e2e" / "cluster" / "versions.env"
TOOL_VERSIONS = REPO / "e2e" / "tools" / "versions.env"


class PinMissing(LookupError):
    """A pin the caller needs is not in its file; the message names both."""


def pinned(name: str, file: Path) -> str:
    """The value of `name=` in `file`."""
    for line in file.read_text().splitlines():
        key, _, value = line.partition("=")
        if key == name:
            return value.strip()
    raise PinMissing(f"{name} is not set in {file.relative_to(REPO)}")
