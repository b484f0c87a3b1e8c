"""Runs the pinned promtool and prometheus (built by build-prometheus.sh, cached) for the
tests: the chart's alert rules under `promtool test rules`, and a real Prometheus that
scrapes the node agent end to end.

Why the real binaries: PromQL, rule evaluation, `for:` holds and alert templating behave
exactly as in a user's Prometheus; a hand-written checker would only test itself.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from e2e.progress import BuildFailed, build_script

BUILD_SCRIPT = Path(__file__).resolve().parent / "build-prometheus.sh"


class PrometheusUnavailable(Exception):
    """prometheus/promtool could not be built (no Go toolchain, proxy unreachable)."""


class PromtoolFailed(Exception):
    """promtool ran and exited non-zero; the message is its output."""


def bin_dir() -> Path:
    """The cached folder holding `prometheus` and `promtool`, built on first use."""
    try:
        return build_script(BUILD_SCRIPT, prefix="build-prometheus", what="building prometheus")
    except BuildFailed as e:
        raise PrometheusUnavailable(f"build-prometheus: {e}") from e


def promtool(bin_path: Path, *args: str, cwd: Path | None = None, timeout: float = 120) -> str:
    """Runs promtool; its combined output, or PromtoolFailed with it."""
    proc = subprocess.run(
        [str(bin_path / "promtool"), *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        timeout=timeout,
    )
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise PromtoolFailed(out)
    return out


def rule_groups(prometheus_rule: Mapping[str, Any]) -> dict[str, Any]:
    """A Prometheus rules file of a PrometheusRule object: what the Operator hands
    Prometheus (its `spec`)."""
    return {"groups": list(prometheus_rule["spec"]["groups"])}


def write_yaml(path: Path, doc: object) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def series(name: str, labels: Mapping[str, str]) -> str:
    """A series in promtool's input notation: `name{a="x",b="y"}`."""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def recording_rules(exprs: Sequence[str]) -> dict[str, Any]:
    """A rules file with each expression as a recording rule, so `promtool check rules`
    parses every one with Prometheus's own PromQL parser."""
    return {
        "groups": [
            {
                "name": "parse",
                "rules": [{"record": f"check:expr_{i}", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }
