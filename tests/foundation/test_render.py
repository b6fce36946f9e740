"""Renders for every engine/backend/tier combination: golden files, and key-by-key checks against engine facts.

Facts are those of vLLM 0.33.0 and TensorRT-LLM (see docs/engines.md); regenerate the golden files with
KVTIER_UPDATE_GOLDEN=1 after an intended change and review the diff.
"""
import json
import os
import pathlib

import pytest
import yaml
from foundation.policies import cpu, disk, policy
from kvtier_operator.api.validation import parse_policy
from kvtier_operator.render import RenderError, TargetFacts, detect_engine, render
from kvtier_runtime.config import (
    VLLM_ADAPTER_MODULE,
    VLLM_OFFLOADING_SPEC_CLASS,
    VLLM_SECONDARY_TIER_CLASS,
    FilesystemTierConfig,
    OffloadSpecConfig,
)

GOLDEN = pathlib.Path(__file__).parent / "golden"
GiB = 2**30

CASES = {
    "vllm-gpu-only": (policy(tiers=[]), None),
    "vllm-native-cpu": (policy(tiers=[cpu(evictionPolicy="arc")], offload={"chunkTokens": 256, "storeThreshold": 2,
                                                                          "promptOnly": True}), None),
    "vllm-native-cpu-fs": (policy(gpu={"memoryUtilization": 0.85, "kvCacheDtype": "fp8"},
                                  offload={"chunkTokens": 256}), None),
    "vllm-native-fs-disabled": (policy(), ["host"]),
    "vllm-native-cpu-disabled": (policy(), ["nvme"]),
    "vllm-lmcache-cpu-fs": (policy(backend="lmcache", offload={"chunkTokens": 256}), None),
    "vllm-kvtier-cpu": (policy(backend="kvtier", tiers=[cpu(evictionPolicy="s3fifo", admission="doorkeeper")]), None),
    "vllm-kvtier-cpu-fs": (policy(backend="kvtier", tiers=[cpu(evictionPolicy="s3fifo"),
                                                           disk(compression="int4", evictionPolicy="arc",
                                                                readThreads=32, writeThreads=8),
                                                           disk("hdd", volume={"hostPath": {"path": "/data"}})]),
                           None),
    "trtllm-gpu-only": (policy(engine="trtllm", tiers=[], gpu={"memoryUtilization": 0.9}), None),
    "trtllm-host": (policy(engine="trtllm", tiers=[cpu()], offload={"minPriority": 50},
                           gpu={"kvCacheDtype": "fp8"}), None),
    "trtllm-host-disk": (policy(engine="trtllm", engineVersion="1.3", blockSize=32,
                                tiers=[cpu(), disk(volume={"persistentVolumeClaim": {"claimName": "kv"}})]), None),
}


def _render(name):
    doc, enabled = CASES[name]
    return render(parse_policy(doc), enabled_tiers=enabled)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    out = json.dumps(_render(name).to_dict(), indent=2, sort_keys=True) + "\n"
    path = GOLDEN / f"{name}.json"
    if os.environ.get("KVTIER_UPDATE_GOLDEN"):
        path.write_text(out)
    assert path.read_text() == out, f"{name}: render changed; review and regenerate with KVTIER_UPDATE_GOLDEN=1"


VLLM_FLAGS = {"block-size", "gpu-memory-utilization", "kv-cache-dtype", "kv-transfer-config"}
KV_TRANSFER_KEYS = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_load_failure_policy"}
OFFLOADING_KEYS = {"spec_name", "cpu_bytes_to_use", "block_size", "eviction_policy", "cache_policy_module_path",
                   "offload_prompt_only", "store_threshold", "secondary_tiers"}
# kvtier's own spec (backend kvtier) reads these; vLLM reads the OFFLOADING_KEYS among them.
KVTIER_SPEC_KEYS = {"spec_name", "spec_module_path", "cpu_bytes_to_use", "block_size", "offload_prompt_only",
                    "eviction_policy", "admission", "host_shm_dir", "tiers", "host_tier_name", "control_file",
                    "recompute_tokens_per_s"}
FS_TIER_KEYS = {"type", "root_dir", "n_read_threads", "n_write_threads"}
TRT_KV_KEYS = {"enable_block_reuse", "host_cache_size", "free_gpu_memory_fraction", "tokens_per_block", "dtype",
               "secondary_offload_min_priority", "disk_cache_size", "disk_cache_path"}


