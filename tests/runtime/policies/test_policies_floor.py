"""The recommended policy's floor: prefix hit ratio >= LRU's - 0.005 at 1-30% capacity on EVERY trace.

Traces: the shared Mooncake synthetic trace, every generated shape (conversation with think time, agent loops over
long system prompts, one-shot documents, their mixture, fast multi-turn chat, system-prompt-heavy traffic, and a
mixture whose shares drift), and Mooncake's real conversation trace. The last was never used to design or tune
the policy's model (issue 25 measured the old adaptive 0.009 below LRU on it at 20%); it is the held-out check
that the hedge against recency holds on real traffic. LRU's ratios come from its stack-distance curve
(tests/runtime/replay/test_replay_cli_sizing.py checks it against replay).
"""
from __future__ import annotations

import pathlib

import pytest
from kvtier_runtime import config
from kvtier_runtime.policies import AdaptivePolicy
from kvtier_runtime.replay.engine import PolicySpec, capacity_blocks, replay_single
from kvtier_runtime.replay.lru_curve import LRUCurve
from kvtier_runtime.replay.metrics import flatten, prefix_hit_count
from kvtier_runtime.replay.synth import SHAPES, generate, write_jsonl
from kvtier_runtime.replay.trace import Trace, load_trace

PERCENTS = (1, 2, 5, 10, 20, 30)
FLOOR = 0.005
HELD_OUT = pathlib.Path(__file__).resolve().parents[2] / "data" / "mooncake-conversation.jsonl"


@pytest.fixture(scope="module")
def held_out() -> Trace:
    assert HELD_OUT.is_file(), f"{HELD_OUT} is missing: it is part of the repository (git checkout -- tests/data)"
    return load_trace(HELD_OUT)


@pytest.fixture(scope="module", params=("mooncake-synthetic", "mooncake-conversation") + SHAPES)
def trace(request, tmp_path_factory, mooncake_trace):
    if request.param == "mooncake-synthetic":
        return mooncake_trace
    if request.param == "mooncake-conversation":
        return request.getfixturevalue("held_out")
    path = tmp_path_factory.mktemp("traces") / f"{request.param}.jsonl"
    write_jsonl(generate(request.param, 3000, seed=1), path)
    return load_trace(path)


def _short_of_lru(trace: Trace, build, percents=PERCENTS) -> list[str]:
    keys, lengths = flatten(trace.requests)
    curve = LRUCurve(keys, lengths)
    short = []
    for pct in percents:
        cap = capacity_blocks(f"{pct}%", trace.n_distinct)
        hits, _ = replay_single(trace.requests, build(cap))
        ratio, lru = prefix_hit_count(hits, lengths) / len(keys), curve.prefix_hit_ratio(cap)
        if ratio < lru - FLOOR:
            short.append(f"{pct}%: {ratio:.4f} < LRU {lru:.4f} - {FLOOR}")
    return short


def test_the_default_policy_is_never_worse_than_lru(trace) -> None:
    short = _short_of_lru(trace, PolicySpec(config.RECOMMENDED_EVICTION_POLICY).build)
    assert not short, f"{config.RECOMMENDED_EVICTION_POLICY} below the LRU floor on {trace.source}: {short}"


def test_the_floor_test_can_fail(tmp_path) -> None:
    # prefix2q (an earlier default) is known to lose ~0.06 to LRU on conversations: the check above must see it.
    path = tmp_path / "conversation.jsonl"
    write_jsonl(generate("conversation", 3000, seed=1), path)
    assert _short_of_lru(load_trace(path), PolicySpec("prefix2q").build, percents=(10,))


class _Unhedged(AdaptivePolicy):
    """adaptive as it was before the hedge: the learned weights always fully trusted."""

    hedge_step = 0.0


def test_without_the_hedge_the_model_falls_below_lru_on_the_held_out_trace(held_out) -> None:
    # What issue 25 measured (0.3354 against LRU 0.3446 at 20%): the hedge, not luck, holds the floor above.
    assert _short_of_lru(held_out, _Unhedged, percents=(20,))
