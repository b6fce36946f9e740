"""A hostile "Prometheus": the guard's query ends within its total deadline, reads a bounded answer, echoes no
body, and no negative number counts as within the SLO.

The servers here are raw sockets on 127.0.0.1 scripted to misbehave in ways a real Prometheus never does (drip one
byte at a time, answer without end, put a secret in an error page); a real Prometheus is used for the normal
path in tests/operator/slo/test_slo_client.py.
"""
from __future__ import annotations

import asyncio
import gc
import math
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from kvtier_operator.slo import Measurements, assess, http
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
            except TimeoutError:
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


def test_a_redirect_is_not_followed_and_the_credentials_stay_put():
    def elsewhere(conn, script):
        send(conn, script, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(OK_BODY), OK_BODY))

    with hostile_server(elsewhere) as (target, other):
        def behave(conn, script):
            send(conn, script, b"HTTP/1.1 302 Found\r\nLocation: %s/api/v1/query?query=vector(1)\r\n"
                 b"Content-Length: 0\r\n\r\n" % target.encode())
        with hostile_server(behave) as (url, script):
            reading, _ = query(url, bearer_token="tok-123")
    # A 3xx is an answer like any other: not Prometheus's, so unavailable; the token went to the named URL only.
    assert reading.is_error and reading.error == unavailable(url) and reading.detail == "HTTP 302", reading
    assert len(script.requests) == 1 and other.requests == []


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 20_000 + b"\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(500)) + b"Content-Length: 0\r\n\r\n",
], ids=["one-huge-header", "many-headers"])
def test_oversized_headers_are_refused(head):
    with hostile_server(lambda conn, script: send(conn, script, head)) as (url, _):
        reading, took = query(url)
    assert reading.is_error and reading.error == unavailable(url) and took < 1.0
    assert reading.detail.startswith("too_large: headers larger than"), reading.detail


@pytest.mark.parametrize("answer, detail", [
    (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "protocol: not an HTTP/1.x answer"),
    (b"", "protocol: connection closed before the headers ended"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}", "protocol: connection closed before the body ended"),
])
def test_broken_answers_are_unavailable(answer, detail):
    with hostile_server(lambda conn, script: send(conn, script, answer)) as (url, _):
        reading, _ = query(url)
    assert reading.is_error and reading.error == unavailable(url) and reading.detail == detail, reading


def test_a_compressed_answer_is_not_inflated():
    # Accept-Encoding: identity is asked; a server that compresses anyway is not decompressed (no zip bomb).
    def behave(conn, script):
        send(conn, script, b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\nabcd")
    with hostile_server(behave) as (url, script):
        reading, _ = query(url)
    assert b"Accept-Encoding: identity" in script.requests[0]
    assert reading.is_error and reading.detail == "not a Prometheus query result", reading


def test_a_closed_port_is_unavailable():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    reading, _ = query(url)
    assert reading.is_error and reading.error == unavailable(url) and reading.detail == "connect: connection refused"


def test_queries_leave_no_session_loop_or_thread_behind():
    def behave(conn, script):
        send(conn, script, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(OK_BODY), OK_BODY))
    before = set(threading.enumerate())
    with warnings_recorded() as seen:
        with hostile_server(behave) as (url, _):
            for _ in range(5):
                assert query(url)[0].value == 0.25
            assert query(url, timeout_s=10.0, max_bytes=8)[0].detail.startswith("too_large")
        # A name that does not resolve goes through the resolver's thread.
        assert query("http://no-such-prometheus.invalid:9090")[0].is_error
        gc.collect()
    leaked = [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]
    assert not leaked, leaked  # an unclosed session, connector, transport or event loop warns when collected
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before


def test_the_reader_refuses_to_block_a_running_event_loop():
    async def on_the_loop():
        http.get("http://127.0.0.1:9/", deadline_s=1, max_bytes=1)

    with pytest.raises(RuntimeError, match="worker thread"):
        asyncio.run(on_the_loop())


@contextmanager
def warnings_recorded() -> Iterator[list]:
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield seen


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
