"""Faults of a REAL store under kvtier's remote tier. The class of defect: a store fault reaching the engine as an
exception, a stall, or wrong bytes. Each fault here must instead be a failed key with a counted reason (vLLM
recomputes the chunk), within a bounded time, with the destination row untouched.
"""
from __future__ import annotations

import struct
import time

import pytest
import torch
from kvtier_runtime.config import ConfigError, RemoteTierConfig
from kvtier_runtime.remote.identity import chunk_key, key_prefix, model_identity
from kvtier_runtime.remote.tier import KeyState, RemoteTier
from kvtier_runtime.store.books import MISS, RETRY
from plugins.redis_server import RedisCluster, RedisServer, free_port, tenant_key_file
from plugins.runtime import engine_books, key_of
from plugins.tier_sync import connected, load_blocks, settled_state, store_blocks, wait_job

ROW = 4096
MODEL = model_identity({"model": "faults"})
SCOPE = "faults"
UNTOUCHED = 7.0


def _block(key: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:4], "big"))
    return torch.randn(ROW, generator=g).to(torch.float16)


def _tier(url: str, *, capacity: int = 8 << 20, identity: str = MODEL, backoff_base_s: float = 0.2,
          **kw) -> RemoteTier:
    kw.setdefault("scope", SCOPE)
    kw.setdefault("mac_key_file", tenant_key_file(kw["scope"]))
    cfg = RemoteTierConfig(url=url, capacity_bytes=capacity, **kw)
    return RemoteTier(cfg, (ROW,), torch.float16, identity=identity, name=f"faults-{time.monotonic_ns()}",
                      backoff_base_s=backoff_base_s)


def _sentinel() -> torch.Tensor:
    return torch.full((ROW,), UNTOUCHED, dtype=torch.float16)


