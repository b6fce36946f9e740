"""Mooncake-format JSONL traces: one request per line, ``hash_ids`` are prefix-chained block ids.

Each line is an object with ``timestamp`` (ms, number), ``input_length`` and ``output_length`` (tokens,
non-negative integers) and ``hash_ids`` (a list of non-negative integers: block i's id identifies the whole prefix
up to block i, so equal ids mean an equal prefix). Blank lines are ignored.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


def _int_field(obj: dict[str, Any], name: str) -> int:
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
    """Requests whose ``len(hash_ids)`` is neither ``ceil(input_length / block_tokens)`` (Mooncake's traces: the
    partial last block has an id) nor its floor (kvtier's recordings: only whole chunks have ids), and an example
    (a wrong ``--block-tokens`` shows up as nearly every request mismatching)."""
    count, example = 0, ""
    for lineno, ids, n_in in zip(trace.line_numbers, trace.requests, trace.input_lengths):
        expected = -(-n_in // block_tokens)
        if len(ids) != expected and len(ids) != n_in // block_tokens:
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


# ---- recordings of kvtier's own traffic (kvtier_runtime.trace.recorder; docs/replay.md) ----------------------
META_FILE = "trace-meta.json"
_RECORDED = re.compile(r"^trace-(\d{3,})\.jsonl$")


def recording_files(path: str | Path) -> tuple[list[Path], Path | None]:
    """The trace files to read for ``--trace PATH``, in order, and the recording's sidecar if there is one.

    A folder: its ``trace-NNN.jsonl`` files in number order. A ``trace-NNN.jsonl`` file next to a
    ``trace-meta.json``: it and the recording's later files (the recorder rotates over several and deletes the
    oldest). Any other file: that file alone."""
    path = Path(path)
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if _RECORDED.match(p.name)), key=_file_number)
        if not files:
            raise TraceError(f"{path}: a folder without trace-NNN.jsonl files")
        meta = path / META_FILE
        return files, meta if meta.is_file() else None
    meta = path.parent / META_FILE
    match = _RECORDED.match(path.name)
    if match and meta.is_file():
        first = int(match.group(1))
        files = sorted((p for p in path.parent.iterdir() if _RECORDED.match(p.name) and _file_number(p) >= first),
                       key=_file_number)
        return files, meta
    return [path], meta if meta.is_file() else None


def _file_number(path: Path) -> int:
    return int(_RECORDED.match(path.name).group(1))  # type: ignore[union-attr]


def load_traces(paths: list[Path], skip_bad: bool = False) -> Trace:
    """Several files read as one trace, in the order given (a rotated recording); empty files are skipped."""
    if len(paths) == 1:
        return load_trace(paths[0], skip_bad)
    merged: Trace | None = None
    for path in paths:
        try:
            part = load_trace(path, skip_bad)
        except TraceError as exc:
            if str(exc).endswith("no requests in the trace"):
                continue  # the recorder's newest file, not written yet
            raise
        if merged is None:
            merged = part
            merged.source = f"{paths[0].parent} ({len(paths)} files)"
            continue
        if part.timestamps_ms[0] < merged.timestamps_ms[-1] and not merged.out_of_order:
            merged.first_out_of_order_line = part.line_numbers[0]
        merged.out_of_order += part.out_of_order + (part.timestamps_ms[0] < merged.timestamps_ms[-1])
        merged.requests += part.requests
        merged.timestamps_ms += part.timestamps_ms
        merged.input_lengths += part.input_lengths
        merged.output_lengths += part.output_lengths
        merged.line_numbers += part.line_numbers
        merged.skipped_lines += part.skipped_lines
        merged.skipped_reasons += part.skipped_reasons[: max(0, 5 - len(merged.skipped_reasons))]
    if merged is None:
        raise TraceError(f"{paths[0].parent}: no requests in the trace files")
    return merged


@dataclass
class RecordedModel:
    """The engine a recording came from, as ``trace-meta.json`` describes it."""

    path: Path
    tokens_per_block: int
    names: list[str]
    capacities: list[int]
    policies: list[str]
    media: list[str]
    device_blocks: int | None = None
    # KV bytes of one block, all tensor-parallel ranks (recorders before it was written: None).
    block_bytes: int | None = None
    # Tokens of one of vLLM's device blocks (``device_blocks`` counts those; None: the same as tokens_per_block).
    device_block_tokens: int | None = None

    @property
    def device_chunks(self) -> int | None:
        """The device tier's capacity in chunks: vLLM's GPU blocks less its null block (never cached)."""
        if self.device_blocks is None:
            return None
        tokens = self.device_block_tokens or self.tokens_per_block
        return max(1, (self.device_blocks - 1) * tokens // self.tokens_per_block)


def load_meta(path: str | Path) -> RecordedModel:
    """Read a recording's sidecar; :class:`TraceError` naming the file and the field on a bad one."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace's sidecar ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:
        raise TraceError(f"{path}: not a JSON sidecar ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{path}: expected a JSON object")
    tokens = obj.get("tokens_per_block")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise TraceError(f"{path}: tokens_per_block: {tokens!r} must be a positive integer")
    tiers = obj.get("tiers")
    if not isinstance(tiers, list) or not tiers:
        raise TraceError(f"{path}: tiers: must be a non-empty list")
    names, caps, policies, media = [], [], [], []
    for i, tier in enumerate(tiers):
        if not isinstance(tier, dict):
            raise TraceError(f"{path}: tiers[{i}]: must be an object")
        cap = tier.get("capacity_blocks")
        if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
            raise TraceError(f"{path}: tiers[{i}].capacity_blocks: {cap!r} must be a positive integer")
        policy = tier.get("eviction_policy") or "lru"
        if not isinstance(policy, str):
            raise TraceError(f"{path}: tiers[{i}].eviction_policy: {policy!r} must be a policy name")
        admission = tier.get("admission") or "none"
        if admission != "none":
            policy = f"{policy}+{admission}"
        names.append(str(tier.get("name") or f"tier{i}"))
        caps.append(cap)
        policies.append(policy)
        media.append(str(tier.get("medium") or "?"))
    device = obj.get("device_blocks")
    block_bytes = obj.get("block_bytes")
    if block_bytes is not None and (isinstance(block_bytes, bool) or not isinstance(block_bytes, int)
                                    or block_bytes <= 0):
        raise TraceError(f"{path}: block_bytes: {block_bytes!r} must be a positive integer")
    if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 2):
        raise TraceError(f"{path}: device_blocks: {device!r} must be an integer >= 2 (vLLM's null block and one more)")
    device_tokens = obj.get("device_block_tokens")
    if device_tokens is not None and (isinstance(device_tokens, bool) or not isinstance(device_tokens, int)
                                      or device_tokens <= 0):
        raise TraceError(f"{path}: device_block_tokens: {device_tokens!r} must be a positive integer")
    return RecordedModel(path, tokens, names, caps, policies, media, device, block_bytes, device_tokens)
