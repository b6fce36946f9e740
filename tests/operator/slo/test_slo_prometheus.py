"""The SLO guard end to end against a REAL Prometheus (Debian's 2.42, 1 s scrape) scraping synthetic engines
that expose vLLM's / TensorRT-LLM's exact metric names and buckets.

Each scenario is a timeline in real time (window 3 s, interval 1 s). They are independent (own engine, own
namespace label, and the Prometheus-outage scenario its own Prometheus), so the module runs the selected ones
concurrently in threads and each test re-raises its scenario's failure: the suite takes about as long as the
longest scenario instead of the sum. Assertions run inside the scenarios, as the timeline unfolds.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kvtier_operator.controller import guard_fields
from kvtier_operator.slo import Scope
from kvtier_operator.slo.client import PrometheusClientConfig, PrometheusSource
from plugins.prometheus import PrometheusProcess, Started, require_prometheus
from plugins.slo_harness import GuardLoop, slo_settings

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

FAST = dict(ttft=0.05, itl=0.02)          # p99 TTFT ~60 ms, ITL ~25 ms
SLOW_TTFT = dict(ttft=3.0)                # p99 TTFT ~4 s: over the 1 s budget
BASE_SLO = {"ttftP99": "1s", "itlP99": "150ms", "window": "3s", "interval": "1s", "consecutiveBreaches": 5,
            "cooldown": "4s", "minRequestRate": 1}


class Ctx:
    """What one scenario gets: its own engine (namespace = scenario name) and a guard-loop factory."""

    def __init__(self, name: str, prometheus: PrometheusProcess, started: Started, engine_kwargs: dict[str, Any]):
        self.name, self.prometheus, self.started = name, prometheus, started
        self.engine = started.engine(rate=20, seed=7, **FAST, **engine_kwargs)
        prometheus.add_target(self.engine.address, namespace=name, pod=f"{name}-0",
                              metrics_path=self.engine.metrics_path)

    def loop(self, state: dict[str, Any] | None = None, rollout: dict[str, Any] | None = None,
             backend: str | None = None, **slo: Any) -> GuardLoop:
        spec: dict[str, Any] = {"selector": {"matchLabels": {"app": "llm"}}, "tiers": [{"name": "host", "medium": "cpu", "size": "1Gi"}, {"name": "nvme", "medium": "filesystem", "size": "10Gi", "path": "/mnt/nvme", "volume": {"emptyDir": {}}}],
                                "slo": {"prometheus": {"url": self.prometheus.url}, **BASE_SLO, **slo}}
        if rollout:
            spec["rollout"] = rollout
        if backend:
            spec["backend"] = backend
        settings = slo_settings(spec)
        source = PrometheusSource(PrometheusClientConfig(self.prometheus.url, timeout_s=2))
        return GuardLoop(settings, source, Scope(namespace=self.name, pod_regex=f"{self.name}-.*"), state=state)


def warm(loop: GuardLoop) -> None:
    """Tick until the guard has a verdict (the first histogram_quantile needs a few scrapes)."""
    loop.run_until(lambda l: l.state["verdict"] == "ok", timeout=25)


def disables(loop: GuardLoop) -> list[Any]:
    return loop.actions("DisableTier")


# ------------------------------------------------------------------------------------------- scenarios
def sustained_breach(ctx: Ctx) -> dict[str, Any]:
    loop = ctx.loop()
    warm(loop)
    ctx.engine.set(**SLOW_TTFT)
    first = loop.run_until(lambda l: l.enabled != ["host", "nvme"], timeout=20)
    assert loop.enabled == ["host"], loop.tiers
    [d] = disables(loop)
    assert (d.tier, d.metric, d.threshold) == ("nvme", "ttftP99", 1.0) and d.value > 2.5
    t_first = loop.records[-1].wall   # evaluation times: what cooldown and streaks are measured in
    loop.run_until(lambda l: l.enabled != ["host"], timeout=25)
    assert loop.enabled == [] and [a.tier for a in disables(loop)] == ["nvme", "host"]
    gap = loop.records[-1].wall - t_first
    # Evaluations less than max(cooldown 4 s, window 3 s) after the rollback are not counted; the one at +4 s
    # starts a fresh streak of 5, so the earliest next rollback is at +8 s.
    assert gap >= 4 + 4 * 1 - 0.1, f"second tier went {gap:.1f}s after the first: cooldown + a fresh streak expected"
    history = [(h["action"], h["tier"]) for h in loop.state["history"]]
    assert history == [("Disabled", "nvme"), ("Disabled", "host")]
    return {"first_disable_s": first, "gap_s": gap}


def transient_spike(ctx: Ctx) -> dict[str, Any]:
    # A spike of length S keeps p99-over-window high for at most about window + S (rate() sees it while two
    # scrapes straddling it are inside the window): 3.5 s here, so 6 x 1 s ignores it whatever the alignment.
    loop = ctx.loop(consecutiveBreaches=6)
    warm(loop)
    ctx.engine.set(**SLOW_TTFT)
    time.sleep(0.5)
    ctx.engine.set(**FAST)
    records = loop.run_for(10)
    assert disables(loop) == [] and loop.enabled == ["host", "nvme"]
    streak = max(r.consecutive_breaches for r in records)
    assert streak >= 1, "the spike was never seen: the scenario proves nothing"
    return {"max_streak": streak}


def prometheus_outage(ctx: Ctx) -> dict[str, Any]:
    loop = ctx.loop()
    warm(loop)
    ctx.engine.set(**SLOW_TTFT)
    loop.run_until(lambda l: l.state["consecutiveBreaches"] >= 2, timeout=15)
    held = loop.state["consecutiveBreaches"]
    ctx.prometheus.stop()
    try:
        records = loop.run_for(6)
    finally:
        ctx.prometheus.start()
    assert all(r.verdict == "error" for r in records), [r.verdict for r in records]
    assert records[-1].conditions["SLOUnknown"].status == "True"
    assert "no usable answer from" in records[-1].conditions["SLOUnknown"].message
    assert disables(loop) == [] and loop.state["consecutiveBreaches"] == held
    # Prometheus is back and the breach goes on: the held counter completes the streak.
    loop.run_until(lambda l: l.enabled == ["host"], timeout=20)
    assert loop.records[-1].conditions["SLOUnknown"].status == "False"
    return {"held": held, "errors": len(records)}


def low_traffic(ctx: Ctx) -> dict[str, Any]:
    loop = ctx.loop()
    warm(loop)
    ctx.engine.set(rate=0.5, **SLOW_TTFT)      # slow, but under minRequestRate 1/s
    records = loop.run_for(8)
    assert disables(loop) == []
    late = records[4:]
    assert all(r.verdict == "lowTraffic" for r in late), [(r.verdict, r.values) for r in records]
    assert any((r.values["ttftP99"] or 0) > 1 for r in late), "slow requests never showed: proves nothing"
    ctx.engine.set(rate=0)
    records = loop.run_for(6)
    assert disables(loop) == [] and records[-1].verdict in ("lowTraffic", "noData")
    return {}


def recovery_auto_reenable(ctx: Ctx) -> dict[str, Any]:
    loop = ctx.loop(reenable={"mode": "auto", "after": "4s", "probation": "4s"})
    warm(loop)
    ctx.engine.set(**SLOW_TTFT)
    loop.run_until(lambda l: l.enabled == ["host"], timeout=20)
    t_disabled = loop.records[-1].wall
    ctx.engine.set(**FAST)
    loop.run_until(lambda l: l.enabled == ["host", "nvme"], timeout=25)
    assert loop.records[-1].wall - t_disabled >= 4
    [enable] = loop.actions("EnableTier")
    assert (enable.tier, enable.reason) == ("nvme", "AutoReenable")
    assert loop.tiers[1]["reason"] == "Probation"
    loop.run_until(lambda l: not l.state["probation"], timeout=15)
    assert [h["action"] for h in loop.state["history"]] == ["Disabled", "Reenabled", "ProbationPassed"]
    assert len(disables(loop)) == 1
    return {}


def probation_breach(ctx: Ctx) -> dict[str, Any]:
    loop = ctx.loop(reenable={"mode": "auto", "after": "4s", "probation": "30s"})
    warm(loop)
    ctx.engine.set(**SLOW_TTFT)
    loop.run_until(lambda l: l.enabled == ["host"], timeout=20)
    ctx.engine.set(**FAST)
    loop.run_until(lambda l: l.enabled == ["host", "nvme"], timeout=25)
    ctx.engine.set(**SLOW_TTFT)
    took = loop.run_until(lambda l: l.enabled == ["host"], timeout=10)
    last = disables(loop)[-1]
    assert (last.tier, last.reason) == ("nvme", "ProbationBreach")
    assert loop.state["history"][-1]["action"] == "ProbationFailed"
    assert took < 5, f"a probation breach must act on the first breach, took {took:.1f}s"
    assert loop.state["autoReenableBlocked"] is True
    ctx.engine.set(**FAST)
    loop.run_for(8)
    assert loop.enabled == ["host"], "auto re-enabling must stop until a person acts"
    loop.tick(reenable_requests=["nvme"])
    assert loop.enabled == ["host", "nvme"] and loop.state["autoReenableBlocked"] is False
    return {"probation_breach_s": took}


def staged_rollout(ctx: Ctx) -> dict[str, Any]:
    loop = ctx.loop(ttftP99MaxRatio=5, rollout={"strategy": "staged", "stageObservation": "4s"})
    loop.tick()
    assert loop.enabled == [] and [t["state"] for t in loop.tiers] == ["Pending", "Pending"]
    loop.run_until(lambda l: l.enabled == ["host", "nvme"], timeout=40)
    enables = [(r.wall, a.tier) for r in loop.records for a in r.actions if a.kind == "EnableTier"]
    assert [t for _, t in enables] == ["host", "nvme"]
    # Stage starts are stored in status at millisecond resolution (RFC 3339), so allow that much.
    assert enables[1][0] - enables[0][0] >= 4 - 0.001, "each stage must hold a full observation period"
    baseline = loop.state["baseline"]["ttftP99"]
    assert 0.04 < baseline < 0.1, baseline
    # 500 ms is within the absolute 1 s budget but 8x the GPU-only baseline (ratio 5): a relative breach.
    ctx.engine.set(ttft=0.5)
    loop.run_until(lambda l: l.enabled == ["host"], timeout=20)
    d = disables(loop)[-1]
    assert d.tier == "nvme" and d.threshold == pytest.approx(5 * baseline)
    return {"baseline_ttft": baseline}


def restart_mid_breach(ctx: Ctx) -> dict[str, Any]:
    loop = ctx.loop()
    warm(loop)
    ctx.engine.set(**SLOW_TTFT)
    loop.run_until(lambda l: l.state["consecutiveBreaches"] == 3, timeout=15)
    stored = json.dumps(loop.state)               # what status.slo holds when the operator dies
    del loop
    reborn = ctx.loop(state=json.loads(stored))   # new process: new client, new loop, state from status
    reborn.run_until(lambda l: l.enabled == ["host"], timeout=10)
    breaches = [r for r in reborn.records if r.verdict == "breach"]
    assert len(breaches) == 2, [(r.verdict, r.consecutive_breaches) for r in reborn.records]
    return {}


class OffloadCounters:
    """A target exposing the runtime's per-tier counters and vLLM's prefix-cache counters, each growing at a fixed
    rate per second (classic text format, so Prometheus keeps the ``vllm:`` names): ``host`` serves 40 of every 100
    looked-up tokens, ``nvme`` 0.5 (idle), the GPU prefix cache 60 of 100 queried."""

    RATES = {'vllm:kv_offload_kvtier_hit_tokens_total{tier="host"}': 40.0,
             'vllm:kv_offload_kvtier_hit_tokens_total{tier="nvme"}': 0.5,
             "vllm:kv_offload_kvtier_lookup_tokens_total": 100.0,
             "vllm:prefix_cache_hits_total": 60.0, "vllm:prefix_cache_queries_total": 100.0}

    def __init__(self, rates: dict[str, float] | None = None) -> None:
        start = time.monotonic()
        rates = rates or self.RATES

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                t = time.monotonic() - start
                names = sorted({k.split("{")[0] for k in rates})
                lines = [f"# TYPE {n} counter" for n in names]
                lines += [f"{series} {rate * t:.3f}" for series, rate in rates.items()]
                body = ("\n".join(lines) + "\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def hit_ratios(ctx: Ctx) -> dict[str, Any]:
    """The guard's hit-ratio queries against real counters: each tier's share of the looked-up tokens over the
    window, the GPU prefix cache's, and TierIdle for the tier that serves 0.5%, all on the scenario's pods only."""
    from kvtier_operator.slo_tick import decide

    counters = OffloadCounters()
    # A pod of another namespace whose every lookup hits host and the GPU: counted, it would lift both figures.
    foreign = OffloadCounters({**OffloadCounters.RATES, 'vllm:kv_offload_kvtier_hit_tokens_total{tier="host"}': 100.0,
                               'vllm:kv_offload_kvtier_hit_tokens_total{tier="nvme"}': 0.0,
                               "vllm:prefix_cache_hits_total": 100.0})
    try:
        ctx.prometheus.add_target(counters.address, namespace=ctx.name, pod=f"{ctx.name}-1")
        ctx.prometheus.add_target(foreign.address, namespace="elsewhere", pod=f"{ctx.name}-2")
        loop = ctx.loop(backend="kvtier", idleWindow="6s")   # kvtier's runtime exports the per-tier counters
        warm(loop)
        policy_obj = {"metadata": {"generation": 1}, "status": {"engine": "vllm"}}
        deadline = time.monotonic() + 25
        while True:
            step = decide(loop.settings, {**policy_obj, "status": {"engine": "vllm", "slo": loop.state}},
                          loop.source, loop.scope, time.time())
            measured = step.hit_ratios
            if measured and measured.error is None and all(
                    measured.window.get(t) is not None for t in ("gpu", "host", "nvme")) and all(
                    measured.idle.get(t) is not None for t in ("host", "nvme")):
                break
            assert time.monotonic() < deadline, f"no hit ratios yet: {measured}"
            time.sleep(1)
        assert step.slo_state == "OK"   # the figures change no verdict
        assert abs(measured.window["host"] - 0.4) < 0.02, measured
        assert abs(measured.window["gpu"] - 0.6) < 0.02, measured
        assert measured.window["nvme"] < 0.01 and measured.idle["nvme"] < 0.01, measured
        tiers = [{"name": t, "state": "Enabled", "reason": "Enabled", "since": "2026-01-01T00:00:00Z"}
                 for t in ("host", "nvme")]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        fields = guard_fields(step, [], 1, now, tiers)
        [idle] = [c for c in fields["conditions"] if c["type"] == "TierIdle"]
        assert (idle["status"], idle["reason"]) == ("True", "NoHits") and "nvme (0.00" in idle["message"], idle
        assert "host" not in idle["message"]
        assert fields["hitRatios"].startswith("gpu=0.6") and " host=0.4" in fields["hitRatios"], fields
        return {"window": measured.window, "idle": measured.idle, "summary": fields["hitRatios"]}
    finally:
        counters.stop()
        foreign.stop()


SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    f.__name__: f for f in (sustained_breach, transient_spike, prometheus_outage, low_traffic,
                            recovery_auto_reenable, probation_breach, staged_rollout, restart_mid_breach,
                            hit_ratios)
}


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Run the scenarios selected in this session concurrently; map name -> result or exception."""
    require_prometheus()
    wanted = [n for n in SCENARIOS if any(item.name == f"test_{n}" for item in request.session.items)]
    started = Started(tmp_path_factory.getbasetemp())
    results: dict[str, Any] = {}
    try:
        shared = started.prometheus()
        contexts = {}
        for name in wanted:
            # The outage scenario stops its Prometheus, so it gets one of its own.
            prom = started.prometheus() if name == "prometheus_outage" else shared
            contexts[name] = Ctx(name.replace("_", "-"), prom, started, {})

        def run(name: str) -> None:
            try:
                results[name] = SCENARIOS[name](contexts[name])
            except BaseException as exc:
                exc.add_note(f"scenario {name}; engine log tail:\n{contexts[name].engine.log()[-800:]}")
                results[name] = exc

        with ThreadPoolExecutor(max_workers=max(1, len(wanted))) as pool:
            list(pool.map(run, wanted))
        yield results
    finally:
        started.close()


