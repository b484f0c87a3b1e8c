#!/usr/bin/env bash
# Builds the pinned helm CLI from the Go module proxy, cached per version outside the
# repository (rebuilt only when missing). Prints the binary's path on success.
#
# Why from source: CI machines start fresh and have Go but no package for helm; the
# module proxy serves helm's source with a go.mod that has no replace directives, so
# `go install` builds it unchanged.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=../progress.sh
. "$here/../progress.sh"

die() { echo "build-helm: $*" >&2; exit 2; }

version=${HELM_VERSION_OVERRIDE:-$HELM_VERSION}
case "$version" in
  v3.*) module=helm.sh/helm/v3 ;;
  v4.*) module=helm.sh/helm/v4 ;;
  *) die "unsupported helm version '$version': set HELM_VERSION in e2e/tools/versions.env to v3.x.y or v4.x.y" ;;
esac
cache=${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}/helm/$version
bin=$cache/bin/helm
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi

command -v go >/dev/null || die "no Go toolchain on PATH: install Go 1.26 or newer (https://go.dev/doc/install), then run again"

export GOTOOLCHAIN=local GOWORK=off GOSUMDB=${GOSUMDB:-off} CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$cache/bin"
# A failed build leaves no half-filled version directory that looks cached.
trap '[ -x "$bin" ] || rm -rf "$cache"' EXIT
ld="-s -w -X helm.sh/helm/${module##*/}/internal/version.version=$version"
progress_run "building helm $version" "the chart's tests render and install with it; cached in $bin" \
  "5-8 minutes" env GOBIN="$cache/bin" go install -trimpath -ldflags "$ld" "$module/cmd/helm@$version" >&2 \
  || die "go install $module/cmd/helm@$version failed (see above); check that the Go module proxy is reachable and serves that version"
[ -x "$bin" ] || die "build finished but $bin is missing"
echo "$bin"
