"""Fixtures for the operator's tests against the real control plane (tests/plugins/controlplane.py).

``kube``: a client on the control plane's kubeconfig. ``namespace``: a fresh namespace per test, so each test's
operator (namespaced) sees only its own objects. ``run_operator``: starts the operator in-process, in a thread
with its own event loop and a fresh kopf registry, and stops every one it started at teardown.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Iterator

import pytest


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, what: str = "") -> Any:
    """Poll until ``predicate()`` is truthy; return its value, or fail naming what was awaited."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what or predicate}; last value: {last!r}")


@pytest.fixture(scope="session")
def kube(controlplane):
    from kvtier_operator.kube import Kube

    client = Kube(str(controlplane.kubeconfig))
    yield client
    client.close()


@pytest.fixture
def namespace(kube) -> Iterator[str]:
    name = f"op-{uuid.uuid4().hex[:8]}"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    kube.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture
def run_operator(kube, namespace, controlplane):
    """``run_operator(**settings)`` -> a started OperatorThread watching the test's namespace."""
    from kvtier_operator.kube import Kube
    from kvtier_operator.main import OperatorThread
    from kvtier_operator.settings import Settings

    started: list[OperatorThread] = []

    def start(**overrides: Any) -> OperatorThread:
        values: dict[str, Any] = dict(namespaces=(namespace,), standalone=True, liveness_endpoint=None,
                                      metrics_port=None, resync_seconds=60.0, backoff_initial=0.2, backoff_max=2.0,
                                      read_nodes=False, kubeconfig=str(controlplane.kubeconfig))
        values.update(overrides)
        runner = OperatorThread(Settings(**values), Kube(str(controlplane.kubeconfig)))
        started.append(runner)
        return runner.start()

    yield start
    for runner in started:
        try:
            runner.stop()
        finally:
            runner.op.kube.close()