def _outcome(outcomes: dict[str, Any], name: str) -> dict[str, Any]:
    result = outcomes[name]
    if isinstance(result, BaseException):
        raise result
    print(f"{name}: {result}")   # margins, visible with -s
    return result


def test_sustained_breach(outcomes):
    """Sustained breach disables exactly one tier, then the next only after cooldown and a fresh streak."""
    _outcome(outcomes, "sustained_breach")


def test_transient_spike(outcomes):
    _outcome(outcomes, "transient_spike")


def test_prometheus_outage(outcomes):
    """Prometheus stopped mid-breach: errors, SLOUnknown, no rollback; the breach counter survives the outage."""
    _outcome(outcomes, "prometheus_outage")


def test_low_traffic(outcomes):
    _outcome(outcomes, "low_traffic")


def test_recovery_auto_reenable(outcomes):
    _outcome(outcomes, "recovery_auto_reenable")


def test_probation_breach(outcomes):
    _outcome(outcomes, "probation_breach")


def test_staged_rollout(outcomes):
    _outcome(outcomes, "staged_rollout")


def test_restart_mid_breach(outcomes):
    _outcome(outcomes, "restart_mid_breach")


def test_hit_ratios(outcomes):
    """Real counters scraped by a real Prometheus: host 0.4, the GPU prefix cache 0.6, nvme idle (TierIdle)."""
    _outcome(outcomes, "hit_ratios")
