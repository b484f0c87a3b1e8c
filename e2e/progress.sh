# Progress lines for the long first-run steps of the build scripts (sourced, not run).
#
# Why: a cold `make demo` builds Kubernetes, containerd and images for many minutes;
# without a word the user cannot tell work from a hang. A step prints what it does,
# why and roughly how long the first run takes, then a line at least every
# GPUDRA_PROGRESS_INTERVAL seconds (default 30) while it runs, then its time.
# Everything goes to stderr: the scripts print their result on stdout for callers.
# e2e/progress.py prints the same lines for the steps written in Python.

# 75 -> 1m15s
progress_duration() {
  local s=$1
  if [ "$s" -lt 60 ]; then echo "${s}s"; else echo "$((s / 60))m$(printf '%02d' $((s % 60)))s"; fi
}

# progress_run WHAT WHY ETA COMMAND...: runs COMMAND in this shell with a heartbeat and
# returns its status. The caller handles failure (`progress_run ... || die ...`); a
# COMMAND that exits the script instead stops the heartbeat within a second, so no
# reader of stderr waits on it.
progress_run() {
  local what=$1 why=$2 eta=$3 every=${GPUDRA_PROGRESS_INTERVAL:-30} start ticker rc=0
  shift 3
  case "$every" in '' | *[!0-9]* | 0) every=30 ;; esac
  start=$(date +%s)
  echo "$what: $why (first run: $eta)" >&2
  (
    elapsed=0
    while kill -0 $$ 2>/dev/null; do
      sleep 1 </dev/null >/dev/null 2>&1
      elapsed=$((elapsed + 1))
      if [ $((elapsed % every)) -eq 0 ]; then
        echo "  still $what ($(progress_duration $(($(date +%s) - start))))"
      fi
    done
  ) >&2 &
  ticker=$!
  "$@" || rc=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  local took
  took=$(progress_duration $(($(date +%s) - start)))
  if [ "$rc" -eq 0 ]; then
    echo "$what: done in $took" >&2
  else
    echo "$what: failed after $took" >&2
  fi
  return "$rc"
}
