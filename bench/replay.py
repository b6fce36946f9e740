"""Replay speed and prefix hit ratios per policy against OPT at 5% and 10% of the trace's distinct blocks.

    python bench/replay.py [--trace tests/data/mooncake-synthetic.jsonl]
    python bench/replay.py --gap [--gap-policies adaptive,prefix2q] [--requests 3000] [--seed 1]

``--gap`` prints, for the shared trace, the held-out real conversation trace (tests/data/mooncake-conversation.jsonl)
and every generated shape (kvtier_runtime.replay.synth), the share of the
LRU -> OPT prefix-hit gap each policy closes at 1-30% capacity, its margin over LRU, and the LRU capacity
matching it (capacity equivalence).

Speed is block accesses per second on one core through kvtier_runtime.replay.replay_single (the runtime's own
policy classes), next to an inline OrderedDict LRU over the same accesses measured in the same run.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections import OrderedDict

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT))  # bench.tables

from kvtier_runtime import config  # noqa: E402
from kvtier_runtime.replay.engine import PolicySpec, capacity_blocks, replay_single  # noqa: E402
from kvtier_runtime.replay.metrics import flatten, prefix_hit_count  # noqa: E402
from kvtier_runtime.replay.opt import opt_hits  # noqa: E402
from kvtier_runtime.replay.trace import Trace, load_trace  # noqa: E402

from bench.tables import SMOKE_HELP, require_rows  # noqa: E402

# --smoke: the trace's first requests only.
SMOKE_REQUESTS = 300
SPECS = ["lru", "arc", "s3fifo", "prefix2q", "adaptive", "lru+doorkeeper", "s3fifo+doorkeeper", "s3fifo+threshold",
         "prefix2q+threshold"]


def default_trace() -> pathlib.Path:
    return ROOT / "tests" / "data" / "mooncake-synthetic.jsonl"


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


def gap_table(traces: list[tuple[str, Trace]], policies: list[str]) -> None:
    from kvtier_runtime.replay.lru_curve import LRUCurve

    print("gap closed = (policy - LRU) / (OPT - LRU) in prefix hit ratio; margin = policy - LRU; "
          "xmem = LRU capacity matching the policy / capacity")
    print(f"{'trace':<20} {'cap':>4} {'LRU':>7} {'OPT':>7} " + " ".join(
        f"{p + ' ratio':>15} {'gap':>6} {'margin':>8} {'xmem':>5}" for p in policies))
    for name, trace in traces:
        keys, lengths = flatten(trace.requests)
        n = len(keys)
        curve = LRUCurve(keys, lengths)
        for pct in (1, 2, 5, 10, 20, 30):
            cap = capacity_blocks(f"{pct}%", trace.n_distinct)
            lru = curve.prefix_hit_ratio(cap)
            opt = prefix_hit_count(opt_hits(keys, cap), lengths) / n
            cells = []
            for p in policies:
                hits, _ = replay_single(trace.requests, PolicySpec.parse(p).build(cap))
                ph = prefix_hit_count(hits, lengths)
                gap = f"{(ph / n - lru) / (opt - lru):>6.1%}" if opt - lru > 1e-9 else f"{'-':>6}"
                cells.append(f"{ph / n:>15.4f} {gap} {ph / n - lru:>+8.4f} {curve.capacity_for(ph) / cap:>5.2f}")
            print(f"{name:<20} {pct:>3}% {lru:>7.4f} {opt:>7.4f} " + " ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(default_trace()))
    ap.add_argument("--repeat", type=int, default=3, help="speed: best of N runs (the machine may be shared)")
    ap.add_argument("--oracles", action="store_true", help="also print two future-knowledge bounds (not policies)")
    ap.add_argument("--policies", help="comma-separated specs for the speed table (default: all of SPECS)")
    ap.add_argument("--gap", action="store_true", help="gap-closure table over the trace and generated shapes")
    ap.add_argument("--gap-policies", default=f"{config.RECOMMENDED_EVICTION_POLICY},prefix2q")
    ap.add_argument("--requests", type=int, default=3000, help="--gap: requests per generated trace")
    ap.add_argument("--seed", type=int, default=1, help="--gap: generator seed")
    ap.add_argument("--smoke", action="store_true", help=f"the speed table on the trace's first requests: {SMOKE_HELP}")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    if args.smoke:
        trace.requests, args.repeat = trace.requests[:SMOKE_REQUESTS], 1
        args.policies = args.policies or "lru,adaptive,s3fifo+doorkeeper"
    if args.gap:
        import tempfile

        from kvtier_runtime.replay.synth import SHAPES, generate, write_jsonl

        traces = [(pathlib.Path(args.trace).stem, trace)]
        held_out = ROOT / "tests" / "data" / "mooncake-conversation.jsonl"
        if pathlib.Path(args.trace).resolve() != held_out:
            traces.append((f"{held_out.stem} (held out)", load_trace(held_out)))
        with tempfile.TemporaryDirectory() as tmp:
            for shape in SHAPES:
                path = pathlib.Path(tmp) / f"{shape}.jsonl"
                write_jsonl(generate(shape, args.requests, seed=args.seed), path)
                traces.append((f"{shape} (seed {args.seed})", load_trace(path)))
        gap_table(traces, args.gap_policies.split(","))
        return
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
    for text in (args.policies.split(",") if args.policies else SPECS):
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
    require_rows(len(ref_all), "replay speed and prefix hit ratios")
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
