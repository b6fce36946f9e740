"""Who may make the operator do what: pure checks behind the threat model in docs/install.md.

The operator holds rights a policy author may lack (it patches Deployments and StatefulSets, reads Secrets named
in policies, and makes HTTP requests from inside the cluster). So a policy is a request, and these rules decide
what of it the operator carries out:

- a workload is touched only if its owner opted in with the ``kvtier.io/opt-in`` label (the operator never writes
  that label, so only someone who may edit the workload can grant it);
- a tier may mount a node path only under a prefix the cluster admin allowed, and a PersistentVolumeClaim only if
  the admin allowed it (operator settings; default none);
- the SLO guard queries, and sends credentials to, only Prometheus endpoints the admin allowed, over https unless
  http was allowed, and never a URL carrying credentials, a query or a fragment;
- a remote tier uses (and gets its Secret mounted for) only a store the admin allowed, over TLS unless the admin
  listed the store as redis://;
- a Secret reaches a pod only by consent: it must carry the ``kvtier.io/remote-stores`` annotation listing the
  tier's store (set by someone who may edit Secrets), never a service-account token, never a TLS private key,
  and a MAC key holds at least 32 bytes;
- kvtier writes and deletes only the ConfigMap it created for the policy (an owner reference to it); one of the
  same name held by anyone else is reported, never adopted.
"""
from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union
from urllib.parse import SplitResult, unquote, urlsplit

from .api import v1alpha1 as api
from .api.paths import segments
from .labels import OPT_IN_ANY, OPT_IN_LABEL, REMOTE_STORES_ANNOTATION

DEFAULT_PORTS = {"http": 80, "https": 443}

# ---------------------------------------------------------------------------------------------- workloads


def opted_in(labels: Mapping[str, str], policy: str) -> bool:
    """Whether the workload's owner lets ``policy`` configure it."""
    value = labels.get(OPT_IN_LABEL)
    return value in (policy, OPT_IN_ANY)


def not_opted_in_message(ref: str, policy: str) -> str:
    return (f"{ref} matches spec.selector but its owner has not opted in: kvtier changes a workload only when it "
            f"carries the label {OPT_IN_LABEL}: {policy} (or \"{OPT_IN_ANY}\" for any policy of its namespace)")


# ---------------------------------------------------------------------------------------------- host paths


_segments = segments  # the one normaliser's segments (api.paths)


# A prefix segment the operator replaces with the policy's namespace: /mnt/nvme/{namespace} gives each namespace
# its own node directory, so two tenants never share a hostPath tier's files (a CRC is no key, and blocks on disk
# are not encrypted: docs/security.md).
NAMESPACE_SEGMENT = "{namespace}"


def check_host_path_prefix(prefix: str) -> Optional[str]:
    """Why an admin-supplied hostPath prefix is unusable, or None."""
    if not prefix.startswith("/"):
        return "must be an absolute path"
    if any(p in (".", "..") for p in _segments(prefix)):
        return "must not contain '.' or '..' segments"
    if "{" in prefix.replace(NAMESPACE_SEGMENT, "") or "}" in prefix.replace(NAMESPACE_SEGMENT, "") or any(
            NAMESPACE_SEGMENT in p and p != NAMESPACE_SEGMENT for p in _segments(prefix)):
        return f"may hold {NAMESPACE_SEGMENT} only as a whole path segment"
    return None


def expand_prefix(prefix: str, namespace: str) -> str:
    """An allowlist prefix for one namespace: its {namespace} segments replaced by the namespace's name."""
    return prefix.replace(NAMESPACE_SEGMENT, namespace)


def under_prefix(path: str, prefix: str) -> bool:
    """``path`` equals ``prefix`` or lies below it, segment by segment (``/mnt/kv`` is not under ``/mnt/k``)."""
    want, have = _segments(prefix), _segments(path)
    return have[: len(want)] == want and ".." not in have and "." not in have


def host_path_problems(spec: api.KVCachePolicySpec, prefixes: Iterable[str], namespace: str = "") -> list[str]:
    """One ``field: rule`` line per tier whose hostPath the admin has not allowed (PVC and emptyDir always are).
    A prefix with a {namespace} segment allows that namespace's own directory only."""
    allowed = [expand_prefix(p, namespace) for p in prefixes]
    out = []
    for i, tier in enumerate(spec.tiers):
        host = tier.volume.host_path if tier.volume is not None else None
        if host is None or any(under_prefix(host.path, p) for p in allowed):
            continue
        where = ", ".join(allowed) if allowed else "none are allowed"
        out.append(f"spec.tiers[{i}].volume.hostPath.path: {host.path!r} is not under a node path the cluster "
                   f"admin allows for tiers ({where}); use a persistentVolumeClaim or emptyDir, or ask the admin "
                   "to add a hostPath prefix to the operator's settings")
    return out


