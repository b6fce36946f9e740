"""The tier registry (kvtier_runtime.tiers.registry): the vLLM spec builds its tiers by medium, and every registered
tier answers the books' questions (kvtier_runtime.tiers.Tier) consistently with its medium."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvtier_runtime.config import FilesystemTierConfig
from kvtier_runtime.tiers import KeyState, Tier, registry
from kvtier_runtime.tiers.registry import MEDIA, TierPlan, build_tier, build_tiers, tier_class


def test_a_filesystem_tier_built_by_medium_is_a_tier_the_books_can_drive(tmp_path) -> None:
    cfg = FilesystemTierConfig(root_dir=str(tmp_path), capacity_bytes=1 << 20)
    tier = build_tier("filesystem", cfg, (256,), torch.float32, name="nvme")
    try:
        assert isinstance(tier, Tier) and tier.medium == "filesystem" and tier.name == "nvme"
        key = b"k" * 8
        assert tier.probe(key) is KeyState.MISS and tier.needs_store(key) and not tier.covers(key)
        job = tier.submit_store([key], [torch.ones(256)])
        tier.drain()
        assert [r.job_id for r in tier.get_finished()] == [job]
        assert tier.probe(key) is KeyState.HIT and not tier.needs_store(key) and tier.covers(key)
    finally:
        tier.close()


def test_each_medium_names_its_own_class_and_what_the_books_ask_is_declared_on_it() -> None:
    assert MEDIA == ("filesystem", "remote")
    declared = ("medium", "origin", "scoped_keys", "logs_load_faults", "io_timeout_s", "capacity_bytes",
                "used_bytes", "probe", "needs_store", "covers", "submit_store", "submit_load", "get_finished",
                "close")
    for medium in MEDIA:
        cls = tier_class(medium)
        assert cls.medium == medium
        assert [name for name in declared if not hasattr(cls, name)] == []
    # A remote tier shares its store with other replicas: raw keys, presence only as a hint.
    assert (tier_class("remote").scoped_keys, tier_class("filesystem").scoped_keys) == (True, False)


@pytest.mark.parametrize("medium", ["cpu", "", None, "Filesystem"])
def test_an_unknown_medium_is_refused_naming_the_known_ones(medium) -> None:
    with pytest.raises(ValueError, match=r"medium: .* is not a tier medium; known: filesystem, remote"):
        tier_class(medium)  # type: ignore[arg-type]


def test_importing_the_registry_imports_no_tier_module() -> None:
    """An engine without a remote tier never imports redis-py; nothing here needs torch until a tier is built."""
    code = ("import sys, kvtier_runtime.tiers.registry; "
            "print(sorted(m for m in sys.modules if m in ('torch', 'redis', 'kvtier_runtime.fs.tier', "
            "'kvtier_runtime.remote.tier')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": "runtime"}, cwd=str(Path(__file__).resolve().parents[3]))
    assert out.stdout.strip() == "[]"


def test_build_tiers_keeps_the_plans_order_and_closes_what_it_built_when_one_fails(tmp_path) -> None:
    plans = [TierPlan("filesystem", FilesystemTierConfig(root_dir=str(tmp_path / name), capacity_bytes=1 << 20),
                      (256,), torch.float32, {"name": name}) for name in ("nvme", "hdd")]
    tiers = build_tiers(plans)
    try:
        assert [t.name for t in tiers] == ["nvme", "hdd"]
    finally:
        for tier in tiers:
            tier.close()
    built: list[Tier] = []
    real = registry.build_tier

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "build_tier", spy)
        with pytest.raises(ValueError, match="medium: 'tape' is not a tier medium"):
            build_tiers([plans[0], TierPlan("tape", None, (256,), torch.float32)])
    (first,) = built
    with pytest.raises(RuntimeError, match="the filesystem tier is closed"):
        first.submit_store([b"k" * 8], [torch.ones(256)])
