"""The books with per-tier breakers (kvtier_runtime.store.books + .breaker): a slow or disabled tier is bypassed
(lookups miss there, stores are not queued to it) while the other tiers keep serving, loads already in flight still
deliver their own bytes, and a recovered or re-enabled tier comes back through half-open probes. Fake tiers whose
jobs finish when the test says, an injected clock: nothing here depends on timing. The breaker's own logic:
tests/runtime/store/test_breaker.py."""
from __future__ import annotations

import json
import zlib

import pytest
import torch
from kvtier_runtime.config import OffloadSpecConfig
from kvtier_runtime.store.books import HIT, MISS, RETRY, OffloadBooks
from kvtier_runtime.store.breaker import CLOSED, DISABLED, HALF_OPEN, OPEN, BreakerSettings, TierBreakers
from kvtier_runtime.store.memory_tier import MemoryTier
from kvtier_runtime.tiers import EventPlace, KeyState, Tier, TierChanges
from kvtier_runtime.tiers.base import ReplayPolicy
from kvtier_runtime.tiers.jobs import JobResult
from plugins.runtime import ManualClock, configmap_update, seq_key

ROW = 64
TOKENS = 100
CHUNK_S = 1e-3  # recomputing one chunk: 100 tokens at 100,000 tokens/s
SUFFIX = b"|run"


class FakeTier:
    """A tier of the books' interface (kvtier_runtime.tiers.Tier), answering as a filesystem tier or, ``shared``,
    as a remote one, whose jobs finish only in :meth:`complete`, loading the bytes it holds for the key, storing
    the host row as it is then."""

    def __init__(self, name: str, io_timeout_s: float = 30.0, on_complete=None, shared: bool = False) -> None:
        self.name = name
        self.medium = "remote" if shared else "filesystem"
        self.origin = "remote" if shared else "disk"
        self.scoped_keys = shared
        self.logs_load_faults = shared
        self.capacity_bytes = self.used_bytes = 0
        self.on_complete = on_complete  # the tier's callback as a job finishes (the books' load meter)
        self.peer = None
        self.io_timeout_s = io_timeout_s
        self.held: dict[bytes, torch.Tensor] = {}
        self.jobs: dict[int, tuple[str, list[bytes], list[torch.Tensor]]] = {}
        self._finished: list[JobResult] = []
        self.loads: list[bytes] = []
        self.stores: list[bytes] = []
        self.state_calls = 0
        self._ids = 0

    def state(self, key: bytes, probe: bool = True) -> KeyState:
        self.state_calls += 1
        return KeyState.HIT if bytes(key) in self.held else KeyState.MISS

    def probe(self, key: bytes) -> KeyState:
        return self.state(key)

    def needs_store(self, key: bytes) -> bool:
        return bytes(key) not in self.held

    def covers(self, key: bytes) -> bool:
        return not self.scoped_keys and bytes(key) in self.held

    def _job(self, kind: str, keys, rows) -> int:
        self._ids += 1
        self.jobs[self._ids] = (kind, [bytes(k) for k in keys], list(rows))
        return self._ids

    def submit_load(self, keys, outs, ctx=None) -> int:
        self.loads += [bytes(k) for k in keys]
        return self._job("load", keys, outs)

    def submit_store(self, keys, rows, ctx=None) -> int:
        self.stores += [bytes(k) for k in keys]
        return self._job("store", keys, rows)

    def complete(self) -> None:
        for job_id, (kind, keys, rows) in self.jobs.items():
            for key, row in zip(keys, rows):
                if kind == "load":
                    row.copy_(self.held[key])
                else:
                    self.held[key] = row.clone()
            result = JobResult(job_id, kind, tuple(keys), (True,) * len(keys))
            self._finished.append(result)
            if self.on_complete is not None:
                self.on_complete(result)
        self.jobs.clear()

    def get_finished(self) -> list[JobResult]:
        out, self._finished = self._finished, []
        return out

    def drain(self, timeout=60) -> None:
        self.complete()

    def close(self) -> None:
        pass

    # What the engine exports and replay models of a tier (the books never ask).
    address = property(lambda self: f"fake://{self.name}")
    capacity_blocks = evictions = 0
    replay_policy = property(lambda self: ReplayPolicy("lru", "none", self.scoped_keys))
    event_place = property(lambda self: EventPlace("STORAGE", "REMOTE" if self.scoped_keys else "LOCAL",
                                                   f"fake-{self.name}"))

    # KV events: what the test says entered (another replica's writes) and left the tier since the last call.
    recording = False
    arrived: list[bytes] = []
    removed: list[bytes] = []

    def record_changes(self) -> None:
        self.recording, self.arrived, self.removed = True, [], []

    def take_changes(self) -> TierChanges:
        out = TierChanges(self.arrived, self.removed)
        self.arrived, self.removed = [], []
        return out

    def gauges(self) -> dict:
        return {}

    def reasons(self) -> dict:
        return {}