def check_pvc_entry(entry: str) -> Optional[str]:
    """Why an admin-supplied PVC allowlist entry (NAMESPACE/CLAIM, '*' for either part) is unusable, or None."""
    parts = entry.split("/")
    if len(parts) != 2 or not all(parts) or any(p != "*" and not re.fullmatch(api.NAME_PATTERN, p) for p in parts):
        return "must be NAMESPACE/CLAIM (either may be '*')"
    return None


def pvc_allowed(namespace: str, claim: str, allowed: Iterable[str]) -> bool:
    for entry in allowed:
        ns, _, name = entry.partition("/")
        if ns in ("*", namespace) and name in ("*", claim):
            return True
    return False


def pvc_problems(spec: api.KVCachePolicySpec, namespace: str, allowed: Iterable[str]) -> list[str]:
    """One ``field: rule`` line per tier whose PersistentVolumeClaim the admin has not allowed: a claim holds
    someone's data, and a policy author may not be allowed to read or write it."""
    entries = list(allowed)
    out = []
    for i, tier in enumerate(spec.tiers):
        pvc = tier.volume.persistent_volume_claim if tier.volume is not None else None
        if pvc is None or pvc_allowed(namespace, pvc.claim_name, entries):
            continue
        out.append(f"spec.tiers[{i}].volume.persistentVolumeClaim.claimName: {pvc.claim_name!r} is not a claim the "
                   "cluster admin lets tiers mount (operator setting pvcAllowed, NAMESPACE/CLAIM); use an emptyDir, "
                   "or ask the admin to allow the claim")
    return out


# ---------------------------------------------------------------------------------------------- ConfigMaps


def owns_config_map(config_map: Optional[Mapping[str, Any]], policy_name: str, policy_uid: Optional[str]) -> bool:
    """Whether kvtier created ``config_map`` for this very policy: an owner reference to it, by uid when known.

    Labels are no proof (whoever creates a ConfigMap can write them), and neither is the name: a ConfigMap
    ``kvtier-<name>`` made by someone else is theirs (adopting it would hand their object to kvtier)."""
    if not config_map:
        return False
    meta = config_map.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("apiVersion", api.API_VERSION).split("/")[0] == api.GROUP and ref.get("kind") == api.KIND \
                and ref.get("name") == policy_name and (policy_uid is None or ref.get("uid") == policy_uid):
            return True
    return False


def foreign_holder_message(kind: str, name: str) -> str:
    return (f"{kind} {name} already exists and was not made by kvtier for this policy (it has no owner reference "
            f"to it): kvtier neither writes nor deletes it, and applies nothing until it is gone or the policy is "
            f"renamed")


# ---------------------------------------------------------------------------------------------- Prometheus


ANY_PORT = "*"
# Percent-encoded '.', '/' and '\\': a server that decodes before routing would see another path than the one
# the allowlist judged, so such URLs are refused outright, never decoded and accepted.
# An encoded '%' too: a server (or proxy) that decodes twice would turn %252e into '.'.
_ENCODED_SEPARATOR = re.compile(r"%(2e|2f|5c|25)", re.IGNORECASE)


def _split(url: str) -> Optional[SplitResult]:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return None
    return parts


def _port(parts: SplitResult) -> Optional[int]:
    return parts.port or DEFAULT_PORTS.get(parts.scheme)


@dataclass(frozen=True)
class _Entry:
    """An allowlist entry: scheme (None: http or https), host, port (None: any, only when written host:*), and
    the path prefix as segments."""

    scheme: Optional[str]
    host: str
    port: Optional[int]
    any_port: bool
    path: tuple[str, ...]


