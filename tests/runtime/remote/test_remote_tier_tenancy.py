"""The tenant boundary of kvtier's remote tier, on REAL stores (Debian's redis-server). Two tenants (two scopes, two
keys) running the same model on one store: B never reads A's KV (the store holds ciphertext, B's key does not open
it), never makes A load B's bytes (a value B writes under A's key is a counted miss for A), never evicts A's chunks
(each scope trims its own index). Replicas of one scope share bit-exactly. With a store ACL user per tenant confined
to ``~kvtier:<scope>:*`` (docs/remote.md), A's tier works and cannot touch B's keys at all.
"""
from __future__ import annotations

import time

import pytest
import redis
import torch
from kvtier_runtime.config import RemoteTierConfig
from kvtier_runtime.remote.format import Sealer
from kvtier_runtime.remote.identity import (
    ACL_CLUSTER_COMMANDS,
    acl_rule,
    chunk_key,
    index_key,
    key_prefix,
    model_identity,
)
from kvtier_runtime.remote.tier import KeyState, RemoteTier
from kvtier_runtime.tiers.keys import read_mac_key
from plugins.redis_server import RedisCluster, RedisServer, tenant_key_file
from plugins.runtime import key_of
from plugins.tier_sync import connected, load_blocks, settled_state, store_blocks

ROW = 4096
MODEL = model_identity({"model": "shared-by-two-tenants"})
A, B = "team-a", "team-b"
UNTOUCHED = 7.0


def _block(key: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:4], "big"))
    return torch.randn(ROW, generator=g).to(torch.float16)


def _tier(url: str, scope: str, key_name: str | None = None, capacity: int = 8 << 20, **kw) -> RemoteTier:
    cfg = RemoteTierConfig(url=url, capacity_bytes=capacity, scope=scope,
                           mac_key_file=tenant_key_file(key_name or scope), **kw)
    return RemoteTier(cfg, (ROW,), torch.float16, identity=MODEL, name=f"tenancy-{time.monotonic_ns()}",
                      backoff_base_s=0.2)


def _sentinel() -> torch.Tensor:
    return torch.full((ROW,), UNTOUCHED, dtype=torch.float16)


def _store_key(scope: str, key: bytes) -> bytes:
    return chunk_key(key_prefix(scope, MODEL), key)


def test_another_tenant_cannot_read_decode_overwrite_or_evict(redis_server) -> None:
    a, b = _tier(redis_server.url, A), _tier(redis_server.url, B, capacity=1 << 20)
    try:
        assert connected(a) and connected(b)
        keys = [key_of(100 + i) for i in range(12)]
        assert store_blocks(a, keys, [_block(k) for k in keys]).success
        client = redis_server.client()

        # Same model, same offload keys: B's lookups are in B's scope, where A wrote nothing.
        assert [settled_state(b, k) for k in keys[:3]] == [KeyState.MISS] * 3

        # Read: a client of the store GETs A's value and finds ciphertext; no 32-byte run of A's KV is in it.
        value = client.get(_store_key(A, keys[0]))
        assert value is not None
        raw = _block(keys[0]).numpy().tobytes()
        assert all(raw[i:i + 32] not in value for i in range(0, len(raw), 256))

        # Decode: A's value under B's key (B's scope) does not open with B's key: a counted miss ("key": sealed under
        # a tenant key B does not hold), B's row untouched.
        client.set(_store_key(B, keys[0]), value)
        out = _sentinel()
        result = load_blocks(b, [keys[0]], [out])
        assert not result.ok[0] and result.errors[0] == "key" and torch.all(out == UNTOUCHED)

        # Overwrite: B's sealed value put under A's key, and a tier claiming A's scope with B's key writing A's
        # keys: A refuses both ("key": sealed under a key A does not hold), counted, and never loads a byte of them.
        before = a.misses["key"]
        buf = bytearray(b.value_bytes)
        payload = bytearray(b.values.max_payload)
        n = b.values.codec.encode(torch.zeros(ROW, dtype=torch.float16), torch.frombuffer(payload, dtype=torch.uint8))
        b_sealer = Sealer(read_mac_key(tenant_key_file(B)), B, MODEL)  # what B's tier seals with
        total = b_sealer.seal(buf, _store_key(A, keys[1]), "none", memoryview(payload)[:n])
        client.set(_store_key(A, keys[1]), bytes(buf[:total]))
        impostor = _tier(redis_server.url, A, key_name=B)
        try:
            assert connected(impostor)
            assert store_blocks(impostor, [keys[2]], [torch.zeros(ROW, dtype=torch.float16)]).success
        finally:
            impostor.close()
        outs = [_sentinel(), _sentinel()]
        result = load_blocks(a, keys[1:3], outs)
        assert not any(result.ok) and set(result.errors.values()) == {"key"}
        assert all(torch.all(out == UNTOUCHED) for out in outs)
        assert a.misses["key"] == before + 2

        # Evict: B writes far past its small budget; its trims pop B's index only, every chunk of A stays.
        many = [key_of(1000 + i) for i in range(3 * b.capacity_entries)]
        for j in range(0, len(many), 8):
            assert store_blocks(b, many[j:j + 8], [_block(k) for k in many[j:j + 8]]).success
        assert client.zcard(index_key(key_prefix(B, MODEL))) <= b.capacity_entries
        assert client.zcard(index_key(key_prefix(A, MODEL))) == len(keys)
        assert all(client.exists(_store_key(A, k)) for k in keys)
        untouched = keys[3:]
        outs = [_sentinel() for _ in untouched]
        assert load_blocks(a, untouched, outs).success
        assert all(torch.equal(out, _block(k)) for out, k in zip(outs, untouched))
    finally:
        a.close()
        b.close()


