"""Regression tests for defects the end-to-end scenario found in the operator, as pure unit tests.

Both were invisible to the operator's own tests at the time (a scripted measurement source, no re-enable after
a rollback) and broke the scenario against a real Prometheus and API server. The status patch was fixed on the
operator branch too (its ``merge_diff``); the Prometheus client config on this branch.
"""
from __future__ import annotations

import json

import pytest
from kvtier_operator.status import status_patch
from plugins.slo_harness import slo_settings


def merge_patch(target, patch):
    """RFC 7386, as the API server applies ``application/merge-patch+json``."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def test_a_tier_leaving_slo_disabled_is_removed_by_the_status_patch():
    old = {"slo": {"disabled": {"nvme": {"since": "t0", "reason": "SLOBreach"}}, "verdict": "ok"},
           "sloState": "OK", "targets": [{"name": "w"}]}
    new = {"slo": {"disabled": {}, "verdict": "ok"}, "sloState": "OK"}
    patch = status_patch(old, new)
    assert merge_patch(old, patch)["slo"] == {"disabled": {}, "verdict": "ok"}
    assert merge_patch(old, patch)["targets"] == [{"name": "w"}]  # fields the writer does not own stay


@pytest.mark.parametrize("old,new", [
    ({"a": {"x": 1, "y": {"z": 2}}}, {"a": {"x": 1, "y": {}}}),
    ({"a": {"x": 1}}, {"a": {"x": 2, "w": [1, 2]}}),
    ({}, {"a": {"x": None, "y": 1}}),
    ({"a": [1, 2]}, {"a": [2]}),
])
def test_applying_the_patch_yields_the_new_fields(old, new):
    patch = status_patch(old, new)
    result = merge_patch(old, patch)
    strip = lambda d: json.loads(json.dumps(d), object_hook=lambda o: {k: v for k, v in o.items() if v is not None})
    assert strip({k: result.get(k) for k in new}) == strip(new)


def test_prometheus_client_config_comes_from_the_slo_settings():
    from kvtier_operator.slo_tick import client_config

    class NoSecrets:
        def get(self, path):
            raise AssertionError(f"no Secret should be read without auth, got {path}")

    settings = slo_settings({"selector": {"matchLabels": {"app": "llm"}}, "tiers": [{"name": "cpu", "medium": "cpu", "size": "1Gi"}], "slo": {
        "prometheus": {"url": "http://prometheus:9090", "timeout": "3s"}, "ttftP99": "1s"}})
    config = client_config(NoSecrets(), "ns", settings.prometheus)
    assert config.url == "http://prometheus:9090" and config.timeout_s == 3.0 and config.bearer_token is None
