"""Mooncake-format JSONL traces: one request per line, ``hash_ids`` are prefix-chained block ids.

Each line is an object with ``timestamp`` (ms, number), ``input_length`` and ``output_length`` (tokens,
non-negative integers) and ``hash_ids`` (a list of non-negative integers: block i's id identifies the whole prefix
up to block i, so equal ids mean an equal prefix). Blank lines are ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class TraceError(ValueError):
    """A trace line broke the format; the message names the file, the line number and the field."""


@dataclass
class Trace:
    requests: list[list[int]]
    timestamps_ms: list[float]
    input_lengths: list[int]
    output_lengths: list[int]
    source: str = ""
    skipped_lines: int = 0
    skipped_reasons: list[str] = field(default_factory=list)

    @property
    def n_accesses(self) -> int:
        return sum(len(r) for r in self.requests)

    @property
    def n_distinct(self) -> int:
        return len({k for r in self.requests for k in r})


def _int_field(obj: dict, name: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: {value!r} must be a non-negative integer")
    return value


def parse_line(text: str) -> tuple[float, int, int, list[int]]:
    """One request from one JSONL line; ValueError naming the field and the rule."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts != ts or ts < 0:
        raise ValueError(f"timestamp: {ts!r} must be a non-negative number of milliseconds")
    input_length = _int_field(obj, "input_length")
    output_length = _int_field(obj, "output_length")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list):
        raise ValueError(f"hash_ids: {type(ids).__name__ if ids is not None else 'missing'}, must be a list of integers")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"hash_ids[{i}]: {h!r} must be a non-negative integer")
    return float(ts), input_length, output_length, ids


def load_trace(path: str | Path, skip_bad: bool = False) -> Trace:
    """Read a trace; :class:`TraceError` at the first malformed line unless ``skip_bad`` (then counted)."""
    path = Path(path)
    trace = Trace([], [], [], [], source=str(path))
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc.strerror or exc})") from None
    with handle:
        try:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    ts, n_in, n_out, ids = parse_line(line)
                except ValueError as exc:
                    if not skip_bad:
                        raise TraceError(f"{path}:{lineno}: {exc} (use --skip-bad to skip such lines)") from None
                    trace.skipped_lines += 1
                    if len(trace.skipped_reasons) < 5:
                        trace.skipped_reasons.append(f"line {lineno}: {exc}")
                    continue
                trace.requests.append(ids)
                trace.timestamps_ms.append(ts)
                trace.input_lengths.append(n_in)
                trace.output_lengths.append(n_out)
        except UnicodeDecodeError as exc:
            raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if not trace.requests:
        raise TraceError(f"{path}: no requests in the trace")
    return trace
