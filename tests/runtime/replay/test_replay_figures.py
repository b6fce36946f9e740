"""Issue 8's reference figures on the shared trace, reproduced within 0.0005, through the runtime's own classes."""
from __future__ import annotations

import pytest
from kvtier_runtime.replay.engine import PolicySpec, capacity_blocks, replay

# (capacity as given, blocks it must resolve to, LRU prefix hit ratio, OPT prefix hit ratio)
FIGURES = [("5%", 2196, 0.1548, 0.3955), ("10%", 4392, 0.2598, 0.5063)]


@pytest.mark.parametrize(("capacity", "blocks", "lru", "opt"), FIGURES)
def test_lru_and_opt_prefix_hit_ratios(mooncake_trace, capacity, blocks, lru, opt) -> None:
    cap = capacity_blocks(capacity, mooncake_trace.n_distinct)
    assert cap == blocks
    res = replay(mooncake_trace, [cap], [PolicySpec("lru")])
    tier = res.tiers[0]
    assert res.ratio(tier.prefix_hits) == pytest.approx(lru, abs=0.0005)
    assert res.ratio(tier.opt_prefix_hits) == pytest.approx(opt, abs=0.0005)
    # OPT maximises block hits, so no online policy may beat its block hit ratio.
    assert tier.hits <= tier.opt_hits


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["arc", "s3fifo", "prefix2q", "s3fifo+doorkeeper", "lru+threshold"])
def test_every_policy_stays_under_opt_block_hits(mooncake_trace, policy) -> None:
    res = replay(mooncake_trace, [2196], [PolicySpec.parse(policy)])
    assert 0 < res.tiers[0].hits <= res.tiers[0].opt_hits


def test_the_recommended_policy_beats_lru_on_the_shared_trace(mooncake_trace) -> None:
    from kvtier_runtime import config

    for blocks in (2196, 4392):
        lru = replay(mooncake_trace, [blocks], [PolicySpec("lru")], with_opt=False)
        default = replay(mooncake_trace, [blocks], [PolicySpec(config.RECOMMENDED_EVICTION_POLICY)], with_opt=False)
        assert default.total_prefix_hits > lru.total_prefix_hits


def test_two_tiers_add_up_and_promote(mooncake_trace) -> None:
    res = replay(mooncake_trace, [1000, 4000], [PolicySpec("lru"), PolicySpec("s3fifo")])
    t1, t2 = res.tiers
    assert t2.promotions == t2.hits > 0
    assert res.total_hits == t1.hits + t2.hits
    single_opt = replay(mooncake_trace, [5000], [PolicySpec("lru")])
    assert res.total_opt_prefix_hits == single_opt.tiers[0].opt_prefix_hits
    assert res.total_prefix_hits <= res.total_hits