def _entry(entry: str) -> Optional[_Entry]:
    explicit = "://" in entry
    any_port = not explicit and entry.endswith(":" + ANY_PORT)
    text = entry[: -len(ANY_PORT) - 1] if any_port else entry
    e = _split(text if explicit else "//" + text)
    if e is None or not e.hostname:
        return None
    if explicit and e.scheme not in DEFAULT_PORTS:
        return None
    if _path_problem(e.path or "/"):
        return None
    return _Entry(e.scheme if explicit else None, e.hostname.lower(), e.port, any_port,
                  tuple(segments(unquote(e.path or "/"))))


def _path_problem(raw: str) -> Optional[str]:
    """Why a URL path is refused before any comparison, or None. Compared decoded and segment by segment."""
    if _ENCODED_SEPARATOR.search(raw) or "\\" in raw:
        return "must not contain percent-encoded '.', '/', '\\' or '%' (nor a backslash)"
    # ';' starts path parameters that some servers strip before resolving (`..;` is `..` to them).
    if any(p.split(";")[0] in (".", "..") for p in unquote(raw).split("/")):
        return "must not contain '.' or '..' path segments"
    return None


def check_endpoint_entry(entry: str) -> Optional[str]:
    """Why an admin-supplied allowlist entry is unusable, or None. Entries: ``host`` (the scheme's default port:
    443 for https, 80 for http), ``host:port``, ``host:*`` (any port: say so explicitly) or an http(s):// URL
    prefix (its port, explicit or the scheme's default, and its path prefix)."""
    if "?" in entry or "#" in entry or "@" in entry:
        return "must not carry credentials, a query or a fragment"
    if "://" in entry and entry.split("://", 1)[0] not in DEFAULT_PORTS:
        return "a URL must start with http:// or https://"
    if _entry(entry) is None:
        return ("must be a host, host:port, host:* or an http(s):// URL whose path has no '.' or '..' segments "
                "and no percent-encoded '.', '/' or '\\'")
    return None


def redacted(url: str) -> str:
    """``scheme://host[:port]/path`` of ``url``, never its credentials, query or fragment (for messages)."""
    parts = _split(url)
    if parts is None or not parts.hostname:
        return "(an unparsable URL)"
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def endpoint_problem(url: str, allowed: Iterable[str], allow_http: bool) -> Optional[str]:
    """Why the SLO guard must not query ``url`` (nor send credentials there), or None when it may.

    Matched on scheme, host, port (explicit or the scheme's default) and the percent-decoded path, segment by
    segment (an allowlist on raw text let ``/prom/%2e%2e/admin`` out of ``/prom``)."""
    parts = _split(url)
    if parts is None or parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return "spec.slo.prometheus.url: must be an http:// or https:// URL with a host"
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        return "spec.slo.prometheus.url: must not contain credentials (user:password@)"
    if parts.query or parts.fragment or "?" in url or "#" in url:
        return "spec.slo.prometheus.url: must not contain '?' or '#'"
    problem = _path_problem(parts.path or "/")
    if problem:
        return f"spec.slo.prometheus.url: the path {problem}"
    host, port = parts.hostname.lower(), _port(parts)
    path = segments(unquote(parts.path or "/"))
    for text in allowed:
        e = _entry(text)
        if e is None or e.host != host:
            continue
        if e.scheme is not None and e.scheme != parts.scheme:
            continue
        if not e.any_port and (e.port or DEFAULT_PORTS[e.scheme or parts.scheme]) != port:
            continue
        if tuple(path[: len(e.path)]) != e.path:
            continue
        # An entry written as http://... allows http to exactly that endpoint.
        if parts.scheme == "http" and not allow_http and e.scheme != "http":
            return (f"spec.slo.prometheus.url: {redacted(url)} uses plain http, which the operator's admin has not "
                    "allowed (operator setting prometheusAllowHttp); use https")
        return None
    return (f"spec.slo.prometheus.url: {redacted(url)} is not a Prometheus endpoint the operator's admin allows "
            "(operator setting prometheusAllowed); the guard does not query it and sends no credentials to it")


# ---------------------------------------------------------------------------------------------- remote stores

REMOTE_SCHEMES = ("redis", "rediss")


def _store(text: str) -> Optional[tuple[Optional[str], str, int, Optional[int]]]:
    """(scheme or None, host, port, db or None) of an allowlist entry or a store URL; None when unusable. The db is
    None when the text names none (``redis://h:p`` or ``redis://h:p/``); a store URL without one uses db 0."""
    explicit = "://" in text
    parts = _split(text if explicit else "//" + text)
    if parts is None or not parts.hostname or parts.port is None:
        return None
    if explicit and parts.scheme not in REMOTE_SCHEMES:
        return None
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        return None
    db = parts.path.lstrip("/") if explicit else ""
    if parts.path not in ("", "/") and not (explicit and db.isascii() and db.isdigit()
                                             and parts.path == "/" + db):
        return None
    return (parts.scheme if explicit else None), parts.hostname.lower(), parts.port, (int(db) if db else None)