def _vllm_file(rendered):
    return yaml.safe_load(rendered.files["engine.yaml"])


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("vllm")])
def test_vllm_keys_are_vllm_033_keys(name):
    rendered = _render(name)
    flags = _vllm_file(rendered)
    assert set(flags) <= VLLM_FLAGS
    assert rendered.config_args == ["--config", "/etc/kvtier/engine.yaml"]
    # The argument form is the same configuration as the file.
    args = dict(zip(rendered.args[::2], rendered.args[1::2]))
    assert {k[2:] for k in args} == set(flags)
    for key, value in flags.items():
        assert (json.loads(args[f"--{key}"]) if isinstance(value, dict) else args[f"--{key}"]) == (
            value if isinstance(value, dict) else str(value))
    ktc = flags.get("kv-transfer-config")
    if ktc is None:
        assert rendered.tiers == [] and "kvtier-shm" not in [v["name"] for v in rendered.volumes]
        return
    assert set(ktc) <= KV_TRANSFER_KEYS
    assert ktc["kv_role"] == "kv_both" and ktc["kv_load_failure_policy"] == "recompute"
    if ktc["kv_connector"] == "LMCacheConnectorV1":
        assert rendered.env["LMCACHE_CONFIG_FILE"] == "/etc/kvtier/lmcache.yaml"
        assert "kv_connector_extra_config" not in ktc
        return
    assert ktc["kv_connector"] == "OffloadingConnector"
    extra = ktc["kv_connector_extra_config"]
    if extra["spec_name"] == VLLM_OFFLOADING_SPEC_CLASS:
        assert set(extra) <= KVTIER_SPEC_KEYS and extra["spec_module_path"] == VLLM_ADAPTER_MODULE
        assert OffloadSpecConfig.from_extra_config(extra).cpu_bytes_to_use == 16 * GiB  # the runtime parses it
        return
    assert set(extra) <= OFFLOADING_KEYS
    assert extra["cpu_bytes_to_use"] == 16 * GiB and isinstance(extra["cpu_bytes_to_use"], int)
    assert extra["spec_name"] == ("TieringOffloadingSpec" if "secondary_tiers" in extra else "CPUOffloadingSpec")
    assert "store_threshold" not in extra or extra["spec_name"] == "CPUOffloadingSpec"
    if "block_size" in extra:
        assert extra["block_size"] % flags["block-size"] == 0
    for tier in extra.get("secondary_tiers", []):
        if tier["type"] == "fs":
            assert set(tier) <= FS_TIER_KEYS
        else:
            assert (tier["type"], tier["module_path"]) == (VLLM_SECONDARY_TIER_CLASS, VLLM_ADAPTER_MODULE)
    # /dev/shm holds the cpu tier's mmap: sized to it plus headroom, and the memory limit grows to match.
    shm = next(v for v in rendered.volumes if v["name"] == "kvtier-shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": str(17 * GiB)}
    assert rendered.resources["memoryLimitIncreaseBytes"] == 17 * GiB


