#!/usr/bin/env python3
"""A synthetic LLM engine for SLO tests: vLLM's and TensorRT-LLM's exact metric names and bucket boundaries,
with a latency distribution and request rate that a test changes at run time.

It serves no model. A generator thread "finishes" requests at the configured rate and observes their TTFT,
inter-token latency and end-to-end latency into the same prometheus_client 0.26 histograms the engines use, so
Prometheus scrapes exactly what it would scrape from vLLM 0.33 / TensorRT-LLM (including the colon-to-underscore
escaping prometheus_client applies when the scraper negotiates OpenMetrics).

Endpoints (127.0.0.1 only):
  GET  /metrics, /prometheus/metrics   the exposition (content-negotiated like the engines, or --exposition classic)
  GET  /control                        current knobs as JSON
  POST /control  {"ttft": 0.05, ...}   change knobs (any subset); answers the new knobs
  GET  /config                         the parsed --config file as JSON
  GET  /health                         200 once serving

``--config FILE``: the rendered engine configuration (vLLM ``--config`` YAML or TensorRT-LLM
``--extra_llm_api_options`` YAML). It must parse into a mapping, and a string ``kv-transfer-config`` must be
JSON, or the process exits 2 before serving, loudly, like a real engine refusing a bad config.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest

# vLLM 0.33 (vllm/v1/metrics/loggers.py) and TensorRT-LLM (tensorrt_llm/metrics/collector.py) defaults.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Knobs:
    """What a test controls. Latencies in seconds; each sample is base * U(1 - jitter, 1 + jitter), and a
    ``tail_fraction`` of requests take ``tail_factor`` times longer (TTFT and ITL alike)."""

    rate: float = 5.0
    ttft: float = 0.05
    itl: float = 0.02
    jitter: float = 0.2
    tail_fraction: float = 0.0
    tail_factor: float = 1.0
    output_tokens: int = 8

    def update(self, changes: dict[str, Any]) -> None:
        known = {f.name: f.type for f in fields(self)}
        for key, value in changes.items():
            if key not in known:
                raise ValueError(f"{key}: unknown knob; known: {', '.join(known)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{key}: {value!r} must be a number >= 0")
        if not 0 <= float(changes.get("jitter", self.jitter)) < 1:
            raise ValueError("jitter: must be in [0, 1)")
        if not 0 <= float(changes.get("tail_fraction", self.tail_fraction)) <= 1:
            raise ValueError("tail_fraction: must be in [0, 1]")
        for key, value in changes.items():
            setattr(self, key, int(value) if key == "output_tokens" else float(value))


class EngineMetrics:
    def __init__(self, engine: str, model_name: str, config_digest: str):
        self.registry = CollectorRegistry()
        r = self.registry
        if engine == "vllm":
            labels = {"model_name": model_name, "engine": "0"}
            prefix, itl_name = "vllm:", "vllm:inter_token_latency_seconds"
            requests_name = "vllm:request_success"   # prometheus_client appends _total
        else:
            labels = {"model_name": model_name, "engine_type": "trtllm"}
            prefix, itl_name = "trtllm_", "trtllm_time_per_output_token_seconds"
            requests_name = "trtllm_request_success"
        names = list(labels)
        self.labels = labels
        self.ttft = Histogram(f"{prefix}time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              names, buckets=TTFT_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram(itl_name, "Histogram of inter-token latency in seconds.", names, buckets=ITL_BUCKETS,
                             registry=r).labels(**labels)
        self.e2e = Histogram(f"{prefix}e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             names, buckets=E2E_BUCKETS, registry=r).labels(**labels)
        self.success = Counter(requests_name, "Count of successfully processed requests.",
                               [*names, "finished_reason"], registry=r).labels(**labels, finished_reason="length")
        self.generation_tokens = Counter(f"{prefix}generation_tokens", "Number of generation tokens processed.",
                                         names, registry=r).labels(**labels)
        self.running = Gauge(f"{prefix}num_requests_running", "Number of requests in model execution batches.",
                             names, registry=r).labels(**labels)
        Gauge("synthetic_engine_config_info", "Digest of the --config file this process loaded.",
              ["digest"], registry=r).labels(digest=config_digest).set(1)


class Generator(threading.Thread):
    """Finishes requests at ``knobs.rate`` per second (fractional carry, so 0.3/s means 3 per 10 s)."""

    def __init__(self, metrics: EngineMetrics, knobs: Knobs, lock: threading.Lock, seed: int | None):
        super().__init__(daemon=True, name="synthetic-generator")
        self.metrics, self.knobs, self.lock = metrics, knobs, lock
        self.random = random.Random(seed)
        self.stop_event = threading.Event()

    def sample(self, base: float, tail: bool) -> float:
        k = self.knobs
        value = base * self.random.uniform(1 - k.jitter, 1 + k.jitter)
        return value * k.tail_factor if tail else value

    def run(self) -> None:
        carry, last = 0.0, time.monotonic()
        while not self.stop_event.wait(0.05):
            now = time.monotonic()
            with self.lock:
                carry += self.knobs.rate * (now - last)
                last = now
                due, carry = int(carry), carry - int(carry)
                self.metrics.running.set(min(due, 64))
                for _ in range(due):
                    tail = self.random.random() < self.knobs.tail_fraction
                    ttft = self.sample(self.knobs.ttft, tail)
                    self.metrics.ttft.observe(ttft)
                    total = ttft
                    for _ in range(max(self.knobs.output_tokens - 1, 0)):
                        gap = self.sample(self.knobs.itl, tail)
                        self.metrics.itl.observe(gap)
                        total += gap
                    self.metrics.e2e.observe(total)
                    self.metrics.success.inc()
                    self.metrics.generation_tokens.inc(self.knobs.output_tokens)


def load_config(path: Path) -> dict[str, Any]:
    """Parse the rendered engine config or exit 2 with the reason (a bad render must fail the scenario)."""
    try:
        text = path.read_text()
    except OSError as exc:
        sys.exit(f"synthetic engine: cannot read --config {path}: {exc}")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        print(f"synthetic engine: --config {path} does not parse as YAML: {exc}", file=sys.stderr)
        sys.exit(2)
    if not isinstance(data, dict):
        print(f"synthetic engine: --config {path} must hold a mapping, got {type(data).__name__}", file=sys.stderr)
        sys.exit(2)
    for key in ("kv-transfer-config", "kv_transfer_config"):
        if isinstance(data.get(key), str):
            try:
                json.loads(data[key])
            except json.JSONDecodeError as exc:
                print(f"synthetic engine: --config {path}: {key} is not JSON: {exc}", file=sys.stderr)
                sys.exit(2)
    return data


def make_handler(metrics: EngineMetrics, knobs: Knobs, lock: threading.Lock, config: dict[str, Any],
                 exposition: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # scrapes every second would flood the test log
            pass

        def reply(self, code: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path in ("/metrics", "/prometheus/metrics"):
                with lock:
                    if exposition == "classic":
                        body, ctype = generate_latest(metrics.registry), CONTENT_TYPE_PLAIN_0_0_4
                    else:
                        encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
                        body = encoder(metrics.registry)
                self.reply(200, body, ctype)
            elif path == "/control":
                with lock:
                    self.reply(200, json.dumps(asdict(knobs)).encode())
            elif path == "/config":
                self.reply(200, json.dumps(config, default=str).encode())
            elif path == "/health":
                self.reply(200, b"{}")
            else:
                self.reply(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            if self.path.split("?")[0] != "/control":
                self.reply(404, b'{"error": "not found"}')
                return
            try:
                changes = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not isinstance(changes, dict):
                    raise ValueError("body must be a JSON object")
                with lock:
                    knobs.update(changes)
                    body = json.dumps(asdict(knobs)).encode()
            except (ValueError, json.JSONDecodeError) as exc:
                self.reply(400, json.dumps({"error": str(exc)}).encode())
                return
            self.reply(200, body)

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("vllm", "trtllm"), default="vllm")
    ap.add_argument("--model-name", default="synthetic-model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (see --port-file)")
    ap.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    ap.add_argument("--config", "--extra_llm_api_options", "--extra-llm-api-options", dest="config", type=Path,
                    help="rendered engine config (vLLM --config / TensorRT-LLM --extra_llm_api_options YAML); "
                         "must parse")
    ap.add_argument("--exposition", choices=("negotiate", "classic"), default="negotiate",
                    help="classic ignores Accept and keeps 'vllm:' names (text format 0.0.4)")
    ap.add_argument("--seed", type=int)
    for f in fields(Knobs):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=int if f.name == "output_tokens" else float,
                        default=f.default)
    args = ap.parse_args(argv)

    config: dict[str, Any] = {}
    digest = "none"
    if args.config is not None:
        config = load_config(args.config)
        digest = hashlib.sha256(args.config.read_bytes()).hexdigest()[:16]
        print(f"synthetic engine: loaded --config {args.config} ({len(config)} keys, digest {digest})",
              file=sys.stderr)
    knobs = Knobs()
    try:
        knobs.update({f.name: getattr(args, f.name) for f in fields(Knobs)})
    except ValueError as exc:
        ap.error(str(exc))
    lock = threading.Lock()
    metrics = EngineMetrics(args.engine, args.model_name, digest)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(metrics, knobs, lock, config, args.exposition))
    port = server.server_address[1]
    generator = Generator(metrics, knobs, lock, args.seed)
    generator.start()
    if args.port_file:
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)   # atomic: a reader never sees a half-written port
    print(f"synthetic engine: {args.engine} serving on http://{args.host}:{port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        generator.stop_event.set()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
