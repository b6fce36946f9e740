"""kvtier's remote tier over TLS (``rediss://``) against a REAL redis-server that serves TLS only, with certificates
of throwaway private CAs made by the openssl CLI (issue #26: an in-cluster Valkey with a cert-manager certificate).

With ``ca_file`` the store is verified against that CA alone, host name included, and the tier round-trips
bit-exactly. Without it (the system bundle), with a CA that did not sign the store, or with a URL host the
certificate does not name, the store is down: every key fails as a counted ``down`` miss, nothing raises into the
caller, the destination row is untouched, and one warning names the URL and says verification failed.
Skipped only where redis-server was built without TLS.
"""
from __future__ import annotations

import logging
import time

import pytest
import torch
from kvtier_runtime.config import ConfigError, RemoteTierConfig
from kvtier_runtime.remote.identity import model_identity
from kvtier_runtime.remote.tier import KeyState, RemoteTier
from plugins.redis_server import RedisServer, TestCA, redis_tls_missing, tenant_key_file
from plugins.runtime import key_of
from plugins.tier_sync import connected, load_blocks, settled_state, store_blocks

pytestmark = pytest.mark.skipif(redis_tls_missing() is not None, reason=redis_tls_missing() or "")

ROW = 4096
MODEL = model_identity({"model": "tls"})
UNTOUCHED = 7.0
PASSWORD = "tls-store-password"
# What every remote tier needs besides its store: its tenant scope and the tenant's key file.
TENANT = {"scope": "tls", "mac_key_file": tenant_key_file("tls")}
# The one host name the "named" certificate carries besides 127.0.0.1; the "unnamed" one carries another.
NAMED = ["IP:127.0.0.1", "DNS:localhost"]
UNNAMED = ["IP:127.0.0.1", "DNS:kv-store.kvtier-test.example"]


def _block(key: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:4], "big"))
    return torch.randn(ROW, generator=g).to(torch.float16)


def _sentinel() -> torch.Tensor:
    return torch.full((ROW,), UNTOUCHED, dtype=torch.float16)


class PKI:
    def __init__(self, root) -> None:
        self.store_ca = TestCA(root, "store-ca")    # signs the stores' certificates
        self.other_ca = TestCA(root, "other-ca")    # a private CA that signed nothing here
        self.named = self.store_ca.issue("named", NAMED)
        self.unnamed = self.store_ca.issue("unnamed", UNNAMED)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_store(pki, tmp_path_factory):
    """TLS only (no plain port), a password, the certificate naming 127.0.0.1 and localhost."""
    server = RedisServer(tmp_path_factory.mktemp("tls-store"), tls=pki.named, password=PASSWORD).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def unnamed_store(pki, tmp_path_factory):
    """TLS only, a certificate of the same CA naming 127.0.0.1 and a name that is not localhost."""
    server = RedisServer(tmp_path_factory.mktemp("unnamed-store"), tls=pki.unnamed).start()
    yield server
    server.kill()


@pytest.fixture
def password_file(tmp_path) -> str:
    path = tmp_path / "password"
    path.write_text(PASSWORD + "\n")
    return str(path)


def _tier(url: str, **kw) -> RemoteTier:
    cfg = RemoteTierConfig(url=url, capacity_bytes=8 << 20, io_timeout_s=2.0, **TENANT, **kw)
    return RemoteTier(cfg, (ROW,), torch.float16, identity=MODEL, name=f"tls-{time.monotonic_ns()}",
                      backoff_base_s=0.1)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_store_with_a_private_ca_round_trips_bit_exactly_over_tls(tls_store, pki, password_file, host) -> None:
    url = f"rediss://{host}:{tls_store.port}"
    writer = _tier(url, ca_file=str(pki.store_ca.cert), password_file=password_file)
    reader = _tier(url, ca_file=str(pki.store_ca.cert), password_file=password_file)
    try:
        assert connected(writer) and connected(reader), (writer.health, reader.health)
        keys = [key_of(i) + host.encode()[:1] for i in range(12)]
        assert store_blocks(writer, keys, [_block(k) for k in keys]).success
        assert [settled_state(reader, k) for k in keys] == [KeyState.HIT] * len(keys)
        outs = [_sentinel() for _ in keys]
        assert load_blocks(reader, keys, outs).success
        assert all(torch.equal(out, _block(k)) for out, k in zip(outs, keys))
        assert not reader.misses and not writer.store_failures
    finally:
        writer.close()
        reader.close()
    # The server speaks TLS only: the bytes went over it (a plain client gets no answer on that port).
    import redis

    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis(host="127.0.0.1", port=tls_store.port, socket_timeout=1, socket_connect_timeout=1).ping()


