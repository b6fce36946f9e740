"""kvtier's remote tier against REAL stores: Debian's redis-server standalone (a fresh one per test) and a 3-node
cluster-mode set (one per module). What a replica stores, another finds and reads back bit-exactly; keys carry the
model identity; kvtier's share stays within capacity_bytes; lookups never wait on the network; the engine path's
books serve one replica's chunk to another from the store.
"""
from __future__ import annotations

import time

import pytest
import torch
from kvtier_runtime.config import ConfigError, RemoteTierConfig
from kvtier_runtime.remote.format import RemoteFormatError, Sealer, value_bytes
from kvtier_runtime.remote.identity import chunk_key, key_prefix, model_identity
from kvtier_runtime.remote.tier import KeyState, RemoteTier
from kvtier_runtime.store.books import HIT, MISS, REMOTE, RETRY
from plugins.redis_server import tenant_key_file
from plugins.runtime import engine_books, key_of
from plugins.tier_sync import connected, load_blocks, settled_state, store_blocks

ROW = 4096  # float16 values per chunk row: 8 KiB
SCOPE = "team-a"
MODEL_A = model_identity({"model": "a", "layers": 8})
MODEL_B = model_identity({"model": "b", "layers": 8})


def _block(key: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:4], "big"))
    return torch.randn(ROW, generator=g).to(torch.float16)


def _tier(url: str, identity: str = MODEL_A, capacity: int = 8 << 20, **kw) -> RemoteTier:
    opts = {k: kw.pop(k) for k in list(kw) if k not in RemoteTierConfig.__dataclass_fields__}
    kw.setdefault("scope", SCOPE)
    kw.setdefault("mac_key_file", tenant_key_file(kw["scope"]))
    cfg = RemoteTierConfig(url=url, capacity_bytes=capacity, **kw)
    tier = RemoteTier(cfg, (ROW,), torch.float16, identity=identity, name=f"remote-{time.monotonic_ns()}", **opts)
    return tier


def _round_trip(tier: RemoteTier, keys: list[bytes]) -> list[torch.Tensor]:
    result = store_blocks(tier, keys, [_block(k) for k in keys])
    assert result.success, result.errors
    outs = [torch.full((ROW,), 7.0, dtype=torch.float16) for _ in keys]
    assert [settled_state(tier, k) for k in keys] == [KeyState.HIT] * len(keys)
    loaded = load_blocks(tier, keys, outs)
    assert loaded.success, loaded.errors
    return outs


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_a_chunk_stored_by_one_replica_is_read_back_bit_exactly_by_another(mode, request) -> None:
    store = request.getfixturevalue("redis_server" if mode == "standalone" else "redis_cluster")
    writer, reader = _tier(store.url), _tier(store.url)
    try:
        assert connected(writer) and connected(reader)
        assert writer.cluster == (mode == "cluster")
        keys = [key_of(i) + bytes([hash(mode) & 0x7F]) for i in range(24)]
        assert store_blocks(writer, keys, [_block(k) for k in keys]).success
        outs = [torch.zeros(ROW, dtype=torch.float16) for _ in keys]
        assert [settled_state(reader, k) for k in keys] == [KeyState.HIT] * len(keys)
        assert load_blocks(reader, keys, outs).success
        assert all(torch.equal(out, _block(k)) for out, k in zip(outs, keys))
        assert not reader.misses and not writer.store_failures
    finally:
        writer.close()
        reader.close()


