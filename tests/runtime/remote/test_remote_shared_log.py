"""The remote tier's changes for KV events, against a REAL redis-server: while the engine publishes events, every
replica of the scope announces the shared store's chunks as its own -- another replica's writes included, so a
router's index scores a shared prefix on every replica that can load it -- and the chunks a trim or the store removed
leave every replica's announcement. A replica that starts late learns what the store already holds; replicas of
another scope or model learn nothing of these; an ACL without the log's commands leaves a replica its own writes.
"""
from __future__ import annotations

import time

import torch
from kvtier_runtime.config import RemoteTierConfig
from kvtier_runtime.remote.changes import log_key
from kvtier_runtime.remote.identity import acl_rule, key_prefix, model_identity
from kvtier_runtime.remote.tier import RemoteTier
from kvtier_runtime.tiers.base import TierChanges
from plugins.redis_server import tenant_key_file
from plugins.runtime import key_of
from plugins.tier_sync import connected, load_blocks, store_blocks

ROW = 4096  # float16 values per chunk row: 8 KiB
SCOPE = "team-a"
MODEL_A = model_identity({"model": "a", "layers": 8})


def _block(key: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:4], "big"))
    return torch.randn(ROW, generator=g).to(torch.float16)


def _tier(url: str, identity: str = MODEL_A, capacity: int = 8 << 20, **kw) -> RemoteTier:
    kw.setdefault("scope", SCOPE)
    kw.setdefault("mac_key_file", tenant_key_file(kw["scope"]))
    cfg = RemoteTierConfig(url=url, capacity_bytes=capacity, **kw)
    return RemoteTier(cfg, (ROW,), torch.float16, identity=identity, name=f"remote-{time.monotonic_ns()}")


def _changes_until(tier: RemoteTier, want: set[bytes], removed: bool = False, timeout_s: float = 10.0) -> TierChanges:
    """Take the tier's changes until every key of ``want`` came (as stored, or ``removed``); all taken meanwhile."""
    stored: list[bytes] = []
    gone: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        changes = tier.take_changes()
        stored += changes.stored
        gone += changes.removed
        if want <= set(gone if removed else stored):
            break
        time.sleep(0.05)
    return TierChanges(stored, gone)


def test_every_replica_announces_the_shared_stores_chunks_and_their_removal(redis_server) -> None:
    a, b = _tier(redis_server.url), _tier(redis_server.url)
    late = other_scope = other_model = None
    try:
        assert connected(a) and connected(b)
        assert a.take_changes() == TierChanges([], [])  # nothing recorded before the engine asks
        for tier in (a, b):
            tier.record_changes()
        keys = [key_of(i) for i in range(6)]
        # b has read the (empty) store's index before a writes (a second poll began: the first one finished), so
        # what it learns next comes from the log's entries, not from the index a starting replica reads.
        deadline = time.monotonic() + 10
        while b.shared_log.polls < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.shared_log.polls >= 2
        assert store_blocks(a, keys, [_block(k) for k in keys]).success
        # b never wrote or read them: it learns from the shared log.
        assert set(keys) <= set(_changes_until(b, set(keys)).stored)
        # A replica starting now learns what the store holds from the index, then follows the log.
        late = _tier(redis_server.url)
        other_scope = _tier(redis_server.url, scope="team-b")
        other_model = _tier(redis_server.url, identity=model_identity({"model": "c"}))
        for tier in (late, other_scope, other_model):
            assert connected(tier)
            tier.record_changes()
        assert set(keys) <= set(_changes_until(late, set(keys)).stored)
        # A replica whose budget is 4 chunks of this size writes 6 more: its trim pops the 6 oldest of the scope's
        # index (a's), and every replica hears of the removal.
        small = _tier(redis_server.url, capacity=4 * a.value_bytes)
        assert connected(small)
        small.record_changes()
        more = [key_of(100 + i) for i in range(6)]
        assert store_blocks(small, more, [_block(k) for k in more]).success
        trimmed = set(small.take_changes().removed)
        assert trimmed and trimmed <= set(keys)
        for tier in (a, b, late):
            assert trimmed <= set(_changes_until(tier, trimmed, removed=True).removed)
        small.close()
        # Another scope or another model shares nothing: nothing of these is announced there.
        for tier in (other_scope, other_model):
            seen = tier.take_changes()
            assert not (set(seen.stored) | set(seen.removed)) & (set(keys) | set(more))
    finally:
        for tier in (a, b, late, other_scope, other_model):
            if tier is not None:
                tier.close()


def test_a_store_that_evicted_a_chunk_is_announced_removed_by_the_replica_that_found_it_gone(redis_server) -> None:
    a, b = _tier(redis_server.url), _tier(redis_server.url)
    try:
        assert connected(a) and connected(b)
        a.record_changes()
        b.record_changes()
        key = key_of(7)
        assert store_blocks(a, [key], [_block(key)]).success
        _changes_until(b, {key})
        redis_server.client().delete(a.store_key(key))  # the store's own eviction (maxmemory)
        assert not load_blocks(b, [key], [torch.zeros_like(_block(key))]).success
        assert key in _changes_until(b, {key}, removed=True).removed
        assert key in _changes_until(a, {key}, removed=True).removed  # through the log
    finally:
        a.close()
        b.close()


def test_an_acl_without_the_logs_commands_leaves_a_replica_its_own_changes(redis_server) -> None:
    """A tenant whose store user predates the log (no ZRANGE/X* commands): its stores still succeed, the refusal
    is logged, and its own trims still reach its events."""
    admin = redis_server.client()
    old_rule = [w for w in acl_rule(SCOPE) if w not in ("+zrange", "+xadd", "+xrange", "+xrevrange")]
    admin.execute_command("ACL", "SETUSER", "old-tenant", "on", ">pw-old-tenant-0123456789", *old_rule)
    pw = redis_server.workdir / "old-pw"
    pw.write_text("pw-old-tenant-0123456789")
    tier = _tier(redis_server.url, username="old-tenant", password_file=str(pw), capacity=2 * 16 << 10)
    try:
        assert connected(tier)
        tier.record_changes()
        keys = [key_of(200 + i) for i in range(4)]
        assert store_blocks(tier, keys, [_block(k) for k in keys]).success
        removed = set(tier.take_changes().removed)  # its budget holds 3 of the 4: one trimmed
        assert removed and removed <= set(keys)
        assert not admin.exists(log_key(key_prefix(SCOPE, MODEL_A)))
    finally:
        tier.close()
