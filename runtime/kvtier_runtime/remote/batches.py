"""The remote tier's batched I/O, on its worker threads: a batch of queued keys is one pipeline (one round trip)
-- ``SET`` per chunk and the capacity index's update for stores, ``GET`` per chunk and the index's touch for
loads, ``EXISTS`` per key for presence probes. Every fault is a failed key with a reason, never an exception into
the engine; a store-level fault also goes to the store's health."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from ..codecs import CodecError
from ..tiers.jobs import Expired, Job, JobQueue
from .changes import REMOVED, STORED, Changes, SharedLog
from .client import RemoteStore, failure_kind
from .format import RemoteFormatError
from .health import StoreHealth
from .index import CapacityIndex
from .presence import PresenceCache
from .tier_metrics import RemoteMetrics
from .values import ChunkValues
from .wire import Reply

__all__ = ["Batches", "KeyOutcomes", "RowWork"]

log = logging.getLogger("kvtier_runtime.remote")

# One key of a job: (job, index in the job, offload key, the caller's host row).
RowWork = tuple[Job, int, bytes, torch.Tensor]
# Values refused for what they hold (not for a store fault): logged, since they mean a writer without the key, a
# damaged store, or (``key``) a value sealed under a tenant key this replica does not hold: the other side of a key
# rotation, a removed key, or another tenant's value copied here.
REFUSED_KINDS = frozenset({"forged", "corrupt", "truncated", "foreign", "version", "key"})


class KeyOutcomes:
    """Settling one key of a job, and counting why one failed: a failed load is a miss, a failed store a store
    failure, each by reason."""

    def __init__(self, jobs: JobQueue, metrics: RemoteMetrics) -> None:
        self._jobs = jobs
        self._metrics = metrics

    def fail(self, job: Job, i: int, reason: str, store: bool = False) -> None:
        with self._jobs.lock:
            job.errors[i] = reason
            result = self._jobs.settle_locked(job, i, False)
        if store:
            self._metrics.store_failed(reason)
        else:
            self._metrics.miss(reason)
        self._jobs.completed(result)

    def succeed(self, job: Job, i: int) -> None:
        self._jobs.settle(job, i, True)


class _Unavailable(Exception):
    """The store was down when a queued probe ran."""


class _LoadReplies:
    """The GET replies of one load batch, handed over one at a time in key order: how many were handled (the rest
    fail if the connection does), the first store fault among them and the bytes loaded."""

    def __init__(self, live: list[RowWork], settle: Callable[[RowWork, Reply | bytes], int]) -> None:
        self.live = live
        self._settle = settle
        self.done = 0
        self.fault = ""
        self.nbytes = 0

    def __call__(self, value: Reply | bytes) -> None:
        item = self.live[self.done]
        self.done += 1
        if isinstance(value, Exception) and not self.fault:
            self.fault = failure_kind(value)
        self.nbytes += self._settle(item, value)


class Batches:
    """The tier's three kinds of batch, over its parts: the store client, the values, the capacity index, the
    store's health, the presence cache, and how keys settle."""

    def __init__(self, *, name: str, peer: str, store: RemoteStore, store_key: Callable[[bytes], bytes],
                 values: ChunkValues, index: CapacityIndex, health: StoreHealth, presence: PresenceCache,
                 outcomes: KeyOutcomes, metrics: RemoteMetrics, changes: Changes, shared_log: SharedLog) -> None:
        self.name = name
        self.peer = peer
        self._store = store
        self._key = store_key
        self._values = values
        self._index = index
        self._health = health
        self._presence = presence
        self._outcomes = outcomes
        self._metrics = metrics
        self._changes = changes
        self._log = shared_log
        self._local = threading.local()  # per load thread: the keys its batch found gone, for the shared log

    # ---- stores -------------------------------------------------------------------------------------------
    def store(self, batch: list[RowWork]) -> None:
        """One pipeline: a SET per chunk, then the model's index (ZADD, ZCARD); trimmed to the capacity (ZPOPMIN,
        DEL) before the keys settle, so a finished store is already accounted."""
        started = time.perf_counter()
        live = [item for item in batch if not item[0].done.is_set()]
        if not live:
            return
        refuse = self._health.store_refusal(self._health.up)
        if refuse:
            for job, i, _, _ in live:
                self._outcomes.fail(job, i, refuse, store=True)
            return
        if self._store.cluster:
            sent = self._seal(live)
            if sent:
                self._send(sent, started)
        else:
            self._stream(live, started)

    def _stream(self, live: list[RowWork], started: float) -> None:
        """Standalone mode: each row sealed into this thread's one value buffer and sent at once, the store taking
        in one value while the next is sealed (the buffer, still in cache, is refilled once the kernel holds the
        bytes); then the index's update, and every reply read."""
        sent: list[tuple[Job, int, bytes, int]] = []
        reached = 0  # rows of ``live`` the stream has taken (sealed and sent, expired, or failed to encode)
        buf = self._values.buffers(1)[0]

        def values() -> Iterator[tuple[bytes, memoryview]]:
            nonlocal reached
            for job, i, key, block in live:
                reached += 1
                store_key = self._key(key)
                total = self._seal_one(job, i, store_key, block, buf)
                if total is None:
                    continue
                sent.append((job, i, key, total))
                yield store_key, memoryview(buf)[:total]

        logged = self._log.active  # every replica's index learns of these chunks from the shared log

        def index(n: int) -> list[tuple[bytes | str, ...]]:
            if not n:
                return []
            keys = [key for _, _, key, _ in sent]
            log_entry = [self._log.command(STORED, keys)] if logged else []
            return [*log_entry, *self._index.write_commands(keys, time.time())]

        try:
            replies, tail = self._store.write_values(values(), index)
        except Exception as exc:
            kind = failure_kind(exc)
            self._health.fault(kind)
            for job, i, _, _ in sent:
                self._outcomes.fail(job, i, kind, store=True)
            for job, i, _, _ in live[reached:]:  # never sealed: the connection failed first
                self._outcomes.fail(job, i, kind, store=True)
            return
        if tail:
            if logged and isinstance(tail[0], Exception):
                self._log.refused(tail[0])
            self._settle_writes(sent, replies, tail[-1], tail[-2], started)

    def _seal(self, live: list[RowWork]) -> list[tuple[Job, int, bytes, memoryview]]:
        """Each row sealed into one of this thread's value buffers; a job that expired first is skipped."""
        sent: list[tuple[Job, int, bytes, memoryview]] = []
        for (job, i, key, block), buf in zip(live, self._values.buffers(len(live))):
            total = self._seal_one(job, i, self._key(key), block, buf)
            if total is not None:
                sent.append((job, i, key, memoryview(buf)[:total]))
        return sent

    def _seal_one(self, job: Job, i: int, store_key: bytes, block: torch.Tensor, buf: bytearray) -> int | None:
        """Row ``i`` of ``job`` sealed into ``buf``: its length, or None (the job expired, or the codec failed:
        the row is then failed here, since a codec fault must not reach the engine)."""
        try:
            return self._values.seal(job, store_key, block, buf)
        except Expired:
            return None
        except Exception as exc:
            log.warning("kvtier remote tier %s: encoding a chunk failed: %s", self.name, exc)
            self._outcomes.fail(job, i, "other", store=True)
            return None

    def _send(self, sent: list[tuple[Job, int, bytes, memoryview]], started: float) -> None:
        try:
            pipe = self._store.pipeline()
            for _, _, key, value in sent:
                pipe.set(self._key(key), value)
            logged = self._log.active  # every replica's index learns of these chunks from the shared log
            if logged:
                self._log.add(pipe, STORED, [key for _, _, key, _ in sent])
            self._index.record_writes(pipe, [key for _, _, key, _ in sent], time.time())
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            kind = failure_kind(exc)
            self._health.fault(kind)
            for job, i, _, _ in sent:
                self._outcomes.fail(job, i, kind, store=True)
            return
        if logged and isinstance(replies[len(sent)], Exception):
            self._log.refused(replies[len(sent)])
        self._settle_writes([(job, i, key, len(value)) for job, i, key, value in sent], replies, replies[-1],
                            replies[-2], started)

    def _settle_writes(self, sent: Sequence[tuple[Job, int, bytes, int]], replies: Sequence[object], entries: object,
                       added: object, started: float) -> None:
        """After a store batch's replies: the index trimmed (it held ``entries`` after this batch added ``added``),
        then each key settled by its SET reply (``sent``: job, index, key, value bytes)."""
        if isinstance(entries, int):
            trimmed = self._index.trim(entries, added if isinstance(added, int) else 0)
            for key in trimmed:
                self._presence.remember(key, False, "evicted")
            self._changes.removed(trimmed)
            self._log.append(REMOVED, trimmed)
        stored_bytes = 0
        fault = ""
        for (job, i, key, nbytes), reply in zip(sent, replies):
            if isinstance(reply, Exception):
                kind = failure_kind(reply)
                fault = fault or kind
                self._outcomes.fail(job, i, kind, store=True)
            else:
                stored_bytes += nbytes
                self._presence.remember(key, True)
                self._outcomes.succeed(job, i)
        self._done(fault, self.peer, self.name, stored_bytes, started, len(sent))

    # ---- loads --------------------------------------------------------------------------------------------
    def load(self, batch: list[RowWork]) -> None:
        """One round trip: a GET per chunk, then the index's touch (a read is a use); each value verified and
        copied into its row as it arrives."""
        started = time.perf_counter()
        live = [item for item in batch if not item[0].done.is_set()]
        if not live:
            return
        if not self._health.up:
            for job, i, _, _ in live:
                self._outcomes.fail(job, i, self._health.miss_reason)
            return
        replies = _LoadReplies(live, self._settle_value)
        gone: list[bytes] = []
        self._local.gone = gone
        try:
            self._read(live, replies)
        except Exception as exc:
            kind = failure_kind(exc)
            self._health.fault(kind)
            for job, i, key, _ in live[replies.done:]:  # no reply handled: the connection failed first
                self._presence.remember(key, False, kind)
                self._outcomes.fail(job, i, kind)
            return
        self._done(replies.fault, self.name, self.peer, replies.nbytes, started, len(live))
        self._log.append(REMOVED, gone)

    def _read(self, live: list[RowWork], on_value: _LoadReplies) -> None:
        keys = [key for _, _, key, _ in live]
        now = time.time()
        if self._store.cluster:
            pipe = self._store.pipeline()
            for key in keys:
                pipe.get(self._key(key))
            self._index.touch(pipe, keys, now)
            for value in pipe.execute(raise_on_error=False)[:len(live)]:
                on_value(value)
        else:
            # One round trip as well, each value read off the socket straight into this thread's value buffer
            # (redis-py's reply parser copies it twice more) and settled as it arrives: the cipher checks one
            # while the kernel receives the next.
            self._store.read_values([self._key(key) for key in keys], self._values.buffers(1)[0], on_value,
                                    [self._index.touch_command(keys, now)])

    def _settle_value(self, item: RowWork, value: Reply | bytes) -> int:
        """One key's reply: its value verified and copied into its row (the bytes loaded), or the key failed with
        the reason (0)."""
        job, i, key, out = item
        kind = self._value_fault(job, key, out, value)
        if kind is None:  # the job expired: the caller gave up on the key
            return 0
        if kind:
            self._presence.remember(key, False, kind)
            if kind == "evicted":  # gone from the store: no replica holds it there any more
                self._changes.removed([key])
                getattr(self._local, "gone", []).append(key)
            self._outcomes.fail(job, i, kind)
            n = self._metrics.misses[kind]
            if kind in REFUSED_KINDS and n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood stays quiet
                log.warning("kvtier remote tier %s: refused a value (%s, %d so far); vLLM recomputes the chunk",
                            self.name, kind, n)
            return 0
        self._presence.remember(key, True)
        self._outcomes.succeed(job, i)
        return out.numel() * out.element_size()

    def _value_fault(self, job: Job, key: bytes, out: torch.Tensor, value: Reply | bytes) -> str | None:
        """Why a reply fails its key ("" when its value landed in ``out``; None when the job expired first)."""
        if isinstance(value, Exception):
            return failure_kind(value)
        if value is None:
            return "evicted"  # the probe saw it; the store or another replica dropped it since
        if isinstance(value, (int, str)):
            return "other"  # not a value: a reply this tier never asks for
        try:
            self._values.open_into(job, value, self._key(key), out)
        except Expired:
            return None
        except RemoteFormatError as exc:
            return exc.kind
        except CodecError:
            return "corrupt"
        except Exception:
            return "other"
        return ""

    # ---- presence probes ----------------------------------------------------------------------------------
    def probe(self, keys: list[bytes]) -> None:
        """One pipeline of EXISTS; each answer remembered (a fault as an absence with its reason)."""
        present: list[object]
        try:
            if not self._health.up:
                raise _Unavailable()
            pipe = self._store.pipeline()
            for key in keys:
                pipe.exists(self._key(key))
            present = pipe.execute(raise_on_error=False)
        except _Unavailable:
            present = [_Unavailable()] * len(keys)
        except Exception as exc:
            self._health.fault(failure_kind(exc))
            present = [exc] * len(keys)
        else:
            if not any(isinstance(r, Exception) for r in present):
                self._health.ok()
        for key, reply in zip(keys, present):
            if isinstance(reply, _Unavailable):
                self._presence.remember(key, False, self._health.miss_reason)
            elif isinstance(reply, Exception):
                self._presence.remember(key, False, failure_kind(reply))
            else:
                self._presence.remember(key, bool(reply))
            self._presence.probed(key)

    def _done(self, fault: str, src: str, dst: str, nbytes: int, started: float, n: int) -> None:
        """After a batch's keys settled: the store's health (its first fault, else up) and the bytes moved."""
        if fault:
            self._health.fault(fault)
        else:
            self._health.ok()
        if nbytes:
            self._metrics.moved(src, dst, nbytes, time.perf_counter() - started, n)
