# gpudra developer entry points. `make demo` and `make test` work on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PKGS := -p gpudra.api -p gpudra.cli -p gpudra.common -p gpudra.driver -p gpudra.webhook
export K8S_VERSION ?= 1.36

.PHONY: venv lint typecheck unit test cluster-build cluster-up cluster-down cluster-env cluster-status demo demo-down bench bench-slices bench-webhook bench-prepare bench-schedule bench-compare

venv: $(VENV)/.stamp
$(VENV)/.stamp: pyproject.toml e2e/bootstrap_venv.py
	$(PY) e2e/bootstrap_venv.py
	touch $@

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	cd $(VENV)/src && ../bin/mypy --config-file ../../pyproject.toml $(PKGS)

cluster-build:
	@bash e2e/cluster/build.sh >/dev/null

cluster-up: venv
	@$(VPY) -m e2e.cluster up

cluster-down: venv
	@$(VPY) -m e2e.cluster down

cluster-env: venv
	@$(VPY) -m e2e.cluster env

cluster-status: venv
	@$(VPY) -m e2e.cluster status

# A real kubelet + containerd node `real-1` next to the local control plane (root, cgroups).
.PHONY: node-up node-down
node-up: cluster-up
	@$(VPY) -m e2e.node up

node-down: venv
	@$(VPY) -m e2e.node down

# Kueue (pinned in e2e/tools/versions.env, built from the Go module proxy and cached) as a
# host process against the local control plane; `make cluster-down` stops it too.
.PHONY: kueue kueue-up kueue-down kueue-status demo-kueue bench-kueue
kueue:
	@bash e2e/tools/build-kueue.sh >/dev/null

kueue-up: cluster-up
	@$(VPY) -m e2e.kueue up

kueue-down: venv
	@$(VPY) -m e2e.kueue down

kueue-status: venv
	@$(VPY) -m e2e.kueue status

unit: venv
	$(VPY) e2e/run_pytest.py -m "not cluster"

# lint, types, then every test (unit and end-to-end on the real control plane) but the
# Kueue ones: their first run builds Kueue (minutes), so they run in `make test-kueue`.
test: lint typecheck
	$(VPY) e2e/run_pytest.py -m "not kueue and not upgrade and not kind"

# Kueue queueing GPU Jobs beside gpudra (e2e/tests/test_kueue.py; real-node parts skip
# with the reason where the machine cannot run a node).
test-kueue: venv
	$(VPY) e2e/run_pytest.py -m kueue e2e/tests/test_kueue.py

# Upgrade and downgrade between the previous release (e2e/tools/versions.env) and the
# working tree with GPU pods of every kind running on the real node (about 4 minutes warm;
# the first run also builds the release's image), and the chart's moves between webhook
# TLS sources with Helm 3 (HELM3_VERSION, built on first use; `make test` runs Helm 4's).
test-upgrade: venv
	$(VPY) e2e/run_pytest.py -m upgrade e2e/tests/test_upgrade.py e2e/tests/test_chart.py

# The end-to-end suites that touch the API on every pinned Kubernetes version, one after
# another (each built on first use), then a table: version, passed, failed, skipped with
# the reason. VERSIONS=1.34,1.37 picks some; not part of `make test` (see README).
.PHONY: test-versions
VERSIONS ?=
test-versions: venv
	$(VPY) -m e2e.versions --versions "$(VERSIONS)"

demo: cluster-up
	@$(VPY) -m e2e.demo

demo-down: venv
	@$(VPY) -m e2e.demo down

# Kueue queueing GPU Jobs on the real node: a table of Job, queue, state, pods, devices.
demo-kueue: cluster-up
	@$(VPY) -m e2e.kueue.demo

# Helm chart: helm is built from the Go module proxy and cached like the Kubernetes binaries.
.PHONY: helm prometheus chart-lint chart-crds image e2e-kind e2e-kind-down test-kind
helm:
	@bash e2e/tools/build-helm.sh

# promtool and prometheus for the alert-rule and end-to-end monitoring tests, the same way.
prometheus:
	@bash e2e/tools/build-prometheus.sh

chart-crds:
	@mkdir -p charts/gpudra/files/crds
	@rm -f charts/gpudra/files/crds/*.yaml
	@if ls api/crds/*.yaml >/dev/null 2>&1; then cp api/crds/*.yaml charts/gpudra/files/crds/; fi

# lint, render and schema checks; the server-side dry-run is e2e/tests/test_chart.py.
chart-lint: venv
	$(VPY) -m pytest -q tests/chart

# The one image, as an OCI archive in dist/, without a container engine (root, debootstrap).
image: venv
	$(VPY) e2e/image/build.py

# kind cluster with DRA gates and CDI, then the e2e suite; its GPU-pod tests install the
# chart with emulated GPUs on a worker, as they do on the local real node, and
# e2e/tests/test_kind_nodes.py installs it on both GPU workers (H100 with MIG, L4). Without a
# Docker engine it starts a private one (root) and builds the node image offline
# (e2e/kind/engine.py, e2e/kind/nodeimage.py); `make e2e-kind-down` removes it all.
# Beside kind's nodes, the local harness's fake nodes (a heartbeat keeps them Ready), so
# the whole suite runs; tests that need the local harness skip with the reason, and the
# run ends with a table per suite (README, "The suite on kind").
# The host check (a cluster of its own) is `make test-kind`.
e2e-kind: venv
	$(VPY) -m e2e.kind up
	GPUDRA_CLUSTER_PROVIDER=kind $(VPY) e2e/run_pytest.py -m cluster e2e/tests \
		--ignore=e2e/tests/test_kind_host.py

e2e-kind-down: venv
	$(VPY) -m e2e.kind down

# kind up and down on the private engine leave the host's /run, sysctls and firewall as
# they were (e2e/tests/test_kind_host.py; a few minutes, not part of `make test`).
test-kind: venv
	$(VPY) e2e/run_pytest.py -m kind e2e/tests/test_kind_host.py

bench-slices: cluster-up
	$(VPY) -m bench.slices

bench-webhook: cluster-up
	$(VPY) -m bench.webhook

bench-prepare: cluster-up
	$(VPY) -m bench.prepare

bench-schedule: cluster-up
	$(VPY) -m bench.schedule

# Admission to Running per Job under Kueue, legacy and native (real node; BENCH_KUEUE_JOBS).
bench-kueue: cluster-up
	$(VPY) -m bench.kueue

bench: bench-slices bench-webhook bench-prepare bench-schedule

# Every side-by-side benchmark, then one table of gpudra against its peer or floor. It
# starts each benchmark's control plane itself (a fresh one; BENCH_FRESH=0 keeps one).
bench-compare: venv
	$(VPY) -m bench.compare

# Long property-based fuzzing of the webhook (over HTTPS), the parsers and recover():
# fresh random cases, FUZZ_EXAMPLES per test; writes bench/results/fuzz.json.
# `make test` runs the same tests with a fixed seed and a few dozen cases.
.PHONY: fuzz
FUZZ_EXAMPLES ?= 2000
fuzz: venv
	$(VPY) -m bench.fuzz --examples $(FUZZ_EXAMPLES)