def test_vllm_kvtier_backend_renders_kvtiers_own_spec():
    extra = _vllm_file(_render("vllm-kvtier-cpu-fs"))["kv-transfer-config"]["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == (VLLM_OFFLOADING_SPEC_CLASS, VLLM_ADAPTER_MODULE)
    assert extra["eviction_policy"] == "s3fifo" and extra["admission"] == "none"
    assert [(t["name"], t["medium"]) for t in extra["tiers"]] == [("nvme", "filesystem"), ("hdd", "filesystem")]
    nvme, hdd = (FilesystemTierConfig.from_kwargs(t["config"]) for t in extra["tiers"])
    assert nvme.codec == "int4" and nvme.capacity_bytes == 500 * GiB and nvme.n_read_threads == 32
    assert nvme.eviction_policy == "arc" and hdd.root_dir == "/mnt/hdd"
    extra = _vllm_file(_render("vllm-kvtier-cpu"))["kv-transfer-config"]["kv_connector_extra_config"]
    assert (extra["eviction_policy"], extra["admission"]) == ("s3fifo", "doorkeeper") and "tiers" not in extra


def test_only_enabled_tiers_are_rendered():
    assert _render("vllm-native-fs-disabled").tiers == ["host"]
    assert "secondary_tiers" not in json.dumps(_render("vllm-native-fs-disabled").to_dict())
    # Without the cpu tier nothing can reach the disk tier: GPU-only.
    gpu_only = _render("vllm-native-cpu-disabled")
    assert gpu_only.tiers == [] and "kv-transfer-config" not in _vllm_file(gpu_only)
    assert _render("vllm-native-cpu-fs").config_hash() != _render("vllm-native-fs-disabled").config_hash()


def test_lmcache_config_file():
    rendered = _render("vllm-lmcache-cpu-fs")
    lm = yaml.safe_load(rendered.files["lmcache.yaml"])
    assert lm == {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 16.0, "cache_policy": "LRU",
                  "local_disk": "file:///mnt/kvcache/", "max_local_disk_size": 500.0}


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("trtllm")])
def test_trtllm_keys(name):
    rendered = _render(name)
    doc = yaml.safe_load(rendered.files["engine.yaml"])
    assert set(doc) == {"kv_cache_config"} and set(doc["kv_cache_config"]) <= TRT_KV_KEYS
    assert rendered.config_args == ["--extra_llm_api_options", "/etc/kvtier/engine.yaml"]
    kv = doc["kv_cache_config"]
    assert kv["enable_block_reuse"] is True and kv["tokens_per_block"] & (kv["tokens_per_block"] - 1) == 0
    if rendered.tiers:
        assert kv["host_cache_size"] == 16 * GiB and 0 <= kv["secondary_offload_min_priority"] <= 100
        assert "kvtier-shm" not in [v["name"] for v in rendered.volumes]
    if "nvme" in rendered.tiers:
        assert (kv["disk_cache_size"], kv["disk_cache_path"]) == (500 * GiB, "/mnt/nvme")


def test_engine_detection_and_detected_engine_rules():
    assert detect_engine(TargetFacts("s", "vllm/vllm-openai:v0.33.0")) == "vllm"
    assert detect_engine(TargetFacts("s", "nvcr.io/nvidia/tensorrt-llm/release:1.3.0")) == "trtllm"
    assert detect_engine(TargetFacts("s", "registry/model:1", command=("trtllm-serve",))) == "trtllm"
    with pytest.raises(RenderError, match="spec.engine: cannot detect"):
        detect_engine(TargetFacts("server", "busybox"))
    undeclared = parse_policy(policy(engine=None, backend="lmcache"))
    with pytest.raises(RenderError, match="engine trtllm does not support backend lmcache"):
        render(undeclared, TargetFacts("s", "nvcr.io/nvidia/tensorrt-llm/release:1.3.0"))
    assert render(undeclared, TargetFacts("s", "vllm/vllm-openai:v0.33.0")).engine == "vllm"


def test_trace_renders_the_recorder_keys_and_an_emptydir_at_the_trace_folder():
    doc = policy(backend="kvtier", trace={"enabled": True, "maxSize": "256Mi", "files": 8})
    rendered = render(parse_policy(doc))
    extra = _vllm_file(rendered)["kv-transfer-config"]["kv_connector_extra_config"]
    config = OffloadSpecConfig.from_extra_config(extra)  # as the runtime reads it
    assert (config.trace_dir, config.trace_max_bytes, config.trace_files) == ("/var/lib/kvtier/trace", 256 * 2**20, 8)
    volume = next(v for v in rendered.volumes if v["name"] == "kvtier-trace")
    # The trace files' bound plus room for the sidecar: the kubelet never evicts the pod for a full recording.
    assert int(volume["emptyDir"]["sizeLimit"]) == 257 * 2**20 and set(volume) == {"name", "emptyDir"}
    assert {"name": "kvtier-trace", "mountPath": "/var/lib/kvtier/trace"} in rendered.volume_mounts
    # Defaults: 64Mi over 4 files, which the runtime leaves out of the extra config as its own defaults.
    rendered = render(parse_policy(policy(backend="kvtier", trace={"enabled": True})))
    extra = _vllm_file(rendered)["kv-transfer-config"]["kv_connector_extra_config"]
    assert extra["trace_dir"] == "/var/lib/kvtier/trace"
    assert OffloadSpecConfig.from_extra_config(extra).trace_max_bytes == 64 * 2**20


