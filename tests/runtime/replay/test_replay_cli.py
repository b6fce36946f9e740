"""`kvtier replay` as a user runs it: options, JSON keys, errors as messages with exit status 2, sweep, analyze."""
from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys

import pytest
from kvtier_runtime.policies import POLICIES
from kvtier_runtime.replay.cli import main
from kvtier_runtime.replay.lru_curve import reuse_distances

ROOT = pathlib.Path(__file__).resolve().parents[3]


def small_trace(tmp_path, n_requests=60, seed=3) -> pathlib.Path:
    """Documents of 2-6 blocks reused with fresh question blocks, in Mooncake's format."""
    rng = random.Random(seed)
    docs = [list(range(d * 10, d * 10 + rng.randrange(2, 6))) for d in range(8)]
    lines, fresh = [], 1000
    for i in range(n_requests):
        ids = docs[rng.randrange(len(docs))] + [fresh]
        fresh += 1
        lines.append(json.dumps({"timestamp": i * 10, "input_length": len(ids) * 16, "output_length": 4,
                                 "hash_ids": ids}))
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_json(capsys, argv) -> dict:
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_documented_keys_per_tier_and_total(capsys, tmp_path) -> None:
    d = run_json(capsys, ["--trace", str(small_trace(tmp_path)), "--block-tokens", "16", "--capacity", "5",
                          "--capacity", "10", "--policy", "lru"])
    assert len(d["tiers"]) == 2
    for part in d["tiers"] + [d["total"]]:
        for key in ("block_hit_ratio", "prefix_hit_ratio", "opt_prefix_hit_ratio"):
            assert 0 <= part[key] <= 1
    assert d["total"]["prefix_hit_ratio"] == pytest.approx(sum(t["prefix_hit_ratio"] for t in d["tiers"]))
    assert d["total"]["capacity_blocks"] == 15


def test_shared_trace_figures_through_the_cli(capsys, mooncake_trace_path) -> None:
    d = run_json(capsys, ["--trace", str(mooncake_trace_path), "--block-tokens", "512", "--policy", "lru",
                          "--capacity", "5%"])
    assert d["total"]["prefix_hit_ratio"] == pytest.approx(0.1548, abs=0.0005)
    assert d["total"]["opt_prefix_hit_ratio"] == pytest.approx(0.3955, abs=0.0005)


