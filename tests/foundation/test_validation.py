"""Every rule rejects with the field path and the rule; valid policies pass. Offline, like the API server."""
import pytest

from kvtier_operator.api.validation import PolicyInvalid, parse_policy, validate_text

from foundation.policies import cpu, disk, policy

SLO = {"prometheus": {"url": "http://prometheus.monitoring:9090"}, "ttftP99": "2s"}


def problems(doc):
    with pytest.raises(PolicyInvalid) as err:
        parse_policy(doc)
    return [str(p) for p in err.value.problems]


@pytest.mark.parametrize("doc", [
    policy(),
    policy(tiers=[]),
    policy(tiers=[cpu()]),
    policy(tiers=[cpu(evictionPolicy="arc")], offload={"chunkTokens": 256, "storeThreshold": 2}),
    policy(backend="kvtier", tiers=[cpu(evictionPolicy="s3fifo", admission="doorkeeper"),
                                    disk(compression="int4"), disk("ssd", compression="fp8")]),
    policy(backend="lmcache", tiers=[cpu(), disk()]),
    policy(engine="trtllm", engineVersion="1.3.0", tiers=[cpu(), disk()]),
    policy(engine=None, tiers=[cpu(size=17179869184)]),
    policy(slo=SLO, rollout={"strategy": "staged"}),
    policy(slo={**SLO, "ttftP99MaxRatio": 1.2}, rollout={"strategy": "staged"}),
])
def test_valid_policies_pass(doc):
    parse_policy(doc)


@pytest.mark.parametrize("doc, expected", [
    (policy(offload={"chunkTokens": 100}), "spec.offload.chunkTokens: 100 is not a multiple of spec.blockSize (16)"),
    (policy(tiers=[cpu(), disk("host")]), "spec.tiers: tier names must be unique"),
    (policy(tiers=[disk()]), "spec.tiers: the first tier must be the cpu tier"),
    (policy(tiers=[cpu(), cpu(name="host2")]), "spec.tiers: at most one cpu tier"),
    (policy(tiers=[cpu(), disk("a"), {**disk("b"), "path": "/mnt/a"}]), "spec.tiers: filesystem tiers need distinct"),
    (policy(tiers=[cpu(), {"name": "nvme", "medium": "filesystem", "size": "1Gi"}]),
     "spec.tiers[1].path: a filesystem tier needs path and volume"),
    (policy(tiers=[cpu(path="/x")]), "spec.tiers[0].medium: a cpu tier takes no path or volume"),
    (policy(backend="kvtier", tiers=[cpu(compression="int4")]),
     "spec.tiers[0].compression: compression applies to filesystem tiers only"),
    (policy(tiers=[cpu(), disk(compression="fp8")]), "spec.backend: compression needs backend kvtier"),
    (policy(tiers=[cpu(admission="doorkeeper")]), "spec.backend: admission filters need backend kvtier"),
    (policy(tiers=[cpu(evictionPolicy="s3fifo")]), "spec.backend: backend native supports evictionPolicy lru or arc"),
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
    (policy(selector={}), "spec.selector: a selector must name matchLabels or matchExpressions"),
    (policy(tiers=[cpu(size="16Gx")]), "spec.tiers[0].size: '16Gx' is not a positive Kubernetes quantity"),
    (policy(tiers=[cpu(size=0)]), "spec.tiers[0].size: '0' is not a positive Kubernetes quantity"),
    (policy(tiers=[cpu(name="Host")]), "spec.tiers[0].name: 'Host' does not match"),
    (policy(tiers=[cpu(evictionPolicy="lfu")]), "spec.tiers[0].evictionPolicy: 'lfu'"),
    (policy(gpu={"memoryUtilization": 1.5}), "spec.gpu.memoryUtilization: 1.5"),
    (policy(slo={**SLO, "window": "5 minutes"}), "spec.slo.window: '5 minutes' does not match"),
    (policy(tires=[]), "spec.tires: unknown field"),
    (policy(selector=None), "spec.selector: required"),
])
def test_each_rule_rejects_with_field_path_and_rule(doc, expected):
    found = problems(doc)
    assert any(p.startswith(expected) for p in found), found


def test_all_problems_are_reported_at_once():
    found = problems(policy(offload={"chunkTokens": 100}, tiers=[cpu(), disk("host")]))
    assert len(found) == 2


def test_validate_text_reports_file_document_and_name():
    text = "kind: KVCachePolicy\napiVersion: kvtier.io/v1alpha1\nmetadata: {name: a}\nspec: {}\n---\n" \
           "kind: ConfigMap\napiVersion: v1\n"
    assert validate_text(text, "p.yaml") == ["p.yaml[0] (a): spec.selector: required"]
    assert validate_text("kind: ConfigMap\n", "c.yaml") == ["c.yaml: no KVCachePolicy (kind: KVCachePolicy) "
                                                            "in this file"]
    assert validate_text("a: [", "broken.yaml")[0].startswith("broken.yaml: not valid YAML")
