"""The pure logic of bench/trace_overhead.py: the request rule, the recording check and the TTFT summary.

The recording check runs against the runtime's own TraceRecorder (no engine): rotated with small files, read the
way the bench reads it, then broken in the ways the check must catch. Nothing here is timed."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib
import sys

import pytest
from kvtier_runtime.trace import TraceRecorder

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load("bench_trace_overhead", ROOT / "bench" / "trace_overhead.py")
tables = _load("bench_tables", ROOT / "bench" / "tables.py")


def chained_keys(ids: tuple[int, ...]) -> list[bytes]:
    """What vLLM hands the manager: one key per block, chained to its parent (a prefix's key)."""
    return [hashlib.sha256(repr(ids[:k + 1]).encode()).digest() for k in range(len(ids))]


REQUESTS = [(1, 2, 3), (1, 2, 4), (1, 2, 3, 5), (7, 8), (1, 9)] * 12


def record(tmp_path: pathlib.Path, requests, *, max_bytes=2048, files=2, poll=True, skip=None):
    rec = TraceRecorder(str(tmp_path / "trace"), max_bytes, files, start=False)
    watch = bench.RecordingWatch(tmp_path / "trace")
    for n, ids in enumerate(requests):
        if n != skip:
            rec.record(chained_keys(ids), len(ids) * bench.BLOCK_TOKENS)
        rec.flush()
        if poll:
            watch.poll()
    sizes = watch.final()
    rec.close()
    return watch, sizes


def test_a_rotated_recording_of_every_request_passes_and_says_what_rotation_deleted(tmp_path) -> None:
    watch, sizes = record(tmp_path, REQUESTS)
    got = bench.verify_recording(REQUESTS, watch.files, sizes, 2048, 2)
    assert got["requests"] == len(REQUESTS)
    assert got["files_deleted"] >= 1, "the sizes here must make rotation delete a file"
    assert got["bytes_on_disk"] == sum(sizes.values()) <= 2048
    assert got["bytes_written"] > 2048
    assert 0 < got["requests_on_disk"] < len(REQUESTS)
    on_disk_lines = sum((tmp_path / "trace" / f"trace-{i:03d}.jsonl").read_bytes().count(b"\n") for i in sizes)
    assert got["requests_on_disk"] == on_disk_lines


def test_a_missing_request_fails(tmp_path) -> None:
    watch, sizes = record(tmp_path, REQUESTS, skip=17)
    with pytest.raises(bench.RecordingError, match=f"{len(REQUESTS)} requests sent, {len(REQUESTS) - 1} recorded"):
        bench.verify_recording(REQUESTS, watch.files, sizes, 2048, 2)


def test_ids_that_do_not_follow_the_prompts_prefixes_fail(tmp_path) -> None:
    watch, sizes = record(tmp_path, REQUESTS)
    # Requests 0 and 1 swapped (same lengths): the ids of their last blocks swap too, which is consistent until
    # request 2 extends (1, 2, 3) -- recorded with the id the check now holds for (1, 2, 4).
    sent = [REQUESTS[1], REQUESTS[0], *REQUESTS[2:]]
    with pytest.raises(bench.RecordingError, match="request 2, block 2: recorded id 2 does not match"):
        bench.verify_recording(sent, watch.files, sizes, 2048, 2)


def test_a_wrong_block_count_fails(tmp_path) -> None:
    watch, sizes = record(tmp_path, REQUESTS)
    sent = [REQUESTS[0] + (6,), *REQUESTS[1:]]
    with pytest.raises(bench.RecordingError, match="request 0: 4 blocks sent, recorded input_length 96 with 3 ids"):
        bench.verify_recording(sent, watch.files, sizes, 2048, 2)


def test_files_over_the_bound_fail(tmp_path) -> None:
    watch, sizes = record(tmp_path, REQUESTS)
    with pytest.raises(bench.RecordingError, match="trace_max_bytes is 1024"):
        bench.verify_recording(REQUESTS, watch.files, sizes, 1024, 2)
    with pytest.raises(bench.RecordingError, match="trace files on disk, trace_files is 1"):
        bench.verify_recording(REQUESTS, watch.files, sizes, 2048, 1)


def test_a_file_deleted_before_the_bench_read_it_is_reported_not_passed(tmp_path) -> None:
    watch, sizes = record(tmp_path, REQUESTS, poll=False)
    with pytest.raises(bench.RecordingError, match=r"trace files \[0"):
        bench.verify_recording(REQUESTS, watch.files, sizes, 2048, 2)


def test_requests_are_the_busiest_families_cut_and_repeated_in_file_order(tmp_path) -> None:
    rows = [[1, 2, 3], [5, 6], [1, 2, 4, 8], [9], [5, 7], [1]]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 32 * len(h), "output_length": 1,
                                        "hash_ids": h}) + "\n" for i, h in enumerate(rows)) + "\n")
    # Family 1 has three requests, family 5 two, family 9 one: the two busiest are 1 and 5.
    assert bench.workload(path, families=2, max_blocks=3, n_requests=7) == [
        (1, 2, 3), (5, 6), (1, 2, 4), (5, 7), (1,), (1, 2, 3), (5, 6)]
    path.write_text('{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1]}\n{"hash": [2]}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: "):  # the replay's reader names the line and the field
        bench.workload(path, families=2, max_blocks=3, n_requests=1)


def test_a_prompt_shares_the_tokens_of_the_blocks_it_shares_and_ends_in_a_partial_block() -> None:
    corpus = list(range(1703))  # token ids of a corpus as long as the prose's (the tokenizer is not needed here)
    a, b = bench.prompt(corpus, (1, 2, 3), 0), bench.prompt(corpus, (1, 2, 4), 1)
    assert a[:64] == b[:64] and a[64:96] != b[64:96]
    assert len(a) % bench.BLOCK_TOKENS != 0 and len(a) // bench.BLOCK_TOKENS == 3


def test_ttft_summary_ratios_are_on_over_off() -> None:
    off = [i / 1000 for i in range(1, 101)]
    on = [2 * x for x in off]
    s = bench.ttft_summary(off, on)
    assert s["p50_ratio"] == pytest.approx(2.0) and s["p99_ratio"] == pytest.approx(2.0)
    assert s["paired_ratio"] == pytest.approx(2.0)
    assert s["p50_off"] == pytest.approx(0.0505) and s["p99_off"] == pytest.approx(0.09901)
    with pytest.raises(ValueError, match="same, non-zero number of samples"):
        bench.ttft_summary(off, on[:-1])


def test_percentile_interpolates_and_refuses_what_it_cannot_compute() -> None:
    xs = list(range(1, 102))
    assert tables.percentile(xs, 50) == 51 and tables.percentile(xs, 99) == 100
    assert tables.percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError, match="q: 100 must be an integer from 1 to 99"):
        tables.percentile(xs, 100)
    with pytest.raises(ValueError, match="at least one sample"):
        tables.percentile([], 50)