def _assert_refused(tier: RemoteTier, url: str, caplog, why: str) -> None:
    """The store is down for this tier: keys fail as counted ``down``, nothing raises, the row is untouched, and
    one warning names the URL, that TLS verification failed, and ``why`` (OpenSSL's own words)."""
    assert not connected(tier)
    assert tier.health == "down"
    key = key_of(7)
    assert tier.state(key) is KeyState.MISS  # at once: no probe of a store that is down
    stored = store_blocks(tier, [key], [_block(key)])
    assert not stored.ok[0] and stored.errors[0] == "down"
    out = _sentinel()
    loaded = load_blocks(tier, [key], [out])
    assert not loaded.ok[0] and loaded.errors[0] == "down"
    assert torch.all(out == UNTOUCHED)
    assert tier.misses["down"] >= 2 and tier.store_failures["down"] == 1
    # Let the backoff (0.1 s) run out a few times: each lookup then starts one reconnect, which fails again.
    deadline = time.monotonic() + 5
    while tier.backoff.failures < 3 and time.monotonic() < deadline:
        tier.state(key_of(8))
        time.sleep(0.02)
    assert tier.backoff.failures >= 3, "the tier never tried to reconnect"
    warned = [r.getMessage() for r in caplog.records
              if r.name == "kvtier_runtime.remote" and r.levelno == logging.WARNING and tier.name in r.getMessage()]
    assert len(warned) == 1, warned  # logged once, not once per reconnect
    assert f"TLS verification of {url} failed" in warned[0] and why in warned[0], warned[0]


def test_without_a_ca_file_the_system_bundle_does_not_trust_a_private_ca(tls_store, password_file, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier_runtime.remote")
    tier = _tier(tls_store.url, password_file=password_file)
    try:
        _assert_refused(tier, tls_store.url, caplog, "self-signed certificate in certificate chain")
        assert "the system CA bundle" in caplog.text
    finally:
        tier.close()


def test_a_ca_that_did_not_sign_the_store_is_refused(tls_store, pki, password_file, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier_runtime.remote")
    tier = _tier(tls_store.url, ca_file=str(pki.other_ca.cert), password_file=password_file)
    try:
        # redis-server sends its CA with its certificate (OpenSSL's automatic chain): a root this tier does not trust.
        _assert_refused(tier, tls_store.url, caplog, "self-signed certificate in certificate chain")
        assert str(pki.other_ca.cert) in caplog.text
    finally:
        tier.close()


def test_a_certificate_that_does_not_name_the_url_host_is_refused(unnamed_store, pki, caplog) -> None:
    ca = str(pki.store_ca.cert)
    # The control: the same certificate, the same CA, a host it names -- it is the name alone that is refused below.
    named = _tier(f"rediss://127.0.0.1:{unnamed_store.port}", ca_file=ca)
    try:
        assert connected(named), named.health
    finally:
        named.close()
    caplog.set_level(logging.WARNING, logger="kvtier_runtime.remote")
    url = f"rediss://localhost:{unnamed_store.port}"  # localhost is 127.0.0.1 here; the certificate does not name it
    tier = _tier(url, ca_file=ca)
    try:
        _assert_refused(tier, url, caplog, "Hostname mismatch, certificate is not valid for 'localhost'")
    finally:
        tier.close()


def test_ca_file_is_for_rediss_only_and_must_hold_a_certificate(tmp_path, pki) -> None:
    ca = str(pki.store_ca.cert)
    with pytest.raises(ConfigError, match=r"^ca_file: allowed only with a rediss:// url: redis:// is plain TCP"):
        RemoteTierConfig(url="redis://127.0.0.1:6379", capacity_bytes=1 << 20, **TENANT, ca_file=ca)
    with pytest.raises(ConfigError, match=r"^ca_file: 'ca.crt' must be an absolute path$"):
        RemoteTierConfig(url="rediss://127.0.0.1:6379", capacity_bytes=1 << 20, **TENANT, ca_file="ca.crt")
    cfg = RemoteTierConfig(url="rediss://127.0.0.1:6379", capacity_bytes=1 << 20, **TENANT, ca_file=ca)
    assert RemoteTierConfig.from_kwargs(cfg.to_kwargs()) == cfg and cfg.to_kwargs()["ca_file"] == ca
    # Unset, the key is not written: configs rendered before it existed stay byte-identical.
    assert "ca_file" not in RemoteTierConfig(url="rediss://h:1", capacity_bytes=1, **TENANT).to_kwargs()
    not_pem = tmp_path / "ca.crt"
    not_pem.write_text("this is not a certificate\n")
    for path, problem in ((str(not_pem), "holds no PEM certificate"), ("/nonexistent/ca.crt", "cannot be read")):
        with pytest.raises(ConfigError, match=f"^ca_file: {path} {problem}"):
            _tier("rediss://127.0.0.1:1", ca_file=path)
