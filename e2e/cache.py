"""The folder that keeps what the harness builds on first run (Kubernetes, containerd,
helm, kind, images), outside the repository so every checkout shares it.

The build scripts compute the same folder in bash:
`${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}`.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """GPUDRA_CACHE, else `gpudra` in XDG_CACHE_HOME (default ~/.cache)."""
    explicit = os.environ.get("GPUDRA_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpudra"
