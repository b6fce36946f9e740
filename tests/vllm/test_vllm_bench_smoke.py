"""kvtier's policies inside vLLM's own CPU offloading manager (bench/vllm_policies.py) still run, at a tiny size
(its ``--smoke`` mode: the trace's first requests, vLLM's LRU and kvtier's default policy), in the env that holds
vLLM 0.33.0; the bench exits non-zero when its table got no row. Its figures are the bench's business."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.manager", reason="vLLM 0.33.0 is not installed here; see .ci/vllm-env")

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "vllm_policies.py"


def test_the_vllm_policies_bench_runs_small_and_prints_a_row_per_policy() -> None:
    out = subprocess.run([sys.executable, "-I", str(BENCH), "--smoke"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split()[:2] for line in out.stdout.splitlines() if line.startswith(("vllm lru", "kvtier"))]
    assert [r[0] for r in rows] == ["vllm", "kvtier"], out.stdout
