"""Policy operations per second, per policy and admission filter, against a bare OrderedDict LRU (same run).

    python bench/policies.py [--ops 200000] [--capacity 4096]

Workload: a Zipf(1.0)-like stream over 8x capacity keys; each op is touch, and on a miss admit + insert
(what a tier does per block lookup). The reference is the same stream through an inline OrderedDict LRU with no
accounting: the ratio is the cost of the shared base class (byte accounting, pins, atomic eviction) plus the
policy's ordering.
"""
from __future__ import annotations

import argparse
import bisect
import itertools
import pathlib
import random
import sys
import time
from collections import OrderedDict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench.tables

from kvtier_runtime.policies import ADMISSIONS, POLICIES, get_policy

from bench.tables import SMOKE_HELP, require_rows


def zipf_stream(n_keys: int, n_ops: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    weights = list(itertools.accumulate(1.0 / (i + 1) for i in range(n_keys)))
    total = weights[-1]
    return [bisect.bisect(weights, rng.random() * total) for _ in range(n_ops)]


def bench_reference(keys: list[int], capacity: int) -> tuple[float, int]:
    od: OrderedDict[int, None] = OrderedDict()
    hits = 0
    start = time.perf_counter()
    for k in keys:
        if k in od:
            od.move_to_end(k)
            hits += 1
        else:
            if len(od) >= capacity:
                od.popitem(last=False)
            od[k] = None
    return len(keys) / (time.perf_counter() - start), hits


def bench_policy(name: str, admission: str, keys: list[int], capacity: int) -> tuple[float, int]:
    p = get_policy(name, capacity, admission=admission)
    touch, admit, insert = p.touch, p.admit, p.insert
    hits = 0
    start = time.perf_counter()
    for k in keys:
        if touch(k):
            hits += 1
        elif admit(k, 1):
            insert(k, 1)
    return len(keys) / (time.perf_counter() - start), hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs (the machine may be shared)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:
        args.ops, args.capacity, args.repeat = 2000, 64, 1
    keys = zipf_stream(8 * args.capacity, args.ops)
    print(f"{args.ops} ops, capacity {args.capacity} entries, Zipf over {8 * args.capacity} keys, best of {args.repeat}")
    print(f"{'policy':<12} {'admission':<11} {'ops/s':>12} {'vs raw OrderedDict LRU':>23} {'hit ratio':>10}")
    refs_all = []
    for name in POLICIES:
        for adm in ADMISSIONS:
            # Reference and policy runs alternate, so a busy neighbour slows both alike.
            refs, runs = [], []
            for _ in range(args.repeat):
                refs.append(bench_reference(keys, args.capacity)[0])
                runs.append(bench_policy(name, adm, keys, args.capacity))
            rate, ref = max(r[0] for r in runs), max(refs)
            refs_all.append(ref)
            print(f"{name:<12} {adm:<11} {rate:>12,.0f} {rate / ref:>23.2f} {runs[0][1] / len(keys):>10.4f}")
    require_rows(len(refs_all), "policy operations per second")
    print(f"{'(reference)':<12} {'-':<11} {max(refs_all):>12,.0f} {1.0:>23.2f} {'':>10}")


if __name__ == "__main__":
    main()
