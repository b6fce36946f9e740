"""The SLO guard's typed state through a policy's pass (controller.Operator.run_pass, an in-memory API, a canned
Prometheus): ``status.slo`` is parsed once per pass and dumped once per guard evaluation -- also when the verdict
changes the rendered tiers and the pass plans a second time -- and the control file the second plan renders
carries the new state's generation."""
from __future__ import annotations

import json
from collections import Counter

from kvtier_operator.api import guard_state
from kvtier_operator.api.guard_state import SLOGuardState
from kvtier_operator.api.times import parse_time
from kvtier_operator.kube import config_map_path
from kvtier_operator.render import CONTROL_FILE
from plugins.policy_pass import SLO, CannedPrometheus, Guarded, applied_world

RATIOS = {("gpu", "5m"): 0.5, ("cpu", "5m"): 0.3, ("nvme", "5m"): 0.1, ("cpu", "1h"): 0.3, ("nvme", "1h"): 0.1}
BREACH = (3.0, 0.01, 10.0)  # p99 TTFT 3 s over the 2 s SLO


def _count_parses_and_dumps(monkeypatch) -> Counter:
    counts: Counter = Counter()
    validate, dump = SLOGuardState.model_validate.__func__, guard_state.dump

    def counted_validate(cls, *args, **kwargs):
        counts["parses"] += 1
        return validate(cls, *args, **kwargs)

    def counted_dump(state):
        counts["dumps"] += 1
        return dump(state)

    monkeypatch.setattr(SLOGuardState, "model_validate", classmethod(counted_validate))
    monkeypatch.setattr(guard_state, "dump", counted_dump)
    return counts


def _control_files(kube) -> list[dict]:
    path = config_map_path("default", "kvtier-llm")
    return [json.loads(body["data"][CONTROL_FILE]) for p, body in kube.applied if p == path]


def test_status_slo_is_parsed_once_and_dumped_once_per_pass_and_the_new_state_reaches_the_control_file(
        monkeypatch) -> None:
    kube, path = applied_world({**SLO, "consecutiveBreaches": 1})
    source = CannedPrometheus(RATIOS)
    op = Guarded(kube, source)
    counts = _count_parses_and_dumps(monkeypatch)

    op.run_pass("default", "llm", [], guard_due=True)  # the first evaluation: nothing stored yet
    assert counts == {"dumps": 1} and kube.objects[path]["status"]["slo"]["verdict"] == "ok"

    counts.clear()
    applied = len(kube.applied)
    source.p99s = BREACH  # one breach disables the newest tier: the pass plans again with the new state
    op.run_pass("default", "llm", [], guard_due=True)
    assert counts == {"parses": 1, "dumps": 1}
    status = kube.objects[path]["status"]
    assert [(t["name"], t["state"]) for t in status["tiers"]] == [("cpu", "Enabled"), ("nvme", "Disabled")]
    [entry] = [h for h in status["slo"]["history"] if h["action"] == "Disabled"]
    # The rendered control file is the second plan's: it bypasses nvme, at the new decision's generation.
    assert len(kube.applied) > applied
    control = _control_files(kube)[-1]
    assert control == {"disabledTiers": ["nvme"], "generation": round(parse_time(entry["time"]) * 1000)}

    counts.clear()
    op.run_pass("default", "llm", [], guard_due=False)  # between evaluations: parsed to render, never dumped
    assert counts == {"parses": 1}
