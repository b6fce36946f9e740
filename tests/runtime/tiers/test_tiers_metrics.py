"""What every tier counts alike (kvtier_runtime.tiers.metrics): capacity, occupancy, evictions, the engine's lookups
and hits, promotions (out of the tier) and demotions (into it), labelled as the dashboard reads them."""
from __future__ import annotations

import torch
from kvtier_runtime.config import FilesystemTierConfig
from kvtier_runtime.fs.tier import FilesystemTier
from kvtier_runtime.tiers.metrics import TierMetrics
from plugins.runtime import metric_value


def test_moves_are_labelled_source_then_destination_and_lookups_count_hits_only_when_found() -> None:
    m = TierMetrics("metrics-unit", 4096)
    assert metric_value("kvtier_runtime_capacity_bytes", tier="metrics-unit") == 4096
    m.occupancy(1024)
    m.evicted(2)
    m.probed(True)
    m.probed(False)
    m.promoted("hostA", 300, 0.01, n=3)
    m.demoted("hostA", 100, 0.01)
    assert metric_value("kvtier_runtime_occupancy_bytes", tier="metrics-unit") == 1024
    assert metric_value("kvtier_runtime_evictions_total", tier="metrics-unit") == 2
    assert (metric_value("kvtier_runtime_lookups_total", tier="metrics-unit"),
            metric_value("kvtier_runtime_hits_total", tier="metrics-unit")) == (2, 1)
    assert metric_value("kvtier_runtime_promotions_total", src="metrics-unit", dst="hostA") == 3
    assert metric_value("kvtier_runtime_demotions_total", src="hostA", dst="metrics-unit") == 1
    assert metric_value("kvtier_runtime_bytes_moved_total", src="metrics-unit", dst="hostA") == 300
    assert metric_value("kvtier_runtime_bytes_moved_total", src="hostA", dst="metrics-unit") == 100


def test_a_filesystem_tier_counts_its_write_as_a_demotion_and_its_read_as_a_promotion(tmp_path) -> None:
    tier = FilesystemTier(FilesystemTierConfig(root_dir=str(tmp_path), capacity_bytes=1 << 20), (256,),
                          torch.float32, name="metrics-fs", peer="hostB")
    try:
        tier.submit_store([b"key-1"], [torch.ones(256)])
        tier.drain()
        out = torch.zeros(256)
        tier.submit_load([b"key-1"], [out])
        tier.drain()
        assert [r.success for r in tier.get_finished()] == [True, True] and bool(out.eq(1).all())
    finally:
        tier.close()
    assert metric_value("kvtier_runtime_demotions_total", src="hostB", dst="metrics-fs") == 1
    assert metric_value("kvtier_runtime_promotions_total", src="metrics-fs", dst="hostB") == 1
    assert metric_value("kvtier_runtime_bytes_moved_total", src="metrics-fs", dst="hostB") == 1024


def test_a_move_is_counted_from_the_side_of_the_tier_whichever_direction() -> None:
    m = TierMetrics("metrics-moved", 4096)
    m.moved("metrics-moved", "hostC", 400, 0.01, 4)  # out of the tier: a promotion into hostC
    m.moved("hostC", "metrics-moved", 200, 0.01, 2)  # into the tier: a demotion from hostC
    assert metric_value("kvtier_runtime_promotions_total", src="metrics-moved", dst="hostC") == 4
    assert metric_value("kvtier_runtime_demotions_total", src="hostC", dst="metrics-moved") == 2
    assert metric_value("kvtier_runtime_bytes_moved_total", src="metrics-moved", dst="hostC") == 400
    assert metric_value("kvtier_runtime_bytes_moved_total", src="hostC", dst="metrics-moved") == 200
    m.looked_up(5, 3)
    assert (metric_value("kvtier_runtime_lookups_total", tier="metrics-moved"),
            metric_value("kvtier_runtime_hits_total", tier="metrics-moved")) == (5, 3)
