"""Every policy `kvtier validate` accepts renders a workload patch and a ConfigMap the real API server accepts
(issue #16: tier paths over the operator's own mounts, `/a` vs `/a/`, truncated volume names colliding, `..` in
hostPath, sizes over int64, odd characters in paths). Random policies from hypothesis, dry-run applied."""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtier_operator import reconcile as rc
from kvtier_operator.api.units import format_quantity, parse_quantity
from kvtier_operator.api.validation import PolicyInvalid, parse_policy
from kvtier_operator.kube import APPLY, config_map_path, workload_path
from kvtier_operator.render import RenderError, render
from kvtier_operator.settings import FIELD_MANAGER
from kvtier_operator.workload import Workload, apply_patch
from plugins.operator import TRTLLM_IMAGE, deployment, user_apply

pytestmark = pytest.mark.controlplane

NAME = st.from_regex(r"[a-z]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
# Two names sharing their first 51 characters used to truncate to one volume name.
LONG_NAME = st.from_regex(r"[a-z0-9]{12}", fullmatch=True).map(lambda tail: "t" * 51 + tail)
SEGMENT = st.from_regex(r"[A-Za-z0-9_ %#:@+=,~-][A-Za-z0-9._ %#:@+=,~-]{0,11}", fullmatch=True).filter(
    lambda s: s not in (".", ".."))
PATH = st.tuples(st.sampled_from(["mnt", "data", "cache", "var/lib", "srv", "opt/kv", "home"]),
                 st.lists(SEGMENT, max_size=3), st.booleans()).map(
    lambda t: "/" + "/".join([t[0], *t[1]]) + ("/" if t[2] else ""))
QUANTITY = st.one_of(
    st.integers(1, 2**50),
    st.integers(1, 2**50).map(str),
    st.tuples(st.integers(1, 1023), st.sampled_from(["Ki", "Mi", "Gi", "Ti", "Pi", "k", "M", "G", "T", "P"])).map(
        lambda t: f"{t[0]}{t[1]}"),
    st.tuples(st.integers(1, 64), st.integers(1, 9)).map(lambda t: f"{t[0]}.{t[1]}Gi"),
)
VOLUME = st.one_of(
    st.just({"emptyDir": {}}),
    QUANTITY.map(lambda q: {"emptyDir": {"sizeLimit": q}}),
    st.just({"emptyDir": {"medium": "Memory"}}),
    st.tuples(PATH, st.sampled_from([None, "", "Directory", "DirectoryOrCreate"])).map(
        lambda t: {"hostPath": {"path": t[0], **({"type": t[1]} if t[1] is not None else {})}}),
    st.tuples(NAME, st.booleans()).map(lambda t: {"persistentVolumeClaim": {"claimName": t[0], "readOnly": t[1]}}),
)


@st.composite
def policies(draw):
    engine, backend = draw(st.sampled_from([("vllm", "native"), ("vllm", "kvtier"), ("vllm", "lmcache"),
                                            ("trtllm", "native")]))
    n_disks = draw(st.integers(0, 1 if engine == "trtllm" or backend == "lmcache" else 3))
    names = draw(st.lists(st.one_of(NAME, LONG_NAME), min_size=n_disks, max_size=n_disks, unique=True))
    paths = draw(st.lists(PATH, min_size=n_disks, max_size=n_disks, unique_by=lambda p: p.rstrip("/")))
    tiers = [{"name": "host", "medium": "cpu", "size": draw(QUANTITY),
              "evictionPolicy": "lru"}]
    for name, path in zip(names, paths):
        if name == "host":
            continue
        tiers.append({"name": name, "medium": "filesystem", "size": draw(QUANTITY), "path": path,
                      "volume": draw(VOLUME), "evictionPolicy": "lru"})
    spec = {"selector": {"matchLabels": {"app": "llm"}}, "engine": engine, "backend": backend, "tiers": tiers,
            "hostMemoryHeadroom": draw(QUANTITY)}
    if engine == "trtllm":
        spec["engineVersion"] = "1.3.0"
    name = draw(st.one_of(NAME, st.from_regex(r"[a-z][a-z0-9]{62}", fullmatch=True)))
    return {"apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy",
            "metadata": {"name": name, "uid": "00000000-0000-0000-0000-000000000001"}, "spec": spec}


def test_rendered_patches_of_accepted_policies_are_accepted_by_the_api_server(kube, namespace):
    workloads = {engine: user_apply(kube, deployment(f"llm-{engine}", namespace, image=image, memory_limit=None))
                 for engine, image in (("vllm", "vllm/vllm-openai:v0.33.0"), ("trtllm", TRTLLM_IMAGE))}
    seen = {"accepted": 0, "rejected_offline": 0}
    started = time.monotonic()

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(policies())
    def check(doc):
        try:
            policy = parse_policy(doc)
            rendered = render(policy, config_map_name=rc.config_map_name(doc["metadata"]["name"]))
        except (PolicyInvalid, RenderError):
            seen["rejected_offline"] += 1
            return
        seen["accepted"] += 1
        wl = workloads[policy.spec.engine]
        container = wl["spec"]["template"]["spec"]["containers"][0]
        increase = int(rendered.resources.get("memoryLimitIncreaseBytes", 0))
        limit = format_quantity(parse_quantity(container["resources"]["requests"]["memory"]) + increase)
        body = apply_patch(Workload(wl), container["name"], rendered, policy=doc["metadata"]["name"],
                           config_hash=rendered.config_hash(), cleanup_image="busybox:1.37.0", memory_limit=limit)
        kube.request("PATCH", workload_path(wl["kind"], namespace, wl["metadata"]["name"]),
                     query=[("fieldManager", FIELD_MANAGER), ("force", "true"), ("dryRun", "All")],
                     body=body, content_type=APPLY)
        cm = rc.config_map_body({**doc, "metadata": {**doc["metadata"], "namespace": namespace}}, rendered.files)
        kube.request("PATCH", config_map_path(namespace, cm["metadata"]["name"]),
                     query=[("fieldManager", FIELD_MANAGER), ("force", "true"), ("dryRun", "All")],
                     body=cm, content_type=APPLY)
        names = [v["name"] for v in body["spec"]["template"]["spec"]["volumes"]]
        assert len(names) == len(set(names)) and all(len(n) <= 63 for n in names)

    check()
    took = time.monotonic() - started
    assert seen["accepted"] >= 30, seen  # the strategy mostly produces valid policies: the test is not vacuous
    assert took < 60, f"{took:.0f}s"
