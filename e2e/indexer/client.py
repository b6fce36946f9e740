"""llm-d's KV-cache indexer (``e2e/indexer/main.go``: the library's own ZMQ subscribers, vLLM event adapter, index and
longest-prefix scorer, served over HTTP) as a router's peer in a test: started on a free loopback port, asked what
a router would ask (``/score``) and what its index holds per block (``/blocks``), and killed at teardown. The node
test (tests/e2e/test_remote_tier_node.py) and the routing bench (bench/routing.py) run it.

The binary is built by ``e2e/indexer/run build`` (``.ci/test-envs`` builds it beside the env installs, so this only
finds it); a failed build fails the test with the build's own message.
"""
from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 20.0
REQUEST_TIMEOUT_S = 10.0
# The medium weights docs/routing.md gives for kvtier's tiers.
WEIGHTS = "gpu=1,cpu=0.9,storage=0.8"


def indexer_binary() -> str:
    build = subprocess.run([str(REPO / "e2e" / "indexer" / "run"), "build"], capture_output=True, text=True,
                           timeout=3600)
    assert build.returncode == 0, f"e2e/indexer/run build failed:\n{build.stderr[-3000:]}"
    return build.stdout.strip().splitlines()[-1]


class Indexer:
    """One indexer process; ``close()`` (also on a failed start) kills it and waits for it."""

    def __init__(self, workdir: Path, block_size: int, weights: str = WEIGHTS):
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "indexer.log"
        port_file = workdir / "indexer.port"
        port_file.unlink(missing_ok=True)
        binary = indexer_binary()
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc: Optional[subprocess.Popen[bytes]] = subprocess.Popen(
                [binary, "-listen", "127.0.0.1:0", "-port-file", str(port_file), "-block-size", str(block_size),
                 "-weights", weights], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not port_file.exists():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the indexer did not start (exit {self.proc.poll()}):\n{self.log(40)}")
                time.sleep(0.05)
            self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        except BaseException:
            self.close()
            raise

    def log(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as err:
            return f"(no indexer log: {err})"

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            raise AssertionError(f"indexer {path}: HTTP {err.code}: {err.read().decode(errors='replace')}") from err

    def subscribe(self, pod: str, endpoint: str) -> None:
        """Dial a pod's ZMQ publisher (``pod`` is only the subscription's name: the index names a pod by the
        topic's pod part, which kvtier renders as the pod IP)."""
        self._post("/subscribe", {"pod": pod, "endpoint": endpoint})

    def score(self, model: str, tokens: list[int], pods: list[str], salt: str = "") -> dict[str, float]:
        """What a router ranks ``pods`` by for this prompt: the library's longest-prefix score (weighted)."""
        scores = self._post("/score", {"model": model, "tokens": tokens, "pods": pods, "salt": salt})["scores"]
        return {p: float(scores.get(p, 0.0)) for p in pods}

    def tiers(self, model: str, tokens: list[int], pod: str, salt: str = "") -> list[set[str]]:
        """For each whole block of the prompt, the mediums the index holds it in for ``pod``."""
        blocks = self._post("/blocks", {"model": model, "tokens": tokens, "pods": [pod], "salt": salt})["blocks"]
        return [{e["tier"] for e in block if e["pod"] == pod} for block in blocks]

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=30)
            self.proc = None
