"""The side-by-side benchmark of kvtier's fs tier and vLLM's own (bench/fs_vs_vllm.py), run small: both tiers,
built by vLLM's SecondaryTierFactory, round-trip every byte through vLLM's job API, with and without the MAC.
Timing figures are the benchmark's job (docs/performance.md), not this test's."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is not installed here; see .ci/vllm-env")

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "fs_vs_vllm.py"


def _bench():
    spec = importlib.util.spec_from_file_location("fs_vs_vllm", _BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fs_vs_vllm"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_both_tiers_round_trip_every_byte_through_vllms_job_api(tmp_path):
    bench = _bench()
    rows = bench.compare(base_dir=str(tmp_path), chunk_sizes=(256 << 10,), bytes_per_round=2 << 20, rounds=2,
                         variants=("crc", "mac"), threads=2)
    assert {(r.variant, r.op) for r in rows} == {("crc", "write"), ("crc", "read"), ("mac", "write"), ("mac", "read")}
    assert all(r.vllm_gbs > 0 and r.kvtier_gbs > 0 and r.ratio > 0 for r in rows)
    assert list(tmp_path.iterdir()) == [], "the benchmark removes what it wrote"
