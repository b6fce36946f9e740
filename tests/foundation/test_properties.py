"""Property-based: any policy either validates and renders parseable configuration, or is rejected with field
paths; nothing in between, and never a crash."""
import json

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtier_operator.api.validation import PolicyInvalid, parse_policy
from kvtier_operator.render import RenderError, render

names = st.sampled_from(["host", "nvme", "ssd", "hdd", "Bad_Name", ""])
sizes = st.one_of(st.sampled_from(["16Gi", "1.5Gi", "500G", "0", "-1Gi", "lots", "1Ki"]),
                  st.integers(min_value=-5, max_value=2**40))
volumes = st.sampled_from([{"emptyDir": {}}, {"hostPath": {"path": "/nvme"}},
                           {"persistentVolumeClaim": {"claimName": "kv"}}, {}, {"emptyDir": {}, "hostPath": {}}])


@st.composite
def tiers(draw):
    tier = {"name": draw(names), "medium": draw(st.sampled_from(["cpu", "filesystem", "remote", "gpu"])),
            "size": draw(sizes)}
    if draw(st.booleans()):
        tier["path"] = draw(st.sampled_from(["/mnt/a", "/mnt/b", "relative"]))
    if draw(st.booleans()):
        tier["remote"] = {"url": draw(st.sampled_from(["redis://v:6379", "rediss://v:6380/1", "redis://u:p@v:1",
                                                       "redis://v", "http://v:6379", "redis://v:1/x?y"]))}
        if draw(st.booleans()):
            tier["remote"]["passwordSecret"] = draw(st.sampled_from([{"name": "v", "key": "p"}, {"name": "V"}]))
        if draw(st.booleans()):  # valid only with rediss://
            tier["remote"]["caSecret"] = draw(st.sampled_from([{"name": "v-tls", "key": "ca.crt"}, {"key": "ca"}]))
    if draw(st.booleans()):
        tier["volume"] = draw(volumes)
    for key, values in {"evictionPolicy": ["lru", "arc", "s3fifo", "lfu"], "admission": ["none", "doorkeeper"],
                        "compression": ["none", "fp8", "int4", "zstd"], "enabled": [True, False]}.items():
        if draw(st.booleans()):
            tier[key] = draw(st.sampled_from(values))
    return tier


@st.composite
def policies(draw):
    spec = {"selector": draw(st.sampled_from([{"matchLabels": {"app": "x"}}, {}, {"matchLabels": {}}]))}
    if draw(st.booleans()):
        spec["engine"] = draw(st.sampled_from(["vllm", "trtllm", "sglang"]))
    if draw(st.booleans()):
        spec["engineVersion"] = draw(st.sampled_from(["1.2", "1.3.0", "2.0", "x"]))
    if draw(st.booleans()):
        spec["blockSize"] = draw(st.sampled_from([16, 32, 48, 0, 2048]))
    if draw(st.booleans()):
        spec["backend"] = draw(st.sampled_from(["native", "lmcache", "kvtier", "other"]))
    spec["tiers"] = draw(st.lists(tiers(), max_size=5))
    if draw(st.booleans()):
        spec["offload"] = {k: v for k, v in {
            "chunkTokens": draw(st.sampled_from([None, 16, 100, 256, 0])),
            "storeThreshold": draw(st.sampled_from([None, 0, 1, 2])),
            "promptOnly": draw(st.sampled_from([None, True, False])),
        }.items() if v is not None}
    if draw(st.booleans()):
        spec["gpu"] = {"memoryUtilization": draw(st.sampled_from([0.5, 0.92, 1.0, 0, 1.2])),
                       "kvCacheDtype": draw(st.sampled_from(["auto", "fp8", "fp8_e5m2", "int8"]))}
    if draw(st.booleans()):
        spec["slo"] = {"prometheus": {"url": draw(st.sampled_from(["http://p:9090", "p:9090"]))},
                       "ttftP99": draw(st.sampled_from(["2s", "150ms", "2 seconds"]))}
    if draw(st.booleans()):
        spec["rollout"] = {"strategy": draw(st.sampled_from(["immediate", "staged", "canary"]))}
    if draw(st.booleans()):
        spec[draw(st.sampled_from(["tires", "extra"]))] = 1
    return {"apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy", "metadata": {"name": "p"}, "spec": spec}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies())
def test_valid_renders_parseable_config_and_invalid_names_a_field(doc):
    try:
        policy = parse_policy(doc)
    except PolicyInvalid as err:
        assert err.problems
        for problem in err.problems:
            assert problem.path.startswith("spec") and problem.message, problem
        return
    for engine in ([policy.spec.engine] if policy.spec.engine else ["vllm", "trtllm"]):
        try:
            rendered = render(policy, engine=engine)
        except RenderError as err:
            # Only a detected engine may still break an engine rule; it says which field.
            assert policy.spec.engine is None and "spec." in str(err)
            continue
        for name, content in rendered.files.items():
            assert isinstance(yaml.safe_load(content), dict), name
        json.dumps(rendered.to_dict())
        enabled = [t.name for t in policy.spec.tiers if t.enabled]
        assert set(rendered.tiers) <= set(enabled)


