"""Start and steer a synthetic engine process (used by tests/plugins/prometheus.py, the bench and e2e)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ENGINE_SCRIPT = Path(__file__).with_name("engine.py")


class SyntheticEngine:
    """A running ``engine.py``; ``set(ttft=3.0)`` changes its latency, ``stop()`` ends it."""

    def __init__(self, engine: str = "vllm", model_name: str = "synthetic-model", config: Path | None = None,
                 exposition: str = "negotiate", **knobs: Any):
        self.engine = engine
        self._dir = tempfile.TemporaryDirectory(prefix="synthetic-engine-")
        port_file = Path(self._dir.name) / "port"
        self.log_path = Path(self._dir.name) / "engine.log"
        cmd = [sys.executable, str(ENGINE_SCRIPT), "--engine", engine, "--model-name", model_name,
               "--port-file", str(port_file), "--exposition", exposition]
        if config is not None:
            cmd += ["--config", str(config)]
        for key, value in knobs.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- the engine's stdout while it runs; closed in stop()
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 15
        while not port_file.exists():
            if self.process.poll() is not None:
                self._log.close()
                raise RuntimeError(f"synthetic engine exited with {self.process.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"synthetic engine did not start within 15 s: {self.log()}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_path = "/metrics" if engine == "vllm" else "/prometheus/metrics"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    def set(self, **knobs: Any) -> dict[str, Any]:
        return self._call("POST", "/control", knobs)

    def knobs(self) -> dict[str, Any]:
        return self._call("GET", "/control")

    def config(self) -> dict[str, Any]:
        return self._call("GET", "/config")

    def scrape(self, accept: str = "") -> str:
        req = urllib.request.Request(self.url + self.metrics_path, headers={"Accept": accept} if accept else {})
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.read().decode()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self._log.closed:
            self._log.close()
        self._dir.cleanup()

    def __enter__(self) -> SyntheticEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
