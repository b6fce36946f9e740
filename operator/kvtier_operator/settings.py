"""Operator settings: command-line flags, each with an environment variable for in-cluster use."""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from .labels import PREFIX
from .trust import (
    check_endpoint_entry,
    check_host_path_prefix,
    check_namespace_entry,
    check_pvc_entry,
    check_remote_store_entry,
)

FIELD_MANAGER = "kvtier-operator"
FINALIZER = f"{PREFIX}/finalizer"
POLICY_LABEL = f"{PREFIX}/policy"
CONFIG_HASH_ANNOTATION = f"{PREFIX}/config-hash"
REENABLE_ANNOTATION = f"{PREFIX}/reenable"  # a person asks the SLO guard to re-enable these tiers (comma list)
DEFAULT_CLEANUP_IMAGE = "busybox:1.37.0"


@dataclass(frozen=True)
class Settings:
    """Everything an operator process can be told; defaults suit one replica in a cluster."""

    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    standalone: bool = False
    peering_name: Optional[str] = None  # None: kopf's default peering if its CRDs exist, else standalone
    liveness_endpoint: Optional[str] = "http://0.0.0.0:8080/healthz"
    metrics_port: Optional[int] = 9090  # 0 picks a free port; None disables
    metrics_host: str = "0.0.0.0"
    resync_seconds: float = 300.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    cleanup_image: str = DEFAULT_CLEANUP_IMAGE
    read_nodes: bool = True  # headroom against node allocatable when nodes are readable
    kubeconfig: Optional[str] = None
    verbose: bool = False
    # Admin trust settings (docs/install.md, "Threat model"): node paths tiers may mount (default none), and the
    # Prometheus endpoints the SLO guard may query and send credentials to (default none), https only unless
    # plain http is allowed.
    host_path_prefixes: tuple[str, ...] = ()
    prometheus_allowed: tuple[str, ...] = ()
    prometheus_allow_http: bool = False
    # PersistentVolumeClaims tiers may mount, as namespace/claim ('*' for either part); default none. And whether
    # spec.slo.queries may replace the built-in PromQL (it runs with the namespace's Prometheus credentials and
    # is not scoped to the policy's targets); default no.
    pvc_allowed: tuple[str, ...] = ()
    allow_query_overrides: bool = False
    # Valkey/Redis stores remote tiers may use (host:port for TLS, redis://host:port for plain TCP); default none.
    remote_stores_allowed: tuple[str, ...] = ()
    # Namespaces whose Secrets remote tiers may name (the chart's operator.remoteSecretNamespaces, which also grants
    # the Role that reads them); default none. The operator checks this list itself before any read, so a Secret
    # another Role happens to let it read (the SLO guard's, say) is never projected for a remote tier.
    remote_secret_namespaces: tuple[str, ...] = ()
    # How often the Secrets a remote tier names are read again between passes (a get each, never a list or a
    # watch), so consent taken back or a Secret deleted takes effect within this time, not at the next resync.
    secret_recheck_seconds: float = 30.0


_ENV = "KVTIER_"


