"""The Prometheus reader and the default queries against a real Prometheus: both spellings of vLLM's names,
TensorRT-LLM's names, scoping to the policy's pods, TLS with a CA bundle, basic auth, a bearer token, timeouts
and an unreachable server. Every failure must come back as an error reading, never an exception."""
from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kvtier_operator.slo import Scope, build_queries
from kvtier_operator.slo.client import PrometheusClientConfig, PrometheusSource, unavailable
from plugins.slo_harness import slo_settings

pytestmark = pytest.mark.prometheus

# bcrypt of "kvtier-test-password" (cost 4): a throwaway credential for a loopback test server, not a secret.
TEST_USER, TEST_PASSWORD = "kvtier", "kvtier-test-password"
TEST_PASSWORD_BCRYPT = "$2b$04$dTb3504JeLV0wkWp2uUySeVTqEzVXolWwS1RVKTNDD12Q4/V6qHzK"


def test_default_queries_find_every_spelling_and_stay_in_scope(prometheus, synthetic_engine):
    engines = {
        # negotiated OpenMetrics: prometheus_client escapes "vllm:" to "vllm_"
        "a": synthetic_engine(engine="vllm", ttft=0.05, rate=20),
        # classic text format: the colon survives
        "b": synthetic_engine(engine="vllm", ttft=0.5, rate=20, exposition="classic"),
        "c": synthetic_engine(engine="trtllm", ttft=3.0, itl=0.2, rate=20),
    }
    for ns, e in engines.items():
        prometheus.add_target(e.address, namespace=ns, pod=f"{ns}-0", metrics_path=e.metrics_path)
    prometheus.wait_for('count({__name__=~".*time_to_first_token_seconds_count"})', lambda v: v == 3)
    stored = {r["metric"]["__name__"] for r in prometheus.query('{__name__=~".*time_to_first_token_seconds_count"}')}
    assert stored == {"vllm_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count",
                      "trtllm_time_to_first_token_seconds_count"}

    expected = {"a": (0.04, 0.06), "b": (0.25, 0.75), "c": (2.5, 5.0)}
    with PrometheusSource(PrometheusClientConfig(prometheus.url, timeout_s=2)) as source:
        for ns, (low, high) in expected.items():
            engine = "trtllm" if ns == "c" else "vllm"
            q = build_queries(engine, Scope(namespace=ns, pods=[f"{ns}-0"]), 5)
            prometheus.wait_for(q.ttft_p99, timeout=30)
            m = source.measure(q)
            assert low < m.ttft_p99.value <= high, (ns, m)
            assert m.itl_p99.value is not None and m.request_rate.value > 5, (ns, m)
        # The TensorRT-LLM ITL comes from time_per_output_token (200 ms -> bucket 0.15-0.3).
        m = source.measure(build_queries("trtllm", Scope(namespace="c"), 5))
        assert 0.15 < m.itl_p99.value <= 0.3
        # A scope matching nothing is "no data", not zero and not an error.
        m = source.measure(build_queries("vllm", Scope(namespace="nobody"), 5))
        assert m.ttft_p99.is_empty and m.request_rate.is_empty


def test_bad_query_and_unreachable_server_are_error_readings(prometheus):
    with PrometheusSource(PrometheusClientConfig(prometheus.url, timeout_s=2)) as source:
        r = source.query_scalar("sum(rate(x[5m]")
        assert r.is_error and r.error == "query rejected by Prometheus (bad_data)"
        assert source.query_scalar("vector(1)").value == 1.0
    prometheus.stop()
    with PrometheusSource(PrometheusClientConfig(prometheus.url, timeout_s=2)) as source:
        m = source.measure(build_queries("vllm", Scope(namespace="x"), 5))
        assert m.request_rate.is_error and m.ttft_p99.is_error and m.request_rate.error.startswith("no usable answer from")


def test_a_server_that_never_answers_times_out():
    with socket.socket() as silent:   # accepts connections (backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with PrometheusSource(PrometheusClientConfig(url, timeout_s=0.5)) as source:
            r = source.query_scalar("vector(1)")
    assert r.is_error and r.error == unavailable(url) and "timed out after 0.5s" in r.detail


@pytest.fixture
def tls_prometheus(prometheus_factory, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "server.key", tmp_path / "server.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-days", "1"],
                   check=True, capture_output=True)
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                   f"basic_auth_users:\n  {TEST_USER}: '{TEST_PASSWORD_BCRYPT}'\n")
    return prometheus_factory(web_config=web, scheme="https"), cert


def test_tls_with_ca_bundle_and_basic_auth(tls_prometheus):
    prom, ca = tls_prometheus
    good = PrometheusClientConfig(prom.url, basic_auth=(TEST_USER, TEST_PASSWORD), ca_file=str(ca))
    with PrometheusSource(good) as source:
        assert source.query_scalar("vector(42)").value == 42.0
    with PrometheusSource(PrometheusClientConfig(prom.url, basic_auth=(TEST_USER, "wrong"), ca_file=str(ca))) as s:
        r = s.query_scalar("vector(1)")
        assert r.is_error and r.detail == "HTTP 401"
    with PrometheusSource(PrometheusClientConfig(prom.url, basic_auth=(TEST_USER, TEST_PASSWORD))) as s:
        r = s.query_scalar("vector(1)")   # system trust store does not know our CA
        assert r.is_error and r.detail.startswith("tls:") and r.error == unavailable(prom.url)