def _mac_file(tmp_path, name: str, byte: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(byte * 32)
    return str(path)


def test_store_down_at_start_is_a_miss_at_once_then_recovers_when_it_comes_up(tmp_path) -> None:
    port = free_port()
    tier = _tier(f"redis://127.0.0.1:{port}", io_timeout_s=0.5)
    try:
        assert not connected(tier)
        started = time.perf_counter()
        assert tier.state(key_of(1)) is KeyState.MISS  # no probe, no wait: the store is down
        assert time.perf_counter() - started < 0.05
        stored = store_blocks(tier, [key_of(1)], [_block(key_of(1))], timeout=5)
        assert not stored.ok[0] and stored.errors[0] == "down"
        out = _sentinel()
        loaded = load_blocks(tier, [key_of(1)], [out], timeout=5)
        assert not loaded.ok[0] and loaded.errors[0] == "down" and torch.all(out == UNTOUCHED)
        assert tier.misses["down"] >= 2 and tier.store_failures["down"] == 1
        server = RedisServer(tmp_path / "late", port=port).start()
        try:
            deadline = time.monotonic() + 10
            while tier.health != "up" and time.monotonic() < deadline:
                tier.state(key_of(99))  # lookups are what notice that the backoff ran out
                time.sleep(0.05)
            assert tier.health == "up"
            assert store_blocks(tier, [key_of(1)], [_block(key_of(1))]).success
            assert settled_state(tier, key_of(1)) is KeyState.HIT
        finally:
            server.kill()
    finally:
        tier.close()


def test_store_killed_mid_load_fails_the_keys_in_bounded_time_and_leaves_the_row(redis_server) -> None:
    tier = _tier(redis_server.url, io_timeout_s=1.0)
    try:
        assert connected(tier)
        keys = [key_of(i) for i in range(8)]
        assert store_blocks(tier, keys, [_block(k) for k in keys]).success
        redis_server.pause()  # the GETs below are sent and wait for a reply ...
        outs = [_sentinel() for _ in keys]
        job = tier.submit_load(keys, outs)
        time.sleep(0.2)
        redis_server.kill()  # ... that never comes: the server dies with the load in flight
        started = time.monotonic()
        result = wait_job(tier, job, timeout=10)
        assert time.monotonic() - started < 2.0
        assert not any(result.ok)
        assert set(result.errors.values()) <= {"down", "timeout"}
        assert all(torch.all(o == UNTOUCHED) for o in outs)
        # The next lookups miss at once (the store is marked down), and nothing raised.
        deadline = time.monotonic() + 3
        while tier.health == "up" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier.state(key_of(100)) is KeyState.MISS
    finally:
        tier.close()


def test_store_killed_mid_store_fails_every_key_of_the_batch_at_once_also_those_never_sealed(
        redis_server, monkeypatch) -> None:
    """A standalone store batch seals each row and sends it before sealing the next: the server dies after the
    second row was sent, so the rows after it are never sealed. Every key must fail as ``down`` at once -- none left
    to expire at the job's deadline as a ``timeout``."""
    tier = _tier(redis_server.url, io_timeout_s=1.0)
    seal, seals = tier.values.seal, []

    def seal_then_die(*args, **kwargs):
        if len(seals) == 2:
            redis_server.kill()
        seals.append(1)
        return seal(*args, **kwargs)

    try:
        assert connected(tier)
        monkeypatch.setattr(tier.values, "seal", seal_then_die)
        keys = [key_of(300 + i) for i in range(8)]
        started = time.monotonic()
        result = wait_job(tier, tier.submit_store(keys, [_block(k) for k in keys]), timeout=10)
        assert time.monotonic() - started < 2.0  # the job's own deadline is 8 s
        assert result.errors == dict.fromkeys(range(len(keys)), "down")
        assert tier.store_failures["down"] == len(keys)
        assert len(seals) < len(keys)  # the stream stopped at the dead connection: some rows were never sealed
    finally:
        tier.close()


def test_a_slow_store_is_a_timeout_and_a_late_reply_never_reaches_the_row(redis_server) -> None:
    tier = _tier(redis_server.url, io_timeout_s=0.3)
    try:
        assert connected(tier)
        key = key_of(5)
        assert store_blocks(tier, [key], [_block(key)]).success
        redis_server.pause()
        out = _sentinel()
        started = time.monotonic()
        result = load_blocks(tier, [key], [out], timeout=10)
        assert time.monotonic() - started < 1.5
        assert not result.ok[0] and result.errors[0] == "timeout"
        redis_server.resume()  # the reply arrives now, after the caller gave up (and may reuse the row)
        time.sleep(0.5)
        assert torch.all(out == UNTOUCHED)
        assert tier.misses["timeout"] >= 1
    finally:
        redis_server.resume()
        tier.close()


def test_a_full_store_refuses_writes_as_counted_misses_and_keeps_serving(tmp_path) -> None:
    server = RedisServer(tmp_path / "full", maxmemory=3 << 20, policy="noeviction").start()
    tier = _tier(server.url, capacity=64 << 20)
    try:
        assert connected(tier)
        first = key_of(0)
        assert store_blocks(tier, [first], [_block(first)]).success
        failed: list[bytes] = []
        for i in range(1, 400):
            key = key_of(i)
            result = store_blocks(tier, [key], [_block(key)], timeout=5)
            if not result.ok[0]:
                assert result.errors[0] == "full", result.errors
                failed.append(key)
            if len(failed) >= 3:
                break
        assert failed, "the store never filled up"
        assert tier.store_failures["full"] >= 1
        used = server.client().info("memory")["used_memory"]
        assert used <= 3 << 20 or server.client().info("memory")["maxmemory"] == 3 << 20
        assert settled_state(tier, failed[0]) is KeyState.MISS  # never stored: a miss, vLLM recomputes
        out = _sentinel()
        assert load_blocks(tier, [first], [out]).success and torch.equal(out, _block(first))  # reads still work
    finally:
        tier.close()
        server.kill()


def _format_1_value() -> bytes:
    """A value as the tier wrote it before values were encrypted (format version 1: header, key, payload in clear,
    a MAC or CRC trailer): whatever its bytes, a reader of version 2 never decodes it."""
    return b"KVTIERR1" + struct.pack("<HHB3xQ16s", 1, 4, 0, 8, b"none") + b"key!" + b"\0" * 8 + b"\0" * 4


@pytest.mark.parametrize("writer_mac, reader_mac, tamper, reason", [
    # Written under another tenant key (a writer without the fleet's key): a "key" miss, the value names a key the
    # reader does not hold (it cannot tell such a writer from the other side of a key rotation, so neither counts
    # as forged); the same value claiming the reader's key id is forged (the id is in the authenticated header).
    ("a", "b", "", "key"),
    ("a", "b", "claim", "forged"),
    ("b", "b", "flip", "forged"),     # one ciphertext byte changed after sealing
    ("b", "b", "header", "forged"),   # one header byte (the codec name) changed: the header is associated data
    ("b", "b", "v1", "version"),      # a value of the format before encryption: a counted miss, never decoded
])
def test_a_forged_or_damaged_value_is_refused_never_decoded(tmp_path, redis_server, writer_mac, reader_mac,
                                                            tamper, reason) -> None:
    macs = {"a": _mac_file(tmp_path, "a", b"A"), "b": _mac_file(tmp_path, "b", b"B")}
    writer = _tier(redis_server.url, mac_key_file=macs[writer_mac])
    reader = _tier(redis_server.url, mac_key_file=macs[reader_mac])
    try:
        assert connected(writer) and connected(reader)
        key = key_of(3)
        assert store_blocks(writer, [key], [_block(key)]).success
        if tamper:
            client = redis_server.client()
            name = chunk_key(key_prefix(SCOPE, MODEL), key)
            value = bytearray(client.get(name))
            if tamper == "flip":
                value[len(value) // 2] ^= 0x01
            elif tamper == "claim":
                value[11:15] = struct.pack("<I", reader.keys.key_ids[0])
            elif tamper == "header":
                value[24] ^= 0x01
            else:
                value = bytearray(_format_1_value())
            client.set(name, bytes(value))
        assert settled_state(reader, key) is KeyState.HIT  # present ...
        out = _sentinel()
        result = load_blocks(reader, [key], [out])
        assert not result.ok[0] and result.errors[0] == reason  # ... but never served
        assert torch.all(out == UNTOUCHED)
        assert reader.misses[reason] == 1
        assert settled_state(reader, key) is KeyState.MISS  # remembered as unusable
    finally:
        writer.close()
        reader.close()


def test_the_books_turn_a_forged_value_into_a_recompute_never_a_hit(tmp_path, redis_server) -> None:
    mac = _mac_file(tmp_path, "mac", b"K")
    tier = _tier(redis_server.url, mac_key_file=mac)
    books, region = engine_books(tmp_path / "b", 4, ROW * 2, [], key_suffix=b"")
    books = type(books)(books.host, [tier], rows=[region.rows.view(torch.float16)])
    try:
        assert connected(tier)
        key = key_of(11)
        forger = _tier(redis_server.url, mac_key_file=_mac_file(tmp_path, "evil", b"E"))
        assert connected(forger)
        assert store_blocks(forger, [key], [_block(key)]).success
        forger.close()
        answers = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            answers.append(books.lookup(key))
            if answers[-1] != RETRY:
                break
            time.sleep(0.005)
        assert answers[-1] == MISS and "hit" not in answers, answers
        # Sealed under the forger's own key: a "key" refusal (a key this tier does not hold), never loaded.
        assert books.remote_load_failures["key"] == 1 and books.counters["remote_promotions"] == 0
        assert len(books.host) == 0  # the reserved host slot was given back
    finally:
        books.close()
        region.close(unlink=True)


def test_a_cluster_node_dying_turns_its_keys_into_misses_not_errors(tmp_path) -> None:
    cluster = RedisCluster(tmp_path / "cluster").start()
    tier = _tier(cluster.url, io_timeout_s=0.5)
    try:
        assert connected(tier) and tier.cluster
        keys = [key_of(500 + i) for i in range(30)]
        assert store_blocks(tier, keys, [_block(k) for k in keys]).success
        cluster.nodes[2].kill()
        outs = [_sentinel() for _ in keys]
        started = time.monotonic()
        result = load_blocks(tier, keys, outs, timeout=10)
        assert time.monotonic() - started < 3.0
        for ok, out, key in zip(result.ok, outs, keys):
            assert torch.equal(out, _block(key)) if ok else torch.all(out == UNTOUCHED)
        assert not all(result.ok)
        assert set(result.errors.values()) <= {"down", "timeout"}
    finally:
        tier.close()
        cluster.kill()


def test_a_remote_tier_without_a_tenant_key_of_its_own_is_refused(tmp_path) -> None:
    """The store password is shared by every client of the store, so it never keys the values: a tier needs a key
    file of its own (remote.macKeySecret), of at least 32 bytes."""
    pw = tmp_path / "password"
    pw.write_text("a-password-of-more-than-32-bytes-long\n")
    with pytest.raises(ConfigError, match=r"^mac_key_file: required: a remote tier needs remote\.macKeySecret: "):
        RemoteTierConfig(url="redis://127.0.0.1:1", capacity_bytes=1 << 20, scope=SCOPE)
    with pytest.raises(ConfigError, match=r"^mac_key_file: is the password_file: a remote tier needs "
                                          r"remote\.macKeySecret: "):
        RemoteTierConfig(url="redis://127.0.0.1:1", capacity_bytes=1 << 20, scope=SCOPE, password_file=str(pw),
                         mac_key_file=str(pw))
    short = tmp_path / "short"
    short.write_bytes(b"\x00" * 31)
    with pytest.raises(ConfigError, match=f"^mac_key_file: {short} holds 31 bytes, needs at least 32$"):
        _tier("redis://127.0.0.1:1", mac_key_file=str(short))


def test_every_remote_series_the_dashboard_reads_is_exported_by_the_engine_path(tmp_path, redis_server) -> None:
    # The remote-tier panel reads what the books over a real store export: a refused (forged) value is a counted
    # miss, a full store a counted store failure, and each tier's up gauge is set.
    from plugins.dashboard import dashboard_runtime_series, samples

    wanted = {s for s in dashboard_runtime_series() if s.startswith("kvtier_runtime_remote_")}
    assert {"kvtier_runtime_remote_misses_total", "kvtier_runtime_remote_store_failures_total",
            "kvtier_runtime_remote_up"} <= wanted
    tier = _tier(redis_server.url, mac_key_file=_mac_file(tmp_path, "mac", b"K"))
    books, region = engine_books(tmp_path / "b", 4, ROW * 2, [], key_suffix=b"")
    books = type(books)(books.host, [tier], rows=[region.rows.view(torch.float16)])
    full = RedisServer(tmp_path / "full", maxmemory=3 << 20, policy="noeviction").start()
    filling = _tier(full.url, capacity=64 << 20)
    try:
        assert connected(tier) and connected(filling)
        key = key_of(21)
        forger = _tier(redis_server.url, mac_key_file=_mac_file(tmp_path, "evil", b"E"))
        assert connected(forger) and store_blocks(forger, [key], [_block(key)]).success
        forger.close()
        deadline = time.monotonic() + 10
        while books.lookup(key) == RETRY and time.monotonic() < deadline:
            time.sleep(0.005)
        for i in range(400):
            if not store_blocks(filling, [key_of(100 + i)], [_block(key_of(100 + i))], timeout=5).ok[0]:
                break
        for series in sorted(wanted):
            values = [v for labels, v in samples(series) if labels.get("tier") in (tier.name, filling.name)]
            assert values and max(values) > 0, f"{series}: no sample from the remote tiers"
    finally:
        books.close()
        filling.close()
        full.kill()
        region.close(unlink=True)


def test_odd_replies_amid_good_values_fail_their_own_keys_and_leave_the_connection_in_step(redis_server) -> None:
    """Standalone loads read replies off the socket themselves: a value far larger than any this tier writes, an
    error reply (a key holding a list) and a nil between good values must each fail only their key, with the reason
    a pipeline gave, and the next batches on the pooled connections must still read the right values."""
    tier = _tier(redis_server.url)
    try:
        assert connected(tier) and not tier.cluster
        good = [key_of(40 + i) for i in range(4)]
        assert store_blocks(tier, good, [_block(k) for k in good]).success
        huge, listed, gone = key_of(50), key_of(51), key_of(52)
        client = redis_server.client()
        client.set(tier.store_key(huge), b"\xab" * (3 * tier.value_bytes + 17))
        client.rpush(tier.store_key(listed), b"x")
        keys = [good[0], huge, good[1], listed, good[2], gone, good[3]]
        for _ in range(3):  # the same pooled connections, again and again
            outs = [_sentinel() for _ in keys]
            result = load_blocks(tier, keys, outs)
            assert result.errors == {1: "foreign", 3: "other", 5: "evicted"}
            for i, key in enumerate(keys):
                if i in result.errors:
                    assert torch.all(outs[i] == UNTOUCHED)
                else:
                    assert torch.equal(outs[i], _block(key))
            client.set(tier.store_key(huge), b"\xab" * (3 * tier.value_bytes + 17))  # refused values are dropped
    finally:
        tier.close()