def _env_bool(value: Optional[str], default: bool) -> bool:
    if value is None or value == "":
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean (true/false)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier operator", description="Run the kvtier operator (kopf).")
    p.add_argument("--namespace", "-n", action="append", dest="namespaces",
                   help="watch this namespace (repeatable; env KVTIER_NAMESPACES, comma separated); "
                        "default: all namespaces")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--standalone", action="store_true", default=None,
                      help="run without peering (exactly one replica; env KVTIER_STANDALONE)")
    mode.add_argument("--peering", dest="peering_name",
                      help="kopf peering object name (env KVTIER_PEERING); makes peering mandatory (needs the "
                           "KopfPeering CRDs); only the highest-priority replica acts. Default: kopf's default "
                           "peering when its CRDs exist, else standalone")
    p.add_argument("--liveness", dest="liveness_endpoint",
                   help="liveness URL to serve (env KVTIER_LIVENESS, default http://0.0.0.0:8080/healthz; "
                        "'off' disables)")
    p.add_argument("--metrics-port", type=int, help="Prometheus metrics port (env KVTIER_METRICS_PORT, "
                                                    "default 9090; 0 picks a free one; -1 disables)")
    p.add_argument("--metrics-host", help="metrics bind address (env KVTIER_METRICS_HOST, default 0.0.0.0)")
    p.add_argument("--resync", type=float, dest="resync_seconds",
                   help="seconds between full re-reconciles of each policy (env KVTIER_RESYNC, default 300)")
    p.add_argument("--backoff-max", type=float, help="longest retry delay after API errors, seconds "
                                                     "(env KVTIER_BACKOFF_MAX, default 30)")
    p.add_argument("--cleanup-image", help="image of the init container that removes stale /dev/shm files "
                                           "(env KVTIER_CLEANUP_IMAGE, default busybox:1.37.0)")
    p.add_argument("--no-read-nodes", dest="read_nodes", action="store_false", default=None,
                   help="do not read nodes for headroom checks (env KVTIER_READ_NODES=false)")
    p.add_argument("--hostpath-prefix", action="append", dest="host_path_prefixes",
                   help="node path under which tiers may use hostPath volumes (repeatable; env "
                        "KVTIER_HOSTPATH_PREFIXES, comma separated); default: none, hostPath tiers are refused")
    p.add_argument("--prometheus-allow", action="append", dest="prometheus_allowed",
                   help="Prometheus endpoint the SLO guard may query and send credentials to: a host, host:port or "
                        "URL prefix (repeatable; env KVTIER_PROMETHEUS_ALLOWED, comma separated); default: none")
    p.add_argument("--prometheus-allow-http", action="store_true", default=None,
                   help="also allow plain http to the allowed endpoints (env KVTIER_PROMETHEUS_ALLOW_HTTP)")
    p.add_argument("--pvc-allow", action="append", dest="pvc_allowed",
                   help="PersistentVolumeClaim tiers may mount, as NAMESPACE/CLAIM, '*' for either part (repeatable; "
                        "env KVTIER_PVC_ALLOWED, comma separated); default: none, PVC tiers are refused")
    p.add_argument("--remote-store-allow", action="append", dest="remote_stores_allowed",
                   help="Valkey/Redis store remote tiers may use: host:port (TLS only) or redis://host:port (plain "
                        "TCP) (repeatable; env KVTIER_REMOTE_STORES_ALLOWED, comma separated); default: none, "
                        "remote tiers are refused")
    p.add_argument("--remote-secret-namespace", action="append", dest="remote_secret_namespaces",
                   help="namespace whose Secrets remote tiers may name (repeatable; env "
                        "KVTIER_REMOTE_SECRET_NAMESPACES, comma separated); default: none, every remote tier's "
                        "Secret is refused")
    p.add_argument("--secret-recheck", type=float, dest="secret_recheck_seconds",
                   help="seconds between re-reads of the Secrets remote tiers name (env KVTIER_SECRET_RECHECK, "
                        "default 30): consent taken back takes effect within this time")
    p.add_argument("--allow-query-overrides", action="store_true", default=None,
                   help="let spec.slo.queries replace the built-in PromQL (arbitrary queries with the namespace's "
                        "Prometheus credentials; env KVTIER_ALLOW_QUERY_OVERRIDES); default: refused")
    p.add_argument("--kubeconfig", help="kubeconfig file (env KUBECONFIG; default in-cluster credentials)")
    p.add_argument("--verbose", "-v", action="store_true", default=None, help="debug logging")
    return p


