"""Small Go programs of this repository (a benchmark's client, the upstream readers the
tests check gpudra's files with), built from the Go module proxy on first use and
cached outside the repository by a hash of their sources, so that an edit rebuilds
one and nothing else does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from e2e.cache import cache_root

__all__ = ["GoBuildError", "go_binary"]

_SOURCES = ("go.mod", "go.sum", "main.go")


class GoBuildError(Exception):
    """Why a Go program could not be built: no toolchain, or the build failed."""


def go_binary(source: Path, name: str) -> Path:
    """The program whose module is `source` (its go.mod, go.sum and main.go), built
    into the cache as `name` when missing; raises GoBuildError."""
    go = shutil.which("go")
    if go is None:
        raise GoBuildError(
            f"no Go toolchain on PATH to build {source.name}: install Go 1.24 or newer "
            "(https://go.dev/doc/install)"
        )
    digest = hashlib.sha256()
    for file in _SOURCES:
        digest.update((source / file).read_bytes())
    binary = cache_root() / name / digest.hexdigest()[:16] / name
    if binary.is_file():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "GOTOOLCHAIN": "local",
        "GOWORK": "off",
        "GOFLAGS": "-mod=mod",
        "CGO_ENABLED": "0",
        "GOSUMDB": os.environ.get("GOSUMDB", "off"),
    }
    temp = binary.with_name(f".{binary.name}.tmp")
    print(f"building {name} into {binary}", file=sys.stderr)
    build = subprocess.run(
        [go, "build", "-trimpath", "-o", str(temp), "."],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if build.returncode != 0:
        temp.unlink(missing_ok=True)
        raise GoBuildError(f"go build of {source} failed:\n{build.stderr.strip()}")
    temp.replace(binary)
    return binary
