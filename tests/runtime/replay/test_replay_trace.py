"""Mooncake JSONL loading: every malformed line is an error naming the line and the field, or skipped and counted."""
from __future__ import annotations

import json

import pytest
from kvtier_runtime.replay.trace import TraceError, load_trace

GOOD = {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]}


def write(tmp_path, lines):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


@pytest.mark.parametrize(("bad", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (dict(GOOD, hash_ids="0,1"), "hash_ids"),
    ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "hash_ids: missing"),
    (dict(GOOD, hash_ids=[0, -1]), r"hash_ids\[1\]"),
    (dict(GOOD, hash_ids=[0, 1.5]), r"hash_ids\[1\]"),
    (dict(GOOD, hash_ids=[True]), r"hash_ids\[0\]"),
    (dict(GOOD, timestamp="soon"), "timestamp"),
    (dict(GOOD, timestamp=-1), "timestamp"),
    (dict(GOOD, input_length=-3), "input_length"),
    (dict(GOOD, output_length=None), "output_length"),
])
def test_a_malformed_line_names_its_number_and_field(tmp_path, bad, message) -> None:
    path = write(tmp_path, [GOOD, "", bad, GOOD])
    with pytest.raises(TraceError, match=rf"t.jsonl:3: .*{message}"):
        load_trace(path)


def test_skip_bad_counts_and_keeps_the_good_lines(tmp_path) -> None:
    path = write(tmp_path, [GOOD, "{", dict(GOOD, hash_ids=[5]), "[]", dict(GOOD, hash_ids=[7, 8, 9])])
    trace = load_trace(path, skip_bad=True)
    assert trace.skipped_lines == 2
    assert trace.requests == [[0, 1], [5], [7, 8, 9]]
    assert trace.n_accesses == 6 and trace.n_distinct == 6
    assert "line 2" in trace.skipped_reasons[0]


def test_missing_empty_and_binary_files_are_errors(tmp_path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="UTF-8"):
        load_trace(tmp_path / "bin.jsonl")


def test_the_shared_trace_has_the_documented_shape(mooncake_trace) -> None:
    assert len(mooncake_trace.requests) == 3993
    assert mooncake_trace.n_accesses == 121_877
    assert mooncake_trace.n_distinct == 43_924
