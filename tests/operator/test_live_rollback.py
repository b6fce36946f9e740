"""The SLO guard's decisions reach a running engine without a restart where the engine can bypass a tier live.

With backend kvtier a tier the guard disables stays rendered (same config hash: the pods do not roll) and is listed
in the control file, a key of the policy's ConfigMap that the kubelet refreshes in place and the runtime watches.
Engines that cannot bypass a tier (backend native, TensorRT-LLM) keep the old path: the tier leaves the rendered
configuration and the pods roll. A tier disabled in the spec is the user's change and always re-renders.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
from kvtier_operator import reconcile as rc
from kvtier_operator.api import guard_state
from kvtier_operator.api.validation import PolicyInvalid, parse_policy
from kvtier_operator.render import CONTROL_FILE
from kvtier_runtime.config import OffloadSpecConfig
from kvtier_runtime.store.control import ControlFile
from plugins.operator import deployment, nvme_tier, observed, policy

NOW = "2026-12-02T10:00:00.000Z"
SLO = {"ttftP99": "2s", "prometheus": {"url": "http://prometheus:9090"}}
CPU = {"name": "cpu", "medium": "cpu", "size": "16Gi"}


def _policy(backend: str = "kvtier", *, status: Optional[dict[str, Any]] = None, nvme_enabled: bool = True,
            **extra: Any) -> dict[str, Any]:
    nvme = dict(nvme_tier(), enabled=nvme_enabled, volume={"emptyDir": {}})  # a hostPath needs the admin's trust
    return policy(tiers=[dict(CPU), nvme], backend=backend, engine="vllm", slo=SLO, status=status, **extra)


def _guard_disabled(tier: str = "nvme", at: str = "2026-12-02T09:59:00.000Z") -> dict[str, Any]:
    """Stored status after the guard disabled ``tier`` on a breach."""
    return {"slo": {"state": "Breach", "disabled": {tier: {"reason": "SLOBreach", "since": at}},
                    "history": [{"time": at, "tier": tier, "action": "Disabled", "reason": "SLOBreach"}]}}


def _reenabled(tier: str = "nvme", at: str = "2026-12-02T10:05:00.000Z") -> dict[str, Any]:
    st = _guard_disabled(tier)
    st["slo"]["disabled"] = {}
    st["slo"]["probation"] = {tier: {"since": at}}
    st["slo"]["history"].append({"time": at, "tier": tier, "action": "Reenabled", "reason": "Annotation"})
    return st


def _generation(status: dict[str, Any]) -> int:
    """The control file's generation for a stored status (its ``slo`` parsed as a pass parses it)."""
    return rc.control_generation(guard_state.read(status["slo"], NOW))


def _plan(p: dict[str, Any]) -> rc.Plan:
    return rc.plan(p, [observed(deployment())], [], now=NOW)


def _control(plan: rc.Plan) -> Optional[str]:
    assert plan.config_map is not None
    return plan.config_map["data"].get(CONTROL_FILE)


def _engine_config(plan: rc.Plan) -> OffloadSpecConfig:
    import yaml
    doc = yaml.safe_load(plan.config_map["data"]["engine.yaml"])  # type: ignore[index]
    return OffloadSpecConfig.from_extra_config(doc["kv-transfer-config"]["kv_connector_extra_config"])


def test_a_guard_disabled_tier_stays_rendered_and_is_bypassed_through_the_control_file():
    healthy, breached = _plan(_policy()), _plan(_policy(status=_guard_disabled()))
    h, b = healthy.targets[0], breached.targets[0]
    # The configuration the engine started with is unchanged: no roll, no restart.
    assert h.config_hash and b.config_hash == h.config_hash
    assert breached.config_map["data"]["engine.yaml"] == healthy.config_map["data"]["engine.yaml"]  # type: ignore
    assert "bypassed live: nvme" in b.message and "bypassed" not in h.message
    # Status still says what the guard did.
    assert [(t["name"], t["state"]) for t in breached.status["tiers"]] == [("cpu", "Enabled"), ("nvme", "Disabled")]
    assert breached.status["activeTiers"] == "cpu"
    assert '"disabledTiers":[]' in (_control(healthy) or "")
    assert '"disabledTiers":["nvme"]' in (_control(breached) or "")


def test_the_runtime_reads_the_written_control_file_with_the_rendered_tier_names(tmp_path):
    """Round trip: what the operator writes is what the runtime's watcher parses, under the names it renders."""
    breached = _plan(_policy(status=_guard_disabled()))
    cfg = _engine_config(breached)
    assert cfg.control_file == f"/etc/kvtier/{CONTROL_FILE}" and list(cfg.names) == ["cpu", "nvme"]
    path = tmp_path / CONTROL_FILE
    path.write_text(_control(breached) or "")
    watcher = ControlFile(str(path), known=cfg.names)
    state = watcher.poll(force=True)
    assert state is not None and state.disabled == {"nvme"} and not watcher.errors
    assert state.generation == _generation(_guard_disabled())


