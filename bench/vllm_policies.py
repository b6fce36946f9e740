"""kvtier's policies against vLLM 0.33's built-in LRU and ARC, inside vLLM's real CPU offloading manager.

    .venv-vllm/bin/python bench/vllm_policies.py --trace PATH/mooncake-synthetic.jsonl [--capacity 2196 4392]

Every policy sees the same recorded operation sequence: the trace's requests in order, each replayed as vLLM's
scheduler-side connector drives ``CPUOffloadingManager`` (one chunk per trace block): ``on_new_request``, a
``lookup`` per block (the leading run of HITs is the prefix hit), ``prepare_load``/``complete_load`` of that run,
``prepare_store``/``complete_store`` of the rest, ``on_request_finished``. The only thing that changes between rows
is ``eviction_policy`` (+ ``cache_policy_module_path`` for kvtier's classes), so the speed column is the whole
manager's speed with that policy (block accesses per CPU-second of this process) and the ratio is against vLLM's
``lru`` measured in the same run.

Hit ratios: prefix = leading hits per request / block accesses (what a request can reuse); block = any hit.
Needs the env built by ``.ci/vllm-env``.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT))  # bench.tables

from kvtier_runtime.config import (  # noqa: E402
    ADMISSION_POLICIES,
    EVICTION_POLICIES,
    RECOMMENDED_EVICTION_POLICY,
    VLLM_ADAPTER_MODULE,
    vllm_cache_policy_class,
)
from kvtier_runtime.replay.trace import load_trace  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from bench.tables import SMOKE_HELP, require_rows  # noqa: E402

TOKENS_PER_BLOCK = 16
# --smoke: the trace's first requests only.
SMOKE_REQUESTS = 200


def default_trace() -> pathlib.Path:
    return ROOT / "tests" / "data" / "mooncake-synthetic.jsonl"


def policy_rows(selected: list[str] | None) -> list[tuple[str, str, str | None]]:
    """(label, eviction_policy, cache_policy_module_path) as kv_connector_extra_config spells them."""
    rows: list[tuple[str, str, str | None]] = [("vllm lru", "lru", None), ("vllm arc", "arc", None)]
    for eviction in EVICTION_POLICIES:
        for admission in ADMISSION_POLICIES:
            label = f"kvtier {eviction}" + ("" if admission == "none" else f"+{admission}")
            rows.append((label, vllm_cache_policy_class(eviction, admission), VLLM_ADAPTER_MODULE))
    if selected:
        rows = [r for r in rows if r[0] in selected or r[1] in selected]
    return rows


def replay(manager: CPUOffloadingManager, requests: list[list[bytes]]) -> tuple[int, int, int]:
    """The connector's call sequence for each request; returns (accesses, prefix hits, block hits)."""
    accesses = prefix_hits = block_hits = 0
    hit = LookupResult.HIT
    for r, keys in enumerate(requests):
        ctx = ReqContext(req_id=f"r{r}")
        for pos, k in enumerate(keys):
            ctx.set_offload_key_position(k, (pos + 1) * TOKENS_PER_BLOCK)
        manager.on_new_request(ctx)
        results = [manager.lookup(k, ctx) is hit for k in keys]
        run = next((i for i, h in enumerate(results) if not h), len(results))
        accesses += len(keys)
        prefix_hits += run
        block_hits += sum(results)
        if run:
            manager.prepare_load(keys[:run], ctx)
            manager.complete_load(keys[:run], ctx)
        if run < len(keys):
            out = manager.prepare_store(keys[run:], ctx)
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
    return accesses, prefix_hits, block_hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=pathlib.Path, default=None, help="Mooncake JSONL trace (default: "
                        "tests/data/mooncake-synthetic.jsonl)")
    parser.add_argument("--capacity", type=int, nargs="+", default=[2196], help="CPU tier size in chunks")
    parser.add_argument("--policies", nargs="*", help="labels or class names to run (default: all)")
    parser.add_argument("--smoke", action="store_true", help=f"vLLM's LRU and kvtier's default on the trace's first "
                                                            f"requests: {SMOKE_HELP}")
    args = parser.parse_args(argv)

    trace = load_trace(args.trace or default_trace())
    if args.smoke:
        trace.requests, args.capacity = trace.requests[:SMOKE_REQUESTS], [64]
        args.policies = args.policies or ["vllm lru", f"kvtier {RECOMMENDED_EVICTION_POLICY}"]
    requests = [[make_offload_key(h.to_bytes(8, "big"), 0) for h in ids] for ids in trace.requests]
    rows = policy_rows(args.policies)
    require_rows(len(rows), "policies in vLLM's manager")
    print(f"trace: {pathlib.Path(trace.source).name}, {len(requests)} requests, {trace.n_accesses} block accesses, "
          f"{trace.n_distinct} distinct blocks; one block = one chunk; vLLM's CPUOffloadingManager")
    for capacity in args.capacity:
        print(f"\nCPU tier: {capacity} chunks")
        print(f"{'policy':28s} {'accesses/s':>11s} {'vs vllm lru':>11s} {'prefix hit':>10s} {'block hit':>10s}")
        reference = None
        for label, name, module in rows:
            manager = CPUOffloadingManager(num_chunks=capacity, cache_policy=name, cache_policy_module_path=module)
            # CPU time of this (single-threaded) process: on a shared machine wall time also counts other jobs.
            start = time.process_time()
            accesses, prefix, block = replay(manager, requests)
            rate = accesses / (time.process_time() - start)
            if reference is None:
                reference = rate
            print(f"{label:28s} {rate:11,.0f} {rate / reference:11.2f} {prefix / accesses:10.4f} "
                  f"{block / accesses:10.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