def check_remote_store_entry(entry: str) -> Optional[str]:
    """Why an admin-supplied remote-store allowlist entry is unusable, or None. Entries: ``host:port`` (TLS only,
    rediss://) or ``redis://host:port[/DB]`` / ``rediss://host:port[/DB]`` (that scheme; redis:// allows plain TCP
    to exactly that store). An entry with a database admits that database only; one without admits any."""
    if "@" in entry or "?" in entry or "#" in entry:
        return "must not carry credentials, a query or a fragment"
    if _store(entry) is None:
        return "must be host:port, redis://host:port[/DB] or rediss://host:port[/DB]"
    return None


def remote_store_problems(spec: api.KVCachePolicySpec, allowed: Iterable[str]) -> list[str]:
    """One ``field: rule`` line per remote tier whose store the admin has not allowed. A remote tier sends the
    password in its Secret to the store, and every replica loads what the store serves, so (as for Prometheus) only
    stores the cluster admin named are used, over TLS unless the entry itself says redis://."""
    entries = [e for e in (_store(a) for a in allowed) if e is not None]
    out = []
    for i, tier in enumerate(spec.tiers):
        if tier.remote is None:
            continue
        url = tier.remote.url
        store = _store(url)
        where = f"spec.tiers[{i}].remote.url"
        if store is None:
            out.append(f"{where}: must be redis://HOST:PORT[/DB] or rediss://HOST:PORT[/DB]")
            continue
        scheme, host, port, db = store
        # An entry naming a database admits that one only (a URL without one uses database 0); one without
        # admits any: databases of one store are separate key spaces, often of separate tenants.
        matching = [e for e in entries if e[1] == host and e[2] == port and (e[3] is None or e[3] == (db or 0))]
        if any(e[0] == scheme or (e[0] is None and scheme == "rediss") for e in matching):
            continue
        if matching and scheme == "redis":
            out.append(f"{where}: {redacted(url)} uses plain TCP (redis://), which the operator's admin allows only "
                       "for stores listed as redis://HOST:PORT; use rediss://")
        else:
            out.append(f"{where}: {redacted(url)} is not a store the operator's admin allows (operator setting "
                       "remoteStoresAllowed); kvtier mounts no credentials for it and renders no tier")
    return out


# ---------------------------------------------------------------------------------------------- Secrets by consent

# The MAC key's least length (HMAC-SHA256: a key shorter than the hash weakens it); a password that keys the MAC
# (no macKeySecret) is held to the same.
MIN_MAC_KEY_BYTES = 32
SERVICE_ACCOUNT_TOKEN = "kubernetes.io/service-account-token"
TLS_SECRET = "kubernetes.io/tls"
# What no Secret key reaching a pod through kvtier may hold, whatever the Secret's type: a PEM private key (PKCS#1,
# PKCS#8, encrypted PKCS#8, EC, DSA, OpenSSH) or a PuTTY one. A CA bundle is held to more: certificates only.
_PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----|PuTTY-User-Key-File-")
_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----")
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----")
NAMESPACE_RULE = ("must be a namespace name: 1..63 lowercase letters, digits and '-', starting and ending with a "
                  "letter or digit")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def check_namespace_entry(entry: str) -> Optional[str]:
    """Why an admin-supplied namespace (operator.remoteSecretNamespaces) is unusable, or None."""
    return None if _NAMESPACE.fullmatch(entry) else NAMESPACE_RULE


def secret_namespace_problems(spec: api.KVCachePolicySpec, namespace: str, allowed: Iterable[str]) -> list[str]:
    """One ``field: rule`` line per Secret reference of a remote tier when the policy's namespace is not one whose
    Secrets the admin lets remote tiers use (operator.remoteSecretNamespaces). The operator checks this itself,
    before any read: which Role happens to let it read a Secret (the SLO guard's, for one) grants nothing here."""
    if namespace in set(allowed):
        return []
    out = []
    for i, tier in enumerate(spec.tiers):
        if tier.remote is None:
            continue
        for field, ref in (("passwordSecret", tier.remote.password_secret),
                           ("macKeySecret", tier.remote.mac_key_secret), ("caSecret", tier.remote.ca_secret)):
            if ref is not None:
                out.append(f"spec.tiers[{i}].remote.{field}: Secrets of namespace {namespace!r} are not ones the "
                           "operator's admin lets remote tiers use (operator setting remoteSecretNamespaces); "
                           "kvtier reads, mounts and sends none of them")
    return out