def fill(key: bytes) -> torch.Tensor:
    return torch.full((ROW,), zlib.crc32(key) % 251, dtype=torch.uint8)


def settings(**kw) -> BreakerSettings:
    return BreakerSettings(recompute_s_per_token=CHUNK_S / TOKENS, tokens_per_chunk=TOKENS, min_chunks=4,
                           window_chunks=8, probe_chunks=2, **kw)


def make_books(clock, control_file: str | None = None, n_rows: int = 8, stamps: bool = False, events: bool = False,
               **kw):
    """Books over a host tier, a filesystem tier ``nvme`` and a remote tier ``remote`` (fakes). ``stamps``: the
    tiers report when they finish a load (as the real ones do), else the books time a load until they collect it.
    ``events``: KV cache events on."""
    host = MemoryTier("host", (ROW,), torch.uint8, n_rows * ROW)
    breakers = TierBreakers(["host", "nvme", "remote"], settings(**kw), clock=clock, control_file=control_file)
    nvme, remote = (FakeTier(name, on_complete=breakers.meters[i].on_complete if stamps else None, shared=i == 2)
                    for i, name in ((1, "nvme"), (2, "remote")))
    assert isinstance(nvme, Tier) and isinstance(remote, Tier)
    books = OffloadBooks(host, [nvme, remote], key_suffix=SUFFIX, breakers=breakers, enable_events=events)
    return books, nvme, remote


def held_in(tier: FakeTier, key: bytes, remote: bool = False) -> None:
    tier.held[key if remote else key + SUFFIX] = fill(key)


def load_through(books: OffloadBooks, tier: FakeTier, clock: ManualClock, key: bytes, cost_s: float) -> str:
    """Look ``key`` up; if a promotion starts, let it take ``cost_s`` and finish; the final answer, with the bytes
    checked for a hit."""
    first = books.lookup(key)
    if first != RETRY:
        return first
    clock.advance(cost_s)
    tier.complete()
    state = books.lookup(key)
    if state == HIT:
        (slot,) = books.prepare_load([key])
        assert torch.equal(books.host.slab[slot], fill(key))  # never another chunk's bytes
        books.complete_load([key])
    return state


def store(books: OffloadBooks, key: bytes) -> None:
    out = books.prepare_store([key])
    assert out is not None
    for k, slot in zip(out[0], out[1]):
        books.host.slab[slot].copy_(fill(k))
    books.complete_store(out[0])


