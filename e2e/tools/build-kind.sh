#!/usr/bin/env bash
# Builds the pinned kind CLI from the Go module proxy, cached per version outside the
# repository (rebuilt only when missing). Prints the binary's path on success.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=../progress.sh
. "$here/../progress.sh"

die() { echo "build-kind: $*" >&2; exit 2; }

version=$KIND_VERSION
cache=${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}/kind/$version
bin=$cache/bin/kind
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
command -v go >/dev/null || die "no Go toolchain on PATH: install Go 1.26 or newer (https://go.dev/doc/install), then run again"
export GOTOOLCHAIN=local GOWORK=off GOSUMDB=${GOSUMDB:-off} CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$cache/bin"
trap '[ -x "$bin" ] || rm -rf "$cache"' EXIT
progress_run "building kind $version" "\`make e2e-kind\` creates its cluster with it; cached in $bin" \
  "1-2 minutes" env GOBIN="$cache/bin" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@$version" >&2 \
  || die "go install sigs.k8s.io/kind@$version failed (see above); check that the Go module proxy is reachable"
echo "$bin"
