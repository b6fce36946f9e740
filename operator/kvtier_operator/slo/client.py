"""Reads the SLO guard's three numbers from Prometheus's HTTP API (``/api/v1/query``).

Every failure becomes a :class:`Reading` error with a message a person can act on; nothing raises into the
policy's pass, because an unreachable Prometheus must surface as ``SLOUnknown``, never as a crash or a breach.
Each query is one bounded, blocking GET (:mod:`.http`, aiohttp): a total deadline of ``timeout_s``, bounded
headers, at most ``max_bytes`` of answer, no redirect followed. The operator calls it from the policy's lane
thread (``lanes.Lanes``), never from kopf's event loop. Error messages name the endpoint without credentials,
query or fragment, and never quote the answer's body.
"""
from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..trust import redacted
from . import http
from .measurements import Measurements, Reading
from .queries import QuerySet
from .settings import PrometheusSettings, SecretKeyRef

# A Prometheus answer for the guard's queries is a few series (KiB); 4 MiB leaves room for an override that
# returns many, and keeps one policy from growing the operator by more.
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
_ERROR_TYPE = re.compile(r"^[a-z_]{1,32}$")


def unavailable(where: str) -> str:
    """The one wording of every failure that must not be told apart: no connection, a timeout, TLS, an answer
    that is not Prometheus's, and a Secret that is missing, forbidden or unusable (see :class:`Unavailable`)."""
    return (f"no usable answer from {where}: it could not be reached or did not answer as Prometheus, or the "
            "credentials in spec.slo.prometheus could not be used (the operator does not say which)")


class Unavailable:
    """A source whose every query fails with :func:`unavailable`: what the guard queries when the Secrets that
    ``spec.slo.prometheus`` names cannot be used, so that a missing Secret reads exactly like an unreachable
    endpoint (the condition must not tell a policy author whether a Secret exists)."""

    def __init__(self, url: str):
        self._error = unavailable(redacted(url))

    def close(self) -> None:
        pass

    def measure(self, queries: QuerySet) -> Measurements:
        return Measurements(Reading.failed(self._error, queries.ttft_p99), Reading.failed(self._error, queries.itl_p99),
                            Reading.failed(self._error, queries.request_rate))


@dataclass(frozen=True)
class PrometheusClientConfig:
    """Resolved connection settings (the operator reads the Secrets named in the spec and fills these in)."""

    url: str
    timeout_s: float = 5.0
    bearer_token: str | None = None
    basic_auth: tuple[str, str] | None = None
    # Path to a PEM bundle that signs the server's certificate; None uses the system store.
    ca_file: str | None = None
    insecure_skip_verify: bool = False
    # Not used: one evaluation is one try (the next interval is the retry). Kept so that existing callers work.
    retries: int = 0
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.bearer_token and self.basic_auth:
            raise ValueError("prometheus: give a bearer token or basic auth, not both")
        if self.ca_file and self.insecure_skip_verify:
            raise ValueError("prometheus: caFile and insecureSkipVerify contradict each other")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"prometheus.url: {redacted(self.url)!r} must be an http:// or https:// URL")
        if self.timeout_s <= 0:
            raise ValueError(f"prometheus.timeout: {self.timeout_s!r} must be greater than zero")

    def __repr__(self) -> str:  # never print credentials into logs
        auth = "bearer" if self.bearer_token else "basic" if self.basic_auth else "none"
        return f"PrometheusClientConfig(url={redacted(self.url)!r}, auth={auth}, ca_file={self.ca_file!r})"