def from_args(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> Settings:
    """Settings from flags, falling back to KVTIER_* environment variables, then defaults."""
    args = build_parser().parse_args(list(argv))
    d = Settings()

    def pick(flag: Any, name: str, convert: Callable[[str], Any] = str, default: Any = None) -> Any:
        if flag is not None:
            return flag
        raw = env.get(_ENV + name)
        if raw is None or raw == "":
            return default
        try:
            return convert(raw)
        except ValueError as err:
            raise SystemExit(f"kvtier operator: {_ENV}{name}: {err}") from None

    def positive(value: float, flag: str, name: str) -> float:
        # Zero or less would turn the reconcile loop's wait (resync) or its retry delay (backoff) into a spin.
        if value <= 0:
            raise SystemExit(f"kvtier operator: {flag} ({_ENV}{name}): {value:g} must be greater than zero")
        return value

    namespaces = args.namespaces or [n for n in env.get(_ENV + "NAMESPACES", "").split(",") if n.strip()]

    def listed(flag: Optional[list[str]], name: str) -> list[str]:
        return [v.strip() for v in (flag or env.get(_ENV + name, "").split(",")) if v.strip()]

    prefixes = listed(args.host_path_prefixes, "HOSTPATH_PREFIXES")
    allowed = listed(args.prometheus_allowed, "PROMETHEUS_ALLOWED")
    pvcs = listed(args.pvc_allowed, "PVC_ALLOWED")
    stores = listed(args.remote_stores_allowed, "REMOTE_STORES_ALLOWED")
    secret_namespaces = listed(args.remote_secret_namespaces, "REMOTE_SECRET_NAMESPACES")
    for value, check, flag, name in [(v, check_host_path_prefix, "--hostpath-prefix", "HOSTPATH_PREFIXES")
                                     for v in prefixes] + \
                                    [(v, check_endpoint_entry, "--prometheus-allow", "PROMETHEUS_ALLOWED")
                                     for v in allowed] + \
                                    [(v, check_pvc_entry, "--pvc-allow", "PVC_ALLOWED") for v in pvcs] + \
                                    [(v, check_remote_store_entry, "--remote-store-allow", "REMOTE_STORES_ALLOWED")
                                     for v in stores] + \
                                    [(v, check_namespace_entry, "--remote-secret-namespace",
                                      "REMOTE_SECRET_NAMESPACES") for v in secret_namespaces]:
        problem = check(value)
        if problem:
            raise SystemExit(f"kvtier operator: {flag} ({_ENV}{name}): {value!r}: {problem}")
    liveness = pick(args.liveness_endpoint, "LIVENESS", default=d.liveness_endpoint)
    metrics_port = pick(args.metrics_port, "METRICS_PORT", int, d.metrics_port)
    return Settings(
        namespaces=tuple(n.strip() for n in namespaces),
        standalone=bool(pick(args.standalone, "STANDALONE", lambda v: _env_bool(v, False), False)),
        peering_name=pick(args.peering_name, "PEERING", default=d.peering_name),
        liveness_endpoint=None if liveness in (None, "", "off") else liveness,
        metrics_port=None if metrics_port is None or metrics_port < 0 else metrics_port,
        metrics_host=pick(args.metrics_host, "METRICS_HOST", default=d.metrics_host),
        resync_seconds=positive(pick(args.resync_seconds, "RESYNC", float, d.resync_seconds), "--resync", "RESYNC"),
        backoff_max=positive(pick(args.backoff_max, "BACKOFF_MAX", float, d.backoff_max), "--backoff-max",
                             "BACKOFF_MAX"),
        cleanup_image=pick(args.cleanup_image, "CLEANUP_IMAGE", default=d.cleanup_image),
        read_nodes=bool(pick(args.read_nodes, "READ_NODES", lambda v: _env_bool(v, True), True)),
        kubeconfig=args.kubeconfig or env.get("KUBECONFIG") or None,
        verbose=bool(pick(args.verbose, "VERBOSE", lambda v: _env_bool(v, False), False)),
        host_path_prefixes=tuple(prefixes),
        prometheus_allowed=tuple(allowed),
        prometheus_allow_http=bool(pick(args.prometheus_allow_http, "PROMETHEUS_ALLOW_HTTP",
                                        lambda v: _env_bool(v, False), False)),
        pvc_allowed=tuple(pvcs),
        remote_stores_allowed=tuple(stores),
        remote_secret_namespaces=tuple(secret_namespaces),
        secret_recheck_seconds=positive(pick(args.secret_recheck_seconds, "SECRET_RECHECK", float,
                                             d.secret_recheck_seconds), "--secret-recheck", "SECRET_RECHECK"),
        allow_query_overrides=bool(pick(args.allow_query_overrides, "ALLOW_QUERY_OVERRIDES",
                                        lambda v: _env_bool(v, False), False)),
    )
