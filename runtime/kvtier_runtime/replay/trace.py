"""Mooncake-format JSONL traces: one request per line, ``hash_ids`` are prefix-chained block ids.

Each line is an object with ``timestamp`` (ms, number), ``input_length`` and ``output_length`` (tokens,
non-negative integers) and ``hash_ids`` (a list of non-negative integers: block i's id identifies the whole prefix
up to block i, so equal ids mean an equal prefix). Blank lines are ignored.
"""
from __future__ import annotations

import json
import math
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
    # Requests whose timestamp is earlier than the one before (file order is replay order; reuse *times* are
    # then meaningless), and the first such line number.
    out_of_order: int = 0
    first_out_of_order_line: int = 0
    line_numbers: list[int] = field(default_factory=list, repr=False)

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
    except RecursionError:
        raise ValueError("not a trace record: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp: {ts!r} must be a finite non-negative number of milliseconds")
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
                if trace.timestamps_ms and ts < trace.timestamps_ms[-1]:
                    if not trace.out_of_order:
                        trace.first_out_of_order_line = lineno
                    trace.out_of_order += 1
                trace.line_numbers.append(lineno)
                trace.requests.append(ids)
                trace.timestamps_ms.append(ts)
                trace.input_lengths.append(n_in)
                trace.output_lengths.append(n_out)
        except UnicodeDecodeError as exc:
            raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if not trace.requests:
        raise TraceError(f"{path}: no requests in the trace")
    return trace


def block_count_mismatches(trace: Trace, block_tokens: int) -> tuple[int, str]:
    """Requests whose ``len(hash_ids) != ceil(input_length / block_tokens)``, and an example (a wrong
    ``--block-tokens`` shows up as nearly every request mismatching)."""
    count, example = 0, ""
    for lineno, ids, n_in in zip(trace.line_numbers, trace.requests, trace.input_lengths):
        expected = -(-n_in // block_tokens)
        if len(ids) != expected:
            if not count:
                example = (f"line {lineno}: {len(ids)} hash_ids for input_length {n_in}, "
                           f"ceil({n_in}/{block_tokens}) = {expected}")
            count += 1
    return count, example


def trace_warnings(trace: Trace, block_tokens: int) -> list[str]:
    """One-line warnings about a loaded trace that replay can run on but a user should know about."""
    out = []
    if trace.out_of_order:
        out.append(f"warning: {trace.out_of_order} requests have a timestamp earlier than the line before (first at "
                   f"line {trace.first_out_of_order_line}); replay follows file order and 'analyze' omits reuse "
                   f"times -- sort the trace by timestamp")
    bad, example = block_count_mismatches(trace, block_tokens)
    if bad:
        out.append(f"warning: {bad} of {len(trace.requests)} requests have len(hash_ids) != "
                   f"ceil(input_length / --block-tokens {block_tokens}), e.g. {example}; is --block-tokens right?")
    return out