def test_keys_carry_the_scope_and_model_identity_and_spread_over_every_cluster_node(redis_cluster) -> None:
    identity = model_identity({"model": "spread"})
    tier = _tier(redis_cluster.url, identity)
    prefix = f"kvtier:{SCOPE}:{identity}:".encode()
    try:
        assert connected(tier)
        keys = [key_of(1000 + i) for i in range(60)]
        assert store_blocks(tier, keys, [_block(k) for k in keys]).success
        per_node = []
        for node in redis_cluster.nodes:
            found = list(node.client().scan_iter(match=f"kvtier:{SCOPE}:{identity}:*", count=1000))
            per_node.append(len(found))
            for name in found:
                assert name == prefix + b"index" or name.removeprefix(prefix) in {k.hex().encode() for k in keys}
        # No hash tag (the scope is not one either): the chunks of one model land on every node, so the cluster
        # scales a model's share.
        assert all(n > 0 for n in per_node), per_node
        assert sum(per_node) == len(keys) + 1  # + the model's index
    finally:
        tier.close()


def test_another_models_chunks_are_never_found_or_served(redis_server) -> None:
    a, b = _tier(redis_server.url, MODEL_A), _tier(redis_server.url, MODEL_B)
    try:
        assert connected(a) and connected(b)
        key = key_of(1)
        assert store_blocks(a, [key], [_block(key)]).success
        assert settled_state(b, key) is KeyState.MISS  # another identity, another key
        assert b.misses["absent"] >= 1
        # Even a value copied under the other model's key is refused: another model's values are sealed under
        # another derived key, and the store key is their associated data.
        client = redis_server.client()
        client.set(chunk_key(key_prefix(SCOPE, MODEL_B), key), client.get(chunk_key(key_prefix(SCOPE, MODEL_A), key)))
        out = torch.full((ROW,), 7.0, dtype=torch.float16)
        result = load_blocks(b, [key], [out])
        assert not result.ok[0] and result.errors[0] == "forged"
        assert torch.all(out == 7.0)  # never a byte of another model's KV
        assert b.misses["forged"] == 1
    finally:
        a.close()
        b.close()


def test_a_value_sealed_in_parts_is_the_value_sealed_whole(monkeypatch) -> None:
    """A store seals a codec-``none`` row in place, as (codec header, row bytes): the value must be the one sealing
    their concatenation gives, whatever the split (GCM encrypts the parts in turn)."""
    from kvtier_runtime.remote import format as fmt

    monkeypatch.setattr(fmt.os, "urandom", lambda n: bytes(range(n)))  # one nonce for both seals
    key, payload = b"kvtier:team-a:x:ab", bytes(i * 7 % 251 for i in range(1000))
    sealer = Sealer(b"k" * 32, "team-a", "0" * 32)
    whole = bytearray(value_bytes(len(payload)))
    n = sealer.seal(whole, key, "none", memoryview(payload))
    for cuts in ([96], [1, 17], [0, 500, 999], [1000]):
        bounds = [0, *cuts, len(payload)]
        parts = [memoryview(payload)[a:b] for a, b in zip(bounds, bounds[1:])]
        split = bytearray(len(whole) + 5)  # room past the value stays unwritten
        assert sealer.seal_parts(split, key, "none", parts) == n
        assert split[:n] == whole and split[n:] == bytes(5), cuts
    assert bytes(sealer.open(bytes(whole), key, bytearray(len(payload)))[1]) == payload


@pytest.mark.parametrize("dtype,shape", [(torch.float16, (ROW,)), (torch.bfloat16, (8, 64)),
                                         (torch.float32, (3, 5, 7))])
