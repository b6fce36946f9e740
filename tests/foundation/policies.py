"""Policy documents for the foundation tests."""
import copy
from typing import Any

BASE: dict[str, Any] = {
    "apiVersion": "kvtier.io/v1alpha1",
    "kind": "KVCachePolicy",
    "metadata": {"name": "llama", "namespace": "serving"},
    "spec": {
        "selector": {"matchLabels": {"app": "llama-70b"}},
        "engine": "vllm",
        "blockSize": 16,
        "tiers": [
            {"name": "host", "medium": "cpu", "size": "16Gi"},
            {"name": "nvme", "medium": "filesystem", "size": "500Gi", "path": "/mnt/kvcache",
             "volume": {"emptyDir": {}}},
        ],
    },
}


def policy(**spec_overrides: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    for key, value in spec_overrides.items():
        if value is None:
            doc["spec"].pop(key, None)
        else:
            doc["spec"][key] = value
    return doc


def cpu(**kw: Any) -> dict[str, Any]:
    return {"name": "host", "medium": "cpu", "size": "16Gi", **kw}


def disk(name: str = "nvme", **kw: Any) -> dict[str, Any]:
    return {"name": name, "medium": "filesystem", "size": "500Gi", "path": f"/mnt/{name}",
            "volume": {"emptyDir": {}}, **kw}


# The tenant's key every remote tier needs (store={"macKeySecret": None} leaves it out).
TENANT_KEY = {"name": "kv-mac", "key": "tenant-key"}


def remote(name: str = "shared", url: str = "redis://valkey.kv:6379/0", **kw: Any) -> dict[str, Any]:
    store = {k: v for k, v in {"url": url, "macKeySecret": TENANT_KEY, **kw.pop("store", {})}.items()
             if v is not None}
    return {"name": name, "medium": "remote", "size": "20Gi", "remote": store, **kw}


SLO = {"prometheus": {"url": "http://prometheus.monitoring:9090"}, "ttftP99": "2s"}

# Policies both `kvtier validate` and the API server must accept.
VALID = [
    policy(),
    policy(tiers=[]),
    policy(tiers=[cpu()]),
    policy(tiers=[cpu(evictionPolicy="arc")], offload={"chunkTokens": 256, "storeThreshold": 2}),
    # kvtier's own policies run in vLLM's own manager through kvtier's CachePolicy plug-in.
    policy(tiers=[cpu(evictionPolicy="adaptive"), disk()]),
    policy(backend="kvtier", tiers=[cpu(evictionPolicy="s3fifo", admission="doorkeeper"),
                                    disk(compression="int4"), disk("ssd", compression="fp8")]),
    policy(backend="lmcache", tiers=[cpu(), disk()]),
    policy(engine="trtllm", engineVersion="1.3.0", tiers=[cpu(), disk()]),
    policy(engine=None, tiers=[cpu(size=17179869184)]),
    policy(slo=SLO, rollout={"strategy": "staged"}),
    policy(slo={**SLO, "ttftP99MaxRatio": 1.2}, rollout={"strategy": "staged"}),
    # A shared tier on a Valkey/Redis store, last in lookup order; IPv6 and TLS stores.
    policy(backend="kvtier", tiers=[cpu(), disk(), remote(compression="fp8", store={
        "passwordSecret": {"name": "valkey", "key": "password"}, "macKeySecret": {"name": "kv-mac", "key": "k"}})]),
    policy(backend="kvtier", tiers=[cpu(), remote(url="rediss://[fd00::1]:6380")]),
    # The tiers behind the cpu tier in any order: the runtime looks them up in the policy's order.
    policy(backend="kvtier", tiers=[cpu(), remote(), disk()]),
    # Recording the engine's traffic (backend kvtier); a disabled recording is accepted with any backend.
    policy(backend="kvtier", trace={"enabled": True, "maxSize": "16Gi", "files": 1000}),
    policy(backend="kvtier", trace={"enabled": True, "maxSize": 262144, "files": 4}),
    policy(trace={"enabled": False}),
    # KV events for routers: bound in the pod (default) or connected to an indexer; one block per chunk.
    policy(backend="kvtier", events={"enabled": True, "model": "llama-70b"}),
    policy(events={"enabled": True, "model": "meta/llama", "endpoint": "tcp://indexer.routing:6000"},
           offload={"chunkTokens": 16}),
    policy(backend="kvtier", events={"enabled": True, "model": "m", "endpoint": "tcp://[fd00::2]:65534"}),
    policy(backend="lmcache", events={"enabled": False}),
]

# (policy, the problem `kvtier validate` reports: "field path: rule"). The API server rejects each too.
INVALID = [
    (policy(trace={"enabled": True}), "spec.trace.enabled: trace.enabled needs backend kvtier"),
    (policy(events={"enabled": True}), "spec.events.model: events.model must be set when events are enabled"),
    (policy(events={"enabled": True, "model": "m"}, offload={"chunkTokens": 64}),
     "spec.events.enabled: events.enabled needs one GPU block per offloaded chunk"),
    (policy(backend="lmcache", events={"enabled": True, "model": "m"}),
     "spec.events.enabled: events.enabled needs backend kvtier or native"),
    (policy(engine="trtllm", tiers=[cpu()], events={"enabled": True, "model": "m"}),
     "spec.events.enabled: engine trtllm: spec.events is for vLLM's KV event publisher"),
    (policy(events={"enabled": True, "model": "m", "endpoint": "tcp://*:65535"}), "spec.events.endpoint: "),
    (policy(events={"enabled": True, "model": "m", "endpoint": "ipc:///tmp/kv"}), "spec.events.endpoint: "),
    (policy(events={"enabled": True, "model": "a@b"}), "spec.events.model: "),
    (policy(backend="kvtier", trace={"enabled": True, "maxSize": "17Gi"}), "spec.trace.maxSize: must be at most 16Gi"),
    (policy(backend="kvtier", trace={"enabled": True, "maxSize": "1Mi", "files": 100}),
     "spec.trace: maxSize: must hold at least 64Ki per trace file"),
    (policy(backend="kvtier", trace={"enabled": True, "files": 1001}), "spec.trace.files: "),
    (policy(offload={"chunkTokens": 100}), "spec.offload.chunkTokens: 100 is not a multiple of spec.blockSize (16)"),
    (policy(tiers=[cpu(), disk("host")]), "spec.tiers: tier names must be unique"),
    (policy(tiers=[disk()]), "spec.tiers: the first tier must be the cpu tier"),
    (policy(tiers=[cpu(), cpu(name="host2")]), "spec.tiers: at most one cpu tier"),
    (policy(tiers=[cpu(), disk("a"), {**disk("b"), "path": "/mnt/a"}]), "spec.tiers: filesystem tiers need distinct"),
    (policy(tiers=[cpu(), {"name": "nvme", "medium": "filesystem", "size": "1Gi"}]),
     "spec.tiers[1].path: a filesystem tier needs path and volume"),
    (policy(tiers=[cpu(path="/x")]), "spec.tiers[0].medium: a cpu tier takes no path or volume"),
    (policy(backend="kvtier", tiers=[cpu(compression="int4")]),
     "spec.tiers[0].compression: compression applies to filesystem and remote tiers only"),
    # Remote tiers: the store's address, where the tier sits, and which backend runs it.
    (policy(backend="kvtier", tiers=[cpu(), remote(url="redis://user:pw@valkey:6379")]),
     "spec.tiers[1].remote.url: must not contain credentials"),
    (policy(backend="kvtier", tiers=[cpu(), remote(url="redis://valkey")]),
     "spec.tiers[1].remote.url: needs a host and a port"),
    (policy(backend="kvtier", tiers=[cpu(), remote(url="redis://valkey:6379/kv")]),
     "spec.tiers[1].remote.url: needs a host and a port, and at most a database number"),
    (policy(backend="kvtier", tiers=[cpu(), remote(url="redis://valkey:6379/0?ssl=true")]),
     "spec.tiers[1].remote.url: must not carry a query or a fragment"),
    (policy(backend="kvtier", tiers=[cpu(), remote(url="http://valkey:6379")]), "spec.tiers[1].remote.url: "),
    (policy(backend="kvtier", tiers=[cpu(), {"name": "shared", "medium": "remote", "size": "1Gi"}]),
     "spec.tiers[1].remote: a remote tier needs remote (url)"),
    (policy(backend="kvtier", tiers=[cpu(), remote(store={"macKeySecret": None,
                                                          "passwordSecret": {"name": "valkey", "key": "pw"}})]),
     "spec.tiers[1].remote.macKeySecret: a remote tier needs remote.macKeySecret: the tenant's key"),
    (policy(backend="kvtier", tiers=[cpu(), disk(remote={"url": "redis://valkey:6379", "macKeySecret": TENANT_KEY})]),
     "spec.tiers[1].remote: a remote tier needs remote (url), and only a remote tier takes it"),
    (policy(backend="kvtier", tiers=[cpu(), remote(path="/mnt/x")]),
     "spec.tiers[1].medium: a remote tier takes no path or volume"),
    (policy(tiers=[cpu(), remote()]), "spec.backend: a remote tier needs backend kvtier"),
    (policy(backend="kvtier", tiers=[cpu(), remote(), remote("other")]), "spec.tiers: at most one remote tier"),
    (policy(tiers=[cpu(), disk(compression="fp8")]), "spec.backend: compression needs backend kvtier"),
    (policy(tiers=[cpu(admission="doorkeeper")]), "spec.backend: admission filters need backend kvtier"),
    (policy(tiers=[cpu(), disk(evictionPolicy="adaptive")]), "spec.backend: backend native runs vLLM's own filesystem tier, which evicts nothing"),
    (policy(backend="lmcache", tiers=[cpu(evictionPolicy="arc")]), "spec.backend: backend lmcache supports evictionPolicy lru"),
    (policy(engine="trtllm", backend="lmcache", tiers=[cpu()]), "spec.backend: engine trtllm does not support "
                                                                "backend lmcache"),
    (policy(engine="trtllm", tiers=[cpu(), disk()]), "spec.engineVersion: a filesystem tier with engine trtllm "
                                                     "needs spec.engineVersion 1.3"),
    (policy(engine="trtllm", engineVersion="1.2.1", tiers=[cpu(), disk()]), "spec.engineVersion: a filesystem"),
    (policy(engine="trtllm", blockSize=48, tiers=[cpu()]), "spec.blockSize: TensorRT-LLM tokens_per_block must be"
                                                           " a power of 2, not 48"),
    (policy(engine="trtllm", gpu={"kvCacheDtype": "fp8_e5m2"}, tiers=[cpu()]), "spec.gpu.kvCacheDtype"),
    (policy(offload={"storeThreshold": 1}), "spec.offload.storeThreshold: storeThreshold must be 0"),
    (policy(offload={"storeThreshold": 2}), "spec.offload.storeThreshold: vLLM rejects storeThreshold with a "
                                            "filesystem tier"),
    (policy(rollout={"strategy": "staged"}), "spec.rollout.strategy: rollout.strategy staged needs spec.slo"),
    (policy(slo={**SLO, "ttftP99MaxRatio": 1.5}), "spec.slo: relative thresholds"),
    (policy(slo={"prometheus": {"url": "http://p:9090"}}), "spec.slo: an SLO needs at least one of"),
    (policy(tiers=[cpu(), disk(volume={"emptyDir": {}, "hostPath": {"path": "/x"}})]),
     "spec.tiers[1].volume: exactly one of emptyDir, hostPath or persistentVolumeClaim"),
    (policy(selector={}), "spec.selector: a selector must name at least one label a workload carries"),
    # Class C (catch-all selectors in disguise): they would select, and conflict over, every workload.
    (policy(selector={"matchExpressions": [{"key": "unused", "operator": "DoesNotExist"}]}),
     "spec.selector: a selector must name at least one label a workload carries"),
    (policy(selector={"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["x"]}]}),
     "spec.selector: a selector must name at least one label a workload carries"),
    (policy(selector={"matchLabels": {}, "matchExpressions": []}),
     "spec.selector: a selector must name at least one label a workload carries"),
    (policy(selector={"matchExpressions": [{"key": "app", "operator": "NotIn", "values": []}]}),
     "spec.selector.matchExpressions[0]: operators In and NotIn need at least one value"),
    (policy(selector={"matchLabels": {"app": "x"}, "matchExpressions": [{"key": "app", "operator": "In"}]}),
     "spec.selector.matchExpressions[0]: operators In and NotIn need at least one value"),
    (policy(tiers=[cpu(size="16Gx")]), "spec.tiers[0].size: '16Gx' is not a positive Kubernetes quantity"),
    (policy(tiers=[cpu(size=0)]), "spec.tiers[0].size: '0' is not a positive Kubernetes quantity"),
    (policy(tiers=[cpu(name="Host")]), "spec.tiers[0].name: 'Host' does not match"),
    (policy(tiers=[cpu(evictionPolicy="lfu")]), "spec.tiers[0].evictionPolicy: 'lfu'"),
    (policy(gpu={"memoryUtilization": 1.5}), "spec.gpu.memoryUtilization: 1.5"),
    (policy(slo={**SLO, "window": "5 minutes"}), "spec.slo.window: '5 minutes' does not match"),
    (policy(tires=[]), "spec.tires: unknown field"),
    (policy(selector=None), "spec.selector: required"),
    # Strict types, as the API server: no strings for integers, booleans or numbers (issue #16).
    (policy(blockSize="16"), "spec.blockSize: '16': Input should be a valid integer"),
    (policy(tiers=[cpu(enabled="false")]), "spec.tiers[0].enabled: 'false': Input should be a valid boolean"),
    (policy(slo={**SLO, "dryRun": "yes"}), "spec.slo.dryRun: 'yes': Input should be a valid boolean"),
    (policy(gpu={"memoryUtilization": "0.9"}), "spec.gpu.memoryUtilization: '0.9': Input should be a valid number"),
    # One set of rules offline and at admission: what the SLO guard would refuse is refused here.
    (policy(slo={**SLO, "ttftP99": "0s"}), "spec.slo.ttftP99: must be greater than zero"),
    (policy(slo={**SLO, "interval": "0s"}), "spec.slo.interval: must be greater than zero"),
    (policy(slo={**SLO, "window": "0m"}), "spec.slo.window: must be greater than zero"),
    (policy(slo={**SLO, "prometheus": {"url": "http://p:9090", "timeout": "0s"}}),
     "spec.slo.prometheus.timeout: must be greater than zero"),
    (policy(slo={**SLO, "prometheus": {"url": "http://p:9090", "timeout": "2m"}}),
     "spec.slo.prometheus.timeout: must be at most 60s"),
    (policy(slo={**SLO, "minRequestRate": 1e7}), "spec.slo.minRequestRate: 10000000.0"),
    (policy(slo={**SLO, "prometheus": {"url": "http:///api"}}), "spec.slo.prometheus.url: needs a host"),
    (policy(slo={**SLO, "prometheus": {"url": "http://u:p@p:9090"}}),
     "spec.slo.prometheus.url: must not contain credentials"),
    (policy(slo={**SLO, "prometheus": {"url": "http://p:9090/x?y=1"}}), "spec.slo.prometheus.url: must not contain"),
    # What the renderer would produce and the API server refuse.
    (policy(tiers=[cpu(), disk(path="/etc/kvtier")]), "spec.tiers[1].path: must not be or contain a system path"),
    (policy(tiers=[cpu(), disk(path="/dev/shm")]), "spec.tiers[1].path: must not be or contain a system path"),
    (policy(tiers=[cpu(), disk(path="/var/run/secrets/kubernetes.io/serviceaccount")]),
     "spec.tiers[1].path: must not be or contain a system path"),
    (policy(tiers=[cpu(), disk(path="/mnt/../etc")]), "spec.tiers[1].path: must not contain '.' or '..'"),
    (policy(backend="kvtier", tiers=[cpu(), disk("a"), {**disk("b"), "path": disk("a")["path"]}]),
     "spec.tiers: filesystem tiers need distinct paths"),
    # Class A (a check before normalisation): paths in any but normal form are refused, never normalised, so
    # two spellings of one directory cannot pass the distinct-paths rule, nor '//' the system-path rule.
    (policy(backend="kvtier", tiers=[cpu(), disk("a"), {**disk("b"), "path": disk("a")["path"] + "/"}]),
     "spec.tiers[2].path: must be in normal form"),
    (policy(backend="kvtier", tiers=[cpu(), disk("a"), {**disk("b"), "path": disk("a")["path"].replace("/", "//")}]),
     "spec.tiers[2].path: must be in normal form"),
    (policy(tiers=[cpu(), disk(path="/var//run/secrets/kubernetes.io/serviceaccount")]),
     "spec.tiers[1].path: must be in normal form"),
    (policy(tiers=[cpu(), disk(volume={"hostPath": {"path": "/mnt/disks//kv/"}})]),
     "spec.tiers[1].volume.hostPath.path: must be in normal form"),
    (policy(tiers=[cpu(), disk(volume={"hostPath": {"path": "/mnt/disks/../../etc"}})]),
     "spec.tiers[1].volume.hostPath.path: must not contain '.' or '..' segments"),
    (policy(tiers=[cpu(size="2Pi")]), "spec.tiers[0].size: must be at most 1Pi"),
    (policy(tiers=[cpu(size=2**50 + 1)]), "spec.tiers[0].size: must be at most 1Pi"),
    (policy(hostMemoryHeadroom="1Ei"), "spec.hostMemoryHeadroom: must be at most 1Pi"),
]

# (metadata, the problem `kvtier validate` reports). The API server rejects each too (its own ObjectMeta rules,
# and the CRD's CEL rule on the name's length, since the name becomes a label value).
INVALID_METADATA = [
    ({"name": "a" * 64}, "(document): metadata.name must be at most 63 characters"),
    ({"name": "a" * 254}, "metadata.name: "),
    ({"name": "Bad_Name!/../x"}, "metadata.name: 'Bad_Name!/../x' must be a DNS-1123 subdomain"),
    ({"name": 12345}, "metadata.name: 12345 must be a string"),
    ({"name": "p", "annotations": {"a": 1}}, "metadata.annotations['a']: 1 must be a string"),
    ({"name": "p", "labels": {"a": True}}, "metadata.labels['a']: True must be a string"),
    ({"name": "p", "labels": {"a": "x" * 64}}, "metadata.labels['a']: "),
    ({"name": "p", "labels": {"bad key": "v"}}, "metadata.labels['bad key']: the name must be"),
]
