"""``vllm serve`` in a subprocess: started on a free loopback port, health-checked with a bounded wait, queried
over HTTP, and always killed with its whole process group (context manager, atexit and finalizer)."""
from __future__ import annotations

import atexit
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

# vLLM's Prometheus text: `name{label="v",...} value`.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class EngineStartError(RuntimeError):
    """The engine exited or did not become healthy in time; the message ends with the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> Samples:
    samples: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, labels = head, ()
        if "{" in head:
            name, _, rest = head.partition("{")
            pairs = []
            for part in _split_labels(rest.rstrip("}")):
                k, _, v = part.partition("=")
                pairs.append((k, v.strip('"')))
            labels = tuple(sorted(pairs))
        try:
            samples[(name, labels)] = float(value)
        except ValueError:
            continue
    return samples


def _split_labels(s: str) -> list[str]:
    out, cur, quoted = [], "", False
    for ch in s:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # Children (engine core, workers) may outlive the API server: SIGKILL whatever is left of the group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


class VllmServer:
    """One ``vllm serve`` process group. Use as a context manager; ``start()``/``stop()`` for restarts."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        config_path: str | os.PathLike[str] | None,
        *,
        kv_cache_memory_bytes: int,
        max_model_len: int,
        python: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 300.0,
        max_num_batched_tokens: int | None = None,
        dtype: str = "bfloat16",
    ) -> None:
        self.model_dir = str(model_dir)
        self.config_path = None if config_path is None else str(config_path)
        self.kv_cache_memory_bytes = int(kv_cache_memory_bytes)
        self.max_model_len = int(max_model_len)
        self.python = python or sys.executable
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.max_num_batched_tokens = max_num_batched_tokens or max_model_len
        self.dtype = dtype
        self.log_path = pathlib.Path(log_path) if log_path else pathlib.Path(
            tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self.port = 0
        self.start_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.cli.main", "serve", self.model_dir]
        if self.config_path:
            cmd += ["--config", self.config_path]
        cmd += [
            "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", "model",
            "--dtype", self.dtype,
            "--enforce-eager",
            "--enable-prefix-caching",
            "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes),
            "--max-model-len", str(self.max_model_len),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-num-seqs", "4",
            *self.extra_args,
        ]
        return cmd

    def start(self) -> VllmServer:
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError("already running")
        self.port = free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false", **self.env}
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {' '.join(self.command())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True)
        self._finalizer = weakref.finalize(self, _kill_group, self._proc)
        atexit.register(self._finalizer)
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self, started: float) -> None:
        assert self._proc is not None
        deadline = started + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EngineStartError(f"vllm serve exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise EngineStartError(f"vllm serve not healthy after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit code once the engine exits by itself (e.g. a config error), ``None`` if still running."""
        assert self._proc is not None
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def launch_only(self) -> VllmServer:
        """Start without waiting for health (to watch a start-up that is expected to fail)."""
        self.port = free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               **self.env}
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True)
        self._finalizer = weakref.finalize(self, _kill_group, self._proc)
        atexit.register(self._finalizer)
        return self

    def stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills the group once; later calls are no-ops
            atexit.unregister(self._finalizer)
            self._finalizer = None

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, not a shutdown)."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait(timeout=30)
        self.stop()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- observation ---------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def rss_bytes(self) -> int:
        """Resident memory of every process in the engine's process group (API server, engine core, workers)."""
        if self._proc is None:
            return 0
        total = 0
        for entry in pathlib.Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getpgid(int(entry.name)) != self._proc.pid:
                    continue
                for line in (entry / "status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except (OSError, ValueError):
                continue
        return total

    def metrics_text(self) -> str:
        req = urllib.request.Request(f"{self.url}/metrics", headers={"Accept": "text/plain;version=0.0.4"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> Samples:
        return parse_metrics(self.metrics_text())

    def metric(self, name: str, samples: Samples | None = None, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0.0 when there are none)."""
        samples = self.metrics() if samples is None else samples
        want = set(labels.items())
        return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))

    # ---- requests ------------------------------------------------------------------------------------------
    def complete(self, prompt_ids: Sequence[int], max_tokens: int = 8, timeout_s: float = 300.0) -> dict[str, Any]:
        """A greedy completion of a token-id prompt; the response JSON plus ``_latency_s``."""
        body = {"model": "model", "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True}
        return self._post("/v1/completions", body, timeout_s)

    def chat(self, question: str, max_tokens: int = 32, timeout_s: float = 300.0) -> dict[str, Any]:
        """A greedy chat completion of one user message (the model's chat template); stops at the end of turn."""
        body = {"model": "model", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                "temperature": 0.0}
        return self._post("/v1/chat/completions", body, timeout_s)

    def _post(self, path: str, body: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out = json.loads(r.read())
        out["_latency_s"] = time.monotonic() - t0
        return out

    def ttft(self, prompt_ids: Sequence[int]) -> float:
        """The engine's own time to first token for one request (its TTFT histogram's sum, before and after)."""
        name_sum, name_count = "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"
        before = self.metrics()
        self.complete(prompt_ids, max_tokens=1)
        deadline = time.monotonic() + 10
        while True:  # the histogram is updated just after the response
            after = self.metrics()
            if self.metric(name_count, after) > self.metric(name_count, before) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        n = self.metric(name_count, after) - self.metric(name_count, before)
        assert n == 1, f"expected one request in the TTFT histogram, saw {n}"
        return self.metric(name_sum, after) - self.metric(name_sum, before)

    @staticmethod
    def text(response: Mapping[str, Any]) -> str:
        return response["choices"][0]["text"]

    @staticmethod
    def answer(response: Mapping[str, Any]) -> str:
        """The assistant's message of a :meth:`chat` response."""
        return response["choices"][0]["message"]["content"]

    @staticmethod
    def cached_tokens(response: Mapping[str, Any]) -> int | None:
        details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens")