def test_a_slow_newest_tier_is_bypassed_while_the_earlier_tiers_keep_serving() -> None:
    clock = ManualClock()
    books, nvme, remote = make_books(clock)
    for i in range(20):
        held_in(nvme, seq_key(i))
        held_in(remote, seq_key(100 + i), remote=True)
    for i in range(4):  # the remote tier: 10x recomputing
        assert load_through(books, remote, clock, seq_key(100 + i), 10 * CHUNK_S) == HIT
    assert books.breakers[2].state == OPEN and books.breakers[1].state == CLOSED
    asked = (len(remote.loads), remote.state_calls)
    assert books.lookup(seq_key(110)) == MISS  # on the remote tier, bypassed: vLLM recomputes
    assert (len(remote.loads), remote.state_calls) == asked  # not even asked whether it holds it
    assert books.breakers.bypassed_lookups == {"remote": 1}
    for i in range(6):  # the filesystem tier still serves, at its own pace
        assert load_through(books, nvme, clock, seq_key(i), 0.2 * CHUNK_S) == HIT
    assert books.breakers[1].state == CLOSED
    store(books, seq_key(500))
    assert nvme.stores == [seq_key(500) + SUFFIX] and seq_key(500) not in remote.stores  # no store to an open tier
    assert books.breakers.bypassed_stores == {"remote": 1}
    nvme.complete()
    books.poll()
    assert not books.has_pending_work()
    assert books.breakers[2].bypass_gauges() == {"slow": 1, "disabled": 0}
    assert books.breakers[1].bypass_gauges() == {"slow": 0, "disabled": 0}


def test_a_slow_middle_tier_is_skipped_and_the_tier_behind_it_serves() -> None:
    clock = ManualClock()
    books, nvme, remote = make_books(clock)
    for i in range(4):
        held_in(nvme, seq_key(i))
        assert load_through(books, nvme, clock, seq_key(i), 20 * CHUNK_S) == HIT
    assert books.breakers[1].state == OPEN
    held_in(nvme, seq_key(50))
    held_in(remote, seq_key(50), remote=True)
    assert load_through(books, remote, clock, seq_key(50), 0.1 * CHUNK_S) == HIT
    assert books.hit_keys[books.slots[1].name] == 1  # counted for the remote tier, behind the skipped one
    assert seq_key(50) + SUFFIX not in nvme.loads


def test_a_recovered_tier_resumes_through_half_open_probes() -> None:
    clock = ManualClock()
    books, nvme, remote = make_books(clock, half_open_dwell_s=0.0)
    s = books.breakers.settings
    for i in range(30):
        held_in(remote, seq_key(i), remote=True)
    for i in range(4):
        load_through(books, remote, clock, seq_key(i), 10 * CHUNK_S)
    assert books.breakers[2].state == OPEN
    clock.advance(s.open_dwell_s)
    books.poll()
    assert books.breakers[2].state == HALF_OPEN
    assert books.lookup(seq_key(10)) == RETRY  # the probe
    assert books.lookup(seq_key(11)) == MISS  # one probe at a time: the rest is bypassed
    clock.advance(0.1 * CHUNK_S)
    remote.complete()
    assert books.lookup(seq_key(10)) == HIT
    assert books.lookup(seq_key(12)) == MISS  # the probe interval has not passed
    clock.advance(s.probe_interval_s)
    assert load_through(books, remote, clock, seq_key(13), 0.1 * CHUNK_S) == HIT
    assert books.breakers[2].state == CLOSED
    assert load_through(books, remote, clock, seq_key(14), 0.1 * CHUNK_S) == HIT
    assert books.breakers.bypassed_lookups == {"remote": 2}


