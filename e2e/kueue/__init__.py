"""A pinned Kueue (e2e/tools/build-kueue.sh) run against the local control plane."""
