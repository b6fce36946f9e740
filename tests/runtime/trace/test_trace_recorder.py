"""The traffic recorder (kvtier_runtime.trace): a Mooncake-format trace replay can read, ids that reveal nothing
and cannot be linked across recordings, bounded files under a flood, and an engine side that never waits."""
from __future__ import annotations

import json
import os
import threading

import pytest
from kvtier_runtime.replay.trace import load_meta, load_trace, load_traces, recording_files
from kvtier_runtime.trace import META_FILE, TraceRecorder
from kvtier_runtime.trace.recorder import TRACE_FILE
from plugins.runtime import seq_key

META = {"tokens_per_block": 16, "device_blocks": None, "engine": "vllm",
        "tiers": [{"name": "host", "medium": "cpu", "capacity_blocks": 8, "eviction_policy": "lru",
                   "admission": "none"}]}
MiB = 1 << 20


class Clock:
    """A manual clock: timestamps in the trace are exactly what the test says."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _recorder(path, **options) -> TraceRecorder:
    options = {"start": False, "meta": META, **options}
    return TraceRecorder(str(path), options.pop("max_bytes", MiB), options.pop("files", 4), **options)


def _lines(path) -> list[dict]:
    files, _ = recording_files(path)
    return [json.loads(line) for f in files for line in f.read_text().splitlines() if line]


def test_a_recording_is_a_mooncake_trace_with_prefix_ids_in_first_appearance_order(tmp_path) -> None:
    clock = Clock()
    rec = _recorder(tmp_path, clock=clock)
    shared = [seq_key(7), seq_key(3)]
    rec.record(shared + [seq_key(11)], 48)
    clock.t += 0.25
    rec.record(shared + [seq_key(12), seq_key(13)], 64)
    rec.close()
    lines = _lines(tmp_path)
    assert lines == [
        {"timestamp": 0.0, "input_length": 48, "output_length": 0, "hash_ids": [0, 1, 2]},
        {"timestamp": 250.0, "input_length": 64, "output_length": 0, "hash_ids": [0, 1, 3, 4]},
    ]
    trace = load_trace(tmp_path / "trace-000.jsonl")
    assert trace.requests == [[0, 1, 2], [0, 1, 3, 4]] and trace.input_lengths == [48, 64]


def test_a_recording_writes_the_prompt_length_sent_and_the_tokens_each_tier_served(tmp_path) -> None:
    """A prompt of two whole 16-token chunks and a 5-token tail is recorded as 37 tokens (what was sent) with two
    ids; replay reads it without a block-count warning (kvtier's ids are whole chunks only), and the tokens each
    tier served are on the line."""
    from kvtier_runtime.replay.trace import trace_warnings

    rec = _recorder(tmp_path, clock=Clock())
    rec.record([seq_key(1), seq_key(2)], 37, hit_tokens={"host": 16, "disk": 16})
    rec.record([seq_key(1)], 20, hit_tokens={})
    rec.close()
    assert [(d["input_length"], d["hit_tokens"]) for d in _lines(tmp_path)] == [
        (37, {"host": 16, "disk": 16}), (20, {})]
    trace = load_trace(tmp_path / "trace-000.jsonl")
    assert trace.input_lengths == [37, 20] and trace_warnings(trace, 16) == []
    # A wrong --block-tokens still shows: 37 tokens are neither 1 nor 2 blocks of 8.
    assert any("block-tokens 8" in w for w in trace_warnings(trace, 8))


def test_ids_are_stable_within_a_recording_and_unlinkable_across_two(tmp_path) -> None:
    keys = [seq_key(i) for i in range(50)]
    order = [keys[(7 * i) % 50] for i in range(50)]
    seen = []
    for run in ("a", "b"):
        rec = _recorder(tmp_path / run)
        rec.record(keys, 50 * 16)
        rec.record(order, 50 * 16)
        rec.close()
        seen.append(_lines(tmp_path / run))
    for lines in seen:
        # Within a recording: one key, one id, so the second request's ids are the first's permuted likewise.
        assert lines[1]["hash_ids"] == [lines[0]["hash_ids"][(7 * i) % 50] for i in range(50)]
    # The ids themselves are first-appearance numbers (no hash leaks into the file) ...
    assert seen[0][0]["hash_ids"] == seen[1][0]["hash_ids"] == list(range(50))
    # ... and the keyed digests behind them differ between recordings (a fresh os.urandom key each time).
    a, b = _recorder(tmp_path / "c"), _recorder(tmp_path / "d")
    a.record([keys[0]], 16)
    b.record([keys[0]], 16)
    a.flush()
    b.flush()
    assert set(a._ids) != set(b._ids) and a._key != b._key
    a.close()
    b.close()
    for name in os.listdir(tmp_path / "c"):  # the key is never written
        assert a._key not in (tmp_path / "c" / name).read_bytes()


def test_a_flood_rotates_files_and_stays_within_the_byte_bound(tmp_path) -> None:
    max_bytes, files = 256 * 1024, 4
    rec = _recorder(tmp_path, max_bytes=max_bytes, files=files, queue_max=1 << 20)
    for i in range(4000):
        rec.record([seq_key(i * 40 + j) for j in range(40)], 40 * 16)
        if i % 100 == 0:
            rec.flush()
            names = [n for n in os.listdir(tmp_path) if TRACE_FILE.match(n)]
            assert len(names) <= files
            assert sum(os.path.getsize(tmp_path / n) for n in names) <= max_bytes
    rec.close()
    names = sorted(n for n in os.listdir(tmp_path) if TRACE_FILE.match(n))
    assert len(names) == files and names[0] != "trace-000.jsonl"  # the oldest were deleted
    assert sum(os.path.getsize(tmp_path / n) for n in names) <= max_bytes
    trace = load_traces(recording_files(tmp_path)[0])
    assert trace.out_of_order == 0 and len(trace.requests) < 4000
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["files"] == names and meta["requests_written"] == 4000


def test_a_full_queue_drops_and_counts_without_waiting(tmp_path) -> None:
    rec = _recorder(tmp_path, queue_max=10)  # no writer thread: nothing drains the queue
    done = threading.Event()

    def engine() -> None:
        for i in range(100):
            rec.record([seq_key(i)], 16)
        done.set()

    thread = threading.Thread(target=engine)
    thread.start()
    assert done.wait(5.0), "record() blocked on a full queue"
    thread.join()
    assert rec.dropped_queue_full == 90
    rec.close()
    assert len(_lines(tmp_path)) == 10
    assert json.loads((tmp_path / META_FILE).read_text())["requests_dropped"]["queue_full"] == 90


def test_the_sidecar_describes_the_engine_and_replay_reads_it(tmp_path) -> None:
    rec = _recorder(tmp_path)
    rec.record([seq_key(1)], 16)
    rec.close()
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["format"] == "mooncake" and meta["recorder_version"] == 1
    assert meta["tokens_per_block"] == 16 and meta["device_blocks"] is None
    assert meta["tiers"] == META["tiers"] and meta["requests_written"] == 1
    model = load_meta(tmp_path / META_FILE)
    assert (model.tokens_per_block, model.capacities, model.policies, model.names) == (16, [8], ["lru"], ["host"])


def test_the_writer_thread_writes_without_a_flush_call_and_close_is_idempotent(tmp_path) -> None:
    rec = _recorder(tmp_path, start=True, flush_interval_s=0.01)
    rec.record([seq_key(1), seq_key(2)], 32)
    for _ in range(500):
        if (tmp_path / "trace-000.jsonl").stat().st_size:
            break
        threading.Event().wait(0.01)
    assert len(_lines(tmp_path)) == 1
    rec.close()
    rec.close()


def test_a_new_recording_replaces_an_earlier_one_in_the_folder(tmp_path) -> None:
    (tmp_path / "trace-007.jsonl").write_text("old\n")
    (tmp_path / "keep.txt").write_text("not ours\n")
    rec = _recorder(tmp_path)
    rec.close()
    assert sorted(os.listdir(tmp_path)) == sorted(["keep.txt", META_FILE, "trace-000.jsonl"])


def test_a_line_larger_than_a_file_is_dropped_and_counted(tmp_path) -> None:
    rec = _recorder(tmp_path, max_bytes=4 * 64 * 1024, files=4)
    rec.record([seq_key(i) for i in range(20000)], 20000 * 16)
    rec.record([seq_key(1)], 16)
    rec.close()
    assert len(_lines(tmp_path)) == 1 and rec.dropped["too_large"] == 1


@pytest.mark.parametrize(("extra", "message"), [
    ({"trace_dir": "traces"}, "kv_connector_extra_config.trace_dir: 'traces' must be an absolute path"),
    ({"trace_dir": "/t", "trace_files": 0}, "kv_connector_extra_config.trace_files: 0 must be an integer from 1"),
    ({"trace_dir": "/t", "trace_max_bytes": 1 << 40},
     "kv_connector_extra_config.trace_max_bytes: 1099511627776 must be an integer from"),
    ({"trace_dir": "/t", "trace_files": 8, "trace_max_bytes": 8 * 1024},
     "kv_connector_extra_config.trace_max_bytes: 8192 must be an integer from 524288"),
])
def test_trace_config_errors_name_the_key(extra, message) -> None:
    from kvtier_runtime.config import ConfigError, OffloadSpecConfig

    with pytest.raises(ConfigError) as err:
        OffloadSpecConfig.from_extra_config({"cpu_bytes_to_use": 1, **extra})
    assert str(err.value).startswith(message)


def test_trace_config_round_trips_and_stays_absent_when_off() -> None:
    from kvtier_runtime.config import OffloadSpecConfig

    off = OffloadSpecConfig.from_extra_config({"cpu_bytes_to_use": 1})
    assert off.trace_dir is None and "trace_dir" not in off.to_extra_config()
    on = OffloadSpecConfig.from_extra_config({"cpu_bytes_to_use": 1, "trace_dir": "/var/kvtier/trace",
                                              "trace_files": 2, "trace_max_bytes": 4 * MiB})
    assert OffloadSpecConfig.from_extra_config(on.to_extra_config()) == on
    assert on.to_extra_config()["trace_files"] == 2


def test_a_folder_that_cannot_be_made_fails_at_start(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        _recorder(tmp_path / "file" / "trace")


# A process that records through the writer thread, waits until its requests are flushed, and is then SIGKILLed,
# as vLLM's front end kills its engine core on SIGTERM (no close(), no atexit, no finally).
_KILLED_RECORDER = """
import os, signal, sys, time
from kvtier_runtime.trace import TraceRecorder
rec = TraceRecorder(sys.argv[1], 1 << 20, 2, {"tokens_per_block": 16, "tiers": [
    {"name": "host", "medium": "cpu", "capacity_blocks": 8}]}, flush_interval_s=0.05)
for i in range(int(sys.argv[2])):
    rec.record([(j % 7).to_bytes(32, "big") + b"\\0\\0\\0\\0" for j in range(i % 5 + 1)], 16 * (i % 5 + 1))
deadline = time.monotonic() + 10
while rec.requests_written < int(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.2)  # the flush's sidecar rewrite follows its write
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_recorder_leaves_a_valid_recording_whose_sidecar_counts_its_lines(tmp_path) -> None:
    import signal
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _KILLED_RECORDER, str(tmp_path), "300"], timeout=60,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    meta = json.loads((tmp_path / META_FILE).read_text())
    lines = _lines(tmp_path)  # every line parses: none was left half-written
    assert meta["state"] == "recording"  # not closed: a reader knows the engine did not finish it
    assert meta["requests_written"] == len(lines) == 300
    assert meta["files"] == sorted(n for n in os.listdir(tmp_path) if TRACE_FILE.match(n))
    trace = load_traces(recording_files(tmp_path)[0])
    assert len(trace.requests) == 300 and load_meta(tmp_path / META_FILE).tokens_per_block == 16


