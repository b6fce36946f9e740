"""The per-tier breaker (kvtier_runtime.store.breaker) and the live control file (kvtier_runtime.store.control), as
pure logic on an injected clock: no sleeps, nothing timing-dependent. Their wiring into the books:
tests/runtime/engines/test_engine_offload_breaker.py."""
from __future__ import annotations

import json
import logging
import os
import random

import pytest
from kvtier_runtime.store.breaker import (
    BYPASS,
    CLOSED,
    DISABLED,
    HALF_OPEN,
    OPEN,
    PASS,
    PROBE,
    Breaker,
    BreakerSettings,
    LoadMeter,
    TierBreakers,
)
from kvtier_runtime.store.control import ControlFile, parse_control
from plugins.runtime import ManualClock, configmap_update

RECOMPUTE_S_PER_TOKEN = 1e-5
TOKENS = 100  # per chunk: recomputing a chunk costs 1 ms
CHUNK_S = RECOMPUTE_S_PER_TOKEN * TOKENS


Clock = ManualClock


def settings(**kw) -> BreakerSettings:
    return BreakerSettings(recompute_s_per_token=RECOMPUTE_S_PER_TOKEN, tokens_per_chunk=TOKENS, **kw)


def feed(b: Breaker, clock: Clock, cost_per_chunk: float, chunks: int = 1, n: int = 1) -> None:
    """``n`` samples of ``chunks`` chunks loaded at ``cost_per_chunk`` seconds each, the clock running meanwhile."""
    for _ in range(n):
        clock.advance(cost_per_chunk * chunks)
        b.record(cost_per_chunk * chunks, chunks)


def test_noisy_but_acceptable_latency_never_flaps() -> None:
    # Lognormal per-chunk costs averaging 0.6x recomputing, heavy-ish tail (sigma 0.6: one sample in a hundred is
    # over 2.4x), delivered in batches of 1-8 chunks: 20,000 samples must not move the breaker once.
    rng = random.Random(20261202)
    clock = Clock()
    b = Breaker("nvme", settings(), clock=clock)
    mu = -0.18  # exp(mu + sigma^2 / 2) = 1.0: mean factor 1
    worst = 0.0
    for _ in range(20_000):
        chunks = rng.randint(1, 8)
        cost = sum(0.6 * CHUNK_S * rng.lognormvariate(mu, 0.6) for _ in range(chunks))
        worst = max(worst, cost / chunks / CHUNK_S)
        clock.advance(cost)
        b.record(cost, chunks)
        assert b.load_gate() == PASS
    assert worst > 1.5, "the noise must cross the open ratio sample by sample, or this test proves nothing"
    assert b.state == CLOSED and not b.transitions


def test_a_slow_tier_opens_after_the_minimum_chunks_and_not_before() -> None:
    clock = Clock()
    s = settings()
    b = Breaker("remote", s, clock=clock)
    feed(b, clock, 3 * CHUNK_S, n=s.min_chunks - 1)
    assert b.state == CLOSED  # too few chunks to judge
    feed(b, clock, 3 * CHUNK_S)
    assert b.state == OPEN and b.reason == "slow" and b.load_gate() == BYPASS and b.store_gate() == BYPASS
    assert b.bypass_gauges() == {"slow": 1, "disabled": 0}


def test_a_tier_just_over_the_close_ratio_but_under_the_open_ratio_stays_closed() -> None:
    clock = Clock()
    b = Breaker("nvme", settings(), clock=clock)
    feed(b, clock, 1.3 * CHUNK_S, n=500)  # slower than recomputing, within the margin
    assert b.state == CLOSED