def test_replicas_of_one_scope_share_bit_exactly(redis_server) -> None:
    writer, reader = _tier(redis_server.url, A), _tier(redis_server.url, A)
    try:
        assert connected(writer) and connected(reader)
        keys = [key_of(200 + i) for i in range(8)]
        assert store_blocks(writer, keys, [_block(k) for k in keys]).success
        outs = [_sentinel() for _ in keys]
        assert [settled_state(reader, k) for k in keys] == [KeyState.HIT] * len(keys)
        assert load_blocks(reader, keys, outs).success
        assert all(torch.equal(out, _block(k)) for out, k in zip(outs, keys))
        assert not reader.misses
    finally:
        writer.close()
        reader.close()


def test_the_trim_never_deletes_a_key_its_index_does_not_name_as_a_chunk(redis_server) -> None:
    """Whatever another client put in a scope's index, the trim deletes only that scope's chunk keys: a member
    that is not a chunk key's hex (here "index", which would name the index itself) is popped and left alone."""
    tier = _tier(redis_server.url, A, capacity=1 << 20)
    client = redis_server.client()
    try:
        assert connected(tier)
        index = index_key(key_prefix(A, MODEL))
        client.zadd(index, {b"index": 0, b"../x": 0})
        client.set(b"kvtier:team-a:" + MODEL.encode() + b":../x", b"someone else's")
        many = [key_of(300 + i) for i in range(tier.capacity_entries + 4)]
        for j in range(0, len(many), 8):
            assert store_blocks(tier, many[j:j + 8], [_block(k) for k in many[j:j + 8]]).success
        assert client.exists(index) and client.zcard(index) <= tier.capacity_entries
        assert client.get(b"kvtier:team-a:" + MODEL.encode() + b":../x") == b"someone else's"
    finally:
        tier.close()


@pytest.fixture
def acl_store(tmp_path):
    """A store whose default user is the admin's (a password), with one ACL user per tenant confined to its
    scope's keys and the tier's commands (docs/remote.md's recipe)."""
    server = RedisServer(tmp_path / "acl", password="admin-password").start()
    try:  # a refused ACL rule must not leave the server running
        admin = server.client()
        for user, scope in (("tenant-a", A), ("tenant-b", B)):
            admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{user}-password",
                                  *acl_rule(scope))
            (tmp_path / f"{user}.pw").write_text(f"{user}-password\n")
        yield server, tmp_path
    finally:
        server.kill()


def test_an_acl_user_per_tenant_works_and_cannot_touch_another_tenants_keys(acl_store) -> None:
    server, tmp = acl_store
    a = _tier(server.url, A, username="tenant-a", password_file=str(tmp / "tenant-a.pw"))
    b = _tier(server.url, B, username="tenant-b", password_file=str(tmp / "tenant-b.pw"))
    try:
        assert connected(a) and connected(b)
        keys = [key_of(400 + i) for i in range(6)]
        for tier in (a, b):  # each tenant's tier round-trips in its own scope, index and trim included
            assert store_blocks(tier, keys, [_block(k) for k in keys]).success
            outs = [_sentinel() for _ in keys]
            assert load_blocks(tier, keys, outs).success
            assert all(torch.equal(out, _block(k)) for out, k in zip(outs, keys))
        assert not a.store_failures and not a.misses

        # As tenant A, every command on B's keys is refused by the store itself.
        as_a = redis.Redis(host="127.0.0.1", port=server.port, username="tenant-a", password="tenant-a-password",
                           socket_timeout=5)
        assert as_a.get(_store_key(A, keys[0])) is not None
        for attempt in (lambda: as_a.get(_store_key(B, keys[0])), lambda: as_a.set(_store_key(B, keys[0]), b"x"),
                        lambda: as_a.delete(_store_key(B, keys[0])),
                        lambda: as_a.zpopmin(index_key(key_prefix(B, MODEL)), 100),
                        lambda: as_a.keys("*"), lambda: as_a.flushall()):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        as_a.close()

        # A tier of tenant A's user that claims B's scope: refused by the store (auth), never a write in B's keys.
        claim = _tier(server.url, B, key_name=A, username="tenant-a", password_file=str(tmp / "tenant-a.pw"))
        try:
            assert connected(claim)
            result = store_blocks(claim, [key_of(999)], [_block(key_of(999))])
            assert not result.ok[0] and result.errors[0] == "auth"
        finally:
            claim.close()
        admin = server.client()
        assert not admin.exists(_store_key(B, key_of(999)))
        assert all(admin.exists(_store_key(B, k)) for k in keys)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("material", [bytes(range(0xA0, 0xBF)) + b"\n", bytes(range(256))],
                         ids=["32-bytes-ending-in-newline", "every-byte-value"])
