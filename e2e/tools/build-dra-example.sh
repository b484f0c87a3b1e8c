#!/usr/bin/env bash
# Builds the pinned sigs.k8s.io/dra-example-driver kubelet plugin and webhook from the Go
# module proxy, cached per version outside the repository (rebuilt only when missing).
# Prints the bin directory that holds both on success.
#
# Why: the benchmarks compare gpudra with the reference implementation on the upstream
# kubelet plugin helper, on the same machine in the same run. Its module is built inside
# its own source (downloaded from the proxy) so that its go.mod, with its exact
# Kubernetes library versions, decides the build.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=../progress.sh
. "$here/../progress.sh"

die() { echo "build-dra-example: $*" >&2; exit 2; }

version=${DRA_EXAMPLE_DRIVER_VERSION_OVERRIDE:-$DRA_EXAMPLE_DRIVER_VERSION}
case "$version" in
  v[0-9]*.[0-9]*.[0-9]*) ;;
  *) die "unsupported version '$version': set DRA_EXAMPLE_DRIVER_VERSION in e2e/tools/versions.env to a release tag such as v0.3.0" ;;
esac
module=sigs.k8s.io/dra-example-driver
cache=${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}/dra-example-driver/$version
bin=$cache/bin
if [ -x "$bin/dra-example-kubeletplugin" ] && [ -x "$bin/dra-example-webhook" ]; then echo "$bin"; exit 0; fi

command -v go >/dev/null || die "no Go toolchain on PATH: install Go 1.24 or newer (https://go.dev/doc/install), then run again"

export GOTOOLCHAIN=local GOWORK=off GOSUMDB=${GOSUMDB:-off} CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$cache"
work=$(mktemp -d "$cache/.src.XXXXXX")
# A failed build leaves no half-filled version directory that looks cached.
trap 'rm -rf "$work"; [ -x "$bin/dra-example-kubeletplugin" ] && [ -x "$bin/dra-example-webhook" ] || rm -rf "$cache"' EXIT
dir=$(go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -n "$dir" ] && [ -d "$dir" ] || die "go mod download $module@$version failed; check that the Go module proxy is reachable and serves that version"
cp -r "$dir/." "$work/"
chmod -R u+w "$work"
progress_run "building dra-example-driver $version" \
  "the prepare and admission benchmarks run the Go reference driver beside gpudra; cached in $bin" \
  "1-3 minutes" bash -c 'cd "$1" && go build -trimpath -o "$2/" ./cmd/dra-example-kubeletplugin ./cmd/dra-example-webhook' _ "$work" "$bin" >&2 \
  || die "building $module@$version failed (see above)"
[ -x "$bin/dra-example-kubeletplugin" ] && [ -x "$bin/dra-example-webhook" ] || die "build finished but the binaries are missing from $bin"
echo "$bin"
