"""Every field the API accepts reaches the runtime with its value.

For each spec field, a base policy and one change to that field; the test renders both through the reconcile
(``reconcile.plan`` on an observed Deployment) and builds the runtime objects from the rendered configuration
the way the engines do: the vLLM CPU tier's policy from its ``eviction_policy`` class name (what
``CachePolicyFactory`` resolves), the filesystem tier's ``FilesystemTierConfig`` and policy from its tier dict,
and the SLO guard's settings from the spec. The table says where each change must show. A model field missing
from the table fails ``test_every_spec_field_is_in_the_table`` (the ``storeThreshold`` class of bug: accepted,
rendered, and dropped on the way to the runtime object).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import yaml
from kvtier_operator import reconcile as rc
from kvtier_operator.api import v1alpha1 as api
from kvtier_runtime.config import (
    VLLM_OFFLOADING_SPEC_CLASS,
    CachePolicyChoice,
    FilesystemTierConfig,
    OffloadSpecConfig,
    RemoteTierConfig,
)
from kvtier_runtime.policies import get_policy
from kvtier_runtime.store.breaker import TierBreakers
from plugins.operator import TRTLLM_IMAGE, deployment, observed
from plugins.slo_harness import slo_settings
from pydantic import BaseModel

NOW = "2026-12-01T00:00:00Z"
# The admin's allowed hostPath prefixes (operator settings): the hostPath flows use paths under it.
HOST_PATH_PREFIXES = ("/mnt/disks",)
# ... and the stores remote tiers may use.
REMOTE_STORES_ALLOWED = ("redis://valkey:6379", "redis://other:6379", "valkey:6380")
GiB = 2**30

SLO = {"prometheus": {"url": "http://prometheus:9090"}, "ttftP99": "2s"}
CPU = {"name": "host", "medium": "cpu", "size": "16Gi"}
DISK = {"name": "nvme", "medium": "filesystem", "size": "100Gi", "path": "/mnt/nvme", "volume": {"emptyDir": {}}}


def base(**spec: Any) -> dict[str, Any]:
    out = {"selector": {"matchLabels": {"app": "llm"}}, "engine": "vllm", "backend": "kvtier",
           "tiers": [copy.deepcopy(CPU), copy.deepcopy(DISK)]}
    out.update(copy.deepcopy(spec))
    return out


def policy_obj(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": "llm", "namespace": "ns", "uid": "u1", "generation": 1}, "spec": spec}


# ---------------------------------------------------------------------------------------------- observation


def _policy_object(p: Any) -> dict[str, Any]:
    """A runtime policy object as comparable facts: class, capacity, admission filter and its parameters."""
    adm = p.admission
    return {"class": type(p).__name__, "capacity": p.capacity_bytes,
            "admission": None if adm is None else {"class": type(adm).__name__, **{
                k: v for k, v in vars(adm).items() if isinstance(v, (int, float, str, bool))}}}


def runtime_objects(files: dict[str, str]) -> dict[str, Any]:
    """What the runtime builds from the rendered vLLM config (the adapter's own parsing path, without vLLM)."""
    doc = yaml.safe_load(files.get("engine.yaml", "{}")) or {}
    extra = (doc.get("kv-transfer-config") or {}).get("kv_connector_extra_config") or {}
    out: dict[str, Any] = {}
    if extra.get("spec_name") == VLLM_OFFLOADING_SPEC_CLASS:
        # backend kvtier: kvtier's own offloading spec, parsed as KvtierOffloadingSpec parses it.
        spec = OffloadSpecConfig.from_extra_config(extra)
        out["cpu"] = _policy_object(get_policy(
            spec.eviction_policy, 1000, admission=None if spec.admission == "none" else spec.admission,
            admission_threshold=spec.admission_threshold))
        tiers = [t.config for t in spec.tiers if isinstance(t.config, FilesystemTierConfig)]
        breakers = TierBreakers.for_spec(spec, tokens_per_chunk=256)  # as the adapter builds them
        out["breakers"] = {"names": breakers.names, "control_file": spec.control_file,
                           "recompute_s_per_token": breakers.settings.recompute_s_per_token}
        if spec.trace_dir is not None:
            out["trace"] = {"dir": spec.trace_dir, "max_bytes": spec.trace_max_bytes, "files": spec.trace_files}
        remote = [t.config for t in spec.tiers if isinstance(t.config, RemoteTierConfig)]
        if remote:
            out["remote"] = [RemoteTierConfig.from_kwargs(t.to_kwargs()).to_kwargs() for t in remote]
        out["tier_order"] = [(t.name, t.medium) for t in spec.tiers]
        # Which tiers announce KV events (the spec's per-tier key, as engines/vllm/events.py reads it).
        out["tier_events"] = [t.config.extra.get("enable_kv_events", False) for t in spec.tiers]
    else:
        if str(extra.get("eviction_policy", "")).startswith("Kvtier"):
            choice = CachePolicyChoice.from_class_name(extra["eviction_policy"])
            out["cpu"] = _policy_object(get_policy(
                choice.eviction, 1000, admission=None if choice.admission == "none" else choice.admission,
                admission_threshold=choice.admission_threshold))
        tiers = [FilesystemTierConfig.from_kwargs({k: v for k, v in t.items() if k not in ("type", "module_path")})
                 for t in extra.get("secondary_tiers") or [] if t.get("type") == "KvtierFilesystemTier"]
    for cfg in tiers:
        # As fs/tier.py builds its policy.
        policy = get_policy(cfg.eviction_policy, cfg.capacity_bytes, admission=cfg.admission,
                            admission_threshold=cfg.admission_threshold)
        out.setdefault("fs", []).append({"config": cfg.to_kwargs(), "policy": _policy_object(policy)})
    # vLLM's --kv-events-config, as the dotted keys vLLM's parser merges with the pod's own topic argument.
    out["kv_events"] = {k.split(".", 1)[1]: v for k, v in doc.items() if k.startswith("kv-events-config.")}
    return out


def observe(spec: dict[str, Any], image: str = deployment()["spec"]["template"]["spec"]["containers"][0]["image"],
            container: str = "vllm", args: Optional[list[str]] = None) -> dict[str, Any]:
    """Everything a spec turns into: plan (targets, status), engine files, workload patch, runtime objects, guard."""
    # The container already references the config (as docs/gitops.md asks): nothing is applied otherwise.
    config_flag = "--extra_llm_api_options" if image == TRTLLM_IMAGE else "--config"
    wl = observed(deployment(labels={"app": "llm", "tier": "gold"}, image=image, container=container,
                             args=args or ["--model", "m", config_flag, "/etc/kvtier/engine.yaml"]))
    plan = rc.plan(policy_obj(spec), [wl], [], now=NOW, host_path_prefixes=HOST_PATH_PREFIXES,
                   pvc_allowed=("*/*",), remote_stores_allowed=REMOTE_STORES_ALLOWED)
    files = plan.config_map["data"] if plan.config_map else {}
    targets = [{k: v for k, v in vars(t).items() if k != "config_hash"} for t in plan.targets]
    guard = None
    if plan.invalid is False and spec.get("slo"):
        guard = dataclasses.asdict(slo_settings(api.KVCachePolicySpec.model_validate(spec)))
    return {
        "valid": not plan.invalid and all(t.state != rc.ERROR for t in plan.targets),
        "files": files,
        "targets": json.loads(json.dumps(targets, default=str)),
        "tiers": plan.status.get("tiers"),
        "runtime": runtime_objects(files),
        "guard": json.loads(json.dumps(guard, default=repr)),
    }


# ---------------------------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Flow:
    """Change ``path`` from ``before`` (a base spec) with ``change``; ``where`` must differ after it."""

    change: Callable[[dict[str, Any]], None]
    where: tuple[str, ...]
    before: Callable[[], dict[str, Any]] = base
    image: Optional[str] = None
    check: Optional[Callable[[dict[str, Any], dict[str, Any]], None]] = None
    args: Optional[list[str]] = None  # the container's args (default: they reference the rendered config)


def setter(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        node: Any = spec
        parts = path.replace("]", "").replace("[", ".").split(".")
        for part in parts[:-1]:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        last = parts[-1]
        node[int(last) if last.isdigit() else last] = value
    return change


def threshold_reaches_runtime(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["runtime"]["cpu"]["admission"]["n"] == 2 and b["runtime"]["cpu"]["admission"]["n"] == 5
    assert a["runtime"]["fs"][0]["policy"]["admission"]["n"] == 2
    assert b["runtime"]["fs"][0]["policy"]["admission"]["n"] == 5


def size_reaches_runtime(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert b["runtime"]["fs"][0]["config"]["capacity_bytes"] == 200 * GiB
    assert b["runtime"]["fs"][0]["policy"]["capacity"] == 200 * GiB


def remote(**store: Any) -> dict[str, Any]:
    """A remote tier with the tenant key every remote tier needs (its own, unless ``store`` names another)."""
    return {"name": "shared", "medium": "remote", "size": "10Gi",
            "remote": {"url": "redis://valkey:6379", "macKeySecret": {"name": "mac", "key": "k"}, **store}}


REMOTE_SECRETS = {"passwordSecret": {"name": "vk", "key": "pw"}, "macKeySecret": {"name": "mac", "key": "k"}}
TLS_STORE = "rediss://valkey:6380"
CA = {"name": "valkey-tls", "key": "ca.crt"}


def ca_file_reaches_runtime(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert "ca_file" not in a["runtime"]["remote"][0]
    assert b["runtime"]["remote"][0]["ca_file"] == "/etc/kvtier-remote/shared/ca.crt"
def recompute_rate_reaches_breakers(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["runtime"]["breakers"]["recompute_s_per_token"] is None
    assert b["runtime"]["breakers"]["recompute_s_per_token"] == pytest.approx(1 / 20000)
    assert b["runtime"]["breakers"]["names"] == ["host", "nvme"]


# A container that already passes the KV event topic of model m (kvtier render -o json's configArgs).
EVENTS_ARGS = ["--model", "m", "--config", "/etc/kvtier/engine.yaml",
               "--kv-events-config.topic", "kv@$(KVTIER_POD_IP)@ns/m"]


def events_on(**events: Any) -> dict[str, Any]:
    return base(events={"enabled": True, "model": "m", **events})


def events_reach_runtime(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["runtime"]["kv_events"] == {} and a["runtime"]["tier_events"] == [False]
    assert b["runtime"]["kv_events"] == {"enable_kv_cache_events": "true", "publisher": "zmq",
                                         "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    assert b["runtime"]["tier_events"] == [True]
    env = b["targets"][0]["apply"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "KVTIER_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env


def endpoint_reaches_runtime(a: dict[str, Any], b: dict[str, Any]) -> None:
    # A publisher that connects to an indexer binds no replay socket in the pod.
    assert b["runtime"]["kv_events"]["endpoint"] == "tcp://indexer:5557"
    assert "replay_endpoint" not in b["runtime"]["kv_events"]


def model_reaches_topic(a: dict[str, Any], b: dict[str, Any]) -> None:
    # The container passes model m's topic: for model other, the operator asks for the new argument first.
    assert a["targets"][0]["state"] == rc.APPLIED
    assert b["targets"][0]["state"] == rc.MISSING_ARG
    assert "kv@$(KVTIER_POD_IP)@ns/other" in b["targets"][0]["message"]


def trace_reaches_runtime(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert b["runtime"]["trace"] == {"dir": api.TRACE_DIR, "max_bytes": 128 * 2**20, "files": 4}


THRESHOLD_TIERS = [dict(CPU, admission="threshold"), dict(DISK, admission="threshold")]
SECRET = {"name": "prom", "key": "token"}
TRT = {"engine": "trtllm", "backend": "native", "tiers": [dict(CPU)]}
NATIVE_CPU = {"backend": "native", "tiers": [dict(CPU)]}
STAGED = {"slo": SLO, "rollout": {"strategy": "staged"}}
PROM = "slo.prometheus"

FLOWS: dict[str, Flow] = {
    "selector.matchLabels": Flow(setter("selector.matchLabels", {"app": "other"}), ("targets",)),
    "selector.matchExpressions.key": Flow(
        setter("selector.matchExpressions", [{"key": "team", "operator": "Exists"}]), ("targets",),
        before=lambda: base(selector={"matchExpressions": [{"key": "tier", "operator": "Exists"}]})),
    "selector.matchExpressions.operator": Flow(
        setter("selector.matchExpressions", [{"key": "tier", "operator": "DoesNotExist"}]), ("targets",),
        before=lambda: base(selector={"matchExpressions": [{"key": "tier", "operator": "Exists"}]})),
    "selector.matchExpressions.values": Flow(
        setter("selector.matchExpressions", [{"key": "tier", "operator": "In", "values": ["silver"]}]),
        ("targets",),
        before=lambda: base(selector={"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold"]}]})),
    "engine": Flow(setter("engine", "trtllm"), ("files",), before=lambda: base(**{**TRT, "engine": "vllm"}),
                   image=TRTLLM_IMAGE),
    "engineVersion": Flow(setter("engineVersion", "1.2"), ("valid",),
                          before=lambda: base(**{**TRT, "engineVersion": "1.3", "tiers": [CPU, DISK]}),
                          image=TRTLLM_IMAGE),
    "container": Flow(setter("container", "sidecar"), ("targets", "valid")),
    "blockSize": Flow(setter("blockSize", 32), ("files",)),
    "gpu.memoryUtilization": Flow(setter("gpu.memoryUtilization", 0.8), ("files",)),
    "gpu.kvCacheDtype": Flow(setter("gpu.kvCacheDtype", "fp8"), ("files",)),
    "backend": Flow(setter("backend", "native"), ("files", "runtime"),
                    before=lambda: base(tiers=[CPU])),
    "tiers.name": Flow(setter("tiers[1].name", "ssd"), ("targets", "tiers")),
    "tiers.medium": Flow(setter("tiers[0].medium", "filesystem"), ("valid",)),
    "tiers.size": Flow(setter("tiers[1].size", "200Gi"), ("files", "runtime"), check=size_reaches_runtime),
    "tiers.enabled": Flow(setter("tiers[1].enabled", False), ("files", "runtime", "tiers")),
    "tiers.evictionPolicy": Flow(setter("tiers[0].evictionPolicy", "s3fifo"), ("files", "runtime")),
    "tiers.admission": Flow(setter("tiers[1].admission", "doorkeeper"), ("files", "runtime")),
    "tiers.path": Flow(setter("tiers[1].path", "/mnt/ssd"), ("files", "runtime", "targets")),
    "tiers.volume.emptyDir.medium": Flow(setter("tiers[1].volume.emptyDir.medium", "Memory"), ("targets",)),
    "tiers.volume.emptyDir.sizeLimit": Flow(setter("tiers[1].volume.emptyDir.sizeLimit", "50Gi"), ("targets",)),
    "tiers.volume.hostPath.path": Flow(
        setter("tiers[1].volume", {"hostPath": {"path": "/mnt/disks/b"}}), ("targets",),
        before=lambda: base(tiers=[CPU, dict(DISK, volume={"hostPath": {"path": "/mnt/disks/a"}})])),
    "tiers.volume.hostPath.type": Flow(
        setter("tiers[1].volume.hostPath.type", "Directory"), ("targets",),
        before=lambda: base(tiers=[CPU, dict(DISK, volume={"hostPath": {"path": "/mnt/disks/a"}})])),
    "tiers.volume.persistentVolumeClaim.claimName": Flow(
        setter("tiers[1].volume.persistentVolumeClaim.claimName", "other"), ("targets",),
        before=lambda: base(tiers=[CPU, dict(DISK, volume={"persistentVolumeClaim": {"claimName": "kv"}})])),
    "tiers.volume.persistentVolumeClaim.readOnly": Flow(
        setter("tiers[1].volume.persistentVolumeClaim.readOnly", True), ("targets",),
        before=lambda: base(tiers=[CPU, dict(DISK, volume={"persistentVolumeClaim": {"claimName": "kv"}})])),
    "tiers.readThreads": Flow(setter("tiers[1].readThreads", 4), ("files", "runtime")),
    "tiers.writeThreads": Flow(setter("tiers[1].writeThreads", 4), ("files", "runtime")),
    "tiers.compression": Flow(setter("tiers[1].compression", "int8"), ("files", "runtime")),
    "tiers.remote.url": Flow(setter("tiers[2].remote.url", "redis://other:6379/1"), ("files", "runtime"),
                             before=lambda: base(tiers=[CPU, DISK, remote()])),
    "tiers.remote.passwordSecret.name": Flow(
        setter("tiers[2].remote.passwordSecret.name", "vk2"), ("targets",),
        before=lambda: base(tiers=[CPU, DISK, remote(**REMOTE_SECRETS)])),
    "tiers.remote.passwordSecret.key": Flow(
        setter("tiers[2].remote.passwordSecret.key", "other"), ("targets",),
        before=lambda: base(tiers=[CPU, DISK, remote(**REMOTE_SECRETS)])),
    "tiers.remote.macKeySecret.name": Flow(
        setter("tiers[2].remote.macKeySecret.name", "mac2"), ("targets",),
        before=lambda: base(tiers=[CPU, DISK, remote(**REMOTE_SECRETS)])),
    "tiers.remote.username": Flow(
        setter("tiers[2].remote.username", "tenant-a"), ("files", "runtime"),
        before=lambda: base(tiers=[CPU, DISK, remote(**REMOTE_SECRETS)])),
    "tiers.remote.macKeySecret.key": Flow(
        setter("tiers[2].remote.macKeySecret.key", "k2"), ("targets",),
        before=lambda: base(tiers=[CPU, DISK, remote(**REMOTE_SECRETS)])),
    "tiers.remote.macKeySecret.previousKey": Flow(
        setter("tiers[2].remote.macKeySecret.previousKey", "k-old"), ("targets",),
        before=lambda: base(tiers=[CPU, DISK, remote(**REMOTE_SECRETS)])),
    "tiers.remote.caSecret.name": Flow(
        setter("tiers[2].remote.caSecret", CA), ("targets", "files", "runtime"),
        before=lambda: base(tiers=[CPU, DISK, remote(url=TLS_STORE, **REMOTE_SECRETS)]), check=ca_file_reaches_runtime),
    "tiers.remote.caSecret.key": Flow(
        setter("tiers[2].remote.caSecret.key", "tls.crt"), ("targets",),
        before=lambda: base(tiers=[CPU, DISK, remote(url=TLS_STORE, caSecret=CA)])),
    "offload.chunkTokens": Flow(setter("offload.chunkTokens", 64), ("files",)),
    "offload.promptOnly": Flow(setter("offload.promptOnly", True), ("files",)),
    "offload.storeThreshold": Flow(setter("offload.storeThreshold", 5), ("files", "runtime"),
                                   before=lambda: base(tiers=THRESHOLD_TIERS), check=threshold_reaches_runtime),
    "offload.recomputeTokensPerSecond": Flow(setter("offload.recomputeTokensPerSecond", 20000), ("files", "runtime"),
                                             check=recompute_rate_reaches_breakers),
    "offload.minPriority": Flow(setter("offload.minPriority", 50), ("files",), before=lambda: base(**TRT),
                                image=TRTLLM_IMAGE),
    "hostMemoryHeadroom": Flow(setter("hostMemoryHeadroom", "4Gi"), ("targets",)),
    "injection.args": Flow(setter("injection.args", "managed"), ("targets",), args=["--model", "m"]),
    "rollout.strategy": Flow(setter("rollout.strategy", "staged"), ("files", "tiers", "guard"),
                             before=lambda: base(slo=SLO)),
    "rollout.stageObservation": Flow(setter("rollout.stageObservation", "5m"), ("guard",),
                                     before=lambda: base(**STAGED)),
    f"{PROM}.url": Flow(setter(f"{PROM}.url", "http://other:9090"), ("guard",), before=lambda: base(slo=SLO)),
    f"{PROM}.timeout": Flow(setter(f"{PROM}.timeout", "3s"), ("guard",), before=lambda: base(slo=SLO)),
    f"{PROM}.caBundle.name": Flow(setter(f"{PROM}.caBundle", {"name": "ca2", "key": "ca.crt"}), ("guard",),
                                  before=lambda: base(slo={**SLO, "prometheus": {
                                      "url": "https://p:9090", "caBundle": {"name": "ca", "key": "ca.crt"}}})),
    f"{PROM}.caBundle.key": Flow(setter(f"{PROM}.caBundle", {"name": "ca", "key": "other"}), ("guard",),
                                 before=lambda: base(slo={**SLO, "prometheus": {
                                     "url": "https://p:9090", "caBundle": {"name": "ca", "key": "ca.crt"}}})),
    f"{PROM}.auth.bearerToken.name": Flow(
        setter(f"{PROM}.auth", {"bearerToken": {"name": "b", "key": "token"}}), ("guard",),
        before=lambda: base(slo={**SLO, "prometheus": {"url": "http://p:9090", "auth": {"bearerToken": SECRET}}})),
    f"{PROM}.auth.bearerToken.key": Flow(
        setter(f"{PROM}.auth", {"bearerToken": {"name": "prom", "key": "t2"}}), ("guard",),
        before=lambda: base(slo={**SLO, "prometheus": {"url": "http://p:9090", "auth": {"bearerToken": SECRET}}})),
    f"{PROM}.auth.username.name": Flow(
        setter(f"{PROM}.auth.username", {"name": "u2", "key": "user"}), ("guard",),
        before=lambda: base(slo={**SLO, "prometheus": {"url": "http://p:9090", "auth": {
            "username": {"name": "u", "key": "user"}, "password": {"name": "u", "key": "pass"}}}})),
    f"{PROM}.auth.username.key": Flow(
        setter(f"{PROM}.auth.username", {"name": "u", "key": "login"}), ("guard",),
        before=lambda: base(slo={**SLO, "prometheus": {"url": "http://p:9090", "auth": {
            "username": {"name": "u", "key": "user"}, "password": {"name": "u", "key": "pass"}}}})),
    f"{PROM}.auth.password.name": Flow(
        setter(f"{PROM}.auth.password", {"name": "p2", "key": "pass"}), ("guard",),
        before=lambda: base(slo={**SLO, "prometheus": {"url": "http://p:9090", "auth": {
            "username": {"name": "u", "key": "user"}, "password": {"name": "u", "key": "pass"}}}})),
    f"{PROM}.auth.password.key": Flow(
        setter(f"{PROM}.auth.password", {"name": "u", "key": "secret"}), ("guard",),
        before=lambda: base(slo={**SLO, "prometheus": {"url": "http://p:9090", "auth": {
            "username": {"name": "u", "key": "user"}, "password": {"name": "u", "key": "pass"}}}})),
    "events.enabled": Flow(setter("events.enabled", True), ("files", "runtime", "targets"),
                           before=lambda: base(events={"model": "m"}), args=EVENTS_ARGS, check=events_reach_runtime),
    "events.endpoint": Flow(setter("events.endpoint", "tcp://indexer:5557"), ("files", "runtime"),
                            before=events_on, args=EVENTS_ARGS, check=endpoint_reaches_runtime),
    "events.model": Flow(setter("events.model", "other"), ("targets",), before=events_on, args=EVENTS_ARGS,
                         check=model_reaches_topic),
    "trace.enabled": Flow(setter("trace.enabled", True), ("files", "runtime", "targets")),
    "trace.maxSize": Flow(setter("trace.maxSize", "128Mi"), ("files", "runtime", "targets"),
                          before=lambda: base(trace={"enabled": True}), check=trace_reaches_runtime),
    "trace.files": Flow(setter("trace.files", 8), ("files", "runtime"), before=lambda: base(trace={"enabled": True})),
    "slo.ttftP99": Flow(setter("slo.ttftP99", "3s"), ("guard",), before=lambda: base(slo=SLO)),
    "slo.itlP99": Flow(setter("slo.itlP99", "150ms"), ("guard",), before=lambda: base(slo=SLO)),
    "slo.ttftP99MaxRatio": Flow(setter("slo.ttftP99MaxRatio", 1.5), ("guard",), before=lambda: base(**STAGED)),
    "slo.itlP99MaxRatio": Flow(setter("slo.itlP99MaxRatio", 1.5), ("guard",), before=lambda: base(**STAGED)),
    "slo.window": Flow(setter("slo.window", "1m"), ("guard",), before=lambda: base(slo=SLO)),
    "slo.interval": Flow(setter("slo.interval", "10s"), ("guard",), before=lambda: base(slo=SLO)),
    "slo.consecutiveBreaches": Flow(setter("slo.consecutiveBreaches", 5), ("guard",), before=lambda: base(slo=SLO)),
    "slo.onNoData": Flow(setter("slo.onNoData", "breach"), ("guard",), before=lambda: base(slo=SLO)),
    "slo.minRequestRate": Flow(setter("slo.minRequestRate", 1.0), ("guard",), before=lambda: base(slo=SLO)),
    "slo.cooldown": Flow(setter("slo.cooldown", "1m"), ("guard",), before=lambda: base(slo=SLO)),
    "slo.idleWindow": Flow(setter("slo.idleWindow", "6h"), ("guard",), before=lambda: base(slo=SLO),
                           check=lambda a, b: b["guard"]["idle_window_s"] == 6 * 3600),
    "slo.reenable.mode": Flow(setter("slo.reenable.mode", "auto"), ("guard",), before=lambda: base(slo=SLO)),
    "slo.reenable.after": Flow(setter("slo.reenable.after", "2h"), ("guard",), before=lambda: base(slo=SLO)),
    "slo.reenable.probation": Flow(setter("slo.reenable.probation", "1h"), ("guard",),
                                   before=lambda: base(slo=SLO)),
    "slo.dryRun": Flow(setter("slo.dryRun", True), ("guard",), before=lambda: base(slo=SLO)),
    "slo.modelName": Flow(setter("slo.modelName", "llama"), ("guard",), before=lambda: base(slo=SLO)),
    "slo.queries.ttftP99": Flow(setter("slo.queries.ttftP99", "max(x{$selector})"), ("guard",),
                                before=lambda: base(slo=SLO)),
    "slo.queries.itlP99": Flow(setter("slo.queries.itlP99", "max(y{$selector})"), ("guard",),
                               before=lambda: base(slo=SLO)),
    "slo.queries.requestRate": Flow(setter("slo.queries.requestRate", "sum(z{$selector})"), ("guard",),
                                    before=lambda: base(slo=SLO)),
}


def spec_fields(model: type[BaseModel] = api.KVCachePolicySpec, prefix: str = "") -> list[str]:
    """Every leaf field of the spec as a dotted camelCase path (list items share their element's path)."""
    out = []
    for name, info in model.model_fields.items():
        path = prefix + (info.alias or name)
        inner = [a for a in _flatten(info.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if inner:
            out += spec_fields(inner[0], path + ".")
        else:
            out.append(path)
    return out


def _flatten(tp: Any) -> list[Any]:
    args = typing.get_args(tp)
    return [tp] if not args else [x for a in args for x in _flatten(a)]


def test_every_spec_field_is_in_the_table():
    fields = spec_fields()
    assert len(fields) > 50
    missing = sorted(set(fields) - set(FLOWS))
    assert not missing, f"spec fields with no flow check (add them to FLOWS): {missing}"
    assert not sorted(set(FLOWS) - set(fields)), "FLOWS names fields the API does not have"


@pytest.mark.parametrize("path", sorted(FLOWS))
def test_a_changed_field_reaches_what_it_configures(path):
    flow = FLOWS[path]
    before = flow.before()
    after = copy.deepcopy(before)
    flow.change(after)
    image = flow.image or deployment()["spec"]["template"]["spec"]["containers"][0]["image"]
    a, b = observe(before, image, args=flow.args), observe(after, image, args=flow.args)
    assert a["valid"] or "valid" in flow.where, f"the base policy for {path} is invalid: {a['targets']}"
    for part in flow.where:
        assert a[part] != b[part], f"{path}: changing it left {part} unchanged"
    if flow.check:
        flow.check(a, b)


def test_store_threshold_builds_threshold_admission_with_its_value():
    """The reported bug: storeThreshold 5 rendered admission_threshold 5, yet the tier admitted on offer 2."""
    spec = base(tiers=THRESHOLD_TIERS, offload={"storeThreshold": 5})
    rt = observe(spec)["runtime"]
    cpu = rt["cpu"]["admission"]
    assert cpu["class"] == "ThresholdAdmission" and cpu["n"] == 5
    assert rt["fs"][0]["policy"]["admission"]["n"] == 5
    files = observe(spec)["files"]
    extra = yaml.safe_load(files["engine.yaml"])["kv-transfer-config"]["kv_connector_extra_config"]
    # backend kvtier renders kvtier's own spec: its host tier reads the threshold from its own key.
    assert extra["admission"] == "threshold" and extra["admission_threshold"] == 5
    assert "store_threshold" not in extra  # kvtier's filter counts the offers; vLLM's would count them again


def test_eviction_default_is_one_function_on_both_sides():
    """An unset evictionPolicy means default_eviction_policy(backend), in the API and in kvtier's runtime configs;
    vLLM's CachePolicy plug-in keeps vLLM's own default (lru)."""
    from kvtier_runtime.config import DEFAULT_EVICTION_POLICY, RECOMMENDED_EVICTION_POLICY, default_eviction_policy

    assert api.TierSpec.model_fields["eviction_policy"].default is None
    from foundation.policies import cpu, policy
    from kvtier_operator.api.validation import parse_policy

    for backend in ("native", "lmcache", "kvtier"):
        spec = parse_policy(policy(backend=backend, tiers=[cpu()])).spec
        assert spec.tiers[0].eviction == default_eviction_policy(backend)
        assert spec.tiers[0].eviction_policy is None, "the stored field stays unset"
    assert default_eviction_policy("kvtier") == RECOMMENDED_EVICTION_POLICY == "adaptive"
    assert default_eviction_policy("native") == DEFAULT_EVICTION_POLICY == "lru"
    assert {f.name: f.default for f in dataclasses.fields(FilesystemTierConfig)}["eviction_policy"] == \
        RECOMMENDED_EVICTION_POLICY
    assert {f.name: f.default for f in dataclasses.fields(OffloadSpecConfig)}["eviction_policy"] == \
        RECOMMENDED_EVICTION_POLICY
    assert CachePolicyChoice().eviction == DEFAULT_EVICTION_POLICY


def test_the_fast_yaml_emitter_writes_the_same_bytes_as_the_pure_python_one():
    """render uses libyaml's emitter for speed; a different byte would change config hashes (pods would roll)."""
    import yaml as pyyaml

    checked = 0
    for flow in FLOWS.values():
        for spec in (flow.before(),):
            after = copy.deepcopy(spec)
            flow.change(after)
            for s in (spec, after):
                for text in observe(s, flow.image or deployment()["spec"]["template"]["spec"]["containers"][0][
                        "image"])["files"].values():
                    doc = pyyaml.safe_load(text)
                    for sort_keys in (False, True):
                        assert pyyaml.dump(doc, Dumper=pyyaml.SafeDumper, sort_keys=sort_keys) == \
                            pyyaml.dump(doc, Dumper=pyyaml.CSafeDumper, sort_keys=sort_keys)
                    checked += 1
    assert checked > 50