# A store as a mark names it, and as a tier's URL does: (scheme, host, port, db or None).
Store = tuple[Optional[str], str, int, Optional[int]]


def _store_name(store: Store) -> str:
    """``scheme://host:port`` (IPv6 in brackets), the spelling a mark for exactly this store takes."""
    scheme, host, port, _ = store
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"{scheme or 'rediss'}://{where}"


def marked_stores(secret: Mapping[str, Any]) -> list[Store]:
    """Every store the Secret's ``kvtier.io/remote-stores`` annotation lists: ``rediss://host:port`` or a bare
    ``host:port`` (TLS only, like the admin's allowlist), ``redis://host:port`` (plain TCP), each with an optional
    ``/DB``. Unusable entries admit nothing."""
    text = ((secret.get("metadata") or {}).get("annotations") or {}).get(REMOTE_STORES_ANNOTATION) or ""
    out = []
    for entry in text.split(","):
        store = _store(entry.strip()) if entry.strip() else None
        if store is not None:
            out.append(store)
    return out


def _mark_admits(mark: Store, tier: Store) -> bool:
    """Whether a mark consents to a tier's store: the same scheme (a bare host:port is rediss://), host and port,
    and the same database when the mark names one. A mark for TLS never lets a password cross plain TCP."""
    scheme, host, port, db = mark
    return ((scheme or "rediss") == (tier[0] or "rediss") and host == tier[1] and port == tier[2]
            and (db is None or db == (tier[3] or 0)))


def secret_value(secret: Optional[Mapping[str, Any]], key: str) -> Optional[bytes]:
    """The bytes of one Secret key (``data`` base64, or ``stringData``), None where absent or undecodable."""
    if secret is None:
        return None
    raw = (secret.get("data") or {}).get(key)
    if raw is None:
        text = (secret.get("stringData") or {}).get(key)
        return text.encode() if isinstance(text, str) else None
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError, TypeError):
        return None


def _content_problem(value: bytes, name: str, key: str, field: str) -> Optional[str]:
    """Why a Secret key's content must not reach a pod, whatever the Secret's type and the key's name."""
    if _PRIVATE_KEY.search(value):
        return (f"key {key!r} of Secret {name!r} holds a private key: kvtier never projects one, whatever the "
                "Secret's type")
    if field == "caSecret":
        kinds = set(_PEM_BLOCK.findall(value))
        if not _CERTIFICATE.search(value) or kinds - {b"CERTIFICATE", b"TRUSTED CERTIFICATE"}:
            return (f"key {key!r} of Secret {name!r} must be a PEM CA bundle: CERTIFICATE blocks only (a CA "
                    "bundle is ca.crt)")
    return None


def _secret_problem(secret: Optional[Mapping[str, Any]], name: str, key: str, store: Store, field: str,
                    minimum: int, what: str, required: bool = True) -> Optional[str]:
    """Why one Secret key must not reach the pods of a tier on ``store``, or None. A Secret that is missing, that
    the operator may not read, or that is not marked for the store reads the same: the policy's author may not be
    allowed to read Secrets, and the condition must not tell them which exist. ``required``: False for a key
    projected only when present (the previous tenant key, during a rotation)."""
    if secret is None or not any(_mark_admits(m, store) for m in marked_stores(secret)):
        mark = _store_name(store)
        return (f"Secret {name!r} is not marked for the store {mark}: kvtier projects a Secret into pods only if "
                f"someone who may edit Secrets annotated it {REMOTE_STORES_ANNOTATION}: \"{mark}\" (a "
                "comma-separated list of stores; the scheme, host and port must be the tier's, a bare host:port "
                "is rediss://)")
    kind = secret.get("type") or "Opaque"
    if kind == SERVICE_ACCOUNT_TOKEN:
        return f"Secret {name!r} is a service-account token ({SERVICE_ACCOUNT_TOKEN}): kvtier never projects one"
    if key.endswith(".key"):
        return (f"key {key!r} of Secret {name!r} is named as a private key (*.key): kvtier never projects one, "
                "whatever the Secret's type (a CA bundle is ca.crt)")
    value = secret_value(secret, key)
    if value is None:
        return f"Secret {name!r} has no key {key!r}" if required else None
    if len(value) < minimum:
        return f"key {key!r} of Secret {name!r} must hold at least {minimum} bytes ({what})"
    return _content_problem(value, name, key, field)


