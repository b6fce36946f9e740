"""`kvtier replay` on a recording of kvtier's own traffic (kvtier_runtime.trace): the sidecar models the recorded
engine unless flags say otherwise, and a rotated recording is read as one trace, in order."""
from __future__ import annotations

import json
import random

import pytest
from kvtier_runtime.replay.cli import main
from kvtier_runtime.trace import META_FILE, TraceRecorder
from plugins.runtime import seq_key

META = {"tokens_per_block": 16, "device_blocks": 1000, "engine": "vllm", "tiers": [
    {"name": "host", "medium": "cpu", "capacity_blocks": 4, "eviction_policy": "lru", "admission": "none"},
    {"name": "nvme", "medium": "disk", "capacity_blocks": 20, "eviction_policy": "s3fifo", "admission": "doorkeeper"},
]}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.01
        return self.t


def record(path, n_requests: int = 80, max_bytes: int = 1 << 20, files: int = 4, meta=META) -> None:
    """Documents of 2-6 chunks, each request one document and a fresh chunk, as the manager would see them."""
    rng = random.Random(5)
    docs = [[seq_key(d * 10 + j) for j in range(rng.randrange(2, 6))] for d in range(8)]
    rec = TraceRecorder(str(path), max_bytes, files, meta, start=False, clock=Clock())
    for i in range(n_requests):
        keys = docs[rng.randrange(len(docs))] + [seq_key(10_000 + i)]
        rec.record(keys, len(keys) * 16)
        rec.flush()
    rec.close()


def run_json(capsys, argv) -> dict:
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_recorded_engine_is_modelled_by_default(capsys, tmp_path) -> None:
    record(tmp_path)
    d = run_json(capsys, ["--trace", str(tmp_path)])
    assert d["model"]["source"] == "recording" and d["model"]["overridden"] == []
    assert d["model"]["replay"] == "recorded engine"
    # vLLM's prefix cache first (1000 GPU blocks less the null block, one chunk each), then the recorded tiers.
    assert [(t["name"], t["capacity_blocks"], t["policy"]) for t in d["tiers"]] == [
        ("device", 999, "vllm prefix cache"), ("host", 4, "lru"), ("nvme", 20, "s3fifo+doorkeeper")]
    assert d["block_tokens"] == 16 and d["requests"] == 80
    assert d["total"]["prefix_hit_ratio"] > 0  # the documents repeat: the recorded tiers serve some of them
    # The first file names the same recording.
    assert run_json(capsys, ["--trace", str(tmp_path / "trace-000.jsonl")])["tiers"] == d["tiers"]


def test_flags_override_the_recording_and_say_so(capsys, tmp_path) -> None:
    record(tmp_path)
    d = run_json(capsys, ["--trace", str(tmp_path), "--capacity", "7", "--policy", "arc", "--block-tokens", "8"])
    assert [(t["capacity_blocks"], t["policy"]) for t in d["tiers"]] == [(7, "arc")]
    assert d["block_tokens"] == 8 and d["model"]["overridden"] == ["--capacity", "--policy", "--block-tokens"]
    assert d["model"]["replay"] == "tiers"  # other capacities: the generic tier model, no device tier
    # Only the policies: the recorded capacities (and the device tier) stay.
    d = run_json(capsys, ["--trace", str(tmp_path), "--policy", "lru"])
    assert [(t["capacity_blocks"], t["policy"]) for t in d["tiers"]] == [
        (999, "vllm prefix cache"), (4, "lru"), (20, "lru")]
    d = run_json(capsys, ["--trace", str(tmp_path), "--no-meta", "--block-tokens", "16"])
    assert d["model"] == {"source": "flags"} and len(d["tiers"]) == 1


def test_the_text_report_names_the_model_it_used(capsys, tmp_path) -> None:
    record(tmp_path)
    assert main(["--trace", str(tmp_path), "--no-opt"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"model: the recorded engine ({tmp_path / META_FILE}): device (vLLM prefix cache) "
                          "999 blocks, host (cpu) 4 blocks lru, "
                          "nvme (disk) 20 blocks s3fifo+doorkeeper; 16 tokens/block")


def test_a_rotated_recording_is_read_in_order_from_the_folder_or_a_file(capsys, tmp_path) -> None:
    record(tmp_path, n_requests=3000, max_bytes=4 * 16 * 1024, files=4)
    names = sorted(p.name for p in tmp_path.glob("trace-*.jsonl"))
    assert len(names) == 4 and names[0] != "trace-000.jsonl"
    lines = [sum(1 for _ in (tmp_path / n).open()) for n in names]
    d = run_json(capsys, ["--trace", str(tmp_path), "--no-opt"])
    assert d["requests"] == sum(lines) and d["trace_files"] == [str(tmp_path / n) for n in names]
    d = run_json(capsys, ["--trace", str(tmp_path / names[1]), "--no-opt"])
    assert d["requests"] == sum(lines[1:])
    err = capsys.readouterr().err
    assert "timestamp earlier" not in err  # file order is time order across the rotated files


def test_an_explicit_meta_file_models_a_trace_without_a_sibling(capsys, tmp_path) -> None:
    record(tmp_path / "rec")
    trace = tmp_path / "copied.jsonl"
    trace.write_text((tmp_path / "rec" / "trace-000.jsonl").read_text())
    assert run_json(capsys, ["--trace", str(trace)])["model"] == {"source": "flags"}
    d = run_json(capsys, ["--trace", str(trace), "--meta", str(tmp_path / "rec" / META_FILE)])
    assert d["model"]["source"] == "recording" and d["block_tokens"] == 16


@pytest.mark.parametrize(("meta", "message"), [
    ({**META, "tokens_per_block": 0}, "tokens_per_block: 0 must be a positive integer"),
    ({**META, "tiers": []}, "tiers: must be a non-empty list"),
    ({**META, "device_blocks": 1}, "device_blocks: 1 must be an integer >= 2"),
    ({**META, "device_block_tokens": -16}, "device_block_tokens: -16 must be a positive integer"),
    ({**META, "tiers": [{"name": "host", "capacity_blocks": "4Gi"}]},
     "tiers[0].capacity_blocks: '4Gi' must be a positive integer"),
])
def test_a_bad_sidecar_is_a_one_line_error_naming_the_field(capsys, tmp_path, meta, message) -> None:
    record(tmp_path)
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    assert main(["--trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_analyze_takes_the_recordings_tokens_per_block_and_says_so(capsys, tmp_path) -> None:
    record(tmp_path)
    assert main(["analyze", "--trace", str(tmp_path), "--policy", "lru", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)
    assert "16 tokens/block -- overridden by --policy (tokens per block only: analyze chooses its own capacities)" \
        in captured.err
    assert "len(hash_ids)" not in captured.err  # input_length is whole chunks: no block-count warning


def test_the_device_tier_moves_no_bytes_and_saves_nothing_for_offloading(capsys, tmp_path) -> None:
    record(tmp_path)
    d = run_json(capsys, ["--trace", str(tmp_path), "--model-kv-bytes-per-token", "1024", "--bandwidth", "10",
                          "--prefill-tokens-per-s", "1000", "--no-opt"])
    device, *offload = d["tiers"]
    assert device["name"] == "device" and device["bytes_moved"] is None
    assert "estimated_prefill_seconds_saved" not in device
    assert d["total"]["bytes_moved"] == sum(t["bytes_moved"] for t in offload)
    assert d["total"]["estimated_prefill_seconds_saved"] == pytest.approx(
        sum(t["estimated_prefill_seconds_saved"] for t in offload))
