#!/usr/bin/env bash
# Builds containerd 2.x (containerd, ctr, containerd-shim-runc-v2) from the Go module
# proxy into a per-version cache outside the repository, and installs runc and the CNI
# plugins from Debian when they are missing. Prints the containerd bin directory.
#
# Why from the proxy: no registry or release download is reachable here, but the
# proxy is, and containerd's module has no replace directives, so `go install
# module@version` builds it unchanged.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=../progress.sh
. "$here/../progress.sh"

die() { echo "build: $*" >&2; exit 2; }

version=${CONTAINERD_VERSION}
case "$version" in v2.*) ;; *) die "CONTAINERD_VERSION '$version' is not a 2.x release: set it to v2.Y.Z in e2e/node/versions.env" ;; esac
cache=${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}/containerd/$version
bin=$cache/bin
cmds=(containerd ctr containerd-shim-runc-v2)
all_present() { local c; for c in "${cmds[@]}"; do [ -x "$bin/$c" ] || return 1; done; }

# runc and the CNI plugins come from Debian: the kubelet only talks to containerd, and
# containerd execs these, so the packaged versions are enough.
need=()
command -v runc >/dev/null || need+=(runc)
[ -x /usr/lib/cni/bridge ] || [ -x /opt/cni/bin/bridge ] || need+=(containernetworking-plugins)
if [ ${#need[@]} -gt 0 ]; then
  bash "$here/../tools/apt-install.sh" "the real node's container runtime and pod network" "${need[@]}"
fi

if all_present; then echo "$bin"; exit 0; fi
command -v go >/dev/null || die "no Go toolchain on PATH: install Go 1.26 or newer (https://go.dev/doc/install), then run again"

export GOTOOLCHAIN=local GOWORK=off GOSUMDB=${GOSUMDB:-off} CGO_ENABLED=0 GOFLAGS=
mkdir -p "$bin"
# A failed build leaves no half-filled version directory that looks cached.
trap 'all_present || rm -rf "$cache"' EXIT
pkg=github.com/containerd/containerd/v2
ld="-s -w -X $pkg/version.Version=$version -X $pkg/version.Package=$pkg"
# Tags as in containerd's own static builds: no cgo-only snapshotters.
tags=no_btrfs,no_devmapper,no_zfs
install_all() {
  local c
  for c in "${cmds[@]}"; do
    GOBIN=$bin go install -trimpath -tags "$tags" -ldflags "$ld" "$pkg/cmd/$c@$version" >&2 \
      || die "go install of $c $version failed (see above); check that the Go module proxy serves $pkg@$version"
  done
}
progress_run "building containerd $version" \
  "${cmds[*]} for the real node, cached in $bin for later runs" "3-5 minutes" install_all \
  || die "building containerd $version failed (see above)"
all_present || die "build finished but binaries are missing under $bin"
echo "$bin"
