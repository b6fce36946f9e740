"""A tenant key rotated under traffic, on a real store (Debian's redis-server): two replicas of one scope, each with
its own copy of the key files (two pods, whose kubelets swap the files at different moments), storing and loading
all along. Each replica writes under its current key from the moment it switches and keeps reading what the
previous key sealed; a replica that has not switched yet sees the new key's values as ``key`` misses, never as
``forged``; once the previous key is removed, its values are refused in the running replicas. Before key ids, a
rotation made the two sides count each other's values as forged, and a retired key stayed valid until a restart.
"""
from __future__ import annotations

import os
import threading
import time

import torch
from kvtier_runtime.config import RemoteTierConfig
from kvtier_runtime.remote.identity import model_identity
from kvtier_runtime.remote.tier import RemoteTier
from plugins.runtime import key_of
from plugins.tier_sync import connected, load_blocks, store_blocks

ROW = 4096
MODEL = model_identity({"model": "rotated"})
K1, K2 = bytes(range(100, 132)), bytes(range(200, 232))


def _block(key: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:4], "big"))
    return torch.randn(ROW, generator=g).to(torch.float16)


def _swap(folder, current: bytes, previous: bytes | None) -> None:
    """What the kubelet does to a projected Secret: every file replaced at once (here: renamed over)."""
    for name, data in (("mac-key", current), ("mac-key.previous", previous)):
        path = folder / name
        if data is None:
            path.unlink(missing_ok=True)
            continue
        tmp = folder / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, path)


def _replica(url: str, folder) -> RemoteTier:
    folder.mkdir(parents=True, exist_ok=True)
    _swap(folder, K1, None)
    config = RemoteTierConfig(url=url, capacity_bytes=64 << 20, scope="team-a", mac_key_file=str(folder / "mac-key"),
                              previous_mac_key_file=str(folder / "mac-key.previous"))
    return RemoteTier(config, (ROW,), torch.float16, identity=MODEL, name=f"rot-{folder.name}-{time.monotonic_ns()}",
                      presence_ttl_s=0.0, absent_ttl_s=0.0)


def _loaded(tier: RemoteTier, keys: list[bytes]) -> tuple[list[bool], dict[int, str]]:
    outs = [torch.zeros(ROW, dtype=torch.float16) for _ in keys]
    result = load_blocks(tier, keys, outs)
    for ok, out, key in zip(result.ok, outs, keys):
        assert not ok or torch.equal(out, _block(key)), "a loaded chunk is bit-exact"
    return list(result.ok), dict(result.errors)


def test_a_key_rotated_mid_traffic_keeps_both_replicas_serving_and_retires_the_old_key(redis_server, tmp_path):
    a, b = _replica(redis_server.url, tmp_path / "a"), _replica(redis_server.url, tmp_path / "b")
    stop = threading.Event()
    failures: list[BaseException] = []

    def traffic(tier: RemoteTier, base: int) -> None:
        # Both replicas keep storing new chunks and reading each other's while the keys change under them.
        i = 0
        try:
            while not stop.is_set():
                key = key_of(base + i % 50)
                store_blocks(tier, [key], [_block(key)])
                _loaded(tier, [key_of((base ^ (1 << 20)) + i % 50)])
                i += 1
        except BaseException as exc:
            failures.append(exc)

    try:
        assert connected(a) and connected(b)
        old = [key_of(5000 + i) for i in range(8)]
        assert store_blocks(a, old, [_block(k) for k in old]).success
        assert all(_loaded(b, old)[0]), "both replicas share under the first key"
        threads = [threading.Thread(target=traffic, args=(t, base), daemon=True)
                   for t, base in ((a, 1 << 20), (b, 0))]
        for t in threads:
            t.start()

        # Step 1 on replica A only (its kubelet came first): the new key current, the old one previous.
        _swap(tmp_path / "a", K2, K1)
        assert a.keys.refresh()
        ok, _ = _loaded(a, old)
        assert all(ok) and a.keys.previous_reads >= len(old), "A still reads what the old key sealed"
        new = [key_of(6000 + i) for i in range(8)]
        assert store_blocks(a, new, [_block(k) for k in new]).success
        ok, errors = _loaded(b, new)
        assert not any(ok) and set(errors.values()) == {"key"}, "B has not switched: a key miss, not forged"

        # Step 1 reaches replica B: it opens the new values and still the old ones.
        _swap(tmp_path / "b", K2, K1)
        assert b.keys.refresh()
        assert all(_loaded(b, new)[0]) and all(_loaded(b, old)[0])
        time.sleep(0.5)  # traffic on both sides of the switch

        # Step 2: the previous key removed on both: the old key's values are refused in the running replicas.
        for name, tier in (("a", a), ("b", b)):
            _swap(tmp_path / name, K2, None)
            assert tier.keys.refresh() and tier.keys.key_ids[1] is None
            ok, errors = _loaded(tier, old)
            assert not any(ok) and set(errors.values()) == {"key"}, "a retired key opens nothing"
            assert all(_loaded(tier, new)[0])
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(10)
        assert not failures, failures
        assert a.misses["forged"] == 0 and b.misses["forged"] == 0, "no value counted as forged at any point"
        assert a.keys.reloads == 2 and b.keys.reloads == 2
    finally:
        stop.set()
        a.close()
        b.close()
