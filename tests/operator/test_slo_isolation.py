"""A slow Prometheus delays only its own policy's evaluations (issue 16, item 3; lanes.Lanes).

Real parts: the guard's own Prometheus client (``PrometheusSource``, aiohttp) against local HTTP servers on
loopback: one that answers at once like Prometheus, one that drips its answer a byte at a time. Each query ends at
its policy's total deadline (``spec.slo.prometheus.timeout``, at most 60 s), so a dripping server holds an
evaluation for that long; the test uses the maximum. Many policies point at the
dripping one, one at the fast one, and reconcile-like jobs run on the event loop's default executor as the
operator's reconciles do. The same scenario on one shared executor is the control: there the fast policy and the
reconciles starve, which shows the test can fail.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kvtier_operator.lanes import Lanes
from kvtier_operator.slo import Scope, build_queries
from kvtier_operator.slo.client import PrometheusClientConfig, PrometheusSource

SLOW_POLICIES = 24
DRIP_S = 0.2          # one byte every DRIP_S: each slow answer takes far longer than the whole scenario
SCENARIO_S = 3.0
INTERVAL_S = 0.25     # the fast policy's evaluation interval
ANSWER = json.dumps({"status": "success", "data": {"resultType": "vector",
                                                   "result": [{"metric": {}, "value": [0, "0.5"]}]}}).encode()


def serve(handler: Callable[[BaseHTTPRequestHandler, threading.Event], None]) -> Iterator[tuple[str, threading.Event]]:
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            handler(self, stop)

        do_POST = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", stop
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def fast(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(ANSWER)))
    h.end_headers()
    h.wfile.write(ANSWER)


def dripping(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(ANSWER)))
    h.end_headers()
    for i in range(len(ANSWER)):   # bounded: ANSWER bytes x DRIP_S, cut short when the test ends
        if stop.wait(DRIP_S):
            return
        try:
            h.wfile.write(ANSWER[i:i + 1])
            h.wfile.flush()
        except OSError:
            return


@pytest.fixture
def servers() -> Iterator[tuple[str, str]]:
    fast_gen, slow_gen = serve(fast), serve(dripping)
    (fast_url, _), (slow_url, _) = next(fast_gen), next(slow_gen)
    try:
        yield fast_url, slow_url
    finally:
        for gen in (slow_gen, fast_gen):
            next(gen, None)


def evaluate(url: str) -> float:
    """One evaluation as the guard runs it: three queries through the guard's client; returns its duration."""
    started = time.monotonic()
    with PrometheusSource(PrometheusClientConfig(url, timeout_s=60.0)) as source:
        source.measure(build_queries("vllm", Scope(namespace="ns"), 60))
    return time.monotonic() - started


async def scenario(run: Callable[[str, Callable[..., Any], Any], Any], fast_url: str,
                   slow_url: str) -> dict[str, Any]:
    """Every policy evaluates in a loop; meanwhile reconcile-like jobs run on the default executor."""
    deadline = time.monotonic() + SCENARIO_S
    fast_ticks: list[float] = []
    reconciles: list[float] = []

    async def policy(key: str, url: str, record: list[float] | None) -> None:
        while time.monotonic() < deadline:
            started = time.monotonic()
            await run(key, evaluate, url)
            if record is not None:
                record.append(time.monotonic() - started)
            await asyncio.sleep(INTERVAL_S)

    async def reconcile_jobs() -> None:
        while time.monotonic() < deadline:
            started = time.monotonic()
            await asyncio.to_thread(time.sleep, 0.01)   # the operator's reconciles: asyncio.to_thread
            reconciles.append(time.monotonic() - started)
            await asyncio.sleep(0.1)

    tasks = [asyncio.ensure_future(policy(f"slow-{i}", slow_url, None)) for i in range(SLOW_POLICIES)]
    await asyncio.sleep(0.3)   # the slow ones hold their threads first
    main = [asyncio.ensure_future(policy("fast", fast_url, fast_ticks)), asyncio.ensure_future(reconcile_jobs())]
    await asyncio.wait(main, timeout=SCENARIO_S + 5)
    for t in tasks + main:
        t.cancel()
    return {"fast_ticks": fast_ticks, "reconciles": reconciles}


def run_loop(coro_factory: Callable[[], Any]) -> Any:
    loop = asyncio.new_event_loop()
    # As main.run: the reconciles' default executor has 16 threads.
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=16))
    try:
        return loop.run_until_complete(coro_factory())
    finally:
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def test_a_dripping_prometheus_delays_only_its_own_policies(servers):
    fast_url, slow_url = servers
    lanes = Lanes("test-slo")

    async def in_lanes(key: str, fn: Callable[..., Any], *args: Any) -> Any:
        return await lanes.run(key, fn, *args)

    out = run_loop(lambda: scenario(in_lanes, fast_url, slow_url))
    for key in ["fast", *(f"slow-{i}" for i in range(SLOW_POLICIES))]:
        lanes.close(key)
    ticks, reconciles = out["fast_ticks"], out["reconciles"]
    # The fast policy keeps its interval: at least half the evaluations that fit, each well under a second.
    assert len(ticks) >= (SCENARIO_S - 0.3) / (INTERVAL_S + 0.2) / 2, ticks
    assert max(ticks) < 1.0, ticks
    assert reconciles and max(reconciles) < 0.5, reconciles


def test_control_on_one_shared_executor_the_fast_policy_and_reconciles_starve(servers):
    """The failure the lanes prevent: evaluations on the executor the reconciles use (asyncio.to_thread)."""
    fast_url, slow_url = servers

    async def shared(key: str, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    out = run_loop(lambda: scenario(shared, fast_url, slow_url))
    ticks, reconciles = out["fast_ticks"], out["reconciles"]
    # 24 dripping evaluations hold all 16 workers for longer than the scenario: nothing else gets one.
    assert len(ticks) == 0 and len(reconciles) <= 1, (ticks, reconciles)