def test_a_recovered_tier_closes_through_half_open_probes() -> None:
    clock = Clock()
    s = settings()
    b = Breaker("nvme", s, clock=clock)
    feed(b, clock, 5 * CHUNK_S, n=s.min_chunks)
    assert b.state == OPEN
    clock.advance(s.open_dwell_s - 1)
    assert b.load_gate() == BYPASS  # still dwelling
    clock.advance(1)
    assert b.load_gate() == PROBE and b.state == HALF_OPEN
    for i in range(s.probe_chunks):
        b.probe_started("load")
        assert b.load_gate() == BYPASS  # one probe at a time
        assert b.store_gate() == (PROBE if i == 0 else BYPASS)  # stores have their own probe
        if i == 0:
            b.probe_started("store")
        feed(b, clock, 0.2 * CHUNK_S)
        b.probe_finished("load")
        assert b.load_gate() == BYPASS  # not before the probe interval
        clock.advance(s.probe_interval_s)
    assert b.state == HALF_OPEN and clock.t - b.since < s.half_open_dwell_s  # healthy, waiting out its dwell
    clock.t = b.since + s.half_open_dwell_s
    assert b.state == HALF_OPEN and b.load_gate() == PASS  # the next look closes it, no probe needed
    assert b.state == CLOSED and b.load_gate() == PASS and b.bypass_gauges() == {"slow": 0, "disabled": 0}
    assert dict(b.transitions) == {OPEN: 1, HALF_OPEN: 1, CLOSED: 1}


def test_half_open_reopens_when_probes_are_still_slow_and_closing_waits_for_its_dwell() -> None:
    clock = Clock()
    s = settings(half_open_dwell_s=60.0)
    b = Breaker("nvme", s, clock=clock)
    feed(b, clock, 5 * CHUNK_S, n=s.min_chunks)
    clock.advance(s.open_dwell_s)
    assert b.load_gate() == PROBE
    feed(b, clock, 1.0 * CHUNK_S, n=s.probe_chunks)  # better, but not under the close ratio
    assert b.state == OPEN and b.transitions[OPEN] == 2
    clock.advance(s.open_dwell_s)
    assert b.load_gate() == PROBE
    feed(b, clock, 0.1 * CHUNK_S, n=s.probe_chunks)
    assert b.state == HALF_OPEN  # healthy, but only just half-open
    clock.advance(s.half_open_dwell_s)
    feed(b, clock, 0.1 * CHUNK_S)
    assert b.state == CLOSED


def test_closed_dwell_keeps_a_just_closed_tier_from_reopening_at_once() -> None:
    clock = Clock()
    s = settings(half_open_dwell_s=0.0)
    b = Breaker("nvme", s, clock=clock)
    feed(b, clock, 5 * CHUNK_S, n=s.min_chunks)
    clock.advance(s.open_dwell_s)
    b.load_gate()
    feed(b, clock, 0.1 * CHUNK_S, n=s.probe_chunks)
    assert b.state == CLOSED
    feed(b, clock, 5 * CHUNK_S, n=s.window_chunks)  # slow again at once: within the closed dwell
    assert clock.t - b.since < s.closed_dwell_s and b.state == CLOSED
    clock.advance(s.closed_dwell_s)
    feed(b, clock, 5 * CHUNK_S)
    assert b.state == OPEN


def test_loads_finishing_while_open_do_not_count() -> None:
    clock = Clock()
    s = settings()
    b = Breaker("nvme", s, clock=clock)
    feed(b, clock, 5 * CHUNK_S, n=s.min_chunks)
    feed(b, clock, 0.01 * CHUNK_S, n=100)  # in flight when it opened
    clock.advance(s.open_dwell_s)
    assert b.load_gate() == PROBE and b.cost_s_per_chunk is None


def test_each_transition_is_logged_once_with_its_figures(caplog) -> None:
    clock = Clock()
    s = settings()
    b = Breaker("nvme", s, clock=clock)
    with caplog.at_level(logging.INFO, logger="kvtier_runtime.store.breaker"):
        feed(b, clock, 4 * CHUNK_S, n=s.min_chunks + 50)  # stays open: one line
        for _ in range(100):
            b.load_gate()
        clock.advance(s.open_dwell_s)
        for _ in range(100):
            b.load_gate()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "nvme" in lines[0] and "closed -> open" in lines[0] and "4 ms/chunk" in lines[0]
    assert "4.00x recomputing" in lines[0] and "100000 tokens/s" in lines[0]
    assert "open -> half_open" in lines[1]


