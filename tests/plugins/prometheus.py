"""Real Prometheus for tests: Debian's ``prometheus`` 2.42 as a process on 127.0.0.1 (random port, 1 s scrape,
storage in a temp dir, torn down after), plus synthetic engines for it to scrape.

Targets are given through a file_sd file, so a test adds or removes engines while Prometheus runs; each target
carries ``namespace`` and ``pod`` labels the way a Kubernetes scrape would. Tests that need it are marked
``prometheus`` and skip (with the install command) when the binary is missing.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL_HINT = "apt-get install -y --no-install-recommends prometheus"


def _load_synthetic_client() -> Any:
    spec = importlib.util.spec_from_file_location("synthetic_engine_client",
                                                  REPO / "e2e" / "synthetic_engine" / "client.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusProcess:
    """One Prometheus server. ``stop()``/``start()`` keep port and storage, like a restarted pod."""

    def __init__(self, workdir: Path, scrape_interval: str = "1s", rule_files: list[Path] | None = None,
                 web_config: Path | None = None, scheme: str = "http"):
        self.binary = shutil.which("prometheus")
        if self.binary is None:
            raise RuntimeError(f"prometheus is not installed: {INSTALL_HINT}")
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.targets_file = workdir / "targets.json"
        self.config_file = workdir / "prometheus.yml"
        self.web_config = web_config
        self.scheme = scheme
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.targets: dict[str, dict[str, Any]] = {}
        self._targets_lock = threading.Lock()   # engines may be added from several threads
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "prometheus.log"
        self.targets_file.write_text("[]")
        config = {
            "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                       "evaluation_interval": scrape_interval},
            "scrape_configs": [{
                "job_name": "engines",
                "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}],
            }],
        }
        if rule_files:
            config["rule_files"] = [str(p) for p in rule_files]
        self.config_file.write_text(json.dumps(config))   # JSON is YAML

    # -- targets
    def add_target(self, address: str, *, namespace: str = "default", pod: str = "engine-0",
                   metrics_path: str = "/metrics", **labels: str) -> None:
        with self._targets_lock:
            self.targets[address] = {"namespace": namespace, "pod": pod, "__metrics_path__": metrics_path,
                                     **labels}
            self._write_targets()

    def remove_target(self, address: str) -> None:
        with self._targets_lock:
            self.targets.pop(address, None)
            self._write_targets()

    def _write_targets(self) -> None:
        groups = [{"targets": [addr], "labels": labels} for addr, labels in self.targets.items()]
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets_file)   # atomic, so file_sd never reads half a file

    # -- lifecycle
    def start(self, timeout: float = 20.0) -> None:
        cmd = [self.binary, f"--config.file={self.config_file}", f"--storage.tsdb.path={self.data_dir}",
               f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle",
               "--storage.tsdb.retention.time=1h", "--log.level=warn"]
        if self.web_config is not None:
            cmd.append(f"--web.config.file={self.web_config}")
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}: {self.log()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                if self.web_config is None:
                    with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                        if r.status == 200:
                            return
                else:
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"prometheus not ready within {timeout} s: {self.log()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    # -- queries (plain HTTP; the code under test uses its own client)
    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
        return body["data"]["result"]

    def wait_for(self, promql: str, predicate: Callable[[float], bool] = lambda v: True,
                 timeout: float = 30.0) -> float:
        """Poll until ``promql`` returns a number satisfying ``predicate``; return it."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            result = self.query(promql)
            if result:
                last = float(result[0]["value"][1])
                if last == last and predicate(last):   # NaN never satisfies
                    return last
            time.sleep(0.25)
        raise AssertionError(f"{promql!r} did not satisfy the predicate within {timeout} s (last {last!r})")


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
