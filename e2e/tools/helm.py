"""Runs the pinned helm (built by build-helm.sh, cached) on the chart, for the tests.

Rendering goes through the real helm binary, so schema checks, `fail` messages and
template functions behave exactly as for a user's `helm install`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from e2e.pins import TOOL_VERSIONS, pinned
from e2e.progress import BuildFailed, build_script

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "gpudra"
FULL_VALUES = CHART / "ci" / "full-values.yaml"
BUILD_SCRIPT = Path(__file__).resolve().parent / "build-helm.sh"


class HelmUnavailable(Exception):
    """helm could not be built (no Go toolchain, proxy unreachable): the one-line reason."""


class HelmFailed(Exception):
    """helm ran and exited non-zero; the message is its stderr."""


def helm_binary(pin: str = "HELM_VERSION") -> Path:
    """The cached helm binary of the version `pin` names in e2e/tools/versions.env (the
    default Helm 4, which HELM_VERSION_OVERRIDE may replace, or HELM3_VERSION), built on
    first use."""
    env = dict(os.environ)
    if pin != "HELM_VERSION":
        env["HELM_VERSION_OVERRIDE"] = pinned(pin, TOOL_VERSIONS)
    try:
        return build_script(BUILD_SCRIPT, prefix="build-helm", what="building helm", env=env)
    except BuildFailed as e:
        raise HelmUnavailable(f"build-helm: {e}") from e


def run(helm: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120) -> str:
    """Runs helm with a private config/cache home, so a user's repositories never leak in."""
    with tempfile.TemporaryDirectory(prefix="helm-home-") as home:
        full_env = {
            **os.environ,
            "HELM_CONFIG_HOME": f"{home}/config",
            "HELM_CACHE_HOME": f"{home}/cache",
            "HELM_DATA_HOME": f"{home}/data",
            **(env or {}),
        }
        proc = subprocess.run(
            [str(helm), *args],
            capture_output=True,
            text=True,
            check=False,
            env=full_env,
            timeout=timeout,
        )
    if proc.returncode != 0:
        raise HelmFailed(proc.stderr.strip() or proc.stdout.strip())
    return proc.stdout


def values_args(values: Sequence[Mapping[str, Any] | Path], tmp: Path) -> list[str]:
    """`-f` arguments; dicts are written as JSON (a YAML subset) into `tmp`."""
    args: list[str] = []
    for i, v in enumerate(values):
        if isinstance(v, Path):
            args += ["-f", str(v)]
        else:
            path = tmp / f"values-{i}.json"
            path.write_text(json.dumps(v))
            args += ["-f", str(path)]
    return args


def template(
    helm: Path,
    *values: Mapping[str, Any] | Path,
    release: str = "gpudra",
    namespace: str = "gpudra",
    extra: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """`helm template` with the given values, parsed into objects (empty documents dropped)."""
    with tempfile.TemporaryDirectory(prefix="helm-values-") as tmp:
        out = run(
            helm,
            "template",
            release,
            str(CHART),
            "--namespace",
            namespace,
            *values_args(values, Path(tmp)),
            *extra,
        )
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(objects: Sequence[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one rendered object of `kind` (and `name`); fails listing what was rendered."""
    hits = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    if len(hits) != 1:
        have = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
        raise LookupError(f"expected one {kind} {name or ''}, rendered: {have}")
    return hits[0]
