"""The example policies: each is valid for the API server's schema (jsonschema over the CRD) and its CEL rules
(`kvtier validate`), renders, and renders what its comments promise."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kvtier_operator.api.validation import parse_policy
from kvtier_operator.render import render

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CRD = yaml.safe_load((ROOT / "crds" / "kvtier.io_kvcachepolicies.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
ENV = {"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'runtime'}", "PATH": "/usr/bin:/bin"}


def kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier_operator", *args], env=ENV, capture_output=True, text=True,
                          timeout=120)


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def policies(path: Path) -> list[dict]:
    return [d for d in documents(path) if d["kind"] == "KVCachePolicy"]


def by_name(name: str) -> dict:
    (doc,) = policies(ROOT / "examples" / name)
    return doc


def rendered(name: str, **kwargs) -> dict:
    return render(parse_policy(by_name(name)), **kwargs).to_dict()


def test_there_are_examples():
    assert len(EXAMPLES) >= 8


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_matches_the_crd_schema(path):
    # The CRD schema is OpenAPI v3.0, whose bounds follow JSON Schema draft 4 (boolean exclusiveMinimum).
    validator = jsonschema.Draft4Validator(SCHEMA)
    docs = policies(path)
    assert docs, f"{path.name} holds no KVCachePolicy"
    for doc in docs:
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert errors == []


def test_schema_check_rejects_what_the_api_server_would():
    doc = copy.deepcopy(by_name("vllm-native-cpu.yaml"))
    doc["spec"]["tiers"][0]["size"] = "-1Gi"
    doc["spec"]["tiers"][0]["evictionPolicy"] = "mru"
    errors = list(jsonschema.Draft4Validator(SCHEMA).iter_errors(doc))
    assert {tuple(e.absolute_path)[-1] for e in errors} >= {"evictionPolicy"}
    assert len(errors) >= 2


def test_kvtier_validate_accepts_every_example():
    result = kvtier("validate", *map(str, EXAMPLES))
    assert result.returncode == 0, result.stderr
    assert f"{len(EXAMPLES)} file(s) valid" in result.stdout


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_kvtier_render_each_example(path):
    for doc in policies(path):
        result = kvtier("render", str(path), "--name", doc["metadata"]["name"], "-o", "json")
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert out["engine"] == doc["spec"]["engine"]
        assert out["tiers"] == [t["name"] for t in doc["spec"]["tiers"] if t.get("enabled", True)]


def test_examples_cover_each_engine_and_backend():
    seen = set()
    for path in EXAMPLES:
        for doc in policies(path):
            spec = doc["spec"]
            media = tuple(sorted({t["medium"] for t in spec["tiers"]}))
            seen.add((spec["engine"], spec.get("backend", "native"), media, "slo" in spec))
    for wanted in [("vllm", "native", ("cpu",), False), ("vllm", "native", ("cpu", "filesystem"), False),
                   ("vllm", "lmcache", ("cpu", "filesystem"), False), ("vllm", "kvtier", ("cpu", "filesystem"), False),
                   ("trtllm", "native", ("cpu",), False), ("trtllm", "native", ("cpu", "filesystem"), False),
                   ("vllm", "native", ("cpu", "filesystem"), True)]:
        assert wanted in seen


def test_no_two_example_policies_select_the_same_workloads():
    # Applying all examples at once must not create conflicting policies (a workload selected twice).
    selectors = [(d["metadata"]["namespace"], json.dumps(d["spec"]["selector"], sort_keys=True))
                 for p in EXAMPLES for d in policies(p)]
    assert len(selectors) == len(set(selectors))


# ---------------------------------------------------------------------------------------------- promises


def test_kvtier_example_renders_s3fifo_doorkeeper_and_both_codecs():
    extra = json.loads(json.dumps(rendered("vllm-kvtier-compressed.yaml")))
    engine = yaml.safe_load(extra["files"]["engine.yaml"])
    config = engine["kv-transfer-config"]["kv_connector_extra_config"]
    assert (config["spec_name"], config["spec_module_path"]) == (
        "KvtierOffloadingSpec", "kvtier_runtime.engines.vllm_adapter")
    assert (config["eviction_policy"], config["admission"]) == ("s3fifo", "doorkeeper")
    assert [(t["config"]["root_dir"], t["config"]["codec"]) for t in config["tiers"]] == [
        ("/mnt/kvcache-nvme", "fp8"), ("/mnt/kvcache-archive", "int4")]


def test_native_cpu_fs_example_uses_vllms_tiering_spec():
    engine = yaml.safe_load(rendered("vllm-native-cpu-fs.yaml")["files"]["engine.yaml"])
    config = engine["kv-transfer-config"]["kv_connector_extra_config"]
    assert config["spec_name"] == "TieringOffloadingSpec" and config["eviction_policy"] == "arc"
    assert config["secondary_tiers"][0]["type"] == "fs"


def test_lmcache_example_points_lmcache_at_its_file():
    out = rendered("vllm-lmcache.yaml")
    assert out["env"]["LMCACHE_CONFIG_FILE"] == "/etc/kvtier/lmcache.yaml"
    assert yaml.safe_load(out["files"]["lmcache.yaml"])["local_disk"] == "file:///mnt/lmcache/"


def test_trtllm_examples_render_host_and_disk_cache():
    host = yaml.safe_load(rendered("trtllm-host.yaml")["files"]["engine.yaml"])["kv_cache_config"]
    assert host["host_cache_size"] == 48 * 2**30 and "disk_cache_path" not in host
    disk = yaml.safe_load(rendered("trtllm-1.3-disk.yaml")["files"]["engine.yaml"])["kv_cache_config"]
    assert disk["disk_cache_path"] == "/mnt/trtllm-kv" and disk["disk_cache_size"] == 2**40


def test_staged_example_guards_with_an_slo_and_starts_gpu_only():
    doc = by_name("staged-rollout-slo.yaml")
    assert doc["spec"]["rollout"]["strategy"] == "staged" and doc["spec"]["slo"]["ttftP99"] == "2s"
    # The first stage: no tier enabled, so nothing is offloaded.
    first = rendered("staged-rollout-slo.yaml", enabled_tiers=[])
    assert first["tiers"] == [] and "kv-transfer-config" not in yaml.safe_load(first["files"]["engine.yaml"])


def test_serving_deployment_example_is_valid_and_references_the_config_once():
    docs = documents(ROOT / "examples" / "vllm-serving-deployment.yaml")
    for doc in docs:
        if doc["kind"] != "KVCachePolicy":
            kubernetes_validate.validate(doc, "1.37.0", strict=True)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (policy,) = [d for d in docs if d["kind"] == "KVCachePolicy"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    config_args = render(parse_policy(policy)).config_args
    assert config_args == ["--config", "/etc/kvtier/engine.yaml"]
    args = container["args"]
    assert [args[i:i + 2] for i in range(len(args) - 1)].count(config_args) == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert policy["metadata"]["namespace"] == deployment["metadata"]["namespace"]
