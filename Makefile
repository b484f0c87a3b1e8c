# gpudra developer entry points. `make demo` and `make test` work on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PKGS := -p gpudra.api -p gpudra.cli -p gpudra.common -p gpudra.driver -p gpudra.webhook
export K8S_VERSION ?= 1.36

.PHONY: venv lint typecheck unit test cluster-build cluster-up cluster-down cluster-env cluster-status demo bench

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

unit: venv
	$(VPY) e2e/run_pytest.py -m "not cluster"

# lint, types, then every test (unit and end-to-end on the real control plane).
test: lint typecheck
	$(VPY) e2e/run_pytest.py

demo: cluster-up
	@$(VPY) -m e2e.demo

bench-slices: cluster-up
	$(VPY) -m bench.slices

bench-prepare: cluster-up
	$(VPY) -m bench.prepare

bench: bench-slices bench-prepare