def test_disabled_tier_is_bypassed_until_released_then_probed() -> None:
    clock = Clock()
    b = Breaker("nvme", settings(), clock=clock)
    b.force(True, " by test")
    assert b.state == DISABLED and b.load_gate() == BYPASS and b.bypass_gauges() == {"slow": 0, "disabled": 1}
    clock.advance(3600)
    feed(b, clock, 0.1 * CHUNK_S, n=50)
    assert b.state == DISABLED  # no dwell ends it, no sample counts
    b.force(False, " by test")
    assert b.state == HALF_OPEN and b.load_gate() == PROBE and b.bypass_gauges()["disabled"] == 1
    clock.advance(b.settings.half_open_dwell_s)
    feed(b, clock, 0.1 * CHUNK_S, n=b.settings.probe_chunks)
    assert b.state == CLOSED


def test_without_a_recompute_rate_only_timeouts_keep_a_released_tier_from_closing() -> None:
    clock = Clock()
    s = BreakerSettings(half_open_dwell_s=0.0)
    b = Breaker("nvme", s, clock=clock)
    feed(b, clock, 100.0, n=500)  # no rate: no verdict by cost
    assert b.state == CLOSED
    b.force(True)
    b.force(False)
    b.record(30.0, 1, timeouts=1)
    feed(b, clock, 0.5, n=s.probe_chunks - 1)
    assert b.state == OPEN and b.reason == "slow"
    clock.advance(s.open_dwell_s)
    assert b.load_gate() == PROBE
    feed(b, clock, 0.5, n=s.probe_chunks)
    assert b.state == CLOSED


def test_an_unmeasured_tier_closes_as_soon_as_it_is_released() -> None:
    b = Breaker("host", settings(), clock=Clock(), measured=False)
    b.record(10.0, 100)
    assert b.state == CLOSED
    b.force(True)
    assert b.load_gate() == BYPASS
    b.force(False)
    assert b.state == CLOSED and b.load_gate() == PASS


@pytest.mark.parametrize(("kw", "message"), [
    ({"recompute_s_per_token": 0}, "recompute_s_per_token: 0 must be a positive number"),
    ({"close_ratio": 1.5, "open_ratio": 1.5}, "close_ratio: 1.5 must be in (0, open_ratio = 1.5)"),
    ({"min_chunks": 65}, "min_chunks: 65 must not exceed window_chunks (64)"),
    ({"probe_chunks": 0}, "probe_chunks: 0 must be a positive integer"),
    ({"open_dwell_s": -1}, "open_dwell_s: -1 must be a non-negative number of seconds"),
])
def test_settings_errors_name_the_field(kw, message) -> None:
    with pytest.raises(ValueError) as err:
        BreakerSettings(**kw)
    assert str(err.value).startswith(message)


def test_load_meter_counts_the_union_of_busy_intervals_ending_when_the_tier_finished() -> None:
    from types import SimpleNamespace

    clock = Clock(0.0)
    m = LoadMeter(clock)
    assert m.take() is None
    # Three loads in parallel from t=10: the tier finishes them at 10.1, 10.2, 10.3; the books collect them at
    # 10.5 (a scheduler step later). Busy: 0.3 s, not 0.5 s, nor 0.6 s (the sum).
    for job, end in ((1, 10.1), (2, 10.2), (3, 10.3)):
        clock.t = end
        m.on_complete(SimpleNamespace(job_id=job, kind="load"))
    m.on_complete(SimpleNamespace(job_id=9, kind="store"))  # stores are not timed
    clock.t = 10.5
    for job in (1, 2, 3):
        m.ended(job, 10.0)
    busy, n, timeouts = m.take()
    assert (n, timeouts) == (3, 0) and busy == pytest.approx(0.3)
    # Idle until 50; a load from 50 the tier never reports (the books expire it at 52): counted up to 52.
    clock.t = 52.0
    m.ended(4, 50.0, timed_out=True)
    busy, n, timeouts = m.take()
    assert (n, timeouts) == (1, 1) and busy == pytest.approx(2.0)
    # Its late end is dropped, not counted again.
    clock.t = 60.0
    m.on_complete(SimpleNamespace(job_id=4, kind="load"))
    m.forget(4)
    assert m.take() is None and not m._ends
    # Overlapping loads collected in two polls: the second counts only what the first did not cover.
    clock.t = 70.4
    m.on_complete(SimpleNamespace(job_id=5, kind="load"))
    m.ended(5, 70.0)
    assert m.take()[0] == pytest.approx(0.4)
    clock.t = 70.6
    m.on_complete(SimpleNamespace(job_id=6, kind="load"))
    m.ended(6, 70.2)
    assert m.take()[0] == pytest.approx(0.2)


