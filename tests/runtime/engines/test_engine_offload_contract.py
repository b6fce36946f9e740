"""kvtier's offloading books keep vLLM's OffloadingManager contract (issue 29), without vLLM installed.

Each test names a class of defect the books had, seen when vLLM 0.33's own offloading tests ran against kvtier:

* an offer evicting part of itself (a store must never leave a hole in its own prefix);
* stores that were neither a prefix nor nothing (vLLM: not enough room is ``None``; an admission refusal is an
  empty store, not ``None``, or the connector counts an allocation failure and never offers the rest again);
* a cache reset leaving in-flight keys ``hit_pending`` for ever (the same prompt then stalls);
* no KV cache events from the host tier or the filesystem tiers.

The same contract, driven through vLLM itself, is tests/vllm/test_vllm_upstream_offload.py.
"""
from __future__ import annotations

import time

from kvtier_runtime.config import FilesystemTierConfig
from kvtier_runtime.policies import AccessContext
from kvtier_runtime.store.books import HIT, HIT_PENDING, MISS, RETRY, OffloadBooks
from plugins.runtime import close_books, engine_books, seq_key

ROW = 1024


def _books(tmp_path, n_rows: int = 4, *, fs: bool = False, fs_rows: int = 64, events: bool = False,
           admission: str | None = None, threshold: int | None = None, policy: str = "lru"):
    tiers = []
    if fs:
        tiers.append(FilesystemTierConfig(root_dir=str(tmp_path / "fs"), capacity_bytes=fs_rows * (ROW + 4096),
                                          codec="none", n_read_threads=1, n_write_threads=1))
    return engine_books(tmp_path, n_rows, ROW, tiers, enable_events=events, eviction_policy=policy,
                        admission=admission, admission_threshold=threshold)


def _store(books: OffloadBooks, keys: list[bytes]) -> list[bytes]:
    out = books.prepare_store(keys)
    assert out is not None
    books.complete_store(out[0])
    return out[0]


# ---- an offer never evicts part of itself -----------------------------------------------------------------------
def test_an_offer_never_evicts_its_own_held_keys(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=4)
    _store(books, [seq_key(1), seq_key(2)])
    books.touch([seq_key(1)])  # 2 is now the least recently used chunk, and it is part of the next offer
    out = books.prepare_store([seq_key(k) for k in (2, 3, 4, 5)])
    assert out is not None
    to_store, _, evicted = out
    assert to_store == [seq_key(3), seq_key(4), seq_key(5)] and evicted == [seq_key(1)]
    books.complete_store(to_store)
    # The offer's whole prefix is held: no [_, 3, 4, 5] hole that makes 3-5 unreachable.
    assert [books.lookup(seq_key(k)) for k in (2, 3, 4, 5)] == [HIT] * 4
    close_books(books, region)


def test_a_request_never_evicts_the_chunks_it_stored_earlier(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=3)
    _store(books, [seq_key(9)])
    _store(books, [seq_key(1), seq_key(2)])  # the request's first step; 9 is older than both
    books.touch([seq_key(9)])  # now 1 is the least recently used
    out = books.prepare_store([seq_key(1), seq_key(2), seq_key(3)])  # the next step re-offers its prefix plus one chunk
    assert out is not None and out[0] == [seq_key(3)] and out[2] == [seq_key(9)]
    close_books(books, region)


# ---- a prefix or nothing, with vLLM's None / empty semantics -----------------------------------------------------
def test_not_enough_room_for_the_whole_offer_is_none_and_changes_nothing(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=2, events=True)
    _store(books, [seq_key(1), seq_key(2)])
    books.prepare_load([seq_key(1)])  # pinned by a load: only chunk 2 is evictable
    books.take_events()
    assert books.prepare_store([seq_key(6), seq_key(7)]) is None
    # Not [6] stored by evicting 2: a partial store that vLLM never asked for, and 2 is still held.
    assert books.lookup(seq_key(2)) == HIT and books.lookup(seq_key(6)) == MISS
    assert books.take_events() == []
    books.complete_load([seq_key(1)])
    close_books(books, region)


def test_an_admission_refusal_is_an_empty_store_not_none(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=8, admission="threshold", threshold=2)
    keys = [seq_key(k) for k in range(4)]
    # First offer: the filter declines every key. vLLM's connector treats None as an allocation failure (and
    # then never offers those chunks again); an empty store means "nothing to do" and the request goes on.
    assert books.prepare_store(keys) == ([], [], [])
    # Every key's offer was recorded, so the second offer stores all of them, not one per offer.
    out = books.prepare_store(keys)
    assert out is not None and out[0] == keys
    close_books(books, region)


def test_an_admission_refusal_stops_the_store_so_it_stays_a_prefix(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=8, admission="threshold", threshold=2)
    assert books.prepare_store([seq_key(1), seq_key(3)]) == ([], [], [])  # offers of 1 and 3 recorded
    out = books.prepare_store([seq_key(1), seq_key(2), seq_key(3)])  # 1 admitted, 2 declined (first offer), 3 admitted
    assert out is not None and out[0] == [seq_key(1)]  # not [1, 3]: 3 would be unreachable behind the hole at 2
    close_books(books, region)