class PrometheusSource:
    """Runs a :class:`QuerySet` against one Prometheus and returns :class:`Measurements`."""

    def __init__(self, config: PrometheusClientConfig):
        self.config = config
        self._where = redacted(config.url)
        self._headers: dict[str, str] = {}
        if config.bearer_token:
            self._headers["Authorization"] = f"Bearer {config.bearer_token}"
        elif config.basic_auth:
            pair = f"{config.basic_auth[0]}:{config.basic_auth[1]}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
        self._endpoint = config.url.rstrip("/") + "/api/v1/query"

    def close(self) -> None:
        pass  # one connection per query, closed by the query

    def __enter__(self) -> PrometheusSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def query_scalar(self, promql: str) -> Reading:
        """The largest value of an instant vector (the worst target when an override returns several series)."""
        c = self.config
        try:
            answer = http.get(self._endpoint, params={"query": promql}, headers=self._headers,
                              deadline_s=c.timeout_s, max_bytes=c.max_bytes, ca_file=c.ca_file,
                              insecure=c.insecure_skip_verify)
        except http.HTTPFailure as exc:
            # Timeout, refused, TLS or a non-HTTP answer: one wording, so that a policy author cannot map which
            # ports of an allowed host are open.
            return Reading.failed(unavailable(self._where), promql, detail=f"{exc.kind}: {exc}")
        try:
            doc = json.loads(answer.body)
        except ValueError:
            doc = None
        if not 200 <= answer.status < 300:
            # Prometheus's own errorType token (its answer to a bad query) is told; anything else (a status code,
            # a reason phrase, the body of an arbitrary URL) is not echoed: one wording with the failures above.
            error_type = doc.get("errorType") if isinstance(doc, dict) else None
            if isinstance(error_type, str) and _ERROR_TYPE.match(error_type):
                return Reading.failed(f"query rejected by Prometheus ({error_type})", promql)
            return Reading.failed(unavailable(self._where), promql, detail=f"HTTP {answer.status}")
        if not isinstance(doc, dict) or doc.get("status") != "success" or not isinstance(doc.get("data"), dict):
            return Reading.failed(unavailable(self._where), promql, detail="not a Prometheus query result")
        data = doc["data"]
        if data.get("resultType") == "scalar":
            return _scalar([{"value": data.get("result")}], promql)
        if data.get("resultType") != "vector":
            return Reading.failed(f"unexpected result type {http.sanitise(str(data.get('resultType')))}", promql)
        return _scalar(data.get("result"), promql)

    def measure(self, queries: QuerySet) -> Measurements:
        rate = self.query_scalar(queries.request_rate)
        if rate.is_error and rate.error == unavailable(self._where):
            # One unreachable server is one error, not three timeouts in a row.
            return Measurements(Reading.failed(rate.error, queries.ttft_p99),
                                Reading.failed(rate.error, queries.itl_p99), rate)
        return Measurements(self.query_scalar(queries.ttft_p99), self.query_scalar(queries.itl_p99), rate)


def _scalar(result: object, promql: str) -> Reading:
    if isinstance(result, dict) and "result" in result:  # scalar-typed answers
        result = result["result"]
    if not isinstance(result, list):
        return Reading.failed(f"unexpected result type {type(result).__name__}", promql)
    if not result:
        return Reading.empty(promql)
    values: list[float] = []
    for series in result:
        try:
            values.append(float(series["value"][1]))
        except (KeyError, IndexError, TypeError, ValueError):
            return Reading.failed("unexpected series shape (expected {\"value\": [time, \"number\"]})", promql)
    if any(v < 0 for v in values):
        # A latency or a rate is never negative (or -Inf): a broken query, not a measurement within the SLO.
        return Reading.failed("invalid value: a negative number (check the query)", promql)
    numbers = [v for v in values if not math.isnan(v)]
    # NaN (e.g. histogram_quantile over buckets that saw no observations) is surfaced as NaN, not hidden.
    return Reading.of(max(numbers) if numbers else math.nan, promql)


def resolve_client_config(settings: PrometheusSettings, read_secret: Callable[[str, str], str],
                          ca_dir: str | os.PathLike[str]) -> PrometheusClientConfig:
    """Turn ``spec.slo.prometheus`` into a connectable config. ``read_secret(name, key)`` returns one key of a
    Secret in the policy's namespace, decoded (the operator passes a Kubernetes reader; KeyError, or any
    exception, when it cannot). The CA bundle is written under ``ca_dir`` because the TLS context loads it from
    a file. Raises ValueError naming the field, and the same words whatever went wrong with the Secret: a policy
    author must not learn from a condition whether a Secret or a key exists."""
    token = basic = ca_file = None
    if settings.bearer_token is not None:
        token = _secret(read_secret, settings.bearer_token, "spec.slo.prometheus.auth.bearerToken").strip()
    if settings.username is not None and settings.password is not None:
        basic = (_secret(read_secret, settings.username, "spec.slo.prometheus.auth.username"),
                 _secret(read_secret, settings.password, "spec.slo.prometheus.auth.password"))
    if settings.ca_bundle is not None:
        ref = settings.ca_bundle
        pem = _secret(read_secret, ref, "spec.slo.prometheus.caBundle")
        if "-----BEGIN CERTIFICATE-----" not in pem:
            raise ValueError(_unusable("spec.slo.prometheus.caBundle", ref))
        digest = hashlib.sha256(pem.encode()).hexdigest()[:16]
        path = Path(ca_dir) / f"prometheus-ca-{digest}.pem"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(pem)
            tmp.replace(path)
        ca_file = str(path)
    return PrometheusClientConfig(url=settings.url, timeout_s=settings.timeout_s, bearer_token=token or None,
                                  basic_auth=basic, ca_file=ca_file)


def _unusable(path: str, ref: SecretKeyRef) -> str:
    return (f"{path}: key {ref.key!r} of Secret {ref.name!r} cannot be used (a missing Secret or key, an empty "
            "or malformed value, or one the operator may not read all read the same here)")


def _secret(read_secret: Callable[[str, str], str], ref: SecretKeyRef, path: str) -> str:
    try:
        value = read_secret(ref.name, ref.key)
    except Exception:
        raise ValueError(_unusable(path, ref)) from None
    if not value:
        raise ValueError(_unusable(path, ref))
    return value