def test_a_binary_tenant_key_is_used_as_written(tmp_path, redis_server, material) -> None:
    """A random key may end in 0x0a or hold any byte: read as written (never cut short and refused), two replicas
    with the same file share, and a key differing only in that last newline is another tenant's."""
    key_file = tmp_path / "tenant.key"
    key_file.write_bytes(material)
    other_file = tmp_path / "other.key"
    other_file.write_bytes(material[:-1] + bytes([material[-1] ^ 0x01]))
    writer = RemoteTier(RemoteTierConfig(url=redis_server.url, capacity_bytes=8 << 20, scope=A,
                                         mac_key_file=str(key_file)), (ROW,), torch.float16, identity=MODEL)
    reader = RemoteTier(RemoteTierConfig(url=redis_server.url, capacity_bytes=8 << 20, scope=A,
                                         mac_key_file=str(key_file)), (ROW,), torch.float16, identity=MODEL)
    other = RemoteTier(RemoteTierConfig(url=redis_server.url, capacity_bytes=8 << 20, scope=A,
                                        mac_key_file=str(other_file)), (ROW,), torch.float16, identity=MODEL)
    try:
        assert connected(writer) and connected(reader) and connected(other)
        key = key_of(500)
        assert store_blocks(writer, [key], [_block(key)]).success
        out = _sentinel()
        assert load_blocks(reader, [key], [out]).success and torch.equal(out, _block(key))
        out = _sentinel()
        result = load_blocks(other, [key], [out])
        assert not result.ok[0] and result.errors[0] == "key" and torch.all(out == UNTOUCHED)
    finally:
        writer.close()
        reader.close()
        other.close()


def test_the_acl_recipe_works_in_cluster_mode_and_confines_the_tenant(tmp_path) -> None:
    cluster = RedisCluster(tmp_path / "cluster", password="admin-password").start()
    try:
        for node in cluster.nodes:
            node.client().execute_command("ACL", "SETUSER", "tenant-a", "reset", "on", ">tenant-a-password",
                                          *acl_rule(A), *ACL_CLUSTER_COMMANDS)
        (tmp_path / "pw").write_text("tenant-a-password\n")
        a = _tier(cluster.url, A, username="tenant-a", password_file=str(tmp_path / "pw"))
        try:
            assert connected(a) and a.cluster
            keys = [key_of(600 + i) for i in range(24)]
            assert store_blocks(a, keys, [_block(k) for k in keys]).success
            outs = [_sentinel() for _ in keys]
            assert load_blocks(a, keys, outs).success
            assert all(torch.equal(out, _block(k)) for out, k in zip(outs, keys))
        finally:
            a.close()
        node = cluster.nodes[0]
        as_a = redis.Redis(host="127.0.0.1", port=node.port, username="tenant-a", password="tenant-a-password",
                           socket_timeout=5)
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_a.execute_command("GET", _store_key(B, key_of(600)))
        as_a.close()
    finally:
        cluster.kill()


def test_a_policy_with_a_one_chunk_size_trims_only_what_it_wrote(redis_server) -> None:
    """Every policy of a namespace shares the scope's index. A second author's policy with a one-chunk ``size`` used
    to pop the whole index down to one chunk at its first store (the probe trimmed another owner's chunks this way);
    a tier now pops at most what it added itself: each of the small tier's stores pops one chunk (the index's
    oldest), so the index does not grow and the small tier removes no more chunks than it wrote."""
    owner = _tier(redis_server.url, A)
    small = _tier(redis_server.url, A, capacity=owner.value_bytes)  # one chunk
    try:
        assert connected(owner) and connected(small)
        assert small.capacity_entries == 1
        keys = [key_of(1200 + i) for i in range(10)]
        assert store_blocks(owner, keys, [_block(k) for k in keys]).success
        client = redis_server.client()
        index = index_key(key_prefix(A, MODEL))
        assert client.zcard(index) == 10
        mine = [key_of(1300 + i) for i in range(3)]
        for k in mine:
            assert store_blocks(small, [k], [_block(k)]).success
        # Each of the small tier's stores added one chunk and popped one (the oldest): the index holds as many as the
        # owner wrote, three of the owner's oldest gave way for the three written, the other seven stay.
        assert client.zcard(index) == 10
        assert sum(client.exists(_store_key(A, k)) for k in keys) == 7
        assert client.exists(_store_key(A, mine[-1]))
    finally:
        owner.close()
        small.close()
