"""Every example, applied as a newcomer applies it, reaches the state its header comment promises on a real
kube-apiserver with the operator running on the chart's default settings (no hostPath prefix, no claim, no remote
store and no Prometheus allowed).

Each example says, in one line of its header, what `make cluster` shows for it: ``Ready``, or ``refused`` with the
policy fields the admin has to allow. The workloads an example does not ship are the ones its comments describe: an
opted-in Deployment its selector matches, running the engine's image with the configuration argument rendered for
it. No pod needs to run for this: the policy's state is about the workload object the operator configures.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvtier_operator.api.validation import parse_policy
from kvtier_operator.render import render
from kvtier_operator.settings import FIELD_MANAGER
from plugins.operator import (
    TRTLLM_IMAGE,
    VLLM_IMAGE,
    cond,
    create_policy,
    deployment,
    get_policy,
    get_workload,
    manager_entry,
    user_apply,
    wait_applied,
    wait_for,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
PROMISE = re.compile(r"^# On `make cluster` \(the chart's defaults\)[^:]*: (Ready|refused)\b(.*(?:\n#(?! On).*)*)",
                     re.M)
FIELD = re.compile(r"spec\.tiers\[\d+\]\.[A-Za-z.]+[A-Za-z]")
# The chart's values.yaml defaults for the operator's trust settings.
CHART_DEFAULTS: dict[str, Any] = dict(host_path_prefixes=(), pvc_allowed=(), remote_stores_allowed=(),
                                      prometheus_allowed=(), prometheus_allow_http=False)


def promise(text: str) -> tuple[str, list[str]]:
    """("Ready", []) or ("refused", [the fields the refusal names]) from the example's header."""
    m = PROMISE.search(text)
    assert m, "the example's header does not say what `make cluster` shows for it"
    return m.group(1), FIELD.findall(m.group(2))


def test_every_promise_line_is_read():
    # A promise line this test could not parse would silently check nothing.
    for path in EXAMPLES:
        state, fields = promise(path.read_text())
        assert (state == "refused") == bool(fields), path.name


def moved(doc: dict[str, Any], namespace: str) -> dict[str, Any]:
    doc["metadata"]["namespace"] = namespace
    return doc


def workload_for(policy: dict[str, Any], namespace: str) -> dict[str, Any]:
    """The opted-in Deployment the example's comments describe, for an example that ships only a policy."""
    name = policy["metadata"]["name"]
    labels = dict(policy["spec"]["selector"]["matchLabels"])
    config_args = render(parse_policy(policy)).config_args
    image = TRTLLM_IMAGE if policy["spec"].get("engine") == "trtllm" else VLLM_IMAGE
    wl = deployment(name, namespace, labels=labels, image=image, args=["--model", "some/model", *config_args],
                    memory_limit=None, opt_in=name)
    wl["spec"]["selector"]["matchLabels"] = labels
    wl["spec"]["template"]["metadata"]["labels"] = labels
    return wl


def apply_as_user(kube, doc: dict[str, Any]) -> None:
    if doc["kind"] == "Service":
        meta = doc["metadata"]
        kube.apply(f"/api/v1/namespaces/{meta['namespace']}/services/{meta['name']}", doc, manager="kubectl")
    else:
        user_apply(kube, doc, manager="kubectl")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_reaches_the_state_its_comments_promise(kube, namespace, run_operator, path):
    text = path.read_text()
    state, fields = promise(text)
    docs = [moved(d, namespace) for d in yaml.safe_load_all(text) if d]
    (policy,) = [d for d in docs if d["kind"] == "KVCachePolicy"]
    others = [d for d in docs if d["kind"] != "KVCachePolicy"]
    workloads = [d for d in others if d["kind"] in ("Deployment", "StatefulSet")] or [workload_for(policy, namespace)]
    for doc in [d for d in others if d not in workloads] + workloads:
        apply_as_user(kube, doc)
    run_operator(**CHART_DEFAULTS)
    create_policy(kube, policy)
    name, target = policy["metadata"]["name"], workloads[0]["metadata"]["name"]

    if state == "Ready":
        wait_applied(kube, namespace, name, target, timeout=60)
        return
    pol = wait_for(lambda: (p := get_policy(kube, namespace, name)) and cond(p, "Degraded").get("status") == "True"
                   and p, 60, what=f"{name} refused")
    message = cond(pol, "Degraded")["message"]
    assert cond(pol, "Ready")["status"] == "False"
    for field in fields:
        assert field in message, (field, message)
    # Refused means nothing applied: the workload is as its owner wrote it.
    assert manager_entry(get_workload(kube, namespace, target), FIELD_MANAGER) is None
    # The refusal reaches `kubectl get events` once, not once per condition that carries it.
    events = wait_for(lambda: [e for e in kube.list(f"/api/v1/namespaces/{namespace}/events")
                               if e.get("message") == message] or None, 30, what="the refusal's Event")
    assert len(events) == 1 and events[0].get("count", 1) == 1, events