def test_control_file_disables_a_tier_its_in_flight_load_still_lands_and_it_resumes_when_removed(tmp_path) -> None:
    root = tmp_path / "kvtier-control"
    root.mkdir()
    configmap_update(root, {"control.json": json.dumps({"disabledTiers": [], "generation": 1})}, 1)
    clock = ManualClock()
    books, nvme, remote = make_books(clock, control_file=str(root / "control.json"), half_open_dwell_s=0.0)
    for i in range(10):
        held_in(nvme, seq_key(i))
    assert books.lookup(seq_key(0)) == RETRY  # a load in flight when the tier is disabled
    configmap_update(root, {"control.json": json.dumps({"disabledTiers": ["nvme"], "generation": 2})}, 2)
    clock.advance(1.0)
    assert books.lookup(seq_key(1)) == MISS  # read on this lookup's poll: disabled from now on
    assert books.breakers[1].state == DISABLED and books.breakers.generation == 2
    nvme.complete()
    assert books.lookup(seq_key(0)) == HIT  # the load that was in flight delivers, with its own bytes
    (slot,) = books.prepare_load([seq_key(0)])
    assert torch.equal(books.host.slab[slot], fill(seq_key(0)))
    books.complete_load([seq_key(0)])
    # A chunk only the disabled tier holds is stored in the host tier again, not skipped as "on disk".
    out = books.prepare_store([seq_key(2)])
    assert out is not None and out[0] == [seq_key(2)]
    books.complete_store(out[0], success=False)
    configmap_update(root, {"control.json": json.dumps({"disabledTiers": [], "generation": 3})}, 3)
    clock.advance(1.0)
    books.poll()
    assert books.breakers[1].state == HALF_OPEN and books.breakers[1].bypass_gauges()["disabled"] == 1
    for i in (3, 4):
        assert load_through(books, nvme, clock, seq_key(i), 0.1 * CHUNK_S) == HIT
        clock.advance(1.0)
    assert books.breakers[1].state == CLOSED and books.breakers[1].bypass_gauges() == {"slow": 0, "disabled": 0}


def test_a_disabled_host_tier_turns_offloading_off_until_re_enabled(tmp_path) -> None:
    root = tmp_path / "cm"
    root.mkdir()
    clock = ManualClock()
    configmap_update(root, {"control.json": "{}"}, 1)
    books, nvme, remote = make_books(clock, control_file=str(root / "control.json"))
    store(books, seq_key(1))
    assert books.lookup(seq_key(1)) == HIT
    configmap_update(root, {"control.json": json.dumps({"disabledTiers": ["host"]})}, 2)
    clock.advance(1.0)
    assert books.lookup(seq_key(1)) == MISS
    held_in(nvme, seq_key(2))
    assert books.lookup(seq_key(2)) == MISS and not nvme.loads  # the tiers behind it load through it
    assert books.prepare_store([seq_key(3)]) == ([], [], [])  # an empty store, not a refusal
    assert books.breakers.bypassed_lookups == {"host": 2} and books.breakers.bypassed_stores == {"host": 1}
    configmap_update(root, {"control.json": json.dumps({"disabledTiers": []})}, 3)
    clock.advance(1.0)
    assert books.lookup(seq_key(1)) == HIT  # the host tier is not timed: closed at once
    nvme.complete()
    books.poll()


def test_a_store_probe_goes_through_a_half_open_tier_one_job_at_a_time() -> None:
    clock = ManualClock()
    books, nvme, remote = make_books(clock)
    books.breakers[2].force(True)
    store(books, seq_key(1))
    assert remote.stores == []
    books.breakers[2].force(False)
    store(books, seq_key(2))
    store(books, seq_key(3))  # the probe job is still in flight
    assert remote.stores == [seq_key(2)] and books.breakers.bypassed_stores["remote"] == 2
    remote.complete()
    nvme.complete()
    books.poll()
    clock.advance(books.breakers.settings.probe_interval_s)
    store(books, seq_key(4))
    assert remote.stores == [seq_key(2), seq_key(4)]


def test_spec_config_names_the_breakers_and_they_answer_to_addresses_too(tmp_path) -> None:
    extra = {"cpu_bytes_to_use": 1 << 20, "fs_tiers": [{"root_dir": "/mnt/nvme", "capacity_bytes": 1 << 30}],
             "remote_tiers": [{"url": "redis://kv:6379", "capacity_bytes": 1 << 30, "scope": "team-a", "mac_key_file": "/etc/kvtier/tenant-key"}],
             "control_file": str(tmp_path / "control.json"), "recompute_tokens_per_s": 50_000,
             "tier_names": ["cpu", "nvme", "shared"]}
    cfg = OffloadSpecConfig.from_extra_config(extra)
    assert OffloadSpecConfig.from_extra_config(cfg.to_extra_config()) == cfg
    (tmp_path / "control.json").write_text(json.dumps({"disabledTiers": ["redis://kv:6379", "cpu"]}))
    tb = TierBreakers.for_spec(cfg, TOKENS, clock=ManualClock())
    assert tb.names == ["cpu", "nvme", "shared"] and tb.settings.recompute_s_per_chunk == pytest.approx(2e-3)
    assert [b.state for b in tb.breakers] == [DISABLED, CLOSED, DISABLED]
    plain = OffloadSpecConfig.from_extra_config({k: v for k, v in extra.items() if k != "tier_names"})
    assert TierBreakers.for_spec(plain, TOKENS).names == ["host", "/mnt/nvme", "redis://kv:6379"]
    assert "control_file" not in OffloadSpecConfig(cpu_bytes_to_use=1).to_extra_config()  # off unless set