# ---- a cache reset fences in-flight transfers -------------------------------------------------------------------
def test_a_reset_turns_in_flight_stores_into_misses_and_fences_their_slots(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=3)
    out = books.prepare_store([seq_key(1), seq_key(2)])
    assert out is not None
    assert books.lookup(seq_key(1)) == HIT_PENDING
    books.reset_host()
    # vLLM 0.33 never completes a job that was in flight at the reset: HIT_PENDING here stalled the request.
    assert books.lookup(seq_key(1)) == MISS and books.lookup(seq_key(2)) == MISS
    assert books.fenced_slots == 2  # the worker may still be writing those rows: they are not reused yet
    again = books.prepare_store([seq_key(1)])
    assert again is not None and again[0] == [seq_key(1)] and again[1][0] not in out[1]
    books.complete_store([seq_key(1)])
    assert books.lookup(seq_key(1)) == HIT
    books.reset_flushed()  # vLLM 0.33: every job in flight at the reset was reported by the workers
    assert books.fenced_slots == 0
    assert books.prepare_store([seq_key(5), seq_key(6)]) is not None  # the fenced rows are usable again
    close_books(books, region)


def test_a_reset_releases_a_fenced_slot_when_its_late_completion_arrives(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=2)
    _store(books, [seq_key(1)])
    books.prepare_load([seq_key(1)])
    books.prepare_store([seq_key(2)])
    books.reset_host()
    assert books.fenced_slots == 2 and books.lookup(seq_key(1)) == MISS
    books.complete_load([seq_key(1)])  # an engine that does report pre-reset jobs (vLLM 0.32)
    books.complete_store([seq_key(2)])
    assert books.fenced_slots == 0 and books.lookup(seq_key(2)) == MISS  # completed, but reset: not a hit
    close_books(books, region)


def test_a_reset_during_a_write_through_fences_the_row_until_the_disk_has_it(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=2, fs=True)
    out = books.prepare_store([seq_key(1)])
    assert out is not None
    books.complete_store([seq_key(1)])  # the row is now pinned by the write to disk
    books.reset_host()
    books.drain()
    assert books.fenced_slots == 0 and len(books.host) == 0
    deadline = time.monotonic() + 10
    while (state := books.lookup(seq_key(1))) == RETRY and time.monotonic() < deadline:
        books.drain()
    assert state == HIT  # the disk copy survives the reset and is promoted back
    close_books(books, region)


# ---- KV cache events from every tier ----------------------------------------------------------------------------
def test_events_announce_host_stores_and_evictions_in_order(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=2, events=True)
    _store(books, [seq_key(1), seq_key(2)])
    assert [(e.keys, e.tier, e.removed) for e in books.take_events()] == [((seq_key(1), seq_key(2)), -1, False)]
    _store(books, [seq_key(3)])
    events = [(e.keys, e.tier, e.removed) for e in books.take_events()]
    assert events == [((seq_key(1),), -1, True), ((seq_key(3),), -1, False)]  # the removal precedes the store
    out = books.prepare_store([seq_key(4)])
    books.complete_store(out[0], success=False)
    failed = books.take_events()
    assert [(e.keys, e.removed, e.metadata_only) for e in failed] == [((seq_key(2),), True, False),
                                                                     ((seq_key(4),), True, True)]
    close_books(books, region)


def test_events_announce_filesystem_tier_stores_and_removals(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=4, fs=True, fs_rows=2, events=True)
    for k in (1, 2, 3):
        _store(books, [seq_key(k)])
        books.drain()
    events = [(e.keys, e.tier, e.removed) for e in books.take_events()]
    on_disk = [e for e in events if e[1] == 0]
    assert ((seq_key(1),), 0, False) in on_disk and ((seq_key(3),), 0, False) in on_disk
    assert any(e[2] and seq_key(1) in e[0] for e in on_disk), events  # the tier holds 2 chunks: 1 was evicted
    close_books(books, region)


def test_events_are_off_unless_enabled(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=2, fs=True)
    _store(books, [seq_key(1)])
    books.drain()
    assert books.take_events() == []
    close_books(books, region)



# ---- `lru` means vLLM 0.33's lru: request-aware ------------------------------------------------------------------
def _ctx(request: str, position: int) -> AccessContext:
    return AccessContext(request_id=request, position=position)


def test_lru_evicts_a_running_requests_tail_before_its_prefix(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=4)
    keys = [seq_key(k) for k in (1, 2, 3)]
    out = books.prepare_store(keys, [_ctx("r", 16 * (i + 1)) for i in range(3)])
    assert out is not None
    books.complete_store(keys)
    _store(books, [seq_key(9)])  # a later chunk of no request
    out = books.prepare_store([seq_key(10), seq_key(11)])
    # Plain LRU evicted the request's head (1, then 2): every chunk behind it was then unreachable.
    assert out is not None and out[2] == [seq_key(3), seq_key(2)]
    assert books.lookup(seq_key(1)) == HIT
    close_books(books, region)


def test_lru_a_finished_requests_head_is_its_most_recent_chunk(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=3)
    keys = [seq_key(k) for k in (1, 2, 3)]
    out = books.prepare_store(keys, [_ctx("r", 16 * (i + 1)) for i in range(3)])
    books.complete_store(out[0])
    books.request_finished(keys, "r")  # tail to head: 1 becomes the most recent
    out = books.prepare_store([seq_key(7), seq_key(8)])
    assert out is not None and out[2] == [seq_key(3), seq_key(2)]
    close_books(books, region)


def test_lru_a_load_by_a_newer_request_outranks_an_older_requests_tail(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=3)
    out = books.prepare_store([seq_key(1), seq_key(2)], [_ctx("old", 16), _ctx("old", 32)])
    books.complete_store(out[0])
    _store(books, [seq_key(5)])
    books.prepare_load([seq_key(2)], [_ctx("new", 16)])  # a newer request reads chunk 2
    books.complete_load([seq_key(2)])
    out = books.prepare_store([seq_key(7)])
    assert out is not None and out[2] == [seq_key(1)]
    close_books(books, region)

