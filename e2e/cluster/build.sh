#!/usr/bin/env bash
# Builds etcd and the Kubernetes binaries for one version from the Go module proxy,
# cached per version outside the repository. Prints the bin directory on success.
#
# Why a wrapper module: k8s.io/kubernetes requires its staging modules at v0.0.0 with
# replace directives, so `go install` of its commands fails. A wrapper that pins every
# staging module to the matching v0.Y.Z builds them unchanged. etcd is built from the
# same module graph (kubernetes already requires go.etcd.io/etcd/server/v3), so its
# dependencies cannot disagree with the API server's.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=../progress.sh
. "$here/../progress.sh"

die() { echo "build: $*" >&2; exit 2; }

resolve_version() {
  local want=${1#v} var
  case "$want" in
    1.[0-9][0-9]) var="K8S_PIN_${want//./_}"; [ -n "${!var:-}" ] || die "unknown K8S_VERSION '$1': supported are $(supported); set K8S_VERSION to one of them"; echo "${!var}" ;;
    1.[0-9][0-9].[0-9]*) local minor; minor=$(cut -d. -f1,2 <<<"$want"); var="K8S_PIN_${minor//./_}"; [ -n "${!var:-}" ] || die "unknown K8S_VERSION '$1': supported are $(supported); set K8S_VERSION to one of them"; echo "v$want" ;;
    *) die "unknown K8S_VERSION '$1': supported are $(supported); set K8S_VERSION to one of them" ;;
  esac
}
supported() { grep -oE '^K8S_PIN_[0-9_]+' "$here/versions.env" | sed -e 's/K8S_PIN_//' -e 's/_/./g' | paste -sd, -; }

version=$(resolve_version "${K8S_VERSION:-$K8S_DEFAULT_MINOR}")
cache=${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}/k8s/$version
bin=$cache/bin
cmds=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet)
# K8S_EXTRA_COMMANDS adds commands of k8s.io/kubernetes/cmd to the same bin directory
# (kind's node image needs kubeadm and kube-proxy); a version already cached builds only
# the missing ones, so the local harness's binaries are never rebuilt for them.
read -r -a extra <<<"${K8S_EXTRA_COMMANDS:-}"
cmds+=("${extra[@]}")
all_present() { local c; for c in "${cmds[@]}" etcd; do [ -x "$bin/$c" ] || return 1; done; }
if all_present; then echo "$bin"; exit 0; fi
missing=(); for c in "${cmds[@]}"; do [ -x "$bin/$c" ] || missing+=("$c"); done

command -v go >/dev/null || die "no Go toolchain on PATH: install Go 1.25 or newer (https://go.dev/doc/install), then run again"

export GOTOOLCHAIN=local GOWORK=off GOSUMDB=${GOSUMDB:-off} CGO_ENABLED=0 GOFLAGS=-mod=mod
src=$cache/src
cached_before=false; [ -x "$bin/etcd" ] && cached_before=true
rm -rf "$src" && mkdir -p "$src" "$bin"
# A failed build leaves no half-filled version directory that looks cached; a failed build
# of extra commands for a cached version removes only what it was building.
cleanup() {
  all_present && return
  if $cached_before; then local c; for c in "${missing[@]}"; do rm -f "$bin/$c"; done
  else rm -rf "$cache"; fi
}
trap cleanup EXIT
resolve_modules() {
  local info err modfile staging_ver goline c
  info=$(go mod download -json "k8s.io/kubernetes@$version" 2>&1) || true
  err=$(printf '%s\n' "$info" | sed -n 's/.*"Error": "\([^"\\]*\).*/\1/p' | head -1)
  [ -z "$err" ] || die "the Go module proxy cannot serve k8s.io/kubernetes@$version ($err); pick another K8S_VERSION"
  modfile=$(printf '%s\n' "$info" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  [ -n "$modfile" ] || die "could not resolve k8s.io/kubernetes@$version from the Go module proxy: $info"
  staging_ver="v0.${version#v1.}"
  goline=$(grep -m1 -E '^go [0-9]' "$modfile") || die "no go directive in $modfile"
  {
    echo "module gpudra.local/k8sbuild"
    echo
    echo "$goline"
    echo
    echo "require k8s.io/kubernetes $version"
    echo
    awk -v v="$staging_ver" '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print "replace " $1 " => " $1 " " v}' "$modfile"
  } > "$src/go.mod"
  {
    echo "//go:build tools"
    echo
    echo "package tools"
    echo
    echo "import ("
    for c in "${cmds[@]}"; do echo "	_ \"k8s.io/kubernetes/cmd/$c\""; done
    echo "	_ \"go.etcd.io/etcd/server/v3\""
    echo ")"
  } > "$src/tools.go"
  (cd "$src" && go mod tidy >&2) || die "resolving modules for $version failed (see above); check that the Go module proxy is reachable"
}
in_src() { (cd "$src" && "$@" >&2); }

progress_run "fetching the Kubernetes $version sources" \
  "the Go module proxy's k8s.io/kubernetes and its dependencies, kept in Go's module cache" \
  "1-3 minutes" resolve_modules || die "fetching the Kubernetes $version sources failed (see above)"

minor=${version#v1.}; minor=${minor%%.*}
ld="-s -w -X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitVersion=$version -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
pkgs=(); for c in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
if [ ${#pkgs[@]} -gt 0 ]; then
  progress_run "building Kubernetes $version" \
    "${missing[*]} for the local control plane and nodes, cached in $bin for later runs" \
    "5-10 minutes on 2 cores" \
    in_src go build -tags=selinux,notest -trimpath -ldflags "$ld" -o "$bin/" "${pkgs[@]}" \
    || die "go build of Kubernetes $version failed (see above)"
fi
if [ ! -x "$bin/etcd" ]; then
  progress_run "building etcd" "the control plane's store, from the same module graph as the API server" \
    "about a minute" in_src go build -trimpath -ldflags "-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3 \
    || die "go build of etcd failed (see above)"
fi

all_present || die "build finished but binaries are missing under $bin"
du -sh "$cache" >&2 || true
echo "$bin"