@pytest.mark.parametrize(("extra", "message"), [
    ({"control_file": "control.json"}, "kv_connector_extra_config.control_file: 'control.json' must be an absolute"),
    ({"recompute_tokens_per_s": 0}, "kv_connector_extra_config.recompute_tokens_per_s: 0 must be a positive number"),
    ({"recompute_tokens_per_s": True}, "kv_connector_extra_config.recompute_tokens_per_s: True must be a positive"),
    ({"tier_names": ["host", "nvme"]}, "kv_connector_extra_config.tier_names: 2 names for 1 tiers"),
    ({"tier_names": [""]}, "kv_connector_extra_config.tier_names: [''] must be a list of non-empty names"),
    ({"tier_names": "host"}, "kv_connector_extra_config.tier_names: 'host' must be a list of tier names"),
    ({"tier_names": ["a", "a"], "fs_tiers": [{"root_dir": "/d", "capacity_bytes": 1}]},
     "kv_connector_extra_config.tier_names: ['a', 'a'] must be distinct"),
])
def test_breaker_config_errors_name_the_key(extra, message) -> None:
    from kvtier_runtime.config import ConfigError

    with pytest.raises(ConfigError) as err:
        OffloadSpecConfig.from_extra_config({"cpu_bytes_to_use": 1, **extra})
    assert str(err.value).startswith(message)


def test_expired_loads_count_once_as_timeouts_and_their_late_end_is_not_counted_again() -> None:
    clock = ManualClock()
    host = MemoryTier("host", (ROW,), torch.uint8, 8 * ROW)
    remote = FakeTier("remote", io_timeout_s=0.0, shared=True)  # every promotion is overdue at the next poll
    breakers = TierBreakers(["host", "remote"], settings(), clock=clock)
    books = OffloadBooks(host, [remote], breakers=breakers)
    for i in range(4):
        held_in(remote, seq_key(i), remote=True)
        assert books.lookup(seq_key(i)) == RETRY
        clock.advance(10 * CHUNK_S)
        assert books.lookup(seq_key(i)) == MISS  # expired: vLLM recomputes (the slot stays fenced)
    assert books.remote_load_failures["timeout"] == 4
    assert breakers[1].state == OPEN
    remote.on_complete = breakers.meters[1].on_complete
    remote.complete()  # the late reads land in their fenced slots
    books.poll()
    assert not breakers.meters[1]._ends and breakers.meters[1].take() is None
    assert not books.has_pending_work() and books.fenced_slots == 0



def test_a_fast_tier_collected_a_long_step_later_is_judged_by_when_it_finished() -> None:
    # The engine collects finished loads once per scheduler step. A tier that reads a chunk in a tenth of the
    # recompute time, collected 20 recompute-times later (a long step), is fast: the tier's own end time counts.
    # Without the tier's end times (stamps False) the same loads look slow: the comparison shows the test can fail.
    for stamps, opened in ((True, False), (False, True)):
        clock = ManualClock()
        books, nvme, remote = make_books(clock, stamps=stamps)
        served = 0
        for i in range(40):
            held_in(nvme, seq_key(i))
            if books.lookup(seq_key(i)) != RETRY:
                break
            clock.advance(0.1 * CHUNK_S)
            nvme.complete()
            clock.advance(20 * CHUNK_S)  # the rest of the step
            assert books.lookup(seq_key(i)) == HIT
            served += 1
        assert (books.breakers[1].state == OPEN) == opened and served == (4 if opened else 40), stamps


