"""Replay speed and prefix hit ratios per policy against OPT at 5% and 10% of the trace's distinct blocks.

    python bench/replay.py [--trace ../shared/traces/mooncake-synthetic.jsonl]

Speed is block accesses per second on one core through kvtier_runtime.replay.replay_single (the runtime's own
policy classes), next to an inline OrderedDict LRU over the same accesses measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from collections import OrderedDict

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from kvtier_runtime import config  # noqa: E402
from kvtier_runtime.replay.engine import PolicySpec, capacity_blocks, replay_single  # noqa: E402
from kvtier_runtime.replay.metrics import flatten, prefix_hit_count  # noqa: E402
from kvtier_runtime.replay.opt import opt_hits  # noqa: E402
from kvtier_runtime.replay.trace import load_trace  # noqa: E402

SPECS = ["lru", "arc", "s3fifo", "prefix2q", "lru+doorkeeper", "s3fifo+doorkeeper", "s3fifo+threshold",
         "prefix2q+threshold"]


def default_trace() -> pathlib.Path:
    base = pathlib.Path(os.environ.get("KVTIER_TRACE_DIR") or ROOT.parent / "shared" / "traces")
    return base / "mooncake-synthetic.jsonl"


def reference_lru(keys: list[int], capacity: int) -> float:
    od: OrderedDict[int, None] = OrderedDict()
    start = time.perf_counter()
    for k in keys:
        if k in od:
            od.move_to_end(k)
        else:
            if len(od) >= capacity:
                od.popitem(last=False)
            od[k] = None
    return len(keys) / (time.perf_counter() - start)


def oracle_bounds(keys: list[int], capacity: int) -> dict[str, list[bool]]:
    """Hit flags of two NON-deployable policies that peek at the future, to size what online policies can reach.

    * ``oracle-admission`` -- LRU that stores only blocks that will be accessed again (perfect admission);
    * ``oracle-popularity`` -- keeps the blocks with the most accesses over the WHOLE trace, LRU among equals.
    """
    import heapq
    from collections import Counter

    from kvtier_runtime.replay.opt import NEVER, next_uses

    nxt = next_uses(keys)
    out: dict[str, list[bool]] = {}
    od: OrderedDict[int, None] = OrderedDict()
    hits = []
    for i, k in enumerate(keys):
        if k in od:
            od.move_to_end(k)
            hits.append(True)
            continue
        hits.append(False)
        if nxt[i] == NEVER:
            continue
        if len(od) >= capacity:
            od.popitem(last=False)
        od[k] = None
    out["oracle-admission"] = hits
    total = Counter(keys)
    prio: dict[int, tuple[int, int]] = {}
    heap: list[tuple[tuple[int, int], int]] = []
    hits = []
    for i, k in enumerate(keys):
        p = (total[k], i)
        hit = k in prio
        hits.append(hit)
        if not hit and len(prio) >= capacity:
            while heap[0][0] != prio.get(heap[0][1]):
                heapq.heappop(heap)
            if p < heap[0][0]:
                continue  # less popular than every cached block: not stored
            del prio[heapq.heappop(heap)[1]]
        prio[k] = p
        heapq.heappush(heap, (p, k))
    out["oracle-popularity"] = hits
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(default_trace()))
    ap.add_argument("--repeat", type=int, default=3, help="speed: best of N runs (the machine may be shared)")
    ap.add_argument("--oracles", action="store_true", help="also print two future-knowledge bounds (not policies)")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    keys, lengths = flatten(trace.requests)
    n = len(keys)
    caps = [capacity_blocks(p, trace.n_distinct) for p in ("5%", "10%")]
    opt = {c: prefix_hit_count(opt_hits(keys, c), lengths) / n for c in caps}
    ref_all: list[float] = []
    print(f"trace: {pathlib.Path(args.trace).name}, {n} block accesses, {trace.n_distinct} distinct blocks; "
          f"capacities {caps[0]} (5%) and {caps[1]} (10%) blocks; default policy {config.RECOMMENDED_EVICTION_POLICY}")
    print(f"{'policy':<20} {'accesses/s':>11} {'vs raw LRU':>10} "
          f"{'prefix@5%':>10} {'of OPT':>7} {'prefix@10%':>11} {'of OPT':>7}")
    print(f"{'OPT (Belady)':<20} {'':>11} {'':>10} {opt[caps[0]]:>10.4f} {'100%':>7} {opt[caps[1]]:>11.4f} {'100%':>7}")
    for text in SPECS:
        spec = PolicySpec.parse(text)
        ratios, rates, refs = [], [], []
        for c in caps:
            for _ in range(args.repeat if c == caps[0] else 1):
                if c == caps[0]:  # the reference runs right next to each timed run: the machine may be shared
                    refs.append(reference_lru(keys, c))
                start = time.perf_counter()
                hits, _ = replay_single(trace.requests, spec.build(c))
                if c == caps[0]:
                    rates.append(n / (time.perf_counter() - start))
            ratios.append(prefix_hit_count(hits, lengths) / n)
        rate, ref = max(rates), max(refs)
        ref_all.append(ref)
        print(f"{text:<20} {rate:>11,.0f} {rate / ref:>10.2f} {ratios[0]:>10.4f} {ratios[0] / opt[caps[0]]:>7.1%} "
              f"{ratios[1]:>11.4f} {ratios[1] / opt[caps[1]]:>7.1%}")
    print(f"{'(raw OrderedDict LRU)':<20} {max(ref_all):>11,.0f} {'1.00':>10}   (speed at 5%; each ratio uses "
          f"the reference runs interleaved with that policy's)")
    if args.oracles:
        per_cap = [oracle_bounds(keys, c) for c in caps]
        for name in per_cap[0]:
            r = [prefix_hit_count(pc[name], lengths) / n for pc in per_cap]
            print(f"{name:<20} {'':>11} {'':>10} {r[0]:>10.4f} {r[0] / opt[caps[0]]:>7.1%} "
                  f"{r[1]:>11.4f} {r[1] / opt[caps[1]]:>7.1%}")


if __name__ == "__main__":
    main()
