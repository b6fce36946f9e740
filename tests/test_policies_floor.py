"""Issue 18's floor: the default policy's prefix hit ratio >= LRU's - 0.005 at 1-30% capacity on EVERY trace.

Traces: the shared Mooncake-style trace (tests/data) and the four generated shapes (conversation with think time,
agent loops over long system prompts, one-shot documents, and their mixture), generated here, not stored.
LRU's ratios come from its stack-distance curve (tests/test_replay_equivalence.py checks it against replay).
"""
from __future__ import annotations

import pytest

from kvtier_runtime import config
from kvtier_runtime.replay.engine import PolicySpec, capacity_blocks, replay_single
from kvtier_runtime.replay.lru_curve import LRUCurve
from kvtier_runtime.replay.metrics import flatten, prefix_hit_count
from kvtier_runtime.replay.synth import SHAPES, generate, write_jsonl
from kvtier_runtime.replay.trace import load_trace

PERCENTS = (1, 2, 5, 10, 20, 30)
FLOOR = 0.005


@pytest.fixture(scope="module", params=("mooncake-synthetic",) + SHAPES)
def trace(request, tmp_path_factory, mooncake_trace):
    if request.param == "mooncake-synthetic":
        return mooncake_trace
    path = tmp_path_factory.mktemp("traces") / f"{request.param}.jsonl"
    write_jsonl(generate(request.param, 3000, seed=1), path)
    return load_trace(path)


def test_the_default_policy_is_never_worse_than_lru(trace) -> None:
    keys, lengths = flatten(trace.requests)
    curve = LRUCurve(keys, lengths)
    n = len(keys)
    short = []
    for pct in PERCENTS:
        cap = capacity_blocks(f"{pct}%", trace.n_distinct)
        hits, _ = replay_single(trace.requests, PolicySpec(config.RECOMMENDED_EVICTION_POLICY).build(cap))
        ratio, lru = prefix_hit_count(hits, lengths) / n, curve.prefix_hit_ratio(cap)
        if ratio < lru - FLOOR:
            short.append(f"{pct}%: {ratio:.4f} < LRU {lru:.4f} - {FLOOR}")
    assert not short, f"{config.RECOMMENDED_EVICTION_POLICY} below the LRU floor on {trace.source}: {short}"


def test_the_floor_test_can_fail(mooncake_trace, tmp_path) -> None:
    # prefix2q (the previous default) is known to lose ~0.06 to LRU on conversations: the check above must see it.
    path = tmp_path / "conversation.jsonl"
    write_jsonl(generate("conversation", 3000, seed=1), path)
    trace = load_trace(path)
    keys, lengths = flatten(trace.requests)
    cap = capacity_blocks("10%", trace.n_distinct)
    hits, _ = replay_single(trace.requests, PolicySpec("prefix2q").build(cap))
    assert prefix_hit_count(hits, lengths) / len(keys) < LRUCurve(keys, lengths).prefix_hit_ratio(cap) - FLOOR
