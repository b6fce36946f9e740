"""A bounded, off-the-hot-path recorder of the requests an engine's offloading manager sees (docs/replay.md).

Output: Mooncake-format JSONL (:mod:`kvtier_runtime.replay.trace`), one request per line -- ``timestamp`` (ms since
the recording started, when the request's lookups settled), ``input_length`` (the prompt's tokens as sent),
``output_length`` (0: the manager is never told it), ``hash_ids`` (the prompt's whole chunks in order: a partial
last chunk is never offloaded, so it has no id) and ``hit_tokens`` (the prompt tokens each of kvtier's tiers served
the request, by tier name, as the engine's ``hit_tokens{tier}`` counts them) -- in ``trace-000.jsonl``,
``trace-001.jsonl``, ... under the trace folder, plus ``trace-meta.json`` describing the engine that produced it
(what replay needs to model it).

Privacy: a chunk's id is a keyed hash (BLAKE2b) of vLLM's offload key under a key drawn from ``os.urandom`` for this
recording and never written anywhere, numbered in order of first appearance. The trace thus reveals which prompts
share which prefixes, never a token, and ids of two recordings cannot be matched against each other.

Cost on the engine thread: :meth:`TraceRecorder.record` reads the clock and appends one tuple to a bounded deque --
no hashing, no formatting, no I/O; when the deque is full the request is dropped and counted, never waited for.
A writer thread hashes, formats, writes and rotates: the files never hold more than ``max_bytes`` in all (each at
most ``max_bytes // files``; the oldest file is deleted when a new one would exceed the count).

Crash consistency: an engine may end without :meth:`TraceRecorder.close` -- vLLM's front end SIGKILLs its engine core
in the same instant it SIGTERMs it unless ``--shutdown-timeout`` is set (the Kubernetes default path), and OOM kills
run nothing. So the folder is valid at every moment, not only after close: each flush writes its lines with one
unbuffered write per file (no torn line is left in a buffer) and then rewrites the sidecar (atomic rename) with the
counters of what is on disk. A killed engine loses at most the requests of its last flush interval; the sidecar's
``state`` says ``recording`` (it was not closed) or ``closed``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger(__name__)

RECORDER_VERSION = 1
META_FILE = "trace-meta.json"
TRACE_FILE = re.compile(r"^trace-(\d{3,})\.jsonl$")
# Requests waiting for the writer thread; beyond this, the engine drops (and counts) rather than waits.
DEFAULT_QUEUE_MAX = 8192
# Distinct chunks whose id is remembered (least recently seen forgotten first): bounds the writer's memory on a
# long recording. A forgotten chunk seen again gets a new id -- replay then sees a miss, never a false hit.
DEFAULT_MAX_IDS = 1 << 20
FLUSH_INTERVAL_S = 0.5


def trace_file_name(index: int) -> str:
    return f"trace-{index:03d}.jsonl"


class TraceRecorder:
    """Writes one recording under ``trace_dir``; any earlier recording's files there are removed at start (their
    ids were drawn under another key and must not be mixed with these)."""

    def __init__(self, trace_dir: str, max_bytes: int, files: int, meta: dict[str, Any] | None = None, *,
                 queue_max: int = DEFAULT_QUEUE_MAX, max_ids: int = DEFAULT_MAX_IDS,
                 flush_interval_s: float = FLUSH_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 start: bool = True) -> None:
        if files < 1 or max_bytes < files:
            raise ValueError(f"trace recorder: {max_bytes} bytes cannot be split over {files} files")
        self.trace_dir = trace_dir
        self.max_bytes = max_bytes
        self.n_files = files
        self.file_bytes = max_bytes // files
        self.meta = dict(meta or {})
        self.queue_max = queue_max
        self.max_ids = max_ids
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._t0 = clock()
        self._queue: deque[tuple[float, int, int, tuple[bytes, ...], dict[str, int] | None]] = deque()
        # Engine thread: drops for a full queue. Writer thread: everything else.
        self.dropped_queue_full = 0
        self.dropped: Counter[str] = Counter()  # too_large, write_error
        self.requests_written = 0
        self.ids_forgotten = 0
        self._key = os.urandom(32)  # this recording's id key: held in memory only
        self._ids: OrderedDict[bytes, int] = OrderedDict()
        self._next_id = 0
        self._files: list[tuple[int, int]] = []  # (index, bytes) of the files on disk, oldest first
        self._handle: Any = None
        self._write_failed = False
        self._closed = False
        self._meta_written: tuple[int, ...] = ()  # the counters the sidecar on disk holds
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one writer at a time: the thread, or close()'s final drain
        self._started_at = datetime.now(UTC).isoformat(timespec="seconds")
        os.makedirs(trace_dir, exist_ok=True)
        removed = self._remove_old_recording()
        if removed:
            log.warning("kvtier: trace recorder removed %d file(s) of an earlier recording from %s", removed,
                        trace_dir)
        self._open(0)
        if self._handle is None:  # a folder the engine cannot write: fail at start, not silently drop everything
            raise PermissionError(f"cannot create {trace_file_name(0)} in {trace_dir}")
        self._write_meta()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="kvtier-trace-writer", daemon=True)
            self._thread.start()

    # ---- engine thread --------------------------------------------------------------------------------------
    def record(self, keys: Sequence[bytes], input_tokens: int, output_tokens: int = 0,
               hit_tokens: dict[str, int] | None = None) -> bool:
        """One request: its prompt chunks' offload keys in order, its prompt's length in tokens (as sent: the keys
        cover its whole chunks) and, when given, the prompt tokens each tier served it (by tier name). Never blocks;
        False when dropped (queue full)."""
        if len(self._queue) >= self.queue_max:
            self.dropped_queue_full += 1
            return False
        self._queue.append((self._clock(), input_tokens, output_tokens, tuple(keys), hit_tokens))
        return True

    # ---- writer thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            try:
                self.flush()
            except Exception:  # pragma: no cover - a recorder bug must not end the recording silently
                log.exception("kvtier: trace recorder failed to write; recording stops")
                return

    def flush(self) -> None:
        """Write what is queued (the writer thread calls this; tests and close() may too)."""
        with self._lock:
            batch: list[bytes] = []  # lines bound for the current file, written with one call
            while self._queue:
                t, n_in, n_out, keys, hits = self._queue.popleft()
                line = self._line(t, n_in, n_out, keys, hits)
                if len(line) > self.file_bytes:
                    self.dropped["too_large"] += 1
                    continue
                index, size = self._files[-1] if self._files else (-1, 0)
                pending = sum(map(len, batch))
                if self._handle is not None and size + pending + len(line) > self.file_bytes:
                    self._write_batch(batch)
                    batch = []
                    self._rotate(index + 1)
                batch.append(line)
            self._write_batch(batch)
            if self._meta_written != self._meta_state():
                self._write_meta()

    def _line(self, t: float, n_in: int, n_out: int, keys: tuple[bytes, ...],
              hits: dict[str, int] | None = None) -> bytes:
        ids = self._ids
        out = []
        for key in keys:
            digest = hashlib.blake2b(bytes(key), key=self._key, digest_size=16).digest()
            i = ids.get(digest)
            if i is None:
                i = ids[digest] = self._next_id
                self._next_id += 1
                if len(ids) > self.max_ids:
                    ids.popitem(last=False)
                    self.ids_forgotten += 1
            else:
                ids.move_to_end(digest)
            out.append(i)
        ms = round(max(0.0, t - self._t0) * 1000.0, 3)
        record: dict[str, Any] = {"timestamp": ms, "input_length": n_in, "output_length": n_out, "hash_ids": out}
        if hits is not None:
            record["hit_tokens"] = hits
        return (json.dumps(record, separators=(",", ":")) + "\n").encode()

    def _write_batch(self, batch: list[bytes]) -> None:
        """Whole lines to the current file in one unbuffered write: a kill leaves no line half on disk."""
        if not batch:
            return
        if self._handle is None:
            self.dropped["write_error"] += len(batch)
            return
        data = b"".join(batch)
        try:
            written = self._handle.write(data)
            while written < len(data):  # a short write (a full disk, a signal): the rest, or an OSError
                more = self._handle.write(data[written:])
                if not more:
                    raise OSError(f"wrote {written} of {len(data)} bytes")
                written += more
        except OSError as exc:
            self._write_error(exc)
            self.dropped["write_error"] += len(batch)
            return
        index, size = self._files[-1]
        self._files[-1] = (index, size + len(data))
        self.requests_written += len(batch)

    def _rotate(self, index: int) -> None:
        self._close_handle()
        self._open(index)
        while len(self._files) > self.n_files:
            old, _ = self._files.pop(0)
            try:
                os.unlink(os.path.join(self.trace_dir, trace_file_name(old)))
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._write_error(exc)
        self._write_meta()

    def _open(self, index: int) -> None:
        path = os.path.join(self.trace_dir, trace_file_name(index))
        try:
            # Unbuffered: every flush reaches the kernel at once (a kill of the process loses nothing written).
            self._handle = open(path, "wb", buffering=0)  # noqa: SIM115 -- closed at rotation and close()
        except OSError as exc:
            self._handle = None
            self._write_error(exc)
            return
        self._files.append((index, 0))

    def _close_handle(self) -> None:
        if self._handle is not None:
            try:
                self._handle.close()
            except OSError as exc:
                self._write_error(exc)
            self._handle = None

    def _write_error(self, exc: OSError) -> None:
        if not self._write_failed:
            log.warning("kvtier: trace recorder cannot write to %s (%s); requests are dropped and counted",
                        self.trace_dir, exc)
        self._write_failed = True

    def _remove_old_recording(self) -> int:
        removed = 0
        for name in os.listdir(self.trace_dir):
            if TRACE_FILE.match(name) or name == META_FILE:
                os.unlink(os.path.join(self.trace_dir, name))
                removed += 1
        return removed

    # ---- sidecar ----------------------------------------------------------------------------------------------
    def meta_dict(self) -> dict[str, Any]:
        return {
            "format": "mooncake",
            "recorder_version": RECORDER_VERSION,
            "started_at": self._started_at,
            **self.meta,
            "files": [trace_file_name(i) for i, _ in self._files],
            "max_bytes": self.max_bytes,
            "requests_written": self.requests_written,
            "requests_dropped": {"queue_full": self.dropped_queue_full, **self.dropped},
            "ids_forgotten": self.ids_forgotten,
            "output_length": "always 0: the offloading manager is not told a request's output length",
            # recording: the engine may still be writing, or was killed (its last flush interval is missing).
            "state": "closed" if self._closed else "recording",
        }

    def _meta_state(self) -> tuple[int, ...]:
        return (self.requests_written, self.dropped_queue_full, *self.dropped.values(), self.ids_forgotten,
                len(self._files), int(self._closed))

    def _write_meta(self) -> None:
        path = os.path.join(self.trace_dir, META_FILE)
        tmp = path + ".tmp"
        state = self._meta_state()
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(self.meta_dict(), handle, indent=2)
                handle.write("\n")
            os.replace(tmp, path)
        except OSError as exc:
            self._write_error(exc)
            return
        self._meta_written = state

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the writer, write what is queued and the final sidecar (counters included). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None
        self.flush()
        with self._lock:
            self._close_handle()
            self._closed = True
            self._write_meta()

    @property
    def bytes_on_disk(self) -> int:
        return sum(size for _, size in self._files)
