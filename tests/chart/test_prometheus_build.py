"""build-prometheus.sh with a stand-in `go`: what it asks the Go toolchain for, where it
caches, and its error for a version it cannot build."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from e2e.progress import BuildFailed, build_script
from e2e.tools.prometheus import BUILD_SCRIPT


def fake_go(bin_dir: Path, calls: Path) -> None:
    """`go install pkg@v...`: records its arguments, writes each package's binary."""
    bin_dir.mkdir()
    go = bin_dir / "go"
    go.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {calls}\n'
        'for pkg in "$@"; do case "$pkg" in *@*) name=${pkg%@*}; bin="$GOBIN/${name##*/}"\n'
        '  mkdir -p "$GOBIN" && printf "#!/bin/sh\\n" > "$bin" && chmod +x "$bin";;\n'
        "esac; done\n"
    )
    go.chmod(0o755)


def env_with_go(tmp_path: Path, **extra: str) -> dict[str, str]:
    fake_go(tmp_path / "bin", tmp_path / "calls")
    return {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "GPUDRA_CACHE": str(tmp_path / "cache"),
        **extra,
    }


def test_builds_both_binaries_once_with_the_release_version(tmp_path: Path) -> None:
    env = env_with_go(tmp_path, PROMETHEUS_VERSION_OVERRIDE="v0.305.1")
    built = build_script(BUILD_SCRIPT, prefix="build-prometheus", what="prometheus", env=env)
    assert built == tmp_path / "cache" / "prometheus" / "v0.305.1" / "bin"
    assert (built / "prometheus").is_file() and (built / "promtool").is_file()
    (call,) = (tmp_path / "calls").read_text().splitlines()
    assert "-tags remove_all_sd" in call
    assert "github.com/prometheus/common/version.Version=3.5.1" in call
    assert "github.com/prometheus/prometheus/cmd/prometheus@v0.305.1" in call
    assert "github.com/prometheus/prometheus/cmd/promtool@v0.305.1" in call
    again = build_script(BUILD_SCRIPT, prefix="build-prometheus", what="prometheus", env=env)
    assert again == built
    assert len((tmp_path / "calls").read_text().splitlines()) == 1  # cached


def test_a_release_tag_is_refused_with_the_module_version_to_use(tmp_path: Path) -> None:
    env = env_with_go(tmp_path, PROMETHEUS_VERSION_OVERRIDE="v3.5.0")
    with pytest.raises(BuildFailed, match=r"v0\.316\.0 is Prometheus 3\.16\.0"):
        build_script(BUILD_SCRIPT, prefix="build-prometheus", what="prometheus", env=env)
    assert not (tmp_path / "calls").exists()
