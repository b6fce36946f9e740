"""A hostile "Prometheus": the guard's query ends within its total deadline, reads a bounded answer, echoes no
body, and no negative number counts as within the SLO.

The servers here are raw sockets on 127.0.0.1 scripted to misbehave in ways a real Prometheus never does (drip one
byte at a time, answer without end, put a secret in an error page); a real Prometheus is used for the normal
path in tests/test_slo_client.py.
"""
from __future__ import annotations

import math
import socket
import threading
import time
import tracemalloc
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest

from kvtier_operator.slo import Measurements, assess
from kvtier_operator.slo.client import PrometheusClientConfig, PrometheusSource, unavailable
from plugins.slo_harness import slo_settings

OK_BODY = b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1,"0.25"]}]}}'


class Script:
    """What the server saw and sent."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.sent = 0
        self.closed_by_client = threading.Event()


@contextmanager
def hostile_server(behave: Callable[[socket.socket, Script], None]) -> Iterator[tuple[str, Script]]:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    script, stop = Script(), threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                script.requests.append(data)
                try:
                    behave(conn, script)
                except OSError:
                    script.closed_by_client.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", script
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()


def send(conn: socket.socket, script: Script, data: bytes) -> None:
    conn.sendall(data)
    script.sent += len(data)


def drip(payload: bytes, every_s: float, limit_s: float = 20.0) -> Callable[[socket.socket, Script], None]:
    def behave(conn: socket.socket, script: Script) -> None:
        end = time.monotonic() + limit_s
        for i in range(len(payload)):
            if time.monotonic() > end:
                return
            send(conn, script, payload[i:i + 1])
            time.sleep(every_s)
    return behave


def query(url: str, timeout_s: float = 1.0, **config) -> tuple[object, float]:
    started = time.monotonic()
    with PrometheusSource(PrometheusClientConfig(url, timeout_s=timeout_s, **config)) as source:
        reading = source.query_scalar("vector(1)")
    return reading, time.monotonic() - started


def test_a_normal_answer_is_read():
    def behave(conn, script):
        send(conn, script, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
             % (len(OK_BODY), OK_BODY))
    with hostile_server(behave) as (url, _):
        reading, _ = query(url)
    assert reading.value == 0.25


def test_chunked_answers_are_read():
    def behave(conn, script):
        half = len(OK_BODY) // 2
        send(conn, script, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" +
             b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, OK_BODY[:half], len(OK_BODY) - half, OK_BODY[half:]))
    with hostile_server(behave) as (url, _):
        reading, _ = query(url)
    assert reading.value == 0.25


@pytest.mark.parametrize("what, payload", [
    # The case: a `timeout: 1s` query held for 18.7 s by a server that sends a byte now and then.
    ("headers", b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000),
    ("body", b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"{" * 100_000),
])
def test_a_dripping_server_is_cut_off_at_the_total_deadline(what, payload):
    with hostile_server(drip(payload, every_s=0.05)) as (url, script):
        reading, took = query(url, timeout_s=1.0)
    assert reading.is_error and reading.error == unavailable(url) and "timed out after 1s" in reading.detail, reading
    assert 0.9 < took < 1.6, took  # the total, not per read: a per-read timeout would wait 20 s here
    assert script.sent > 10  # it really was dripping, not silent


def test_a_silent_server_times_out():
    with hostile_server(lambda conn, script: time.sleep(3)) as (url, _):
        reading, took = query(url, timeout_s=0.5)
    assert reading.is_error and "timed out after 0.5s" in reading.detail and took < 1.0
    assert reading.error == unavailable(url)  # one wording for every failure (class F: no port oracle)


def test_an_endless_answer_is_cut_at_the_size_cap_with_bounded_memory():
    block = b"x" * 65536

    def behave(conn, script):
        send(conn, script, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
        for _ in range(200 * 16):  # 200 MB, the answer
            send(conn, script, block)

    tracemalloc.start()
    try:
        with hostile_server(behave) as (url, script):
            reading, took = query(url, timeout_s=10.0, max_bytes=1 << 20)
            script.closed_by_client.wait(5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reading.is_error and "larger than 1048576 bytes" in reading.detail, reading
    assert took < 5
    assert peak < 16 << 20, f"peak Python allocations {peak / 2**20:.1f} MiB"
    # The client hung up: what the server got out is the cap plus socket buffers, not 200 MB.
    assert script.sent < 64 << 20, script.sent


def test_a_declared_huge_length_is_refused_before_reading():
    def behave(conn, script):
        send(conn, script, b"HTTP/1.1 200 OK\r\nContent-Length: 209715200\r\n\r\n")
        time.sleep(2)
    with hostile_server(behave) as (url, _):
        reading, took = query(url, timeout_s=5.0, max_bytes=1 << 20)
    assert reading.is_error and "larger than" in reading.detail and took < 1.5


def test_an_error_page_is_not_reflected():
    body = b'{"status":"error","errorType":"bad_data","error":"SECRET-FROM-INTERNAL-SERVICE"}'

    def behave(conn, script):
        send(conn, script, b"HTTP/1.1 400 Bad Request \x1b[31m<script>SECRET-REASON</script>" + b"y" * 500 +
             b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    with hostile_server(behave) as (url, _):
        reading, _ = query(url)
    # Class F (reflected reason phrases): neither the reason phrase nor the body is shown, only errorType.
    assert reading.is_error and reading.error == "query rejected by Prometheus (bad_data)", reading.error
    assert "SECRET" not in reading.error and "Bad Request" not in reading.error


def test_a_non_prometheus_answer_is_not_reflected():
    def behave(conn, script):
        page = b"<html>internal admin console: SECRET</html>"
        send(conn, script, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(page), page))
    with hostile_server(behave) as (url, _):
        reading, _ = query(url)
    assert reading.is_error and "SECRET" not in reading.error and "not a Prometheus query result" in reading.detail
    assert reading.error == unavailable(url)


def test_credentials_are_sent_only_as_configured_and_never_echoed():
    def behave(conn, script):
        send(conn, script, b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
    with hostile_server(behave) as (url, script):
        reading, _ = query(url, bearer_token="tok-123")
    assert b"Authorization: Bearer tok-123" in script.requests[0]
    assert "tok-123" not in reading.error and reading.detail == "HTTP 401"
    assert reading.error == unavailable(url) and "Unauthorized" not in reading.error


@pytest.mark.parametrize("value", ["-0.5", "-Inf"])
def test_a_negative_reading_is_an_error_not_within_the_slo(value):
    body = (b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1,"%s"]}]}}'
            % value.encode())

    def behave(conn, script):
        send(conn, script, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    with hostile_server(behave) as (url, _):
        reading, _ = query(url)
    assert reading.is_error and "negative" in reading.error


@pytest.mark.parametrize("ttft", [-1.0, -math.inf, math.nan])
def test_the_decision_engine_never_calls_an_invalid_latency_within_the_slo(ttft):
    settings = slo_settings({"selector": {"matchLabels": {"app": "llm"}},
                                      "tiers": [{"name": "cpu", "medium": "cpu", "size": "1Gi"}], "slo": {
        "prometheus": {"url": "https://prom"}, "ttftP99": "1s"}})
    verdict = assess(settings, Measurements.of(ttft, None, 5.0), None)
    assert verdict.verdict == "error", verdict
    assert assess(settings, Measurements.of(0.5, None, -1.0), None).verdict == "error"
    assert assess(settings, Measurements.of(0.5, None, 5.0), None).verdict == "ok"  # the control