def test_runs_alternate_in_abba_order_one_engine_at_a_time() -> None:
    assert bench.run_order(3) == [(1, "off"), (1, "on"), (2, "on"), (2, "off"), (3, "off"), (3, "on")]
    with pytest.raises(ValueError, match="rounds: 0 must be at least 1"):
        bench.run_order(0)


def test_the_overall_ratio_is_the_median_of_the_rounds_ratios() -> None:
    rounds = [bench.ttft_summary([0.1, 0.2, 0.3], [f * x for x in (0.1, 0.2, 0.3)]) for f in (1.0, 1.5, 1.1)]
    o = bench.overall_summary(rounds)
    assert o["p50_ratio"] == pytest.approx(1.1) and o["p99_ratio"] == pytest.approx(1.1)
    assert o["paired_ratio"] == pytest.approx(1.1)
    with pytest.raises(ValueError, match="no round"):
        bench.overall_summary([])


def test_the_table_has_one_cell_per_column_a_row_per_round_and_the_overall_row() -> None:
    rounds = [(1, "off, on", bench.ttft_summary([0.1, 0.2, 0.3], [0.1, 0.2, 0.3]),
               {"requests": 4, "requests_on_disk": 2, "bytes_written": 900, "bytes_on_disk": 400, "files_deleted": 1}),
              (2, "on, off", bench.ttft_summary([0.1, 0.2, 0.3], [0.2, 0.4, 0.6]),
               {"requests": 4, "requests_on_disk": 3, "bytes_written": 900, "bytes_on_disk": 450, "files_deleted": 1})]
    head, sep, *rows = bench.table(rounds, 3, 512, 2).splitlines()
    assert len(rows) == 3
    assert all(head.count("|") == sep.count("|") == row.count("|") for row in rows)
    names = [c.strip() for c in head.split("|")]
    first, second, overall = ([c.strip() for c in row.split("|")] for row in rows)
    cells = dict(zip(names, first))
    assert cells["timed requests"] == "3" and cells["recorded (warm-up included)"] == "4 (last 2 on disk)"
    assert cells["p50 on/off"] == "1.000" and cells["on disk / trace_max_bytes"] == "400 / 512 (2 files)"
    assert dict(zip(names, second))["p50 on/off"] == "2.000" and dict(zip(names, second))["order"] == "on, off"
    cells = dict(zip(names, overall))
    assert cells["round"] == "all (2)" and cells["p50 on/off"] == "1.500"  # the median of 1.0 and 2.0
    assert cells["on disk / trace_max_bytes"] == "at most 450 / 512"
