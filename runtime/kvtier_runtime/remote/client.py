"""The store client of the remote tier: redis-py (standalone or cluster mode), short timeouts, no retries.

Mode is detected at connect time (``INFO cluster``: ``cluster_enabled:1`` switches to
:class:`redis.cluster.RedisCluster` seeded with the same address), so one ``redis://host:port`` works against a
single server, a Valkey/Redis with replicas behind a Service, or a cluster. The password comes from
``password_file`` (a Secret mounted read-only), never from the URL, and is the ACL user ``username``'s when one is
set. ``rediss://`` always verifies the store's certificate and host name: against ``ca_file`` (a private CA) and the
system CA bundle (redis-py's TLS context always loads the system bundle; the tier's own load connections do the same); a failed verification is a ``down`` store. Every socket operation
is bounded by ``io_timeout_s`` and nothing is retried: a slow or absent store must cost the engine a miss, not a
retry loop. Faults are classified by :func:`failure_kind` into the reasons the tier's metrics count.
"""
from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import PythonRespSerializer
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    ClusterError,
    NoPermissionError,
    OutOfMemoryError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)
from redis.retry import Retry

from ..config import ConfigError, RemoteTierConfig, check_remote_url
from .wire import Address, Arg, Reply, ValueConnections

log = logging.getLogger("kvtier_runtime.remote")

MAX_PASSWORD_BYTES = 4096
# A CA bundle is a few certificates; a file much larger is not one.
MAX_CA_FILE_BYTES = 1 << 20
_PEM_CERT = b"-----BEGIN CERTIFICATE-----"