def test_a_real_filesystem_tier_reports_its_load_ends_to_the_meter_and_can_be_disabled(tmp_path) -> None:
    import time

    from kvtier_runtime.config import FilesystemTierConfig
    from kvtier_runtime.fs.tier import FilesystemTier

    host = MemoryTier("host", (ROW,), torch.uint8, 2 * ROW)
    breakers = TierBreakers(["host", "disk"], BreakerSettings(), clock=time.monotonic)  # no rate: no verdicts
    cfg = FilesystemTierConfig(root_dir=str(tmp_path / "fs"), capacity_bytes=1 << 20, n_read_threads=1,
                               n_write_threads=1)
    disk = FilesystemTier(cfg, (ROW // 2,), torch.float16, name=f"disk-{time.monotonic_ns()}",
                          on_complete=breakers.meters[1].on_complete)
    books = OffloadBooks(host, [disk], rows=[host.slab.view(torch.float16)], key_suffix=SUFFIX,
                         breakers=breakers)
    try:
        for i in range(3):  # two host rows: the first key ends up on disk only
            store(books, seq_key(i))
            books.drain()
        assert seq_key(0) not in books.host and books.lookup(seq_key(0)) == RETRY
        books.drain()
        assert books.lookup(seq_key(0)) == HIT
        (slot,) = books.prepare_load([seq_key(0)])
        assert torch.equal(books.host.slab[slot], fill(seq_key(0)))
        books.complete_load([seq_key(0)])
        assert breakers[1].cost_s_per_chunk is not None and not breakers.meters[1]._ends  # timed, stamp used
        breakers[1].force(True)
        assert books.lookup(seq_key(1)) == MISS and breakers.bypassed_lookups == {"disk": 1}
        store(books, seq_key(9))
        books.drain()
        assert breakers.bypassed_stores == {"disk": 1} and disk.state(seq_key(9) + SUFFIX) is KeyState.MISS
    finally:
        books.close()


def test_two_remote_tiers_on_one_store_get_distinct_default_names() -> None:
    cfg = OffloadSpecConfig.from_extra_config({"cpu_bytes_to_use": 1, "remote_tiers": [
        {"url": "redis://kv:6379", "capacity_bytes": 1, "scope": "team-a", "mac_key_file": "/etc/kvtier/tenant-key"},
        {"url": "redis://kv:6379", "capacity_bytes": 2, "scope": "team-a", "mac_key_file": "/etc/kvtier/tenant-key"}]})
    assert TierBreakers.for_spec(cfg, TOKENS).names == ["host", "redis://kv:6379", "redis://kv:6379#2"]


def announced(books: OffloadBooks) -> list[tuple[int, bool, tuple[bytes, ...]]]:
    """The books' KV events for the tiers behind the host tier: (announced under tier, removed, keys)."""
    return [(e.tier, e.removed, e.keys) for e in books.take_events() if e.tier >= 0]


def test_every_tier_announces_its_chunks_once_per_medium_whatever_its_kind_or_place() -> None:
    """The books take every tier in one list, in lookup order, and each announces what enters and leaves it; which
    tier announces is never decided by its kind or its place in the list. Both tiers are vLLM's STORAGE medium, and
    a router's index keeps one entry per medium (llm-d's, no count): a chunk both hold is announced once, and is
    removed only when neither holds it -- under the tier that announced it."""
    host = MemoryTier("host", (ROW,), torch.uint8, 4 * ROW)
    shared, local = FakeTier("remote", shared=True), FakeTier("nvme")
    books = OffloadBooks(host, [shared, local], key_suffix=SUFFIX, enable_events=True)
    assert books.tiers == [shared, local] and shared.recording and local.recording
    # Another replica wrote k1 into the shared store; the local tier holds k1 and k2 (another run's key: not ours).
    shared.arrived = [seq_key(1)]
    local.arrived = [seq_key(1) + SUFFIX, seq_key(2) + SUFFIX, seq_key(3) + b"other-model"]
    assert announced(books) == [(0, False, (seq_key(1),)), (1, False, (seq_key(2),))]
    local.removed = [seq_key(1) + SUFFIX, seq_key(2) + SUFFIX]  # evicted from disk: k1 is still in the store
    assert announced(books) == [(1, True, (seq_key(2),))]
    shared.removed = [seq_key(1)]  # trimmed from the store: now nobody holds it
    assert announced(books) == [(0, True, (seq_key(1),))]
    # Events off for a tier: it is not asked to record, and announces nothing.
    quiet = FakeTier("hdd")
    OffloadBooks(host, [quiet], enable_events=True, tier_events=[False])
    assert not quiet.recording


def test_a_bypassed_tier_leaves_the_index_and_comes_back_when_it_serves_again(tmp_path) -> None:
    """The control file disables nvme: the chunks only nvme holds are announced removed at the next events (a
    router must stop sending their prefixes here), those the store also holds stay; what enters or leaves nvme
    meanwhile is not announced. Re-enabled, it stays out of the index while half-open and is announced again, as
    it holds then, once its probes pass. The host tier disabled takes every chunk out of the index."""
    root = tmp_path / "kvtier-control"
    root.mkdir()
    configmap_update(root, {"control.json": json.dumps({"disabledTiers": [], "generation": 1})}, 1)
    clock = ManualClock()
    books, nvme, remote = make_books(clock, control_file=str(root / "control.json"), events=True,
                                     half_open_dwell_s=0.0)
    store(books, seq_key(9))
    nvme.arrived = [seq_key(1) + SUFFIX, seq_key(2) + SUFFIX]
    remote.arrived = [seq_key(2)]
    assert announced(books) == [(0, False, (seq_key(1), seq_key(2)))]
    configmap_update(root, {"control.json": json.dumps({"disabledTiers": ["nvme"], "generation": 2})}, 2)
    clock.advance(1.0)
    assert announced(books) == [(0, True, (seq_key(1),))]  # k2: the store still serves it
    nvme.arrived = [seq_key(3) + SUFFIX]  # a write that was in flight lands while bypassed
    nvme.removed = [seq_key(2) + SUFFIX]
    assert announced(books) == []
    configmap_update(root, {"control.json": json.dumps({"disabledTiers": [], "generation": 3})}, 3)
    clock.advance(1.0)
    books.poll()
    assert books.breakers[1].state == HALF_OPEN and announced(books) == []
    for i in (13, 14):
        held_in(nvme, seq_key(i))
        assert load_through(books, nvme, clock, seq_key(i), 0.1 * CHUNK_S) == HIT
        clock.advance(1.0)
    assert books.breakers[1].state == CLOSED
    # k9's write-through to nvme, queued before the tier was disabled, finished while it was bypassed.
    assert announced(books) == [(0, False, (seq_key(1), seq_key(3), seq_key(9)))]
    configmap_update(root, {"control.json": json.dumps({"disabledTiers": ["host"], "generation": 4})}, 4)
    clock.advance(1.0)
    events = books.take_events()
    assert [e.removed for e in events] == [True] * len(events)
    assert seq_key(9) in {k for e in events if e.tier < 0 for k in e.keys}
    assert sorted(k for e in events if e.tier >= 0 for k in e.keys) == [seq_key(i) for i in (1, 2, 3, 9)]


@pytest.mark.parametrize(("kw", "message"), [
    ({"tier_events": [True]}, r"tier_events: 1 flags for 2 tiers \(one per tier\)"),
    ({"rows": [None]}, r"rows: 1 row views for 2 tiers \(one per tier\)"),
])
def test_the_books_refuse_per_tier_options_that_do_not_fit_the_tier_list(kw, message) -> None:
    host = MemoryTier("host", (ROW,), torch.uint8, 4 * ROW)
    with pytest.raises(ValueError, match=message):
        OffloadBooks(host, [FakeTier("remote", shared=True), FakeTier("nvme")], **kw)
