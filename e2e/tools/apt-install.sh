#!/usr/bin/env bash
# Installs Debian packages that a build needs and the machine lacks: apt-get as root,
# with one `apt-get update` only when the first try fails (a fresh machine's lists are
# empty). Usage: apt-install.sh WHY PACKAGE...; prints nothing on stdout.
#
# Why here and not in the README's prerequisites: the README promises `make test` on a
# fresh machine with Python, Go, make and git, so the build installs the rest itself.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../progress.sh
. "$here/../progress.sh"

die() { echo "build: $*" >&2; exit 2; }
[ $# -ge 2 ] || die "usage: apt-install.sh WHY PACKAGE..."
why=$1; shift
[ "$(id -u)" = 0 ] || die "$* missing and installing needs root: run \`apt-get install $*\` as root"
command -v apt-get >/dev/null || die "$* missing and there is no apt-get: install $* with the system's package manager"
install_packages() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >&2 \
    || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >&2; }
}
progress_run "installing $* from Debian" "$why" "under a minute" install_packages "$@" \
  || die "apt-get could not install $*: check that the Debian repositories are reachable (apt-get update)"
