#!/usr/bin/env python3
"""How long the SLO guard takes from the start of a sustained breach to the tier being disabled, against the
theoretical consecutiveBreaches x interval plus scrape and window lag.

Real parts: Debian's prometheus 2.42 (1 s scrape) scraping synthetic engines that expose vLLM's exact metric
names and buckets; the guard's real reader, queries and decision engine, ticking at a fixed rate like the kopf
timer. Each configuration runs in its own thread with its own engine; repetitions start the breach at a random
phase of the tick schedule.

    python bench/slo_reaction.py [--reps 3]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for sub in ("operator", "runtime", "tests", "e2e"):  # e2e: the Prometheus process the tests start (scenario)
    sys.path.insert(0, str(REPO / sub))
sys.path.insert(0, str(REPO))  # bench.tables

from kvtier_operator.slo import Scope  # noqa: E402
from kvtier_operator.slo.client import PrometheusClientConfig, PrometheusSource  # noqa: E402
from kvtier_operator.slo.settings import SLOSettings  # noqa: E402
from plugins.prometheus import Started  # noqa: E402
from plugins.slo_harness import GuardLoop, slo_settings  # noqa: E402

from bench.tables import SMOKE_HELP, require_rows  # noqa: E402

SCRAPE_S = 1.0
# (interval s, window s, consecutiveBreaches)
CONFIGS = [(1.0, 3.0, 3), (1.0, 5.0, 5), (2.0, 5.0, 3), (2.0, 10.0, 4)]


def run_config(started: Started, prom, interval: float, window: float, cb: int, reps: int, seed: int):
    name = f"i{interval:g}-w{window:g}-n{cb}".replace(".", "p")
    engine = started.engine(rate=20, ttft=0.05, itl=0.02, seed=seed)
    prom.add_target(engine.address, namespace=name, pod=f"{name}-0")
    rng = random.Random(seed)
    out = []
    for _ in range(reps):
        engine.set(ttft=0.05)
        spec = {"selector": {"matchLabels": {"app": "llm"}}, "tiers": [{"name": "host", "medium": "cpu", "size": "1Gi"}, {"name": "nvme", "medium": "filesystem", "size": "10Gi", "path": "/mnt/nvme", "volume": {"emptyDir": {}}}],
                "slo": {"prometheus": {"url": prom.url}, "ttftP99": "1s", "window": f"{window:g}s",
                        "interval": f"{interval:g}s", "consecutiveBreaches": cb, "cooldown": "1h"}}
        settings = slo_settings(spec)

        def new_loop(settings: SLOSettings = settings) -> GuardLoop:
            return GuardLoop(settings, PrometheusSource(PrometheusClientConfig(prom.url, timeout_s=2)),
                             Scope(namespace=name))

        # Wait until a full window is clean (no slow sample of the previous repetition left in it), then
        # measure with a fresh guard whose state has seen nothing.
        warm = new_loop()
        clean = int(window / interval) + 2
        warm.run_until(lambda l, clean=clean: len(l.records) >= clean
                       and all(r.verdict == "ok" for r in l.records[-clean:]), 90)
        loop = new_loop()
        loop.tick()
        loop.wait_next()
        time.sleep(rng.uniform(0, interval))     # the breach starts at a random phase of the tick schedule
        t0 = time.monotonic()
        engine.set(ttft=3.0)
        loop.run_until(lambda l: bool(l.actions("DisableTier")), 120)
        first_breach = next(r.monotonic for r in loop.records if r.monotonic > t0 and r.verdict == "breach")
        out.append((loop.records[-1].monotonic - t0, first_breach - t0))
    engine.set(ttft=0.05)
    return (interval, window, cb), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help=f"the first configuration once: {SMOKE_HELP}")
    args = ap.parse_args()
    configs = CONFIGS[:1] if args.smoke else CONFIGS
    if args.smoke:
        args.reps = 1
    with tempfile.TemporaryDirectory(prefix="slo-bench-") as tmp:
        started = Started(Path(tmp))
        try:
            prom = started.prometheus(scrape_interval=f"{SCRAPE_S:g}s")
            with ThreadPoolExecutor(len(configs)) as pool:
                results = list(pool.map(
                    lambda i, c: run_config(started, prom, c[0], c[1], c[2], args.reps, args.seed + i),
                    range(len(configs)), configs))
        finally:
            started.close()

    print(f"SLO guard reaction time, breach start -> tier disabled (scrape {SCRAPE_S:g}s, {args.reps} reps each)")
    print("bound    = N x interval + scrape + 1% of window: the p99 moves once 1% of the window's requests are")
    print("           slow, the next scrape stores it, the next tick sees it, N-1 more ticks confirm it")
    print("expected = (N-1) x interval + (interval + scrape) / 2: the same with the breach at a random phase")
    header = (f"{'interval':>8} {'window':>6} {'N':>3} {'detect':>6} {'disable':>7} {'min':>5} {'max':>5} "
              f"{'expected':>8} {'bound':>5} {'mean/expected':>13} {'max/bound':>9}")
    print(header)
    print("-" * len(header))
    require_rows(min(len(reps) for _, reps in results), "SLO guard reaction time")
    for (interval, window, cb), reps in results:
        reaction = [r for r, _ in reps]
        detect = [d for _, d in reps]
        bound = cb * interval + SCRAPE_S + 0.01 * window
        expected = (cb - 1) * interval + (interval + SCRAPE_S) / 2
        mean = statistics.mean(reaction)
        print(f"{interval:>8g} {window:>6g} {cb:>3} {statistics.mean(detect):>6.2f} {mean:>7.2f} "
              f"{min(reaction):>5.2f} {max(reaction):>5.2f} {expected:>8.2f} {bound:>5.2f} "
              f"{mean / expected:>13.2f} {max(reaction) / bound:>9.2f}")
    print("(seconds; detect = breach start -> first breach verdict)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
