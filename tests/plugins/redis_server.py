"""Real Valkey/Redis servers for the remote tier's tests: Debian's ``redis-server`` (installed by scripts/setup),
started on free loopback ports in temporary directories, standalone or as a 3-node cluster-mode set, and always
killed at teardown (SIGKILL of what is left, also at interpreter exit). Every wait is bounded.

A missing binary fails the test that asks for a server, naming scripts/setup: these tests never skip. A server may
serve TLS only (``tls=``, certificates of a throwaway CA made with the openssl CLI by :class:`TestCA`); a test of
TLS skips only where this redis-server was built without it (:func:`redis_tls_missing`).
"""
from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

START_TIMEOUT_S = 15.0
CLUSTER_TIMEOUT_S = 30.0
_LIVE: weakref.WeakSet[RedisServer] = weakref.WeakSet()


def redis_binaries() -> tuple[str, str]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        pytest.fail("redis-server/redis-cli not found: scripts/setup installs Debian's redis-server package "
                    "(apt-get install redis-server)", pytrace=False)
    return server, cli


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A free loopback port; with ``cluster``, one whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster or (port + 10000 < 65536 and _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port (with a free cluster bus port)")


def redis_tls_missing() -> str | None:
    """Why this redis-server cannot serve TLS (built without it: no libssl linked in), or None. A missing binary is
    None here: the test then fails naming scripts/setup, as every redis test does."""
    server = shutil.which("redis-server")
    if not server:
        return None
    with open(server, "rb") as fh:
        if b"libssl" not in fh.read():
            return f"{server} was built without TLS (no libssl linked): rediss:// cannot be tested here"
    return None


@dataclass(frozen=True)
class ServerCert:
    """A server certificate, its key and the CA that signed it (PEM files)."""

    cert: pathlib.Path
    key: pathlib.Path
    ca: pathlib.Path


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    openssl = shutil.which("openssl")
    if not openssl:
        pytest.fail("openssl not found: the TLS tests make their certificates with the openssl CLI", pytrace=False)
    done = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {done.stderr}")


class TestCA:
    """A throwaway private CA (an EC P-256 key and a self-signed CA certificate, valid two days) that signs server
    certificates with the names given, as cert-manager's CA issuer would for an in-cluster store."""

    __test__ = False  # not a test class

    def __init__(self, workdir: pathlib.Path, name: str) -> None:
        self.dir = pathlib.Path(workdir) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.cert, self.key = self.dir / "ca.crt", self.dir / "ca.key"
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", str(self.key), "-out", str(self.cert), "-days", "2", "-subj", f"/CN=kvtier test {name}",
                 "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                 cwd=self.dir)

    def issue(self, name: str, sans: Sequence[str]) -> ServerCert:
        """A server certificate whose subjectAltName is exactly ``sans`` (e.g. ``IP:127.0.0.1``, ``DNS:localhost``);
        its common name is ``name``, which no client checks (a SAN is present)."""
        key, csr, cert = (self.dir / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        ext = self.dir / f"{name}.ext"
        ext.write_text(f"subjectAltName={','.join(sans)}\nbasicConstraints=CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
                       "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
        _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}", cwd=self.dir)
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
                 "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext), cwd=self.dir)
        return ServerCert(cert, key, self.cert)


class RedisServer:
    """One ``redis-server`` process. ``maxmemory`` (bytes) with ``policy`` bounds it as a deployment would. With
    ``tls``: TLS only (``--port 0``, ``--tls-port``), that certificate, clients not asked for one."""

    def __init__(self, workdir: pathlib.Path, *, port: int | None = None, maxmemory: int = 64 << 20,
                 policy: str = "allkeys-lru", password: str | None = None, cluster: bool = False,
                 tls: ServerCert | None = None, extra: Sequence[str] = ()) -> None:
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(cluster)
        self.maxmemory = maxmemory
        self.policy = policy
        self.password = password
        self.cluster = cluster
        self.tls = tls
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        _LIVE.add(self)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> pathlib.Path:
        return self.workdir / "redis.log"

    def command(self) -> list[str]:
        server, _ = redis_binaries()
        ports = ["--port", str(self.port)]
        if self.tls:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                     "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                     "--tls-auth-clients", "no"]
        cmd = [server, *ports, "--bind", "127.0.0.1", "--dir", str(self.workdir),
               "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", str(self.log_path),
               "--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.policy]
        if self.password:
            cmd += ["--requirepass", self.password]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / "nodes.conf"),
                    "--cluster-node-timeout", "2000"]
        return cmd + self.extra

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if self.client().ping():
                    return self
            except Exception:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} not answering after {START_TIMEOUT_S}s: "
                                   f"{self.log_tail()}")
            time.sleep(0.02)

    def client(self, **kw):
        import redis

        if self.tls:
            kw = {"ssl": True, "ssl_ca_certs": str(self.tls.ca), **kw}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5,
                           socket_connect_timeout=5, **kw)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections (the kernel does) but never answers -- a hung store."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    stop = kill


def _kill_all() -> None:
    for server in list(_LIVE):
        server.kill()


atexit.register(_kill_all)


class RedisCluster:
    """Three cluster-mode servers, every slot assigned (``redis-cli --cluster create``, no replicas)."""

    def __init__(self, workdir: pathlib.Path, n: int = 3, **kw: object) -> None:
        self.nodes = [RedisServer(pathlib.Path(workdir) / f"node{i}", cluster=True, **kw) for i in range(n)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisCluster:
        _, cli = redis_binaries()
        for node in self.nodes:
            node.start()
        args = [cli]
        if self.nodes[0].password:
            args += ["-a", self.nodes[0].password, "--no-auth-warning"]
        args += ["--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                 "--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=CLUSTER_TIMEOUT_S)
        if done.returncode != 0:
            self.kill()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        deadline = time.monotonic() + CLUSTER_TIMEOUT_S
        while True:
            states = [n.client().execute_command("CLUSTER", "INFO").decode() for n in self.nodes]
            if all("cluster_state:ok" in s for s in states):
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"cluster not ok after {CLUSTER_TIMEOUT_S}s: {states}")
            time.sleep(0.1)

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    stop = kill


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A fresh standalone server (64 MiB, allkeys-lru) per test."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory) -> Iterator[RedisCluster]:
    """A 3-node cluster-mode set on loopback, shared by a module's tests (each uses its own model identity)."""
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.kill()


_KEY_DIR: list[pathlib.Path] = []


def tenant_key_file(name: str = "tenant-a", nbytes: int = 32) -> str:
    """The path of a tenant's key file for a remote tier (``mac_key_file``): ``nbytes`` binary bytes, the same for a
    name on every run (a test can never draw a key that reads shorter than written), different for two names. The
    files live in one temporary directory per test process, removed at exit."""
    import random
    import tempfile

    if not _KEY_DIR:
        _KEY_DIR.append(pathlib.Path(tempfile.mkdtemp(prefix="kvtier-tenant-keys-")))
        atexit.register(shutil.rmtree, str(_KEY_DIR[0]), True)
    path = _KEY_DIR[0] / f"{name}-{nbytes}.key"
    if not path.exists():
        path.write_bytes(random.Random(f"tenant-key/{name}/{nbytes}").randbytes(nbytes))
    return str(path)
