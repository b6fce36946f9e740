# The two commands a newcomer needs: `make demo` (the end-to-end scenario on a local control plane) and
# `make test` (the whole test suite). Both install what they need first (scripts/setup).
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
export KVTIER_VENV := $(VENV)

.PHONY: setup test demo crd

setup:
	scripts/setup

test: setup
	$(PY) -m pytest -p no:cacheprovider -ra $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/kvtier demo

crd: setup
	$(VENV)/bin/kvtier crd > crds/kvtier.io_kvcachepolicies.yaml
	tools/sync-chart-crds.sh