def test_cost_model_flags_a_tier_slower_than_recompute(capsys, tmp_path) -> None:
    d = run_json(capsys, ["--trace", str(small_trace(tmp_path)), "--block-tokens", "16", "--capacity", "4",
                          "--capacity", "20", "--model-kv-bytes-per-token", "1000000", "--bandwidth", "100",
                          "--bandwidth", "0.1", "--prefill-tokens-per-s", "10000"])
    fast, slow = d["tiers"]
    assert fast["slower_than_recompute"] is False and slow["slower_than_recompute"] is True
    assert fast["bytes_moved"] == (fast["loaded_blocks"] + fast["stored_blocks"]) * 16 * 1_000_000
    assert fast["estimated_prefill_seconds_saved"] > 0 > slow["estimated_prefill_seconds_saved"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--capacity", "0"], "--capacity"),
    (["--capacity", "150%"], "--capacity"),
    (["--capacity", "lots"], "--capacity"),
    (["--policy", "mru"], "--policy"),
    (["--policy", "lru+always"], "admission"),
    (["--capacity", "3", "--capacity", "4", "--policy", "lru", "--policy", "arc", "--policy", "s3fifo"], "--policy"),
    (["--capacity", "3", "--capacity", "4", "--capacity", "5", "--bandwidth", "1", "--bandwidth", "2"], "--bandwidth"),
    (["--budget-gib", "1", "analyze"], "--budget-gib"),
])
def test_bad_options_are_messages_with_exit_2(capsys, tmp_path, argv, message) -> None:
    assert main(["--trace", str(small_trace(tmp_path))] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_trace_lines_fail_with_the_line_number_or_are_skipped(capsys, tmp_path) -> None:
    path = small_trace(tmp_path)
    lines = path.read_text().splitlines()
    lines.insert(4, '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": "x"}')
    path.write_text("\n".join(lines) + "\n")
    assert main(["--trace", str(path)]) == 2
    assert "small.jsonl:5: hash_ids" in capsys.readouterr().err
    d = run_json(capsys, ["--trace", str(path), "--skip-bad"])
    assert d["skipped_lines"] == 1 and d["requests"] == 60


def test_missing_trace_option_and_file(capsys, tmp_path) -> None:
    assert main([]) == 2
    assert "--trace" in capsys.readouterr().err
    assert main(["--trace", str(tmp_path / "absent.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "option"), [
    (["--block-tokens", "-5"], "--block-tokens"),
    (["--bandwidth", "nan"], "--bandwidth"),
    (["--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s"),
    (["--transfer-latency-us", "-1"], "--transfer-latency-us"),
    (["--model-kv-bytes-per-token", "1.5"], "--model-kv-bytes-per-token"),
    (["summarize"], "invalid choice"),
])
def test_argparse_errors_exit_2(capsys, argv, option) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--trace", "x"] + argv)
    assert exc.value.code == 2
    assert option in capsys.readouterr().err


def test_list_policies_names_them_all(capsys) -> None:
    from kvtier_runtime import config
    from kvtier_runtime.policies import ADMISSIONS, POLICIES

    assert main(["--list-policies"]) == 0
    out = capsys.readouterr().out
    for name in list(POLICIES) + list(ADMISSIONS):
        assert f"  {name}" in out
    assert f"{config.RECOMMENDED_EVICTION_POLICY} (default)" in out


def test_sweep_writes_a_png_with_one_line_per_policy_and_opt(capsys, tmp_path) -> None:
    png = tmp_path / "sweep.png"
    d = run_json(capsys, ["--trace", str(small_trace(tmp_path)), "--sweep", str(png),
                          "--sweep-capacities", "2,5,10%,20"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(d["prefix_hit_ratio"]) == set(POLICIES) | {"OPT"}
    for values in d["prefix_hit_ratio"].values():
        assert len(values) == len(d["capacities_blocks"])
    opt = d["prefix_hit_ratio"]["OPT"]
    assert opt == sorted(opt), "MIN is a stack algorithm: its hits can only grow with capacity"


def test_analyze_reports_reuse_and_recommendations(capsys, tmp_path) -> None:
    d = run_json(capsys, ["analyze", "--trace", str(small_trace(tmp_path)), "--block-tokens", "16",
                          "--model-kv-bytes-per-token", "1000", "--bandwidth", "10", "--prefill-tokens-per-s", "5000"])
    # 60 fresh question blocks are never reused; the document blocks all are.
    assert d["never_reused_fraction"] == pytest.approx(60 / d["distinct_blocks"])
    assert {"p50", "p90"} <= set(d["reuse_distance_blocks"]) and d["reuse_time_ms"]["p50"] > 0
    tops = d["top_prefixes"]
    assert tops[0]["reused_tokens"] >= tops[-1]["reused_tokens"]
    assert len({t["block_id"] // 10 for t in tops}) == len(tops), "one row per document, not per block"
    assert d["recommended_capacity_blocks"] >= 1 and d["recommended_chunk_tokens"] % 16 == 0
    assert d["transfer_slower_than_recompute"] is False


def test_reuse_distance_matches_a_naive_count() -> None:
    rng = random.Random(5)
    keys = [rng.randrange(9) for _ in range(300)]
    naive, last = [], {}
    for i, k in enumerate(keys):
        if k in last:
            naive.append(len(set(keys[last[k] + 1:i]) - {k}))
        last[k] = i
    assert reuse_distances(keys) == naive


def test_runs_as_a_module_without_torch(tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "runtime"))
    code = ("import runpy, sys; sys.argv = ['x', '--trace', sys.argv[1], '--json'];"
            "import kvtier_runtime.replay.cli as c; rc = c.main(sys.argv[1:]);"
            "assert not any(m.split('.')[0] in ('torch', 'kopf') for m in sys.modules); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, str(small_trace(tmp_path))], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, "-m", "kvtier_runtime.replay", "--capacity", "-1", "--trace",
                           str(small_trace(tmp_path))], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "--capacity" in done.stderr
