"""Reads the SLO guard's three numbers from Prometheus (prometheus-api-client 0.7.2).

Every failure becomes a :class:`Reading` error with a message a person can act on; nothing raises into the
operator's timer, because an unreachable Prometheus must surface as ``SLOUnknown``, never as a crash or a breach.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.exceptions import NewConnectionError, TimeoutError as TimeoutError_
from urllib3.util.retry import Retry

from .measurements import Measurements, Reading
from .queries import QuerySet
from .settings import PrometheusSettings, SecretKeyRef


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
    # Retries inside one evaluation: the next interval is the real retry, so keep one evaluation short.
    retries: int = 0

    def __post_init__(self) -> None:
        if self.bearer_token and self.basic_auth:
            raise ValueError("prometheus: give a bearer token or basic auth, not both")
        if self.ca_file and self.insecure_skip_verify:
            raise ValueError("prometheus: caFile and insecureSkipVerify contradict each other")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"prometheus.url: {self.url!r} must be an http:// or https:// URL")
        if self.timeout_s <= 0:
            raise ValueError(f"prometheus.timeout: {self.timeout_s!r} must be greater than zero")

    def __repr__(self) -> str:  # never print credentials into logs
        auth = "bearer" if self.bearer_token else "basic" if self.basic_auth else "none"
        return f"PrometheusClientConfig(url={self.url!r}, auth={auth}, ca_file={self.ca_file!r})"


class PrometheusSource:
    """Runs a :class:`QuerySet` against one Prometheus and returns :class:`Measurements`."""

    def __init__(self, config: PrometheusClientConfig):
        self.config = config
        session = requests.Session()
        if config.insecure_skip_verify:
            session.verify = False
        elif config.ca_file:
            session.verify = config.ca_file
        headers = {"Authorization": f"Bearer {config.bearer_token}"} if config.bearer_token else None
        self._client = PrometheusConnect(
            url=config.url.rstrip("/"),
            headers=headers,
            auth=config.basic_auth,
            session=session,
            timeout=config.timeout_s,
            retry=Retry(total=config.retries, backoff_factor=0.2, status_forcelist=[502, 503, 504],
                        allowed_methods=["GET"]),
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "PrometheusSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def query_scalar(self, promql: str) -> Reading:
        """The largest value of an instant vector (the worst target when an override returns several series)."""
        try:
            result = self._client.custom_query(promql)
        except PrometheusApiClientException as exc:
            return Reading.failed(f"query rejected: {_short(str(exc))}", promql)
        except requests.exceptions.SSLError as exc:
            return Reading.failed(f"TLS error talking to {self.config.url}: {_short(str(exc))}", promql)
        except requests.exceptions.Timeout:
            return Reading.failed(f"timed out after {self.config.timeout_s:g}s waiting for {self.config.url}", promql)
        except requests.exceptions.ConnectionError as exc:
            # With retries exhausted urllib3 wraps a read timeout in MaxRetryError -> ConnectionError.
            reason = getattr(exc.args[0], "reason", None) if exc.args else None
            # (NewConnectionError subclasses ConnectTimeoutError in urllib3 2.x, but "refused" is not a timeout.)
            if isinstance(reason, TimeoutError_) and not isinstance(reason, NewConnectionError):
                return Reading.failed(f"timed out after {self.config.timeout_s:g}s waiting for {self.config.url}",
                                      promql)
            return Reading.failed(f"cannot reach {self.config.url}: {_short(str(exc))}", promql)
        except (requests.exceptions.RequestException, ValueError, KeyError) as exc:
            return Reading.failed(f"bad answer from {self.config.url}: {_short(str(exc))}", promql)
        return _scalar(result, promql)

    def measure(self, queries: QuerySet) -> Measurements:
        rate = self.query_scalar(queries.request_rate)
        if rate.is_error and rate.error and rate.error.startswith(("cannot reach", "timed out", "TLS error")):
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
            return Reading.failed(f"unexpected series shape {_short(repr(series))}", promql)
    numbers = [v for v in values if not math.isnan(v)]
    # NaN (e.g. histogram_quantile over buckets that saw no observations) is surfaced as NaN, not hidden.
    return Reading.of(max(numbers) if numbers else math.nan, promql)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resolve_client_config(settings: PrometheusSettings, read_secret: Callable[[str, str], str],
                          ca_dir: str | os.PathLike[str]) -> PrometheusClientConfig:
    """Turn ``spec.slo.prometheus`` into a connectable config. ``read_secret(name, key)`` returns one key of a
    Secret in the policy's namespace, decoded (the operator passes a Kubernetes reader; KeyError when the key
    is missing). The CA bundle is written under ``ca_dir`` because requests verifies against a file.
    Raises ValueError naming the field."""
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
            raise ValueError(f"spec.slo.prometheus.caBundle: key {ref.key!r} of Secret {ref.name!r} is not a PEM "
                             "certificate bundle")
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


def _secret(read_secret: Callable[[str, str], str], ref: SecretKeyRef, path: str) -> str:
    try:
        value = read_secret(ref.name, ref.key)
    except KeyError:
        raise ValueError(f"{path}: Secret {ref.name!r} has no key {ref.key!r}") from None
    if not value:
        raise ValueError(f"{path}: key {ref.key!r} of Secret {ref.name!r} is empty")
    return value
