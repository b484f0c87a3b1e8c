#!/usr/bin/env bash
# Exports the previous gpudra release (pinned by commit in versions.env) from this
# repository's history and builds its image, cached per commit outside the repository
# (rebuilt only when missing). Prints the cache folder on success:
#   <cache>/src/                 the release's tree (its chart: src/charts/gpudra)
#   <cache>/gpudra.oci.tar       its image, named gpudra.local/gpudra:<tag>
#   <cache>/tag                  that tag
#
# Why from git rather than a registry: no registry is reachable here, and the release is
# a commit of this repository, so `git archive` gives its exact files; the image is built
# by the release's own e2e/image/build.py, so it holds the release's code and nothing of
# the working tree. Keyed by the commit, not the tag: a clone without tags builds it too.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=../progress.sh
. "$here/../progress.sh"

die() { echo "build-release: $*" >&2; exit 2; }

tag=$GPUDRA_PREVIOUS_RELEASE
# An override tries a candidate release commit before the pin moves to it.
commit=${GPUDRA_PREVIOUS_RELEASE_COMMIT_OVERRIDE:-$GPUDRA_PREVIOUS_RELEASE_COMMIT}
repo=$(cd "$here/../.." && pwd)
cache=${GPUDRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpudra}/releases/$commit
image=$cache/gpudra.oci.tar
if [ -f "$image" ] && [ -f "$cache/tag" ] && [ -d "$cache/src/charts/gpudra" ]; then echo "$cache"; exit 0; fi

command -v git >/dev/null || die "git is missing, needed to export release $tag: apt-get install git"
git -C "$repo" cat-file -e "$commit^{commit}" 2>/dev/null \
  || die "commit $commit of release $tag is not in this clone: git fetch --unshallow (or fetch the tag $tag), then run again"
if [ -z "${GPUDRA_PREVIOUS_RELEASE_COMMIT_OVERRIDE:-}" ] \
  && tagged=$(git -C "$repo" rev-parse -q --verify "refs/tags/$tag^{commit}"); then
  [ "$tagged" = "$commit" ] \
    || die "tag $tag names $tagged but e2e/tools/versions.env pins $commit: set GPUDRA_PREVIOUS_RELEASE_COMMIT to the tag's commit"
fi
mkdir -p "$cache"
# A failed build leaves no half-filled folder that looks cached.
trap '[ -f "$image" ] || rm -rf "$cache"' EXIT
rm -rf "$cache/src"
mkdir -p "$cache/src"
git -C "$repo" archive --format=tar "$commit" | tar -x -C "$cache/src" \
  || die "git archive $commit failed (see above)"
python=${PYTHON:-python3}
progress_run "building the image of gpudra $tag" "the upgrade tests install it before (and after) the working tree's; cached in $image" \
  "about a minute (base layer cached)" "$python" "$cache/src/e2e/image/build.py" \
  --out "$image.tmp" --name "gpudra.local/gpudra:$tag" >&2 \
  || die "building the image of $tag failed (see above)"
echo "$tag" >"$cache/tag"
mv "$image.tmp" "$image"
echo "$cache"