def test_rows_sealed_in_place_are_plain_codec_blocks_both_ways(redis_server, dtype, shape) -> None:
    """Codec ``none`` stores seal the row itself and loads copy a verified payload straight into the row: a stored
    value must still be exactly a codec block any reader decodes, and a value sealed from the codec's own encoding
    must load bit-exactly."""
    from kvtier_runtime.codecs import decode, get_codec
    from kvtier_runtime.tiers.keys import read_mac_key

    cfg = RemoteTierConfig(url=redis_server.url, capacity_bytes=8 << 20, scope=SCOPE,
                           mac_key_file=tenant_key_file(SCOPE))
    tier = RemoteTier(cfg, shape, dtype, identity=MODEL_A, name=f"remote-{time.monotonic_ns()}")
    g = torch.Generator().manual_seed(11)
    rows = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
    keys = [key_of(1), key_of(2)]
    sealer = Sealer(read_mac_key(tenant_key_file(SCOPE)), SCOPE, MODEL_A)
    client = redis_server.client()
    try:
        assert connected(tier)
        assert store_blocks(tier, keys[:1], rows[:1]).success
        value = client.get(tier.store_key(keys[0]))
        codec, payload = sealer.open(value, tier.store_key(keys[0]), bytearray(len(value)))
        assert codec == "none" and torch.equal(decode(payload), rows[0])
        # The other way: the codec's own encoding, sealed whole, under key 2.
        encoded = torch.empty(get_codec("none").max_encoded_nbytes(shape, dtype), dtype=torch.uint8)
        n = get_codec("none").encode(rows[1], encoded)
        buf = bytearray(value_bytes(n))
        sealer.seal(buf, tier.store_key(keys[1]), "none", memoryview(encoded.numpy())[:n])
        client.set(tier.store_key(keys[1]), bytes(buf))
        outs = [torch.zeros(shape, dtype=dtype) for _ in keys]
        assert load_blocks(tier, keys, outs).success
        assert all(torch.equal(out, row) for out, row in zip(outs, rows))
    finally:
        tier.close()


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_the_store_client_sends_a_value_view_without_copying_it(mode, request) -> None:
    """A sealed value is a view of the tier's buffer: the client's connections hand that view to the socket as it
    is (hiredis's packer would copy it twice into one command buffer)."""
    from kvtier_runtime.remote.client import RemoteStore

    store = request.getfixturevalue("redis_server" if mode == "standalone" else "redis_cluster")
    remote = RemoteStore(RemoteTierConfig(url=store.url, capacity_bytes=1 << 20, scope=SCOPE,
                                          mac_key_file=tenant_key_file(SCOPE)))
    try:
        client = remote.connect()
        pools = ([n.redis_connection.connection_pool for n in client.get_nodes()] if remote.cluster
                 else [client.connection_pool])
        value = memoryview(bytearray(b"v" * 10000))[:9000]
        for pool in pools:
            conn = pool.get_connection()
            try:
                assert any(chunk is value for chunk in conn.pack_commands([("SET", b"k", value)]))
            finally:
                pool.release(conn)
        pipe = remote.pipeline()
        pipe.set(b"kvtier:team-a:view", value)
        pipe.get(b"kvtier:team-a:view")
        assert pipe.execute()[1] == bytes(value)
    finally:
        remote.close()


def test_value_format_round_trip_and_every_byte_is_checked() -> None:
    key, payload = b"kvtier:team-a:x:ab", bytes(range(200))
    sealer = Sealer(b"k" * 32, "team-a", "0" * 32)
    buf = bytearray(value_bytes(len(payload)))
    n = sealer.seal(buf, key, "none", memoryview(payload))
    assert n == len(buf)
    assert payload[16:48] not in bytes(buf)  # the payload is not in the value in clear
    scratch = bytearray(len(payload))
    codec, got = sealer.open(bytes(buf), key, scratch)
    assert codec == "none" and bytes(got) == payload
    for i in range(n):  # any flipped byte (header, nonce, ciphertext, tag) is refused, never decoded
        bad = bytearray(buf)
        bad[i] ^= 0x10
        with pytest.raises(RemoteFormatError):
            sealer.open(bytes(bad), key, bytearray(len(payload)))
    for cut in (0, 5, n - 1):
        with pytest.raises(RemoteFormatError):
            sealer.open(bytes(buf[:cut]), key, bytearray(len(payload)))
    # Another store key, scope, model or tenant key: refused as forged.
    for other, at in [(sealer, b"kvtier:team-a:x:ac"), (Sealer(b"k" * 32, "team-b", "0" * 32), key),
                      (Sealer(b"k" * 32, "team-a", "1" * 32), key), (Sealer(b"K" * 32, "team-a", "0" * 32), key)]:
        with pytest.raises(RemoteFormatError) as info:
            other.open(bytes(buf), at, bytearray(len(payload)))
        assert info.value.kind == "forged"
    # Two seals of one payload never share a nonce (96 random bits each): the values differ.
    again = bytearray(len(buf))
    sealer.seal(again, key, "none", memoryview(payload))
    assert again[40:52] != buf[40:52] and again != buf


