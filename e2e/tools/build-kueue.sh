#!/usr/bin/env bash
# Builds the pinned Kueue manager from the Go module proxy, cached per version outside the
# repository (rebuilt only when missing), and keeps the module's CRDs, webhook
# configurations and RBAC beside it. Prints the cache folder on success:
#   <cache>/bin/kueue   the manager
#   <cache>/config/     the module's config/components (crd, webhook, rbac, manager)
#
# Why from the module source: the proxy refuses `go install sigs.k8s.io/kueue/cmd/kueue@v`
# listings for new versions but serves the module itself; building inside the downloaded
# module with -mod=mod uses its own go.sum, so the binary is the release's code.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=../progress.sh
. "$here/../progress.sh"

die() { echo "build-kueue: $*" >&2; exit 2; }

version=${KUEUE_VERSION_OVERRIDE:-$KUEUE_VERSION}
case "$version" in
  v0.19.* | v0.[2-9][0-9].* | v[1-9].*) ;;
  *) die "unsupported Kueue version '$version': set KUEUE_VERSION in e2e/tools/versions.env to v0.19.x or newer (DRA accounting of extended resources needs v0.19)" ;;
esac
cache=${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}/kueue/$version
bin=$cache/bin/kueue
if [ -x "$bin" ] && [ -d "$cache/config/crd" ]; then echo "$cache"; exit 0; fi

command -v go >/dev/null || die "no Go toolchain on PATH: install Go 1.26 or newer (https://go.dev/doc/install), then run again"

export GOTOOLCHAIN=local GOWORK=off GOSUMDB=${GOSUMDB:-off} CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$cache/bin"
# A failed build leaves no half-filled version directory that looks cached.
trap '[ -x "$bin" ] && [ -d "$cache/config/crd" ] || rm -rf "$cache"' EXIT
dir=$(progress_run "downloading Kueue $version" "the module source from the Go module proxy" \
  "1 minute" go mod download -json "sigs.k8s.io/kueue@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p') \
  || die "go mod download sigs.k8s.io/kueue@$version failed (see above); check that the Go module proxy is reachable and serves that version"
[ -n "$dir" ] && [ -d "$dir/cmd/kueue" ] || die "module sigs.k8s.io/kueue@$version has no cmd/kueue (got '$dir')"
ld="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$version"
progress_run "building Kueue $version" "the queueing tests run its manager against the local control plane; cached in $bin" \
  "8-15 minutes" go -C "$dir" build -trimpath -ldflags "$ld" -o "$bin" ./cmd/kueue >&2 \
  || die "go build ./cmd/kueue in $dir failed (see above)"
[ -x "$bin" ] || die "build finished but $bin is missing"
mkdir -p "$cache/config"
for part in crd webhook rbac manager; do
  cp -r "$dir/config/components/$part" "$cache/config/$part"
done
chmod -R u+w "$cache/config"
echo "$cache"
