"""Every policy's replay results pinned to the figures the code produced before its hot paths were optimised.

Speed work on the policies and on replay (fused loops, other data structures) must not change a single result.
For each policy and admission filter, on the two fixture traces (their first requests) and on generated shapes at
fixed seeds, at a tiny capacity (constant eviction) and two percentages, this pins: the hit flags of
``replay_single`` (count, prefix hits, stores and a digest of the whole sequence), and, through the public
touch/admit/insert path, the order in which keys were evicted and the cache's final contents. Multi-tier and
shared-tier replays pin each tier's hits, prefix hits, promotions and stores.

The pinned figures live in tests/data/replay-golden.json. They were written by this module's ``--write`` from the
code before the optimisation; regenerate them only for a change that is *meant* to change a policy's decisions:

    .venv/bin/python tests/runtime/replay/test_replay_golden.py --write
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import sys
from collections.abc import Iterator, Sequence

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "data" / "replay-golden.json"
if __name__ == "__main__":  # run as a script to write the figures: the runtime is not installed on that path
    sys.path.insert(0, str(ROOT / "runtime"))

from kvtier_runtime.policies import ADMISSIONS, POLICIES, AccessContext, EvictionPolicy  # noqa: E402
from kvtier_runtime.replay.engine import PolicySpec, replay, replay_single  # noqa: E402
from kvtier_runtime.replay.metrics import flatten, prefix_hit_count  # noqa: E402
from kvtier_runtime.replay.synth import SHAPES, generate  # noqa: E402
from kvtier_runtime.replay.trace import Trace, load_trace  # noqa: E402

SPECS = [str(PolicySpec(e, a)) for e in POLICIES for a in ADMISSIONS]
FIXTURE_REQUESTS = 800  # of each fixture trace: enough reuse for every branch, fast enough for every policy
SHAPE_REQUESTS, SHAPE_SEED = 250, 11
TIER_SETUPS = [  # (policies, capacities in % of distinct blocks, replicas, shared last tier)
    (("adaptive", "s3fifo+doorkeeper"), (2, 10), 1, False),
    (("lru", "adaptive"), (1, 5), 1, False),
    (("arc", "prefix2q+threshold"), (1, 5), 3, True),
    (("adaptive",), (3,), 2, False),
]


def _traces() -> Iterator[tuple[str, list[list[int]]]]:
    for name in ("synthetic", "conversation"):
        trace = load_trace(ROOT / "tests" / "data" / f"mooncake-{name}.jsonl")
        yield name, [list(r) for r in trace.requests[:FIXTURE_REQUESTS]]
    for shape in SHAPES:
        yield shape, [list(r["hash_ids"]) for r in generate(shape, SHAPE_REQUESTS, seed=SHAPE_SEED)]


def _capacities(requests: Sequence[Sequence[int]]) -> list[int]:
    distinct = len({k for r in requests for k in r})
    return [3, max(4, distinct * 2 // 100), max(5, distinct * 10 // 100)]


def _digest(values: Sequence[object]) -> str:
    return hashlib.sha256(",".join(map(str, values)).encode()).hexdigest()[:24]


def _public_evictions(requests: Sequence[Sequence[int]], policy: EvictionPolicy) -> tuple[list[int], list[int]]:
    """replay_single's steps through the public methods; the evicted keys in order and the final contents."""
    evicted: list[int] = []
    for rid, req in enumerate(requests):
        n = len(req)
        for pos, key in enumerate(req):
            ctx = AccessContext(rid, pos, n) if policy.uses_context else None
            if not policy.touch(key, ctx) and policy.admit(key, 1, ctx):
                out = policy.insert(key, 1, ctx)
                assert out is not None, "size 1 always fits when nothing is pinned"
                evicted.extend(out)
    return evicted, sorted(policy)


def _single(requests: Sequence[Sequence[int]], spec: str, cap: int) -> dict[str, object]:
    parsed = PolicySpec.parse(spec)
    hits, stored = replay_single(requests, parsed.build(cap))
    _, lengths = flatten(requests)
    evicted, contents = _public_evictions(requests, parsed.build(cap))
    return {"hits": sum(hits), "prefix_hits": prefix_hit_count(hits, lengths), "stored": stored,
            "hit_flags": _digest([int(h) for h in hits]), "evictions": len(evicted),
            "eviction_order": _digest(evicted), "contents": _digest(contents)}


def _tiers(requests: list[list[int]], policies: Sequence[str], pcts: Sequence[int], replicas: int,
           shared: bool) -> list[list[int]]:
    trace = Trace(requests=requests, timestamps_ms=[0.0] * len(requests), input_lengths=[0] * len(requests),
                  output_lengths=[0] * len(requests))
    distinct = len({k for r in requests for k in r})
    caps = [max(1, distinct * p // 100) for p in pcts]
    res = replay(trace, caps, [PolicySpec.parse(p) for p in policies], with_opt=False, replicas=replicas,
                 shared_last=shared)
    return [[t.hits, t.prefix_hits, t.promotions, t.stored_blocks] for t in res.tiers]


def compute() -> dict[str, object]:
    single: dict[str, object] = {}
    tiers: dict[str, object] = {}
    for name, requests in _traces():
        for cap in _capacities(requests):
            for spec in SPECS:
                single[f"{name} {spec} {cap}"] = _single(requests, spec, cap)
        if name in ("synthetic", "conversation", "chat"):
            for policies, pcts, replicas, shared in TIER_SETUPS:
                key = f"{name} {'/'.join(policies)} {'/'.join(map(str, pcts))}% x{replicas}{' shared' if shared else ''}"
                tiers[key] = _tiers(requests, policies, pcts, replicas, shared)
    return {"single": single, "tiers": tiers}


@pytest.fixture(scope="module")
def golden() -> dict[str, dict[str, object]]:
    return json.loads(GOLDEN.read_text())


def test_the_pinned_figures_cover_every_policy_and_admission(golden) -> None:
    pinned_specs = {key.split(" ")[1] for key in golden["single"]}
    assert pinned_specs == set(SPECS)
    # A digest of a trace that never hits or never evicts would pin little: every policy must do both somewhere.
    for spec in SPECS:
        cells = [v for k, v in golden["single"].items() if k.split(" ")[1] == spec]
        assert any(c["hits"] > 0 for c in cells) and any(c["evictions"] > 0 for c in cells), spec


@pytest.mark.parametrize("trace_name", ["synthetic", "conversation", *SHAPES])
def test_replay_results_are_the_pinned_ones(golden, trace_name) -> None:
    requests = dict(_traces())[trace_name]
    for cap in _capacities(requests):
        for spec in SPECS:
            key = f"{trace_name} {spec} {cap}"
            assert _single(requests, spec, cap) == golden["single"][key], key


def test_tiered_and_shared_replays_are_the_pinned_ones(golden) -> None:
    traces = dict(_traces())
    for name in ("synthetic", "conversation", "chat"):
        for policies, pcts, replicas, shared in TIER_SETUPS:
            key = f"{name} {'/'.join(policies)} {'/'.join(map(str, pcts))}% x{replicas}{' shared' if shared else ''}"
            assert _tiers(traces[name], policies, pcts, replicas, shared) == golden["tiers"][key], key


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {sys.argv[0]} --write  (rewrites {GOLDEN.relative_to(ROOT)})")
    GOLDEN.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN.relative_to(ROOT)}")