def test_kvtiers_share_stays_within_capacity_bytes_fleet_wide(redis_server) -> None:
    """Two replicas of one model writing through: the model's index never lists more chunks than capacity_bytes
    allows at the largest value size, the oldest are deleted from the store, the gauge says what is used."""
    probe = _tier(redis_server.url, capacity=1 << 20)
    value = probe.value_bytes
    probe.close()
    capacity = 10 * value
    a, b = _tier(redis_server.url, capacity=capacity), _tier(redis_server.url, capacity=capacity)
    try:
        assert connected(a) and connected(b)
        keys = [key_of(2000 + i) for i in range(40)]
        for j in range(0, 40, 4):
            writer = a if (j // 4) % 2 == 0 else b
            assert store_blocks(writer, keys[j:j + 4], [_block(k) for k in keys[j:j + 4]]).success
        client = redis_server.client()
        index = key_prefix(SCOPE, MODEL_A) + b"index"
        assert client.zcard(index) <= 10
        held = [k for k in keys if client.exists(chunk_key(key_prefix(SCOPE, MODEL_A), k))]
        assert 0 < len(held) <= 10
        # The oldest went first (scores are per batch of 4, so within the cut batch the order is the store's).
        assert set(keys[-4:]) <= set(held) <= set(keys[-12:])
        assert client.zcard(index) * value <= capacity
        assert a.used_bytes <= capacity and b.used_bytes <= capacity
    finally:
        a.close()
        b.close()


def test_a_capacity_that_holds_no_chunk_is_refused_naming_the_key(redis_server) -> None:
    with pytest.raises(ConfigError, match=r"^capacity_bytes: 100 bytes hold no chunk"):
        _tier(redis_server.url, capacity=100)


def test_the_password_comes_from_the_file_and_a_wrong_one_is_a_counted_miss(tmp_path) -> None:
    from plugins.redis_server import RedisServer

    server = RedisServer(tmp_path / "auth", password="s3cret-pass").start()
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("s3cret-pass\n")
    bad.write_text("wrong")
    try:
        tier = _tier(server.url, password_file=str(good))
        assert connected(tier)
        _round_trip(tier, [key_of(1)])
        tier.close()
        denied = _tier(server.url, password_file=str(bad))
        assert not connected(denied)
        # This tier's fault, not the store's: its keys fail as "auth", the store is reported up (it answers).
        assert denied.health == "refused"
        assert denied.state(key_of(1)) is KeyState.MISS
        assert denied.misses["auth"] >= 1 and not denied.misses["down"]
        result = store_blocks(denied, [key_of(2)], [_block(key_of(2))])
        assert not result.ok[0] and denied.store_failures["auth"] == 1
        from prometheus_client import REGISTRY
        assert REGISTRY.get_sample_value("kvtier_runtime_remote_refused", {"tier": denied.name}) == 1
        assert REGISTRY.get_sample_value("kvtier_runtime_remote_up", {"tier": denied.name}) == 1
        denied.close()
    finally:
        server.kill()
    with pytest.raises(ConfigError, match="^password_file: /nonexistent/pw cannot be read"):
        _tier(server.url, password_file="/nonexistent/pw")


def test_lookups_never_wait_on_the_network(redis_server) -> None:
    """The scheduler thread asks ``state`` for every chunk of every waiting request each step: with a hung store
    (SIGSTOP: the kernel accepts, nothing answers) it must still answer at memory speed."""
    tier = _tier(redis_server.url, io_timeout_s=0.5)
    try:
        assert connected(tier)
        redis_server.pause()
        started = time.perf_counter()
        states = [tier.state(key_of(i)) for i in range(200)]
        elapsed = time.perf_counter() - started
        assert elapsed < 0.2, f"200 lookups took {elapsed:.3f}s with a hung store"
        assert set(states) == {KeyState.PENDING}
        # The probe times out within io_timeout_s: the keys become misses (vLLM recomputes), no request stalls.
        deadline = time.monotonic() + 5
        while tier.state(key_of(0)) is KeyState.PENDING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier.state(key_of(0)) is KeyState.MISS
        assert tier.misses["timeout"] >= 1
    finally:
        redis_server.resume()
        tier.close()


def test_the_books_serve_one_replicas_chunk_to_another_from_the_store(tmp_path, redis_server) -> None:
    """The engine path: replica A's host tier writes a chunk through to the store; replica B (its own host region,
    no filesystem tier) looks it up -- retry while probing, retry while promoting -- then serves it from its host
    row with A's exact bytes, counted as a remote promotion."""
    replicas = []
    for name in ("a", "b"):
        tier = _tier(redis_server.url)
        books, region = engine_books(tmp_path / name, 4, ROW * 2, [], key_suffix=b"")
        books = type(books)(books.host, [tier], rows=[region.rows.view(torch.float16)])
        assert connected(tier)
        replicas.append((books, region))
    (a, region_a), (b, region_b) = replicas
    key = key_of(7)
    out = a.prepare_store([key])
    assert out is not None
    region_a.rows[out[1][0]].view(torch.float16).copy_(_block(key))
    a.complete_store([key])
    a.drain()
    assert a.counters["remote_stores"] == 1
    found = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found.append(b.find(key))
        if found[-1].state != RETRY:
            break
        time.sleep(0.005)
    assert found[0].state == RETRY and found[-1].state == HIT, found
    assert found[-1].served is not None and b.served_by(found[-1].served)[1] == REMOTE
    assert b.counters["remote_promotions"] == 1
    (slot,) = b.prepare_load([key])
    assert torch.equal(region_b.rows[slot].view(torch.float16), _block(key))
    b.complete_load([key])
    assert b.lookup(key_of(8)) == RETRY  # unknown: probed
    b.drain()
    deadline = time.monotonic() + 5
    while b.lookup(key_of(8)) == RETRY and time.monotonic() < deadline:
        time.sleep(0.005)
    assert b.lookup(key_of(8)) == MISS
    for books, region in replicas:
        books.close()
        region.close(unlink=True)


def test_the_model_identity_changes_with_every_fact_and_only_with_them() -> None:
    facts = {"model": "/models/llama", "kv_cache_dtype": "bfloat16", "block_tokens": 16, "blocks_per_chunk": 16,
             "layers": 32, "kv_heads": 8, "head_size": 128, "tp_size": 2, "rank": 0, "codec": "none"}
    base = model_identity(facts)
    assert base == model_identity(dict(reversed(list(facts.items()))))  # key order does not matter
    for name, other in [("model", "/models/mistral"), ("kv_cache_dtype", "fp8"), ("block_tokens", 32),
                        ("blocks_per_chunk", 8), ("layers", 40), ("kv_heads", 4), ("head_size", 64),
                        ("tp_size", 4), ("rank", 1), ("codec", "fp8")]:
        assert model_identity({**facts, name: other}) != base, name
    assert key_prefix("team-a", base) == f"kvtier:team-a:{base}:".encode()
    assert chunk_key(key_prefix("team-a", base), b"\x01\xff") == f"kvtier:team-a:{base}:01ff".encode()
    with pytest.raises(ValueError, match="^identity: "):
        key_prefix("team-a", "{tag}")  # never a hash tag: one model's chunks must spread over every cluster slot