SecretRef = Union[api.SecretKeyRef, api.TenantKeyRef]


def _refs(remote: api.RemoteStoreSpec) -> list[tuple[str, SecretRef, str, int, str, bool]]:
    """(field, Secret, key, least bytes, what it is, required) of every Secret key a remote tier projects. The
    tenant key keys every block (the password never does): it alone has a minimum length."""
    out: list[tuple[str, SecretRef, str, int, str, bool]] = []
    if remote.password_secret is not None:
        out.append(("passwordSecret", remote.password_secret, remote.password_secret.key, 1, "a password", True))
    if remote.mac_key_secret is not None:
        mac = remote.mac_key_secret
        out.append(("macKeySecret", mac, mac.key, MIN_MAC_KEY_BYTES, "the tenant key", True))
        out.append(("macKeySecret.previousKey", mac, mac.previous, MIN_MAC_KEY_BYTES,
                    "the previous tenant key", False))
    if remote.ca_secret is not None:
        out.append(("caSecret", remote.ca_secret, remote.ca_secret.key, 1, "a PEM CA bundle", True))
    return out


def _credential_problems(remote: api.RemoteStoreSpec, where: str,
                         secrets: Mapping[str, Optional[Mapping[str, Any]]]) -> list[str]:
    """The tenant key is never a credential of the store: whoever can AUTH could otherwise claim the tenant's scope,
    read its blocks and write blocks it loads as its own. Compared by bytes, whatever Secret or key holds them."""
    mac = remote.mac_key_secret
    if mac is None:
        return []
    credentials: list[tuple[str, bytes]] = []
    if remote.password_secret is not None:
        pw = secret_value(secrets.get(remote.password_secret.name), remote.password_secret.key)
        if pw:
            credentials.append(("passwordSecret", pw))
    if remote.username:
        credentials.append(("username", remote.username.encode()))
    out = []
    for field, key in (("macKeySecret", mac.key), ("macKeySecret.previousKey", mac.previous)):
        value = secret_value(secrets.get(mac.name), key)
        for other, credential in credentials:
            if value is not None and value == credential:
                out.append(f"{where}.{field}: holds the same bytes as {where}.{other}: the tenant key is never a "
                           "credential of the store (whoever can log in to the store could read and forge this "
                           "tenant's blocks); generate it apart, e.g. `openssl rand 32`")
    return out


def remote_secret_problems(spec: api.KVCachePolicySpec, secrets: Mapping[str, Optional[Mapping[str, Any]]]) -> \
        list[str]:
    """One ``field: rule`` line per Secret key a remote tier names that must not reach its pods. ``secrets``: the
    named Secrets as the operator read them, by name (None: missing or not readable)."""
    out = []
    for i, tier in enumerate(spec.tiers):
        remote = tier.remote
        if remote is None:
            continue
        store = _store(remote.url)
        if store is None:
            continue  # the URL's own problem is reported (remote_store_problems)
        where = f"spec.tiers[{i}].remote"
        mine = []
        for field, ref, key, minimum, what, required in _refs(remote):
            problem = _secret_problem(secrets.get(ref.name), ref.name, key, store, field, minimum, what, required)
            if problem:
                mine.append(f"{where}.{field}: {problem}")
        # Compared only once each Secret may be read for this store: the comparison itself must tell an author
        # nothing about a Secret that is not theirs to use.
        out += mine or _credential_problems(remote, where, secrets)
    return out


def remote_secret_names(spec: api.KVCachePolicySpec) -> list[str]:
    """The Secrets the remote tiers name (the operator reads exactly these, never a list)."""
    names: list[str] = []
    for tier in spec.tiers:
        if tier.remote is None:
            continue
        for ref in (tier.remote.password_secret, tier.remote.mac_key_secret, tier.remote.ca_secret):
            if ref is not None and ref.name not in names:
                names.append(ref.name)
    return names
