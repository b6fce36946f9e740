"""A real Prometheus process on loopback, scraping the stand-in pods every second.

Targets come from a file_sd file the kubelet stand-in rewrites as pods come and go; each target carries the
``namespace`` and ``pod`` labels a Kubernetes pod scrape adds, which is what the SLO guard's queries select on.
"""
from __future__ import annotations

import json
import shutil
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from .processes import ScenarioError, Started, Supervisor, wait_http_ok

INSTALL_HINT = "apt-get install -y --no-install-recommends prometheus (Debian/Ubuntu)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, supervisor: Supervisor, workdir: Path, scrape_interval: str = "1s"):
        binary = shutil.which("prometheus")
        if binary is None:
            raise ScenarioError(f"prometheus is not installed: {INSTALL_HINT}")
        self.binary = binary
        self.supervisor = supervisor
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.targets_file = workdir / "targets.json"
        self.targets_file.write_text("[]")
        self._targets: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: Started | None = None
        config = {
            "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                       "evaluation_interval": scrape_interval},
            "scrape_configs": [{"job_name": "engines", "file_sd_configs": [
                {"files": [str(self.targets_file)], "refresh_interval": "1s"}]}],
        }
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def start(self, timeout: float = 30.0) -> None:
        cmd = [self.binary, f"--config.file={self.workdir / 'prometheus.yml'}",
               f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
               "--storage.tsdb.retention.time=1h", "--log.level=warn"]
        # Registered first, so it runs after the process stopped: the TSDB is of no use afterwards.
        self.supervisor.on_close("prometheus data", lambda: shutil.rmtree(self.workdir / "data", ignore_errors=True))
        self.process = self.supervisor.start("prometheus", cmd, self.log_path, cwd=self.workdir)
        wait_http_ok(self.process, f"{self.url}/-/ready", timeout, interval=0.1)

    def set_target(self, address: str, labels: dict[str, str]) -> None:
        with self._lock:
            self._targets[address] = dict(labels)
            self._write()

    def remove_target(self, address: str) -> None:
        with self._lock:
            self._targets.pop(address, None)
            self._write()

    def _write(self) -> None:
        groups = [{"targets": [a], "labels": l} for a, l in self._targets.items()]
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets_file)  # atomic: file_sd never reads half a file

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())["data"]["result"]

    def scraped_pods(self) -> dict[str, bool]:
        """pod label -> whether its last scrape succeeded (``up``)."""
        try:
            return {r["metric"].get("pod", "?"): r["value"][1] == "1" for r in self.query('up{job="engines"}')}
        except (OSError, urllib.error.URLError, KeyError, ValueError):
            return {}
