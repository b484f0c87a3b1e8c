#!/usr/bin/env bash
# Builds the pinned prometheus and promtool from the Go module proxy, cached per version
# outside the repository (rebuilt only when missing). Prints the bin directory that holds
# both on success.
#
# Why from source: CI machines start fresh and have Go but no package for Prometheus; the
# module proxy serves its source with a go.mod that has no replace directives, so
# `go install` builds it unchanged. The tag `remove_all_sd` leaves out the cloud service
# discoveries (AWS, Azure, GCE, ...) the tests never use, which roughly halves the build;
# static and file targets, and Kubernetes discovery (promtool needs it), stay. Without the
# tag `builtinassets` the web UI is served from files that are not there: the UI pages
# answer 404 while the HTTP API, the rules and the scrapes work unchanged.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=../progress.sh
. "$here/../progress.sh"

die() { echo "build-prometheus: $*" >&2; exit 2; }

version=${PROMETHEUS_VERSION_OVERRIDE:-$PROMETHEUS_VERSION}
case "$version" in
  v0.[0-9]*) ;;
  *) die "unsupported Prometheus module version '$version': set PROMETHEUS_VERSION in e2e/tools/versions.env to v0.x.y (v0.316.0 is Prometheus 3.16.0)" ;;
esac
module=github.com/prometheus/prometheus
cache=${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}/prometheus/$version
bin=$cache/bin
if [ -x "$bin/prometheus" ] && [ -x "$bin/promtool" ]; then echo "$bin"; exit 0; fi

command -v go >/dev/null || die "no Go toolchain on PATH: install Go 1.26 or newer (https://go.dev/doc/install), then run again"

export GOTOOLCHAIN=local GOWORK=off GOSUMDB=${GOSUMDB:-off} CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$bin"
# A failed build leaves no half-filled version directory that looks cached.
trap '[ -x "$bin/prometheus" ] && [ -x "$bin/promtool" ] || rm -rf "$cache"' EXIT
# v0.316.0 -> 3.16.0, the release version `prometheus --version` reports.
minor=${version#v0.}
minor=${minor%%.*}
release="$((minor / 100)).$((minor % 100)).${version##*.}"
ld="-s -w -X github.com/prometheus/common/version.Version=$release"
progress_run "building prometheus and promtool $version" \
  "the chart's alert rules are tested with promtool and the end-to-end test scrapes the node agent with prometheus; cached in $bin" \
  "6-15 minutes" env GOBIN="$bin" go install -trimpath -tags remove_all_sd -ldflags "$ld" \
  "$module/cmd/prometheus@$version" "$module/cmd/promtool@$version" >&2 \
  || die "go install $module/cmd/{prometheus,promtool}@$version failed (see above); check that the Go module proxy is reachable and serves that version"
[ -x "$bin/prometheus" ] && [ -x "$bin/promtool" ] || die "build finished but $bin/prometheus or $bin/promtool is missing"
echo "$bin"
