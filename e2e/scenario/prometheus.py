"""A real Prometheus process on loopback: the one launcher, used by the scenario (the demo, ``tests/e2e``) and
by the tests' fixtures (``tests/plugins/prometheus.py``).

Debian's ``prometheus`` 2.42 on 127.0.0.1 or a given address (the demo: the node's bridge; random port, 1 s scrape by default, storage in its work dir). Targets
come from a file_sd file rewritten as engines come and go; each target carries the ``namespace`` and ``pod``
labels a Kubernetes pod scrape adds, which is what the SLO guard's queries select on. ``stop()``/``start()``
keep port and storage, like a restarted pod. Rule files and a web config (TLS, basic auth) are optional.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

INSTALL_HINT = "apt-get install -y --no-install-recommends prometheus (Debian/Ubuntu)"
# How the process is started: (command, log file, working dir) -> the process. The scenario passes its
# supervisor's (stopped with everything else, dies with its parent); plain subprocess otherwise.
Spawn = Callable[[list[str], Path, Path], "subprocess.Popen[bytes]"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _popen(cmd: list[str], log_path: Path, cwd: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)


class PrometheusProcess:
    """One Prometheus server. ``stop()``/``start()`` keep port and storage, like a restarted pod."""

    def __init__(self, workdir: Path, scrape_interval: str = "1s", rule_files: list[Path] | None = None,
                 web_config: Path | None = None, scheme: str = "http", spawn: Spawn | None = None,
                 host: str = "127.0.0.1"):
        self.binary = shutil.which("prometheus")
        if self.binary is None:
            raise RuntimeError(f"prometheus is not installed: {INSTALL_HINT}")
        workdir.mkdir(parents=True, exist_ok=True)
        self.spawn = spawn or _popen
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.targets_file = workdir / "targets.json"
        self.config_file = workdir / "prometheus.yml"
        self.web_config = web_config
        self.scheme = scheme
        self.port = free_port()
        self.host = host  # the address it listens on (the node's bridge address: pods query it there)
        self.url = f"{scheme}://{host}:{self.port}"
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
               f"--web.listen-address={self.host}:{self.port}", "--web.enable-lifecycle",
               "--storage.tsdb.retention.time=1h", "--log.level=warn"]
        if self.web_config is not None:
            cmd.append(f"--web.config.file={self.web_config}")
        self.process = self.spawn(cmd, self.log_path, self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}: {self.log()}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
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

    def scraped_pods(self) -> dict[str, bool]:
        """pod label -> whether its last scrape succeeded (``up``)."""
        try:
            return {r["metric"].get("pod", "?"): r["value"][1] == "1" for r in self.query('up{job="engines"}')}
        except (OSError, urllib.error.URLError, KeyError, ValueError):
            return {}

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