def test_the_sidecar_follows_each_flush_and_says_closed_after_close(tmp_path) -> None:
    rec = _recorder(tmp_path)
    rec.record([seq_key(1)], 16)
    rec.flush()
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert (meta["requests_written"], meta["state"]) == (1, "recording")
    rec.record([seq_key(2)], 16)
    rec.record([seq_key(3)], 16)
    rec.flush()
    assert json.loads((tmp_path / META_FILE).read_text())["requests_written"] == 3
    before = (tmp_path / META_FILE).stat().st_mtime_ns
    rec.flush()  # nothing new: the sidecar is not rewritten
    assert (tmp_path / META_FILE).stat().st_mtime_ns == before
    rec.close()
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert (meta["requests_written"], meta["state"]) == (3, "closed")
    assert len(_lines(tmp_path)) == 3


def test_one_flush_larger_than_a_file_rotates_mid_batch_within_the_bound(tmp_path) -> None:
    max_bytes, files = 256 * 1024, 4
    rec = _recorder(tmp_path, max_bytes=max_bytes, files=files, queue_max=1 << 20)
    for i in range(3000):
        rec.record([seq_key(i * 40 + j) for j in range(40)], 40 * 16)
    rec.flush()  # one flush, many files' worth: each file gets whole lines up to its share
    names = sorted(n for n in os.listdir(tmp_path) if TRACE_FILE.match(n))
    assert len(names) == files
    assert all(os.path.getsize(tmp_path / n) <= max_bytes // files for n in names)
    lines = _lines(tmp_path)
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["files"] == names and meta["requests_written"] == 3000
    assert 0 < len(lines) < 3000 and lines[-1]["input_length"] == 40 * 16
    rec.close()
