#!/usr/bin/env bash
# Builds e2e/kind/validate (checks a kind config against the pinned kind's own types),
# cached outside the repository per KIND_VERSION and hash of its sources, so a source
# change rebuilds. Prints the binary's path on success.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=../progress.sh
. "$here/../progress.sh"

die() { echo "build-kind-validate: $*" >&2; exit 2; }

src=$(cd "$here/../kind/validate" && pwd)
version=$KIND_VERSION
# go.mod must require the kind that `make e2e-kind` runs, or the check would be
# against other types than the ones that read the config.
pinned=$(awk '$1 == "sigs.k8s.io/kind" { print $2 }' "$src/go.mod")
[ "$pinned" = "$version" ] \
  || die "e2e/kind/validate/go.mod requires sigs.k8s.io/kind ${pinned:-(none)}, versions.env pins $version: run 'go get sigs.k8s.io/kind@$version && go mod tidy' there"

command -v sha256sum >/dev/null || die "sha256sum not found on PATH (coreutils)"
hash=$(cd "$src" && LC_ALL=C sha256sum go.mod go.sum ./*.go | sha256sum | cut -c1-16)
cache=${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}/kind-validate/$version-$hash
bin=$cache/bin/kind-validate
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
command -v go >/dev/null || die "no Go toolchain on PATH: install Go 1.26 or newer (https://go.dev/doc/install), then run again"
# -mod=readonly: build from the committed go.sum, never rewrite files in the repository.
export GOTOOLCHAIN=local GOWORK=off GOSUMDB=${GOSUMDB:-off} CGO_ENABLED=0 GOFLAGS=-mod=readonly
mkdir -p "$cache/bin"
tmp=$(mktemp "$cache/bin/.kind-validate.XXXXXX")
trap 'rm -f "$tmp"; [ -x "$bin" ] || rm -rf "$cache"' EXIT
build_validator() { (cd "$src" && go build -trimpath -ldflags "-s -w" -o "$tmp" .) >&2; }
progress_run "building the kind config validator" "checks e2e/kind/cluster.yaml against kind $version's own types" \
  "about a minute" build_validator \
  || die "go build of e2e/kind/validate failed (see above); check that the Go module proxy is reachable"
mv -f "$tmp" "$bin"  # atomic, so a concurrent run never sees a half-written binary
echo "$bin"