# ---- the control file ------------------------------------------------------------------------------------------

def control(root, disabled, generation: int | None = None, **more) -> str:
    doc = {"disabledTiers": disabled, **more}
    if generation is not None:
        doc["generation"] = generation
    return json.dumps(doc)


def breakers(tmp_path, clock, names=("host", "nvme", "remote")) -> TierBreakers:
    return TierBreakers(list(names), settings(), clock=clock, control_file=str(tmp_path / "cm" / "control.json"),
                        aliases=[("host",), ("/mnt/nvme",), ("redis://kv:6379",)])


def test_control_file_forces_and_clears_bypass_across_configmap_symlink_swaps(tmp_path, caplog) -> None:
    root = tmp_path / "cm"
    root.mkdir()
    clock = Clock()
    tb = breakers(tmp_path, clock)  # the file does not exist yet: nothing disabled
    assert [b.state for b in tb.breakers] == [CLOSED] * 3 and tb.generation is None
    configmap_update(root, {"control.json": control(root, ["remote"], 1)}, 1)
    tb.tick()
    assert tb[2].state == CLOSED  # polled at most once a second
    clock.advance(1.0)
    tb.tick()
    assert [b.state for b in tb.breakers] == [CLOSED, CLOSED, DISABLED] and tb.generation == 1
    configmap_update(root, {"control.json": control(root, ["/mnt/nvme", "remote"], 2)}, 2)  # by address, too
    clock.advance(1.0)
    tb.tick()
    assert [b.state for b in tb.breakers] == [CLOSED, DISABLED, DISABLED] and tb.generation == 2
    caplog.clear()
    with caplog.at_level(logging.INFO):
        for _ in range(5):  # unchanged: no new state, no log line
            clock.advance(1.0)
            tb.tick()
    assert not caplog.records
    configmap_update(root, {"control.json": control(root, ["nvme"], 3)}, 3)
    clock.advance(1.0)
    tb.tick()
    assert [b.state for b in tb.breakers] == [CLOSED, DISABLED, HALF_OPEN] and tb.generation == 3
    assert tb.control_errors == {}


def test_a_corrupt_oversized_or_unknown_control_file_keeps_the_last_good_state(tmp_path, caplog) -> None:
    root = tmp_path / "cm"
    root.mkdir()
    clock = Clock()
    configmap_update(root, {"control.json": control(root, ["nvme"], 1)}, 1)
    tb = breakers(tmp_path, clock)
    assert tb[1].state == DISABLED
    bad = [
        ('{"disabledTiers": ["nvme"', "unparsable"),
        (control(root, "nvme", 2), "invalid"),
        (control(root, ["nvme"], -1), "invalid"),
        (control(root, ["nvme"], 2, padding="x" * 70_000), "too_large"),
        ("\xff\xfe", "unparsable"),
    ]
    for version, (text, reason) in enumerate(bad, start=2):
        configmap_update(root, {"control.json": text}, version)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            for _ in range(3):  # the same bad version is logged and counted once
                clock.advance(1.0)
                tb.tick()
        assert len(caplog.records) == 1 and "keeping the last good state" in caplog.records[0].getMessage()
        assert tb[1].state == DISABLED and tb.generation == 1, reason
    assert tb.control_errors == {"unparsable": 2, "invalid": 2, "too_large": 1}
    configmap_update(root, {"control.json": control(root, [], 9)}, 20)
    clock.advance(1.0)
    tb.tick()
    assert tb[1].state == HALF_OPEN and tb.generation == 9