class _BearerProxy(BaseHTTPRequestHandler):
    """Stand-in for the auth proxy in front of an in-cluster Prometheus (kube-rbac-proxy, oauth2-proxy), which
    cannot run here: Prometheus itself does not check bearer tokens. It forwards to the real Prometheus."""

    token = ""
    upstream = ""

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            self.send_response(401)
            self.end_headers()
            return
        try:
            with urllib.request.urlopen(self.upstream + self.path, timeout=5) as r:
                status, body = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, body = e.code, e.read()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_bearer_token_is_sent(prometheus):
    handler = type("Proxy", (_BearerProxy,), {"token": "t0ken", "upstream": prometheus.url})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with PrometheusSource(PrometheusClientConfig(url, bearer_token="t0ken")) as source:
            assert source.query_scalar("vector(7)").value == 7.0
        with PrometheusSource(PrometheusClientConfig(url, bearer_token="other")) as source:
            assert source.query_scalar("vector(7)").detail == "HTTP 401"
    finally:
        server.shutdown()
        server.server_close()


def test_config_rejects_contradictions_and_hides_credentials():
    with pytest.raises(ValueError, match="bearer token or basic auth, not both"):
        PrometheusClientConfig("http://p:9090", bearer_token="x", basic_auth=("u", "p"))
    with pytest.raises(ValueError, match="prometheus.url"):
        PrometheusClientConfig("p:9090")
    assert "s3cret" not in repr(PrometheusClientConfig("http://p:9090", bearer_token="s3cret"))


def test_synthetic_engine_refuses_a_config_that_does_not_parse(tmp_path, synthetic_engine):
    bad = tmp_path / "vllm.yaml"
    bad.write_text("kv-transfer-config: {kv_connector: [unclosed\n")
    with pytest.raises(RuntimeError, match="does not parse as YAML"):
        synthetic_engine(config=bad)
    bad.write_text("kv-transfer-config: '{\"kv_connector\": '\n")
    with pytest.raises(RuntimeError, match="kv-transfer-config is not JSON"):
        synthetic_engine(config=bad)
    good = tmp_path / "good.yaml"
    good.write_text("block-size: 16\nkv-transfer-config: {kv_connector: OffloadingConnector, kv_role: kv_both}\n")
    engine = synthetic_engine(config=good)
    assert engine.config()["kv-transfer-config"]["kv_connector"] == "OffloadingConnector"
    assert "synthetic_engine_config_info" in engine.scrape()


def test_secrets_resolve_into_a_client_config(tmp_path, tls_prometheus):
    from kvtier_operator.slo.client import resolve_client_config

    prom, ca = tls_prometheus
    secrets = {("prom-basic", "username"): TEST_USER, ("prom-basic", "password"): TEST_PASSWORD,
               ("prom-ca", "ca.crt"): ca.read_text()}
    spec = {"selector": {"matchLabels": {"app": "llm"}}, "tiers": [], "slo": {"ttftP99": "1s", "prometheus": {
        "url": prom.url, "caBundle": {"name": "prom-ca", "key": "ca.crt"},
        "auth": {"username": {"name": "prom-basic", "key": "username"},
                 "password": {"name": "prom-basic", "key": "password"}}}}}
    settings = slo_settings(spec).prometheus
    config = resolve_client_config(settings, lambda name, key: secrets[(name, key)], tmp_path / "ca")
    with PrometheusSource(config) as source:
        assert source.query_scalar("vector(3)").value == 3.0
    # A missing key, an empty value, a missing or unreadable Secret and a malformed bundle all read the same:
    # a policy author must not learn from status whether a Secret or key exists.
    messages = set()
    del secrets[("prom-basic", "password")]
    with pytest.raises(ValueError, match="spec.slo.prometheus.auth.password: key 'password' of Secret "
                                         "'prom-basic' cannot be used") as missing:
        resolve_client_config(settings, lambda name, key: secrets[(name, key)], tmp_path / "ca")
    messages.add(str(missing.value))
    secrets[("prom-basic", "password")] = ""
    with pytest.raises(ValueError) as empty:
        resolve_client_config(settings, lambda name, key: secrets[(name, key)], tmp_path / "ca")
    messages.add(str(empty.value))

    def forbidden(name, key):
        raise PermissionError("403")

    settings_pw_only = settings
    with pytest.raises(ValueError) as denied:
        resolve_client_config(settings_pw_only, lambda name, key: forbidden(name, key) if key == "password"
                              else secrets[(name, key)], tmp_path / "ca")
    messages.add(str(denied.value))
    assert len(messages) == 1, messages
    secrets[("prom-basic", "password")] = TEST_PASSWORD
    secrets[("prom-ca", "ca.crt")] = "not a certificate"
    with pytest.raises(ValueError, match="spec.slo.prometheus.caBundle: key 'ca.crt' of Secret 'prom-ca' cannot"):
        resolve_client_config(settings, lambda name, key: secrets[(name, key)], tmp_path / "ca")
