"""Real Prometheus for tests: the scenario's launcher (``e2e/scenario/prometheus.py``, the one copy) as fixtures,
plus synthetic engines for it to scrape.

Targets are given through a file_sd file, so a test adds or removes engines while Prometheus runs; each target
carries ``namespace`` and ``pod`` labels the way a Kubernetes scrape would. Tests that need it are marked
``prometheus`` and skip (with the install command) when the binary is missing.
"""
from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from scenario.prometheus import INSTALL_HINT, PrometheusProcess, free_port

__all__ = ["INSTALL_HINT", "PrometheusProcess", "Started", "free_port", "require_prometheus"]
REPO = Path(__file__).resolve().parents[2]


def _load_synthetic_client() -> Any:
    spec = importlib.util.spec_from_file_location("synthetic_engine_client",
                                                  REPO / "e2e" / "synthetic_engine" / "client.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


class Started:
    """Starts Prometheus servers and synthetic engines and stops every one of them on ``close()``, so a
    fixture of any scope can own a set of them."""

    def __init__(self, base: Path):
        self.base = base
        self.servers: list[PrometheusProcess] = []
        self.engines: list[Any] = []
        self._client = _load_synthetic_client()

    def prometheus(self, **kwargs: Any) -> PrometheusProcess:
        proc = PrometheusProcess(Path(tempfile.mkdtemp(dir=self.base, prefix="prom-")), **kwargs)
        self.servers.append(proc)
        proc.start()
        return proc

    def engine(self, **kwargs: Any) -> Any:
        engine = self._client.SyntheticEngine(**kwargs)
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        for engine in self.engines:
            engine.stop()
        for proc in self.servers:
            proc.stop()


def require_prometheus() -> None:
    if shutil.which("prometheus") is None:
        pytest.skip(f"prometheus is not installed: {INSTALL_HINT}")


@pytest.fixture
def prometheus_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., PrometheusProcess]]:
    """Start Prometheus servers with custom options (rule files, web config); all stopped at teardown."""
    require_prometheus()
    started = Started(tmp_path_factory.getbasetemp())
    yield started.prometheus
    started.close()


@pytest.fixture
def prometheus(prometheus_factory: Callable[..., PrometheusProcess]) -> PrometheusProcess:
    """A fresh Prometheus on loopback with a 1 s scrape and no targets yet."""
    return prometheus_factory()


@pytest.fixture
def synthetic_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Any]]:
    """Start synthetic engine processes (``e2e/synthetic_engine``); all stopped at teardown."""
    started = Started(tmp_path_factory.getbasetemp())
    yield started.engine
    started.close()