def test_a_name_that_is_no_tier_of_this_engine_is_counted_and_the_other_names_still_apply(tmp_path, caplog) -> None:
    # A tier the operator disabled and then stopped rendering (or a typo) must not void the rest of the list.
    root = tmp_path / "cm"
    root.mkdir()
    clock = Clock()
    configmap_update(root, {"control.json": control(root, ["nvme"], 1)}, 1)
    tb = breakers(tmp_path, clock)
    configmap_update(root, {"control.json": control(root, ["remote", "ssd-gone"], 2)}, 2)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            clock.advance(1.0)
            tb.tick()
    warnings = [r.getMessage() for r in caplog.records if "control file" in r.getMessage()]
    assert len(warnings) == 1 and "'ssd-gone' is not a tier of this engine" in warnings[0]
    assert [b.state for b in tb.breakers] == [CLOSED, HALF_OPEN, DISABLED] and tb.generation == 2
    assert tb.control_errors == {"unknown_tier": 1}


def test_a_removed_control_file_disables_nothing(tmp_path) -> None:
    root = tmp_path / "cm"
    root.mkdir()
    clock = Clock()
    configmap_update(root, {"control.json": control(root, ["host"])}, 1)
    tb = breakers(tmp_path, clock)
    assert tb[0].state == DISABLED
    configmap_update(root, {"other.json": "{}"}, 2)  # the key left the ConfigMap: its symlink dangles
    clock.advance(1.0)
    tb.tick()
    assert tb[0].state == CLOSED and tb.control_errors == {}


def test_a_file_rewritten_in_place_is_read_again_once_it_changes(tmp_path) -> None:
    # Not a ConfigMap: a writer replacing the content in place. Every change of size or mtime is a new version.
    path = tmp_path / "control.json"
    clock = Clock()
    path.write_text('{"disabledTiers": ["a"')  # caught half-written
    cf = ControlFile(str(path), {"a", "b"}, clock=clock)
    assert cf.poll() is None and cf.errors == {"unparsable": 1}
    path.write_text('{"disabledTiers": ["a"], "generation": 4}')
    clock.advance(1.0)
    state = cf.poll()
    assert state is not None and state.disabled == {"a"} and state.generation == 4
    os.utime(path, ns=(1, 1))
    clock.advance(1.0)
    assert cf.poll() is None  # re-read, same state: nothing new


def test_parse_control_names_the_field_and_the_rule() -> None:
    with pytest.raises(ValueError, match=r"disabledTiers\[1\]: 7 must be a non-empty string"):
        parse_control(b'{"disabledTiers": ["a", 7]}')
    with pytest.raises(ValueError, match=r"must be a JSON object, got list"):
        parse_control(b'["a"]')
    assert parse_control(b'{"generation": 0, "future": true}').disabled == frozenset()


def test_the_operators_control_file_text_is_what_the_runtime_reads() -> None:
    from kvtier_runtime.config import ConfigError, control_file_json

    text = control_file_json(["remote", "nvme", "nvme"], 3)
    assert text == '{"disabledTiers":["nvme","remote"],"generation":3}'  # sorted, deduplicated: stable bytes
    state = parse_control(text.encode(), {"host", "nvme", "remote"})
    assert state.disabled == {"nvme", "remote"} and state.generation == 3
    with pytest.raises(ConfigError, match="generation: -1 must be a non-negative integer"):
        control_file_json([], -1)
    with pytest.raises(ConfigError, match="would exceed 65536 bytes"):
        control_file_json([f"tier-{i:05d}" for i in range(10_000)], 1)
