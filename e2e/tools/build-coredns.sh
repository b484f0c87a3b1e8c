#!/usr/bin/env bash
# Builds CoreDNS (COREDNS_VERSION, the version kubeadm deploys, e.g. v1.14.2) from the Go
# module proxy, cached per version outside the repository. Prints the binary's path.
#
# Why: kind's node image carries the cluster DNS image preloaded, and no registry is
# reachable here; CoreDNS's module has no replace directives, so `go install` builds it.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../progress.sh
. "$here/../progress.sh"

die() { echo "build-coredns: $*" >&2; exit 2; }

version=${COREDNS_VERSION:-}
case "$version" in v[0-9]*) ;; *) die "set COREDNS_VERSION to vX.Y.Z, the version \`kubeadm config images list\` names" ;; esac
cache=${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}/coredns/$version
bin=$cache/bin/coredns
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
command -v go >/dev/null || die "no Go toolchain on PATH: install Go 1.26 or newer (https://go.dev/doc/install), then run again"
export GOTOOLCHAIN=local GOWORK=off GOSUMDB=${GOSUMDB:-off} CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$cache/bin"
trap '[ -x "$bin" ] || rm -rf "$cache"' EXIT
progress_run "building CoreDNS $version" "the cluster DNS image of kind's node image; cached in $bin" \
  "2-4 minutes" env GOBIN="$cache/bin" nice -n 19 go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@$version" >&2 \
  || die "go install github.com/coredns/coredns@$version failed (see above); check that the Go module proxy is reachable"
echo "$bin"