def test_reenabling_is_live_too_and_the_generation_grows():
    breached, back = _plan(_policy(status=_guard_disabled())), _plan(_policy(status=_reenabled()))
    assert back.targets[0].config_hash == breached.targets[0].config_hash
    assert '"disabledTiers":[]' in (_control(back) or "")
    assert _generation(_reenabled()) > _generation(_guard_disabled()) > 0
    # The same status always writes the same bytes (an unchanged ConfigMap is not written again).
    assert _control(_plan(_policy(status=_reenabled()))) == _control(back)


def test_the_host_tier_disabled_by_the_guard_turns_offloading_off_live():
    p = _policy(status=_guard_disabled("cpu"))
    plan, healthy = _plan(p), _plan(_policy())
    assert plan.targets[0].config_hash == healthy.targets[0].config_hash
    assert '"disabledTiers":["cpu"]' in (_control(plan) or "")


def test_engines_that_cannot_bypass_a_tier_still_roll_without_it():
    healthy, breached = _plan(_policy("native")), _plan(_policy("native", status=_guard_disabled()))
    assert breached.targets[0].config_hash != healthy.targets[0].config_hash
    assert "nvme" not in breached.config_map["data"]["engine.yaml"]  # type: ignore[index]
    assert _control(breached) is None and _control(healthy) is None


def test_a_tier_disabled_in_the_spec_is_not_rendered_and_not_in_the_control_file():
    healthy, off = _plan(_policy()), _plan(_policy(nvme_enabled=False))
    assert off.targets[0].config_hash != healthy.targets[0].config_hash
    assert "/mnt/nvme" not in off.config_map["data"]["engine.yaml"]  # type: ignore[index]
    assert '"disabledTiers":[]' in (_control(off) or "")


def test_a_hand_edited_history_time_cannot_break_the_control_file():
    st = _guard_disabled()
    st["slo"]["history"].append({"time": "yesterday", "tier": "nvme", "action": "Disabled"})
    st["slo"]["history"].append("not an entry")
    assert _generation(st) == _generation(_guard_disabled())
    assert rc.control_generation(None) == 0 and _generation({"slo": {}}) == 0


def test_the_recompute_rate_reaches_the_engine_and_needs_backend_kvtier():
    plan = _plan(_policy(offload={"recomputeTokensPerSecond": 20000}))
    assert _engine_config(plan).recompute_tokens_per_s == 20000
    bad = copy.deepcopy(_policy("native", offload={"recomputeTokensPerSecond": 20000}))
    with pytest.raises(PolicyInvalid) as err:
        parse_policy(bad)
    assert "spec.offload.recomputeTokensPerSecond" in str(err.value.problems[0])
    assert "needs backend kvtier" in str(err.value.problems[0])
    with pytest.raises(PolicyInvalid) as err:
        parse_policy(_policy(offload={"recomputeTokensPerSecond": 0}))
    assert "recomputeTokensPerSecond" in str(err.value.problems[0])


REMOTE = {"name": "shared", "medium": "remote", "size": "10Gi",
          "remote": {"url": "redis://valkey:6379", "macKeySecret": {"name": "mac", "key": "k"}}}


@pytest.mark.parametrize("newest", ["shared", "nvme"])
def test_every_tier_kind_is_bypassed_live_among_several_tiers(newest):
    """cpu, filesystem and remote tiers together: whichever the guard disabled is listed, under its policy name,
    and the engine's configuration (with the runtime's order of names) stays as it was."""
    def plan(status: Optional[dict[str, Any]]) -> rc.Plan:
        p = policy(tiers=[dict(CPU), dict(nvme_tier(), volume={"emptyDir": {}}), dict(REMOTE)], backend="kvtier",
                   engine="vllm", slo=SLO, status=status)
        return rc.plan(p, [observed(deployment())], [], now=NOW, remote_stores_allowed=("redis://valkey:6379",))
    healthy, breached = plan(None), plan(_guard_disabled(newest))
    assert healthy.targets[0].state == rc.APPLIED, healthy.targets[0].message
    assert breached.targets[0].config_hash == healthy.targets[0].config_hash
    assert f'"disabledTiers":["{newest}"]' in (_control(breached) or "")
    assert list(_engine_config(breached).names) == ["cpu", "nvme", "shared"]
