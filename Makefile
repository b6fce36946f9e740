# The two commands a newcomer needs: `make demo` (the end-to-end scenario on a local control plane) and
# `make test` (the whole test suite). Both install what they need first (scripts/setup).
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
export KVTIER_VENV := $(VENV)

.PHONY: setup test demo crd

setup:
	scripts/setup

# Two runs: the project's environment, then the vLLM plug-in tests in a separate env holding vllm==0.33.0
# (its ~80 pins must not leak into the operator's environment). KVTIER_REQUIRE_VLLM turns "vllm missing" into a
# failure instead of a skip.
test: setup
	$(PY) -m pytest -p no:cacheprovider -ra --ignore=tests/vllm $(PYTEST_ARGS)
	.ci/vllm-env
	KVTIER_REQUIRE_VLLM=1 $(CURDIR)/.venv-vllm/bin/python -m pytest -p no:cacheprovider -ra tests/vllm

demo: setup
	$(VENV)/bin/kvtier demo

crd: setup
	$(VENV)/bin/kvtier crd > crds/kvtier.io_kvcachepolicies.yaml
	tools/sync-chart-crds.sh
