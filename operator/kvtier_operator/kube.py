"""A small Kubernetes client: the few calls the operator makes, returning plain dicts, with typed errors.

Built on the ``kubernetes`` package's ApiClient (auth, TLS, kubeconfig or in-cluster credentials) but talking
raw JSON, so server-side apply, strategic merge and status merge patches are exactly what is sent.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any, Optional
from urllib.parse import quote

import urllib3
from kubernetes import client, config

from .settings import FIELD_MANAGER

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, body: dict[str, Any] | None, method: str = "", path: str = ""):
        self.status = status
        self.body = body or {}
        self.reason = self.body.get("reason", "")
        self.message = self.body.get("message", "")
        super().__init__(f"{method} {path}: {status} {self.reason}: {self.message}")

    @property
    def field_conflict(self) -> bool:
        """Server-side apply refused because another manager owns a field we set (needs a person, not a retry)."""
        causes = (self.body.get("details") or {}).get("causes") or []
        # StatusCause serialises its type under "reason".
        return self.status == 409 and any(c.get("reason") == "FieldManagerConflict" for c in causes)

    @property
    def transient(self) -> bool:
        """Worth retrying: stale resourceVersion, throttling, server trouble."""
        return (self.status == 409 and not self.field_conflict) or self.status in (429, 500, 502, 503, 504)


class Kube:
    """Thread-safe; one per operator process."""

    def __init__(self, kubeconfig: Optional[str] = None, timeout: float = 30.0):
        cfg = client.Configuration()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
        cfg.connection_pool_maxsize = 32
        self.api = client.ApiClient(cfg)
        self.timeout = timeout
        self._lock = threading.Lock()
        # Test seam: called with (method, path) before every write, e.g. to race a concurrent writer.
        self.before_write: Optional[Callable[[str, str], None]] = None
        self.calls = 0

    def close(self) -> None:
        self.api.close()

    def request(self, method: str, path: str, *, query: Optional[list[tuple[str, str]]] = None,
                body: Any = None, content_type: str = "application/json") -> Optional[dict[str, Any]]:
        if method != "GET" and self.before_write is not None:
            self.before_write(method, path)
        headers = {"Accept": "application/json", "Content-Type": content_type}
        _, url, headers, body, _ = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body,
            auth_settings=["BearerToken"])
        with self._lock:
            self.calls += 1
        response = self.api.call_api(method, url, header_params=headers, body=body,
                                     _request_timeout=self.timeout)
        raw = response.read()
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = {"message": raw.decode(errors="replace")[:500]}
        if not 200 <= response.status < 300:
            raise ApiError(response.status, data if isinstance(data, dict) else None, method, path)
        return data

    # ----------------------------------------------------------------------------------------- verbs

    def get(self, path: str) -> Optional[dict[str, Any]]:
        try:
            return self.request("GET", path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def list(self, path: str, label_selector: Optional[str] = None) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        data = self.request("GET", path, query=query) or {}
        kind = (data.get("kind") or "").removesuffix("List")
        api_version = data.get("apiVersion")
        items = data.get("items") or []
        for item in items:  # list items come without apiVersion/kind
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", api_version)
        return items

    def apply(self, path: str, body: dict[str, Any], manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """Server-side apply, never forced: a field another manager owns raises ApiError 409.

        The operator always applies as FIELD_MANAGER; tests pass another manager to act as a GitOps tool.
        """
        return self.request("PATCH", path, query=[("fieldManager", manager), ("force", "false")],
                            body=body, content_type=APPLY) or {}

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body=body) or {}

    def patch(self, path: str, body: dict[str, Any], content_type: str = MERGE) -> dict[str, Any]:
        return self.request("PATCH", path, query=[("fieldManager", FIELD_MANAGER)], body=body,
                            content_type=content_type) or {}

    def delete(self, path: str) -> bool:
        """True if deleted, False if it was already gone ("not found" is success)."""
        try:
            self.request("DELETE", path)
            return True
        except ApiError as err:
            if err.status == 404:
                return False
            raise


def error_reason(err: BaseException) -> str:
    """A short label for an error (metrics, logs): Conflict, HTTP<status>, or the exception's type."""
    if isinstance(err, ApiError):
        return "Conflict" if err.status == 409 else f"HTTP{err.status}"
    return type(err).__name__


def is_transient(err: BaseException) -> bool:
    if isinstance(err, ApiError):
        return err.transient
    return isinstance(err, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError, OSError))


# ---------------------------------------------------------------------------------------------- paths

def _ns(namespace: str) -> str:
    return quote(namespace, safe="")


def workload_path(kind: str, namespace: str, name: Optional[str] = None) -> str:
    plural = {"Deployment": "deployments", "StatefulSet": "statefulsets"}[kind]
    base = f"/apis/apps/v1/namespaces/{_ns(namespace)}/{plural}"
    return f"{base}/{quote(name, safe='')}" if name else base


def config_map_path(namespace: str, name: Optional[str] = None) -> str:
    base = f"/api/v1/namespaces/{_ns(namespace)}/configmaps"
    return f"{base}/{quote(name, safe='')}" if name else base


def secret_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{_ns(namespace)}/secrets/{quote(name, safe='')}"


def policy_path(namespace: str, name: Optional[str] = None, status: bool = False) -> str:
    base = f"/apis/kvtier.io/v1alpha1/namespaces/{_ns(namespace)}/kvcachepolicies"
    if name is None:
        return base
    return f"{base}/{quote(name, safe='')}" + ("/status" if status else "")


NODES = "/api/v1/nodes"