@st.composite
def valid_policies(draw):
    """Policies valid by construction: the validator must accept them and every engine must render them."""
    engine = draw(st.sampled_from(["vllm", "trtllm"]))
    backend = "native" if engine == "trtllm" else draw(st.sampled_from(["native", "lmcache", "kvtier"]))
    block = draw(st.sampled_from([16, 32, 64]))
    policies_for = {"native": ["lru"] if engine == "trtllm" else ["lru", "arc"], "lmcache": ["lru"],
                    "kvtier": ["lru", "arc", "s3fifo"]}[backend]
    tiers_ = []
    if draw(st.booleans()):
        tiers_.append({"name": "host", "medium": "cpu", "size": draw(st.sampled_from(["1Gi", "16Gi", "1000000"])),
                       "evictionPolicy": draw(st.sampled_from(policies_for))})
        max_disks = {"native": 1 if engine == "trtllm" else 3, "lmcache": 1, "kvtier": 3}[backend]
        for i in range(draw(st.integers(0, max_disks))):
            tier = {"name": f"disk{i}", "medium": "filesystem", "size": "100Gi", "path": f"/mnt/d{i}",
                    "volume": draw(volumes.filter(lambda v: len(v) == 1 and v != {"hostPath": {}})),
                    "evictionPolicy": draw(st.sampled_from(policies_for)), "enabled": draw(st.booleans())}
            if backend == "kvtier":
                tier["compression"] = draw(st.sampled_from(["none", "fp8", "fp8_e5m2", "int8", "int4"]))
                tier["admission"] = draw(st.sampled_from(["none", "doorkeeper"]))
            tiers_.append(tier)
        if backend == "kvtier" and len(tiers_) < 4 and draw(st.booleans()):
            remote = {"name": "shared", "medium": "remote", "size": "20Gi", "enabled": draw(st.booleans()),
                      "compression": draw(st.sampled_from(["none", "fp8", "int8"])),
                      "remote": {"url": draw(st.sampled_from(["redis://valkey:6379", "rediss://[fd00::1]:6380/2"])),
                                 "macKeySecret": {"name": "mackeysecret", "key": "k"}}}  # required
            if draw(st.booleans()):
                remote["remote"]["username"] = draw(st.sampled_from(["tenant-a", "svc.kv_1"]))
            keys = ["passwordSecret"] + (["caSecret"] if "rediss" in remote["remote"]["url"] else [])
            for key in draw(st.sets(st.sampled_from(keys))):
                remote["remote"][key] = {"name": key.lower(), "key": "k"}
            tiers_.append(remote)
    spec = {"selector": {"matchLabels": {"app": "x"}}, "engine": engine, "backend": backend, "blockSize": block,
            "tiers": tiers_, "offload": {"chunkTokens": block * draw(st.integers(1, 32))}}
    if engine == "trtllm" and any(t["medium"] == "filesystem" for t in tiers_):
        spec["engineVersion"] = draw(st.sampled_from(["1.3", "1.4.0rc1", "2.0"]))
    metadata = {"name": "p", **({"namespace": draw(st.sampled_from(["team-a", "kv-2"]))} if draw(st.booleans()) else {})}
    return {"apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy", "metadata": metadata, "spec": spec}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_policies(), st.data())
def test_every_valid_policy_renders_for_any_subset_of_enabled_tiers(doc, data):
    policy = parse_policy(doc)
    names = [t.name for t in policy.spec.tiers]
    enabled = data.draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    rendered = render(policy, enabled_tiers=enabled)
    for content in rendered.files.values():
        assert isinstance(yaml.safe_load(content), dict)
    assert set(rendered.tiers) <= set(enabled)
    if rendered.tiers:
        assert rendered.tiers[0] == "host" and rendered.resources["cpuTierBytes"] > 0
    mounted = {m["mountPath"] for m in rendered.volume_mounts}
    assert {t.path for t in policy.spec.tiers if t.name in rendered.tiers and t.path} <= mounted
    # A rendered remote tier reaches the runtime's parser, and its Secret files are mounted read-only.
    remote = next((t for t in policy.spec.tiers if t.medium == "remote" and t.name in rendered.tiers), None)
    if remote is not None:
        from kvtier_runtime.config import OffloadSpecConfig

        extra = yaml.safe_load(rendered.files["engine.yaml"])["kv-transfer-config"]["kv_connector_extra_config"]
        (cfg,) = [t.config for t in OffloadSpecConfig.from_extra_config(extra).tiers if t.medium == "remote"]
        assert cfg.url == remote.remote.url and cfg.capacity_bytes == remote.size_bytes
        # The policy's namespace is the tenant scope ("default" for a document without one, as kubectl would).
        assert cfg.scope == (doc["metadata"].get("namespace") or "default") and cfg.username == remote.remote.username
        assert cfg.mac_key_file is not None and cfg.mac_key_file != cfg.password_file
        assert (cfg.ca_file is not None) == (remote.remote.ca_secret is not None)
        for path in (cfg.password_file, cfg.mac_key_file, cfg.ca_file):
            assert path is None or any(path.startswith(m["mountPath"] + "/") and m.get("readOnly")
                                       for m in rendered.volume_mounts)