def _read_bounded(key: str, path: str, limit: int) -> bytes:
    """A mounted Secret file of at most ``limit`` bytes; ConfigError names the key and never the contents."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{key}: {path} cannot be read ({exc.strerror or exc})") from None
    if len(raw) > limit:
        raise ConfigError(f"{key}: {path} holds more than {limit} bytes")
    return raw


def read_password(path: str | None) -> str | None:
    """The store password from ``password_file`` (one trailing newline dropped, as a Secret written with ``echo``
    may carry); ConfigError names the key and never the contents."""
    if path is None:
        return None
    raw = _read_bounded("password_file", path, MAX_PASSWORD_BYTES)
    raw = raw[:-1] if raw.endswith(b"\n") else raw
    if not raw:
        raise ConfigError(f"password_file: {path} is empty")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"password_file: {path} is not UTF-8 text") from None


def store_credentials(config: RemoteTierConfig) -> dict[str, bytes]:
    """The store's credentials by the field that names them, as bytes (the password file read as the client reads
    it): what the tenant key must never equal."""
    out: dict[str, bytes] = {}
    password = read_password(config.password_file)
    if password is not None:
        out["password_file"] = password.encode()
    if config.username:
        out["username"] = config.username.encode()
    return out


def check_ca_file(path: str | None) -> str | None:
    """``ca_file`` when it holds at least one PEM certificate; ConfigError names the key otherwise. redis-py loads it
    on each new connection, so a CA rotated in the mounted Secret is used from the next connection on."""
    if path is None:
        return None
    raw = _read_bounded("ca_file", path, MAX_CA_FILE_BYTES)
    if _PEM_CERT not in raw:
        raise ConfigError(f"ca_file: {path} holds no PEM certificate ({_PEM_CERT.decode()})")
    return path


def tls_failure(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind a store fault (redis-py wraps it in a ConnectionError), or None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, ssl.SSLError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def failure_kind(exc: BaseException) -> str:
    """The reason a store operation failed, as the tier's metrics count it: ``timeout`` (slower than io_timeout_s),
    ``full`` (the store's maxmemory with a noeviction policy refused a write), ``auth`` (password refused),
    ``down`` (unreachable, refused, reset, cluster not serving the slot, TLS verification or handshake failed), else
    ``other``."""
    if isinstance(exc, RedisTimeoutError):
        return "timeout"
    if isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError) and str(exc).startswith("OOM")):
        return "full"
    if isinstance(exc, (AuthenticationError, AuthorizationError, NoPermissionError)) or (
            isinstance(exc, ResponseError) and str(exc).startswith(("NOAUTH", "WRONGPASS", "NOPERM"))):
        return "auth"
    if isinstance(exc, (RedisConnectionError, ClusterDownError, ClusterError, RedisClusterException, OSError)):
        return "down"
    return "other"


def send_values_in_place(client: Any) -> None:
    """Make ``client``'s connections opened from now on send a memoryview argument as it is (a sealed value, a view
    of the tier's buffer: one socket write of it, no copy). With hiredis installed redis-py packs every command with
    it, which copies such a value twice (``bytes(view)``, then into one command buffer); redis-py's own Python
    packer passes large and memoryview arguments to the socket in place. Cluster mode: every node known now (one
    found later by a redirection packs with hiredis: slower, not wrong)."""
    pools = []
    if isinstance(client, RedisCluster):
        pools = [node.redis_connection.connection_pool for node in client.get_nodes() if node.redis_connection]
    elif isinstance(client, redis.Redis):
        pools = [client.connection_pool]
    for pool in pools:
        kwargs = pool.connection_kwargs
        # The Connection's own defaults: 6000-byte cutoff, the pool's encoder (bytes and memoryviews pass unchanged).
        kwargs["command_packer"] = PythonRespSerializer(6000, pool.get_encoder().encode)
        # Connections already open (cluster mode: the nodes' discovery) were made with the other packer: closed
        # and dropped, the next ones are opened with this one. Nothing else holds the client yet.
        pool.disconnect()
        pool.reset()


class RemoteStore:
    """A connected redis-py client for one :class:`RemoteTierConfig` (thread-safe: redis-py pools connections)."""

    def __init__(self, config: RemoteTierConfig) -> None:
        check_remote_url("url", config.url)
        parts = urlsplit(config.url)
        self.host = parts.hostname or ""
        self.port = int(parts.port or 0)
        self.db = int(parts.path.lstrip("/") or 0)
        self.ssl = parts.scheme == "rediss"
        self.timeout_s = float(config.io_timeout_s)
        self._password = read_password(config.password_file)
        # The store's ACL user (AUTH username password); None: the default user.
        self.username = config.username
        self.ca_file = check_ca_file(config.ca_file)
        self.url = config.url
        self.cluster = False
        self._client: Any = None
        self._lock = threading.Lock()
        # Standalone loads' connections (opened when first used): replies read straight into the tier's buffer.
        self._values = ValueConnections(Address(self.host, self.port, self.db, self.username, self._password,
                                                self.timeout_s, self.ssl, self.ca_file))

    def _options(self) -> dict[str, Any]:
        # RESP2 (redis-py 8 speaks RESP3 unless told), as the tier's own load connections speak it (.wire): one
        # protocol to the store, whose replies (ZPOPMIN's pairs, INFO) have the shapes the tier was written for.
        options = dict(username=self.username, password=self._password, ssl=self.ssl, socket_timeout=self.timeout_s,
                       socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 0), health_check_interval=0,
                       protocol=2)
        if self.ssl:
            # Never cert_reqs "none": the store's certificate and host name are always checked, against ca_file
            # only when set (load_verify_locations on a fresh context), else against the system CA bundle.
            options.update(ssl_cert_reqs="required", ssl_check_hostname=True, ssl_ca_certs=self.ca_file)
        return options

    def describe_tls_failure(self, exc: BaseException) -> str | None:
        """One line naming the URL and what failed, when ``exc`` is a TLS failure; None otherwise."""
        err = tls_failure(exc)
        if err is None:
            return None
        against = f"ca_file {self.ca_file}" if self.ca_file else "the system CA bundle (no ca_file)"
        if isinstance(err, ssl.SSLCertVerificationError):
            detail = err.verify_message or str(err)
            return (f"TLS verification of {self.url} failed ({detail}): the store's certificate must be signed by "
                    f"{against} and name the URL's host")
        return f"TLS handshake with {self.url} failed ({err.reason or err}): is the store serving TLS on that port?"

    def connect(self) -> Any:
        """Connect (detecting the mode) unless connected; raises a redis-py error or ConfigError."""
        with self._lock:
            if self._client is not None:
                return self._client
            probe = redis.Redis(host=self.host, port=self.port, db=self.db, **self._options())
            send_values_in_place(probe)
            try:
                info = probe.info("cluster")
                cluster = bool(info.get("cluster_enabled"))
                if not cluster:
                    self._client, self.cluster = probe, False
                    return probe
            except BaseException:
                probe.close()
                raise
            probe.close()
            if self.db:
                raise ConfigError(f"url: {self.url!r}: the store runs in cluster mode, which has only database 0")
            self._client = RedisCluster(host=self.host, port=self.port, require_full_coverage=False,
                                        **self._options())
            self.cluster = True
            send_values_in_place(self._client)
            log.info("kvtier remote tier: %s is a Redis/Valkey cluster (%d nodes)", self.url,
                     len(self._client.get_nodes()))
            return self._client

    @property
    def connected(self) -> bool:
        return self._client is not None

    def pipeline(self) -> Any:
        """A non-transactional pipeline (cluster mode: commands grouped per node, one round trip each)."""
        return self.connect().pipeline(transaction=False)

    def read_values(self, keys: Sequence[bytes], buf: bytearray, on_value: Callable[[Reply], None],
                    after: Sequence[Sequence[Arg]] = ()) -> list[Reply]:
        """Standalone mode: ``GET`` of every key, then the commands ``after``, in one round trip on one of the tier's
        own connections, each value read off the socket into ``buf`` and handed to ``on_value`` as it arrives (see
        :meth:`kvtier_runtime.remote.wire.ValueConnections.read_values`). Returns the replies of ``after``."""
        self.connect()
        if self.cluster:
            raise RuntimeError("read_values: standalone mode only (cluster mode routes keys per node)")
        return self._values.read_values(keys, buf, on_value, after)

    def write_values(self, values: Iterator[tuple[bytes, memoryview]],
                     after: Callable[[int], Sequence[Sequence[Arg]]]) -> tuple[list[Reply], list[Reply]]:
        """Standalone mode: ``SET`` of each ``(key, value)`` ``values`` yields, sent as it is yielded, then the
        commands ``after(n)`` returns, in one round trip on one of the tier's own connections (see
        :meth:`kvtier_runtime.remote.wire.ValueConnections.write_values`). Returns the SET replies and those of
        ``after``."""
        self.connect()
        if self.cluster:
            raise RuntimeError("write_values: standalone mode only (cluster mode routes keys per node)")
        return self._values.write_values(values, after)

    def reset(self) -> None:
        """Forget the connection after a fault: the next :meth:`connect` detects the mode again."""
        with self._lock:
            client, self._client = self._client, None
        self._values.close()
        if client is not None:
            try:
                client.close()
            except (RedisError, OSError):  # a half-open socket: nothing left to close cleanly
                pass

    close = reset