def test_trace_off_or_without_a_tier_renders_no_recording():
    for doc, enabled in ((policy(backend="kvtier", trace={"enabled": False}), None),
                         (policy(backend="kvtier"), None),
                         (policy(backend="kvtier", trace={"enabled": True}), [])):
        rendered = render(parse_policy(doc), enabled_tiers=enabled)
        assert "trace_dir" not in json.dumps(rendered.to_dict())
        assert all(v["name"] != "kvtier-trace" for v in rendered.volumes)
    # A disabled recording changes nothing: no roll of the workloads for writing trace: {enabled: false}.
    assert render(parse_policy(policy(backend="kvtier", trace={"enabled": False}))).config_hash() == \
        render(parse_policy(policy(backend="kvtier"))).config_hash()


def test_trace_is_refused_for_other_backends_and_over_a_tier_mount():
    doc = policy(trace={"enabled": True})
    doc["spec"]["backend"] = "native"
    with pytest.raises(Exception, match="trace.enabled needs backend kvtier"):
        render(parse_policy(doc))
    doc = policy(backend="kvtier", trace={"enabled": True}, tiers=[cpu(), disk(path="/var/lib/kvtier")])
    with pytest.raises(RenderError, match="spec.trace: the recording's folder /var/lib/kvtier/trace overlaps"):
        render(parse_policy(doc))


def test_events_render_the_publisher_as_keys_vllm_merges_with_the_pods_topic_and_every_tier_announces():
    """spec.events: vLLM's --kv-events-config in the config file as dotted keys (a nested dict would be replaced by
    the pod's own --kv-events-config.topic argument, which names the pod), the pod IP from the downward API, every
    tier's enable_kv_events (kvtier's spec and vLLM's own secondary tiers), and nothing at all while disabled."""
    from foundation.policies import remote

    doc = policy(backend="kvtier", tiers=[cpu(), disk(), remote()], events={"enabled": True, "model": "llama"})
    rendered = render(parse_policy(doc))
    file = _vllm_file(rendered)
    assert {k: v for k, v in file.items() if k.startswith("kv-events-config")} == {
        "kv-events-config.enable_kv_cache_events": "true", "kv-events-config.publisher": "zmq",
        "kv-events-config.endpoint": "tcp://*:5557", "kv-events-config.replay_endpoint": "tcp://*:5558"}
    assert rendered.config_args == ["--config", "/etc/kvtier/engine.yaml",
                                    "--kv-events-config.topic", "kv@$(KVTIER_POD_IP)@serving/llama"]
    assert rendered.env_fields == {"KVTIER_POD_IP": "status.podIP"}
    cfg = OffloadSpecConfig.from_extra_config(file["kv-transfer-config"]["kv_connector_extra_config"])
    assert [t.config.extra.get("enable_kv_events") for t in cfg.tiers] == [True, True]
    native = _vllm_file(render(parse_policy(policy(events={"enabled": True, "model": "llama"}))))
    assert [t["enable_kv_events"] for t in
            native["kv-transfer-config"]["kv_connector_extra_config"]["secondary_tiers"]] == [True]
    # Disabled (or absent): no roll of the workloads for writing events: {enabled: false}.
    off = render(parse_policy(policy(backend="kvtier", events={"enabled": False, "model": "llama"})))
    assert off.config_hash() == render(parse_policy(policy(backend="kvtier"))).config_hash()
    assert "kv-events" not in json.dumps(off.to_dict())


def test_the_runtime_config_keeps_the_policys_tier_order_a_remote_tier_before_a_filesystem_tier():
    """The tiers behind the cpu tier reach the runtime in the policy's order, under the policy's names: a remote
    tier declared before a filesystem tier is looked up (and its breaker named, its metrics labelled) first."""
    from foundation.policies import remote

    doc = policy(backend="kvtier", tiers=[cpu(), remote(), disk()])
    rendered = render(parse_policy(doc), enabled_tiers=["host", "shared", "nvme"])
    extra = _vllm_file(rendered)["kv-transfer-config"]["kv_connector_extra_config"]
    cfg = OffloadSpecConfig.from_extra_config(extra)
    assert [(t.name, t.medium) for t in cfg.tiers] == [("shared", "remote"), ("nvme", "filesystem")]
    assert cfg.names == ["host", "shared", "nvme"]
